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
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/failure"
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

// Exe describes a stage executable: its name and help, its arguments, its
// body, and how it treats signals and unanswering guests.
type Exe struct {
	// Name is the executable's name, in its help, errors and log; without
	// the jobvm.AdminExecutable+"-" prefix it names the stage in the
	// records.
	Name string
	// Usage is the help's one-line description.
	Usage string
	// ArgsUsage describes the arguments in the help ("" for none).
	ArgsUsage string
	// NArgs is how many arguments the stage takes, exactly.
	NArgs int
	// Stage is the stage's body.
	Stage Stage
	// RunsToCompletion marks a stage that finishes its work after SIGTERM,
	// on its own deadline, and then reports how that went (cleanup). Every
	// other stage that received SIGTERM or SIGINT exits with
	// SYSTEM_FAILURE, also when its work happened to finish first: the job
	// was stopped, and the exit code must not depend on which of the two
	// came first.
	RunsToCompletion bool
	// Undo, if set, undoes a stage whose work finished but which is
	// reported as stopped (a signal came after its work was done): so
	// that a stopped stage leaves nothing, whichever came first
	// (prepare: its machine goes, as at cleanup). It runs on the
	// configuration's cleanup timeout, not on the signalled context.
	Undo Stage
	// ExplainViaAdminTool marks a stage built without libvirt (run): when
	// a guest stops answering, the stage asks the admin tool
	// (jobvm.AdminExecutable, next to the running executable, else on
	// PATH) in a child process what became of the machine
	// (gitlab.Env.Explain, jobvm.ExplainCommand) instead of asking
	// libvirt itself. The child gets the stage's configuration file as a
	// flag and the stage's environment without the job's variables
	// (CUSTOM_ENV_*); it runs from its argv, never through a shell, for at
	// most 6 s. When the tool is not found, the stage's error says so in
	// place of the explanation. The host cache's restore disk is asked of
	// it the same way (gitlab.Env.CacheDisk, cachexfer.AdminCommand).
	ExplainViaAdminTool bool
	// Pull pulls images with a source (gitlab.Env.Pull): prepare's. With
	// it, the stage also refreshes a stale image in the background
	// (gitlab.Env.Refresh: the admin tool's image pull, detached).
	Pull jobvm.PullFunc
	// Steps runs a GitLab Steps job's steps natively (gitlab.Env.Steps):
	// the run stage's, the one executable that links the Step Runner's
	// client.
	Steps func(ctx context.Context, j gitlab.StepsJob) error
}

// Process is what a stage executable gets from its process: its argv, its
// environment, and its output (stdout is the runner's protocol output,
// stderr the job log).
type Process struct {
	Args   []string
	Getenv func(string) string
	Stdout io.Writer
	Stderr io.Writer
}

// Main runs a stage executable and exits with the code exitcodes decides.
func Main(e Exe) {
	os.Exit(Run(Process{Args: os.Args, Getenv: os.Getenv, Stdout: os.Stdout, Stderr: os.Stderr}, e))
}

// Run is Main without os.Exit, for tests.
func Run(p Process, e Exe) int {
	name, getenv, stdout, stderr := e.Name, p.Getenv, p.Stdout, p.Stderr
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
		Usage:     e.Usage,
		ArgsUsage: e.ArgsUsage,
		Version:   buildinfo.String(),
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
			logger := obs.NewTextLogger(stderr, &slog.HandlerOptions{Level: level}).With("exe", name)
			if c.NArg() != e.NArgs {
				return fmt.Errorf("%s takes %d argument(s) (%s), got %d", name, e.NArgs, e.ArgsUsage, c.NArg())
			}
			cfgPath := config.Resolve(c.String("config"), getenv)
			cfg, err := config.Load(cfgPath)
			if err != nil {
				return err
			}
			report := &obs.Report{Stage: strings.TrimPrefix(name, jobvm.AdminExecutable+"-")}
			env := gitlab.Env{Getenv: getenv, Stdout: stdout, Stderr: stderr, Log: logger, Report: report, Pull: e.Pull, Steps: e.Steps}
			if e.Pull != nil {
				env.Refresh = newAdminTool(cfgPath, logger).refreshImage(cfg.StateDir)
			}
			if e.ExplainViaAdminTool {
				tool := newAdminTool(cfgPath, logger)
				env.Explain = tool.Explain
				env.CacheDisk = adminCacheDisk(tool)
			}
			stageErr = e.Stage(c.Context, env, cfg, c.Args().Slice())
			if !e.RunsToCompletion && ctx.Err() != nil && exitcodes.Classify(stageErr) != exitcodes.SystemClass {
				// Signalled: the job was stopped, whatever the work's own
				// outcome (success or the script's failure) raced it.
				stopped := fmt.Errorf("stopped: %w", context.Cause(ctx))
				if stageErr != nil {
					stopped = fmt.Errorf("%w (the stage had ended: %v)", stopped, stageErr)
				} else if e.Undo != nil {
					uctx, cancel := detachctx.WithTimeout(ctx, cfg.Timeouts.Cleanup.D())
					if uerr := e.Undo(uctx, env, cfg, c.Args().Slice()); uerr != nil {
						stopped = fmt.Errorf("%w; undoing what the stage had done failed: %v", stopped, uerr)
					} else {
						stopped = fmt.Errorf("%w (what the stage had done is undone)", stopped)
					}
					cancel()
				}
				stageErr = exitcodes.System(stopped)
			}
			if stageErr != nil {
				fmt.Fprintf(stderr, "%s: %v\n", name, stageErr)
			}
			cancelled := ctx.Err() != nil && (stageErr != nil || !e.RunsToCompletion)
			record(cfg, logger, report, stageErr, cancelled, began)
			return nil
		},
	}
	if err := app.RunContext(ctx, p.Args); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return codes.System
	}
	return codes.Resolve(stageErr)
}

// record ends the stage's report and records it (lifecycle.RecordReport).
func record(cfg *config.Config, log *slog.Logger, r *obs.Report, err error, cancelled bool, began time.Time) {
	end := time.Now()
	dead, _ := sshexec.DeadAfter(err)
	lifecycle.RecordReport(cfg, log, r, obs.Outcome{Err: err, Cancelled: cancelled, Took: end.Sub(began), End: end, Classify: Classify, DeadAfter: dead})
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
	return result, failure.Classify(err, cancelled)
}
