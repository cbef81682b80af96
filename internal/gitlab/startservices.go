package gitlab

import (
	"bytes"
	"context"
	"fmt"
	"os"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

// servicesPlan is prepare's plan of the job's `services:` when this runner
// starts them in the job's VM (services.enabled): read from the runner's
// payload (JOB_RESPONSE_FILE) and judged before any machine is touched, so
// a service the admin does not allow fails the job with nothing made. nil
// when the job asks for none or the runner does not start services (then
// checkServices has said so).
func servicesPlan(cfg *config.Config, j *job, img *config.Image, getenv func(string) string) (*services.Plan, services.Options, error) {
	if !cfg.Services.Enabled || j.job.Services.Count == 0 {
		return nil, services.Options{}, nil
	}
	path := getenv("JOB_RESPONSE_FILE")
	if path == "" {
		return nil, services.Options{}, exitcodes.System(fmt.Errorf("services: the job's services are read from JOB_RESPONSE_FILE, which is not set"))
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
	return plan, o, nil
}

// startServices starts the plan's services in the job's machine, through
// the job's one way into its guest (jobvm.Session), before the first
// script; each step's time goes to the job log.
func startServices(ctx context.Context, vm *jobvm.Job, plan *services.Plan, o services.Options, say func(string, ...any)) error {
	s := vm.Session()
	defer s.Close()
	_, c, err := s.Client(ctx)
	if err != nil {
		return exitcodes.System(fmt.Errorf("services: the job's VM: %w", err))
	}
	_, err = services.Start(ctx, c, plan, o, &lineWriter{say: say})
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
