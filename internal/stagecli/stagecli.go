// Package stagecli is the common shell of the four stage executables: flags,
// signals, logging, configuration, and the one call that turns the stage's
// error into the exit code.
package stagecli

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// early receives SIGTERM/SIGINT from the moment the package initialises, so
// a signal that arrives while the executable is still starting (loading its
// configuration, connecting to libvirt) cancels the stage instead of killing
// it with nothing undone.
var early = make(chan os.Signal, 1)

func init() { signal.Notify(early, syscall.SIGTERM, syscall.SIGINT) }

// Stage is one stage's body.
type Stage func(ctx context.Context, env gitlab.Env, cfg *config.Config, args []string) error

// Option changes how a stage treats signals.
type Option func(*options)

type options struct{ toCompletion, explainViaAdmin bool }

// RunsToCompletion marks a stage that finishes its work after SIGTERM, on
// its own deadline, and then reports how that went (cleanup). Every other
// stage that received SIGTERM or SIGINT exits with SYSTEM_FAILURE, also when
// its work happened to finish first: the job was stopped, and the exit code
// must not depend on which of the two came first.
func RunsToCompletion() Option { return func(o *options) { o.toCompletion = true } }

// Main runs a stage executable and exits with the code exitcodes decides.
func Main(name, usage string, argsUsage string, nargs int, stage Stage, opts ...Option) {
	os.Exit(Run(os.Args, os.Getenv, os.Stdout, os.Stderr, name, usage, argsUsage, nargs, stage, opts...))
}

// Run is Main without os.Exit, for tests.
func Run(argv []string, getenv func(string) string, stdout, stderr io.Writer, name, usage, argsUsage string, nargs int, stage Stage, opts ...Option) int {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	began := time.Now()
	codes := exitcodes.FromEnv(getenv)
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	go func() {
		select {
		case sig := <-early:
			if ctx.Err() != nil {
				// Run had returned (its cancel ran before anything
				// after it could signal): the signal is for the next
				// Run of this process (tests run several); pass it on.
				select {
				case early <- sig:
				default:
				}
				return
			}
			cancel(fmt.Errorf("%v signal received", sig))
		case <-ctx.Done(): // Run returned
		}
	}()
	var stageErr error
	app := &cli.App{
		Name:      name,
		Usage:     usage,
		ArgsUsage: argsUsage,
		Version:   buildinfo.Version,
		Writer:    stderr,
		ErrWriter: stderr,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "config", Usage: "driver configuration file (default " + config.DefaultPath + ")", EnvVars: []string{config.EnvPath}},
			&cli.StringFlag{Name: "log-level", Value: "info", Usage: "debug, info, warn or error"},
		},
		HideHelpCommand: true,
		Action: func(c *cli.Context) error {
			var level slog.Level
			if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
				return fmt.Errorf("--log-level %q: use debug, info, warn or error", c.String("log-level"))
			}
			logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})).With("exe", name)
			if c.NArg() != nargs {
				return fmt.Errorf("%s takes %d argument(s) (%s), got %d", name, nargs, argsUsage, c.NArg())
			}
			cfgPath := config.Resolve(c.String("config"), getenv)
			cfg, err := config.Load(cfgPath)
			if err != nil {
				return err
			}
			report := &obs.Report{Stage: strings.TrimPrefix(name, lifecycle.AdminExecutable+"-")}
			env := gitlab.Env{Getenv: getenv, Stdout: stdout, Stderr: stderr, Log: logger, Report: report}
			if o.explainViaAdmin {
				env.Explain = newAdminExplainer(cfgPath, logger).Explain
			}
			stageErr = stage(c.Context, env, cfg, c.Args().Slice())
			if !o.toCompletion && ctx.Err() != nil && exitcodes.Classify(stageErr) != exitcodes.SystemClass {
				// Signalled: the job was stopped, whatever the work's own
				// outcome (success or the script's failure) raced it.
				stopped := fmt.Errorf("stopped: %w", context.Cause(ctx))
				if stageErr != nil {
					stopped = fmt.Errorf("%w (the stage had ended: %v)", stopped, stageErr)
				}
				stageErr = exitcodes.System(stopped)
			}
			if stageErr != nil {
				fmt.Fprintf(stderr, "%s: %v\n", name, stageErr)
			}
			cancelled := ctx.Err() != nil && (stageErr != nil || !o.toCompletion)
			record(cfg, logger, report, stageErr, cancelled, began)
			return nil
		},
	}
	if err := app.RunContext(ctx, argv); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return codes.System
	}
	return codes.Resolve(stageErr)
}

// record ends the stage's report and records it: the event for the
// service's metrics (the spool in the state directory) and the step
// records for the host's structured log. Neither can fail the stage; a
// failure is logged at debug level (stderr is the job log).
func record(cfg *config.Config, log *slog.Logger, r *obs.Report, err error, cancelled bool, began time.Time) {
	end := time.Now()
	dead, _ := sshexec.DeadAfter(err)
	ev, steps := r.Finish(obs.Outcome{Err: err, Cancelled: cancelled, Took: end.Sub(began), End: end, Classify: Classify, DeadAfter: dead})
	spool := obs.Spool{Dir: filepath.Join(cfg.StateDir, lifecycle.EventsDir), MaxBytes: int64(cfg.Serve.EventSpoolMiB) << 20}
	if aerr := spool.Append(ev); aerr != nil {
		log.Debug("event record not written", "err", aerr)
	}
	sl, oerr := obs.OpenStepLog(cfg.Log.Steps, stepLogPath(cfg), int64(cfg.Log.StepsFileMiB)<<20)
	if oerr != nil {
		log.Debug("step log not opened", "err", oerr)
		return
	}
	defer func() { _ = sl.Close() }()
	for _, s := range steps {
		if lerr := sl.Log(s); lerr != nil {
			log.Debug("step record not written", "err", lerr)
			return
		}
	}
}

// stepLogPath is the step log's path for its kind: the file, or for the
// journal its default socket.
func stepLogPath(cfg *config.Config) string {
	if cfg.Log.Steps == "file" {
		return cfg.Log.StepsFile
	}
	return ""
}

// Classify is a stage error's result class and failure reason, as the
// metrics and the structured log give them.
func Classify(err error, cancelled bool) (result, reason string) {
	switch exitcodes.Classify(err) {
	case exitcodes.OK:
		result = obs.ResultSuccess
	case exitcodes.BuildClass:
		result = obs.ResultBuild
	default:
		result = obs.ResultSystem
	}
	if cancelled && result == obs.ResultSuccess {
		result = obs.ResultSystem
	}
	return result, jobvm.FailureReason(err, cancelled)
}
