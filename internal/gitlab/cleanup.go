package gitlab

import (
	"context"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
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
	defer j.jobs.Close()
	if err := j.jobs.Dial(ctx); err != nil {
		return err
	}
	r, err := j.vm.Release(ctx, jobvm.Observer{Step: e.Report.Step})
	if err == nil {
		e.say("The job was stopped as its VM became ready: VM %s removed", r.Machine.Name)
	}
	return err
}

// Cleanup is the cleanup stage: it ends the job's machine (jobvm.Job.Release)
// or, for a failed job that asked for it where the admin allows it, keeps it
// for debugging. It runs on its own deadline, also after a cancel.
func Cleanup(ctx context.Context, e Env, cfg *config.Config) error {
	j, err := e.load(cfg)
	if err != nil {
		return err
	}
	defer j.jobs.Close()
	defer func() { e.Report.Reconnects(j.jobs.Reconnects()) }()
	ctx, cancel := detachctx.WithTimeout(ctx, cfg.Timeouts.Cleanup.D())
	defer cancel()
	if err := j.jobs.Dial(ctx); err != nil {
		return err
	}
	if e.Getenv("CUSTOM_ENV_CI_JOB_STATUS") == "failed" && keepRequested(e.Getenv) && cfg.Debug.AllowKeepOnFailure {
		if keepVM(ctx, j, cfg) {
			return nil
		}
	}
	t0 := time.Now()
	r, err := j.vm.Release(ctx, jobvm.Observer{Step: e.Report.Step, Machine: e.Report.Machine})
	if err != nil {
		j.log.Error("cleanup incomplete", "vm", r.Machine.Name, "reaper", r.Reaper, "err", err)
		return exitcodes.System(err)
	}
	j.log.Info("cleaned up", "vm", r.Machine.Name, "warm", r.Machine.Warm, "reaper", r.Reaper, "took", jobvm.Round(time.Since(t0)).String(), "job_status", e.Getenv("CUSTOM_ENV_CI_JOB_STATUS"))
	return nil
}

// keepVM keeps the failed job's VM for debugging, within the caps
// (planKeep): the project's oldest kept VM goes first where the project
// is at debug.keep_max_per_project; at debug.keep_max nothing is kept. It
// reports whether the VM was kept; otherwise the caller removes it. The
// decision is made under the host's keep lock (jobvm.Job.Keep), so two
// cleanups at once cannot both take the last place.
func keepVM(ctx context.Context, j *job, cfg *config.Config) bool {
	now := time.Now()
	project := keepProject(j.job)
	return j.vm.Keep(ctx, project, now.Add(cfg.Debug.KeepMaxAge.D()), func(kept []jobvm.KeptMachine, self string) jobvm.KeepDecision {
		p := planKeep(kept, self, project, now, cfg.Debug)
		return jobvm.KeepDecision{Keep: p.Keep, Release: p.Release, Why: p.Why}
	})
}
