package gitlab

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

// servicesPlan is prepare's plan of the job's `services:` when this runner
// starts them in the job's VM (services.enabled), and of a container job's
// container (services.container_jobs, #46 item 2): read from the runner's
// payload (JOB_RESPONSE_FILE) and judged before any machine is touched, so
// a service the admin does not allow fails the job with nothing made. nil
// when the job asks for neither or the runner does not start services
// (then checkServices has said so).
func servicesPlan(cfg *config.Config, j *job, img *config.Image, getenv func(string) string) (*services.Plan, services.Options, error) {
	_, container := containerHost(cfg, j.job.Image)
	if !cfg.Services.Enabled || (j.job.Services.Count == 0 && !container) {
		return nil, services.Options{}, nil
	}
	if container && j.job.Steps {
		return nil, services.Options{}, exitcodes.Userf("a GitLab Steps job (run:) runs on a VM image, not in a container image: " +
			"name one of this runner's VM images in image:")
	}
	path := getenv("JOB_RESPONSE_FILE")
	if path == "" {
		return nil, services.Options{}, exitcodes.System(fmt.Errorf("services: the job's services and container image are read from JOB_RESPONSE_FILE, which is not set"))
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, services.Options{}, exitcodes.System(fmt.Errorf("services: JOB_RESPONSE_FILE: %w", err))
	}
	defer f.Close()
	p, err := services.DecodePayload(f)
	if err != nil {
		return nil, services.Options{}, exitcodes.User(fmt.Errorf("services: %w", err))
	}
	o, err := services.OptionsFrom(cfg.Services, j.job.ID, img.Name, img.User)
	if err != nil {
		return nil, services.Options{}, exitcodes.System(fmt.Errorf("services: %w", err))
	}
	plan, err := services.NewPlan(p, o)
	if err != nil {
		// What the job asked for (an image not allowed, a pull policy the
		// admin does not accept, a bad name): the job's to fix.
		return nil, services.Options{}, exitcodes.User(fmt.Errorf("services: %w", err))
	}
	if container {
		allow, err := services.NewAllowlist(cfg.Services.ContainerJobs.AllowedImages)
		if err != nil {
			return nil, services.Options{}, exitcodes.System(fmt.Errorf("services: %w", err))
		}
		if plan.Job, err = services.NewJobContainer(p, j.job.ID, []string{img.BuildsDir, img.CacheDir}, allow, o); err != nil {
			return nil, services.Options{}, err
		}
	}
	return plan, o, nil
}

// startServices starts the plan's services in the job's machine, through
// the job's one way into its guest (jobvm.Session), before the first
// script; each step's time goes to the job log.
func startServices(ctx context.Context, vm *jobvm.Job, plan *services.Plan, o services.Options, say func(string, ...any), rep *obs.Report) (err error) {
	t0 := time.Now()
	started := 0
	defer func() { rep.Services(started, time.Since(t0), plan.Job != nil, err) }()
	s := vm.Session()
	defer s.Close()
	_, c, err := s.Client(ctx)
	if err != nil {
		return exitcodes.System(fmt.Errorf("services: the job's VM: %w", err))
	}
	st, err := services.Start(ctx, c, plan, o, &lineWriter{say: say})
	if err != nil {
		return err
	}
	started = len(st.Services)
	// A container job's later stages run its scripts in its container
	// (runInContainer): the job's mapping names it since Acquire.
	return nil
}

// runInContainer runs a container job's stage in its container
// (services.RunStage) over the stage's session into the guest.
func runInContainer(ctx context.Context, e Env, sess *jobvm.Session, mach *jobvm.MachineRecord, container string, script []byte, span *time.Duration) error {
	_, c, err := sess.Client(ctx)
	if err != nil {
		return exitcodes.System(err)
	}
	t := time.Now()
	err = services.RunStage(ctx, c, container, mach.User != "" && mach.User != "root", script, e.Stdout, e.Stderr)
	*span = time.Since(t)
	return err
}

// lineWriter hands each complete line written to it to say (the job log).
type lineWriter struct {
	say func(string, ...any)
	buf []byte
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.say("%s", string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
	return len(p), nil
}

// debugServices: the job set CI_DEBUG_SERVICES (the runner passes the
// job's variables as CUSTOM_ENV_*).
func debugServices(getenv func(string) string) bool {
	v := getenv("CUSTOM_ENV_CI_DEBUG_SERVICES")
	return v == "true" || v == "1"
}

// followServiceLogs streams what the job's services write during a stage
// of the user's scripts into the job log, beside the script's output
// (CI_DEBUG_SERVICES, services.StartServiceLogs), over the stage's direct
// connection into the guest; stop ends it once the streams have shown
// what the services wrote so far (at most serviceLogsCatchUp after the
// script: a follower starts slowly in a slow guest). A failure to start it
// is a line in the job log: the stage goes on.
// serviceLogsCatchUp bounds how long a stage waits, after its script, for
// the services' logs to be shown.
const serviceLogsCatchUp = 15 * time.Second

func followServiceLogs(ctx context.Context, e Env, sess *jobvm.Session, sudo bool) (stop func()) {
	_, c, err := sess.Client(ctx)
	if err == nil {
		var end func(time.Duration)
		if end, err = services.StartServiceLogs(ctx, c, sudo, e.Stdout); err == nil {
			return func() { end(serviceLogsCatchUp) }
		}
	}
	fmt.Fprintf(e.Stderr, "libvirt-executor: CI_DEBUG_SERVICES: the services' logs are not shown: %v\n", err)
	return func() {}
}
