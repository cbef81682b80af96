package gitlab

import (
	"context"
	"strconv"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// Frontend is the ownership record's front end of GitLab's job machines.
const Frontend = "gitlab"

// Prepare is the prepare stage: a fresh machine for the job, ready for SSH
// (jobvm.Job.Acquire: a claimed standby machine, else one booted cold).
func Prepare(ctx context.Context, e Env, cfg *config.Config) error {
	j, img, res, err := e.plan(cfg)
	if err != nil {
		return err
	}
	defer j.jobs.Close()
	defer func() { e.Report.Reconnects(j.jobs.Reconnects()) }()
	say := e.say
	plan, svcOpts, err := servicesPlan(cfg, j, img, e.Getenv)
	if err != nil {
		return err
	}
	if plan == nil {
		if err := checkServices(cfg, j.job.Services, say); err != nil {
			return err
		}
	}
	began := time.Now()
	say("Preparing a fresh %s VM %s for job %d (%s)", img.Name, j.name, j.job.ID, DriverName+" "+buildinfo.Version)
	if !j.job.FromPayload {
		say("Warning: job identity taken from CUSTOM_ENV_CI_JOB_ID because JOB_RESPONSE_FILE is not set (insecure_job_id_from_env = true)")
	}
	if req := j.job.Image; req.expanded() && !req.Hidden {
		say("Image %q from the job's variables: %q", cut(req.Written), cut(req.Name))
	}
	if j.job.Steps {
		say("GitLab Steps job (run:): the runner runs its steps with step-runner ci in the VM (docs/steps.md)")
		if j.job.Image.StepsDefault && img.Name == cfg.DefaultImage {
			say("The runner gave this run: job without image: the image %s; it asks for this runner's default VM image %q", StepRunnerImage, img.Name)
		}
	}
	if keepRequested(e.Getenv) && !cfg.Debug.AllowKeepOnFailure {
		say("Note: %s is set, but this runner does not keep VMs of failed jobs (debug.allow_keep_on_failure = false)", VarKeep)
	}
	if err := j.jobs.Dial(ctx); err != nil {
		return err
	}
	// The image as it is before the clone: what the tool check finds is
	// remembered for this version of it (an image pulled by this prepare
	// has none yet: its version is taken once it is on the host).
	version := imageVersion(img)
	if tools, exact := j.jobs.ToolsNow(); j.job.Steps && exact {
		if err := knownStepRunnerMissing(j.jobs.Memory(), img, version, tools); err != nil {
			say("No VM is booted: the guest tool check of this image (remembered) found no step-runner")
			return err
		}
	}
	var container string
	if plan != nil && plan.Job != nil {
		container = plan.Job.Name
	}
	// Acquire first makes sure the image is on this host (a job on an
	// image not pulled yet pulls it), then records the name the later
	// stages find the machine by, whatever version runs them (an upgrade
	// in the middle of the job).
	a, err := j.vm.Acquire(ctx, jobvm.AcquireRequest{
		Request: jobvm.Request{Frontend: Frontend, Job: strconv.FormatInt(j.job.ID, 10), Image: img, Lifetime: j.job.Timeout},
		Size:    res, Holder: cfg.SSH.HolderEnabled(), Log: j.log, Container: container,
		Pull: e.Pull, Refresh: e.Refresh,
		Check: func(ctx context.Context, g jobvm.Guest, tools *jobvm.Tools) error {
			if version == nil {
				version = imageVersion(img)
			}
			return checkGuestTools(ctx, g, say, j.jobs.Memory(), img, version.withTools(tools), tools, j.job.Steps)
		},
		Observe: jobvm.Observer{Step: e.Report.Step, Pool: e.Report.Pool, Machine: e.Report.Machine},
	})
	if err != nil {
		j.log.Error("prepare failed", "err", err)
		return exitcodes.System(err)
	}
	switch start := a.Start(); start {
	case obs.PathCold:
		writeTimings(e, j, a, began)
		e.Report.Path(start)
	default:
		e.Report.Path(start)
		say("Machine ready in %s (%s)", jobvm.Round(time.Since(began)), start)
		writeTimings(e, j, a, began)
	}
	if plan != nil {
		// The machine is the job's now: a failure here leaves it to
		// cleanup, as any other.
		if err := startServices(ctx, j.vm, plan, svcOpts, say, e.Report); err != nil {
			j.log.Error("services failed", "err", err)
			return err
		}
	}
	return nil
}

// writeTimings appends the machine's timing record (jobvm.Acquired.Timings)
// to the file that LIBVIRT_EXECUTOR_TIMINGS names (jobvm.WriteTimings), if
// it is set. That is a variable of the runner host, which the stage inherits
// from the runner: never a job's, whose variables arrive as CUSTOM_ENV_*
// (CUSTOM_ENV_LIBVIRT_EXECUTOR_TIMINGS is not looked at). The job does not
// depend on the record: a failure to write it is only logged.
func writeTimings(e Env, j *job, a *jobvm.Acquired, began time.Time) {
	if err := jobvm.WriteTimings(e.Getenv, a.Timings(began)); err != nil {
		j.log.Warn("timings record not written", "err", err)
	}
}
