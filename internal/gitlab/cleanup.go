package gitlab

import (
	"context"
	"errors"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// UndoPrepare removes what a prepare made whose work finished but which
// is reported as stopped (a signal came after the machine was ready): the
// job's machine goes as at cleanup, so that a stopped prepare leaves
// nothing, whichever came first. The runner's cleanup finds nothing more.
func UndoPrepare(ctx context.Context, e Env, cfg *config.Config) error {
	j, err := e.load(cfg)
	if err != nil {
		return err
	}
	defer j.m.Close()
	if err := j.m.Dial(ctx); err != nil {
		return err
	}
	r, err := j.m.Release(ctx, j.name, jobvm.Observer{Step: e.Report.Step}, j.log)
	if err == nil {
		e.say("The job was stopped as its VM became ready: VM %s removed", r.Machine.Name)
	}
	return err
}

// Cleanup is the cleanup stage: it ends the job's machine (jobvm.Host.Release)
// or, for a failed job that asked for it where the admin allows it, keeps it
// for debugging. It runs on its own deadline, also after a cancel.
func Cleanup(ctx context.Context, e Env, cfg *config.Config) error {
	j, err := e.load(cfg)
	if err != nil {
		return err
	}
	defer j.m.Close()
	defer func() { e.Report.Reconnects(j.m.Reconnects()) }()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.Timeouts.Cleanup.D())
	defer cancel()
	m := j.m
	if err := m.Dial(ctx); err != nil {
		return err
	}
	if e.Getenv("CUSTOM_ENV_CI_JOB_STATUS") == "failed" && keepRequested(e.Getenv) && cfg.Debug.AllowKeepOnFailure {
		if keepVM(ctx, j, cfg) {
			return nil
		}
	}
	t0 := time.Now()
	r, err := m.Release(ctx, j.name, jobvm.Observer{Step: e.Report.Step, Machine: e.Report.Machine}, j.log)
	if err != nil {
		j.log.Error("cleanup incomplete", "vm", r.Machine.Name, "reaper", r.Reaper, "err", err)
		return exitcodes.System(err)
	}
	if err := m.Store.ForgetJobName(j.key); err != nil {
		j.log.Warn("could not remove the job's name record (the sweep will)", "err", err)
	}
	j.log.Info("cleaned up", "vm", r.Machine.Name, "warm", r.Machine.Warm, "reaper", r.Reaper, "took", vm.Round(time.Since(t0)).String(), "job_status", e.Getenv("CUSTOM_ENV_CI_JOB_STATUS"))
	return nil
}

// keepVM keeps the failed job's VM for debugging, within the caps
// (planKeep): the project's oldest kept VM goes first where the project
// is at debug.keep_max_per_project; at debug.keep_max nothing is kept. It
// reports whether the VM was kept; otherwise the caller removes it. The
// decision is made under the host's keep lock, so two cleanups at once
// cannot both take the last place.
func keepVM(ctx context.Context, j *job, cfg *config.Config) bool {
	m := j.m
	unlock, err := m.Store.LockKept(ctx)
	if err != nil {
		j.log.Error("could not keep the VM; removing it", "err", err)
		return false
	}
	defer unlock()
	jm, err := m.MachineOf(j.name)
	if err != nil {
		if !errors.Is(err, vm.ErrNotFound) {
			j.log.Error("could not keep the VM; removing it", "err", err)
		}
		return false
	}
	kept, err := m.Store.KeptMachines()
	if err != nil {
		j.log.Error("could not keep the VM (the kept VMs cannot be counted); removing it", "err", err)
		return false
	}
	now := time.Now()
	project := keepProject(j.job)
	plan := planKeep(kept, jm.Name, project, now, cfg.Debug)
	if !plan.Keep {
		j.log.Warn("not keeping the failed job's VM; removing it", "vm", jm.Name, "why", plan.Why)
		return false
	}
	for _, k := range plan.Release {
		if err := m.Teardown(ctx, k.Name); err != nil {
			j.log.Error("could not remove the project's oldest kept VM; not keeping this one", "vm", jm.Name, "oldest", k.Name, "err", err)
			return false
		}
		j.log.Info("removed a kept VM: its project keeps a newer one (debug.keep_max_per_project)", "vm", k.Name, "kept_since", k.At.UTC().Format(time.RFC3339), "for", jm.Name)
	}
	until := now.Add(cfg.Debug.KeepMaxAge.D())
	// The mark first: a kept VM the cap cannot count must not exist.
	if err := m.Store.MarkKept(jm.Name, state.Kept{Project: project, At: now, Until: until}); err != nil {
		j.log.Error("could not keep the VM; removing it", "err", err)
		return false
	}
	if err := m.Keep(ctx, jm.Name, until); err != nil {
		if !errors.Is(err, vm.ErrNotFound) {
			j.log.Error("could not keep the VM; removing it", "err", err)
		}
		return false
	}
	j.log.Warn("kept the failed job's VM for debugging", "vm", jm.Name, "until", until.UTC().Format(time.RFC3339))
	return true
}
