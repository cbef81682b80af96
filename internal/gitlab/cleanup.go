package gitlab

import (
	"context"
	"errors"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
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
		until := time.Now().Add(cfg.Debug.KeepMaxAge.D())
		jm, err := m.MachineOf(j.name)
		if err == nil {
			err = m.Keep(ctx, jm.Name, until)
		}
		if err == nil {
			j.log.Warn("kept the failed job's VM for debugging", "until", until.UTC().Format(time.RFC3339))
			return nil
		}
		if !errors.Is(err, vm.ErrNotFound) {
			j.log.Error("could not keep the VM; removing it", "err", err)
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
