package gitlab

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"slices"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// stepStages are the names the runner gives the stage whose script its
// shim fills with `step-runner ci` for a run: job (the Custom executor gets
// build_script for step_script).
var stepStages = []string{"build_script", "step_script"}

// nativeSteps says whether this stage runs the job's steps natively: a
// run: job's step stage with gitlab.steps = "native". Without the payload
// (insecure_job_id_from_env) the runner's shim runs them.
func nativeSteps(cfg *config.Config, j *job, stage string) bool {
	return slices.Contains(stepStages, stage) && cfg.GitLab.Steps == config.StepsNative && j.job.Steps && j.job.FromPayload
}

// StepsJob is a GitLab Steps job's step stage, handed to Env.Steps (the
// run stage's executable gives it to internal/stepsvc's RunJob, field by
// field): the payload with the job's run: and variables, the stage's
// environment, the job's way into its guest and the job log.
type StepsJob struct {
	PayloadPath    string
	Environ        []string
	Stream         func(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error
	Stdout, Stderr io.Writer
	Log            *slog.Logger
	Span           *time.Duration
}

// runNative runs the job's steps through the step-runner service in the
// guest (docs/steps.md, "Native mode"), over the job's session.
func runNative(ctx context.Context, e Env, j *job, sess *jobvm.Session, span *time.Duration) error {
	if e.Steps == nil {
		return exitcodes.System(errors.New("this executable does not run GitLab Steps natively (the run stage's does)"))
	}
	environ := e.Environ
	if environ == nil {
		environ = os.Environ
	}
	sess.Who = "the steps"
	return e.Steps(ctx, StepsJob{
		PayloadPath: e.Getenv("JOB_RESPONSE_FILE"), Environ: environ(),
		Stream: func(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error {
			return sess.Stream(ctx, cmd, stdin, stdout, e.Stderr)
		},
		Stdout: e.Stdout, Stderr: e.Stderr, Log: j.log, Span: span,
	})
}
