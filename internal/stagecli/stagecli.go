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
	"syscall"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
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
	codes := exitcodes.FromEnv(getenv)
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	go func() {
		select {
		case sig := <-early:
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
			env := gitlab.Env{Getenv: getenv, Stdout: stdout, Stderr: stderr, Log: logger}
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
			return nil
		},
	}
	if err := app.RunContext(ctx, argv); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return codes.System
	}
	return codes.Resolve(stageErr)
}
