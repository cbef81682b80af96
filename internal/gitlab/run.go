package gitlab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

// Run is the run stage: it executes the runner's script for one stage in the
// job's machine.
func Run(ctx context.Context, e Env, cfg *config.Config, scriptPath, stage string) error {
	j, err := e.load(cfg)
	if err != nil {
		return err
	}
	defer j.jobs.Close()
	script, err := os.ReadFile(scriptPath)
	if err != nil {
		return exitcodes.System(fmt.Errorf("read the stage script: %w", err))
	}
	e.Report.SetStage(stage)
	jm, err := j.vm.Machine()
	if err != nil {
		return exitcodes.System(err)
	}
	// One session into the guest for the stage: the holder, else one
	// direct connection.
	sess := j.vm.Session()
	defer sess.Close()
	var img *config.Image
	var inContainer *jobvm.MachineRecord // a container job's stage for its container
	var container string
	if mach, rerr := j.vm.Record(); rerr == nil {
		e.Report.Machine(jm.Name, mach.Image)
		img = cfg.Images[mach.Image]
		if container, _ = j.vm.Container(); container != "" && services.InContainer(stage) {
			inContainer = mach
		}
		if cfg.Services.Enabled && services.InContainer(stage) && debugServices(e.Getenv) {
			defer followServiceLogs(ctx, e, sess, mach.User != "" && mach.User != "root")()
		}
	}
	op := cacheOpOf(stage, script)
	var early *cachexfer.Early
	switch op {
	case cacheRestore:
		runCache(ctx, e, j, jm.Name, img, op, script, nil)
	case cacheSave:
		// A disk attached during the script is deleted when the stage
		// ends, whatever became of the save (deleting none is success).
		early = startScratch(ctx, e, j, jm.Name, img, script)
		defer early.Drop(ctx)
	}
	var span time.Duration
	if inContainer != nil {
		err = runInContainer(ctx, e, sess, inContainer, container, script, &span)
	} else if nativeSteps(cfg, j, stage) {
		err = runNative(ctx, e, j, sess, &span)
	} else {
		err = sess.Run(ctx, jobvm.Stage{Name: stage, Script: script, Stdout: e.Stdout, Stderr: e.Stderr, Span: &span})
	}
	e.Report.GuestSpan(span)
	if op == cacheSave && err == nil {
		runCache(ctx, e, j, jm.Name, img, op, script, early)
	}
	if code, ok := exitcodes.ScriptCode(err); ok {
		if keepRequested(e.Getenv) && cfg.Debug.AllowKeepOnFailure {
			mach, rerr := j.vm.Record()
			dir, derr := j.vm.MachineDir()
			if rerr == nil && derr == nil && !sayKeepPlan(e, j, cfg, jm.Name) {
				fmt.Fprintf(e.Stderr, "libvirt-executor: %s is set: if the job fails, VM %s stays up for %s for debugging.\n"+
					"  On the runner host: ssh -i %s/id_ed25519 %s@%s   (libvirt-executor list shows it; gc removes it after its deadline)\n",
					VarKeep, jm.Name, cfg.Debug.KeepMaxAge.D(), dir, mach.User, mach.Address)
			}
		}
		if path := e.Getenv("BUILD_EXIT_CODE_FILE"); path != "" {
			if werr := os.WriteFile(path, //nolint:gosec // G703: BUILD_EXIT_CODE_FILE is set by the runner, not by the job (CUSTOM_ENV_* is the job's)
				[]byte(strconv.Itoa(code)+"\n"), 0o600); werr != nil {
				return exitcodes.System(errors.Join(err, fmt.Errorf("write BUILD_EXIT_CODE_FILE: %w", werr)))
			}
		}
		return err
	}
	if err != nil && ctx.Err() == nil && !errors.Is(err, jobvm.ErrNoMachine) {
		// The guest stopped answering: say what became of it.
		err = exitcodes.System(explained(ctx, j, err))
	}
	if err != nil {
		j.log.Error("stage failed", "stage", stage, "err", err)
	}
	return err
}

// explained adds to err what libvirt says became of the job's machine
// (gone, shut off, paused after a failed disk write), if it can tell within
// a few seconds and before ctx ends (jobvm.Job.Explain: through Env.Explain
// if set, else here).
func explained(ctx context.Context, j *job, err error) error {
	if why := j.vm.Explain(ctx); why != "" {
		return fmt.Errorf("%w; %s", err, why)
	}
	return err
}
