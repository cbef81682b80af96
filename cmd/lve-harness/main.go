// Command lve-harness drives the driver's four Custom executor executables
// the way GitLab Runner 16.11 does (see internal/testkit/harness), and serves a git
// repository for guests to clone. It is a test tool, used by `make demo`.
//
//	lve-harness run --config-exec X --prepare-exec X --run-exec X --cleanup-exec X \
//	    --repo URL --sha SHA --image NAME --script 'cmd' [--after-script 'cmd'] ...
//	lve-harness demo --bin DIR [--config FILE]
//	lve-harness demo-repo --dir DIR
//	lve-harness git-serve --repo DIR --listen ADDR
//
// run exits 0 when the job succeeded, 1 when it failed, 2 on a harness error.
// Ctrl-C (SIGINT) or SIGTERM cancels the job like the GitLab cancel button:
// the running stage gets SIGTERM, after_script and cleanup still run.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

// errJobFailed marks a job that ran and failed (exit 1).
var errJobFailed = errors.New("job failed")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := app().RunContext(ctx, os.Args)
	os.Exit(exitCode(err))
}

// exitCode is the one place that maps errors to the process exit code.
func exitCode(err error) int {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, errJobFailed):
		return 1
	default:
		fmt.Fprintln(os.Stderr, "lve-harness:", err)
		return 2
	}
}

func app() *cli.App {
	return &cli.App{
		Name:  "lve-harness",
		Usage: "run CI jobs through Custom executor executables the way GitLab Runner 16.11 does",
		Commands: []*cli.Command{
			runCommand(),
			demoCommand(),
			{
				Name:  "demo-repo",
				Usage: "create DIR/demo.git, a bare repository with README.md and build.sh; prints its path and commit",
				Flags: []cli.Flag{&cli.StringFlag{Name: "dir", Required: true, Usage: "directory to create the repository in"}},
				Action: func(c *cli.Context) error {
					bare, sha, err := harness.MakeDemoRepo(c.String("dir"))
					if err != nil {
						return err
					}
					fmt.Printf("repo=%s\nsha=%s\n", bare, sha)
					return nil
				},
			},
			{
				Name:  "git-serve",
				Usage: "serve a bare repository read-only over smart HTTP until interrupted",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "repo", Required: true, Usage: "bare repository directory"},
					&cli.StringFlag{Name: "listen", Value: "127.0.0.1:0", Usage: "listen address"},
				},
				Action: func(c *cli.Context) error {
					url, stopServe, err := harness.ServeGit(c.Context, c.String("repo"), c.String("listen"))
					if err != nil {
						return err
					}
					fmt.Println(url)
					<-c.Done()
					stopServe()
					return nil
				},
			},
		},
	}
}

func runCommand() *cli.Command {
	return &cli.Command{
		Name:  "run",
		Usage: "run one job; prints the job log live, then a summary",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "config-exec", Usage: "config_exec path (optional)"},
			&cli.StringFlag{Name: "prepare-exec", Usage: "prepare_exec path (optional)"},
			&cli.StringFlag{Name: "run-exec", Required: true, Usage: "run_exec path"},
			&cli.StringFlag{Name: "cleanup-exec", Usage: "cleanup_exec path (optional)"},
			&cli.StringSliceFlag{Name: "exec-arg", Usage: "argument given to all four executables before their own (repeatable)"},
			&cli.StringSliceFlag{Name: "config-arg", Usage: "config_args entry (repeatable)"},
			&cli.StringSliceFlag{Name: "prepare-arg", Usage: "prepare_args entry (repeatable)"},
			&cli.StringSliceFlag{Name: "run-arg", Usage: "run_args entry (repeatable)"},
			&cli.StringSliceFlag{Name: "cleanup-arg", Usage: "cleanup_args entry (repeatable)"},
			&cli.Int64Flag{Name: "job-id", Usage: "job id (default: random)"},
			&cli.StringFlag{Name: "job-name", Value: "test"},
			&cli.StringFlag{Name: "project-path", Value: "lab/demo", Usage: "namespace/project"},
			&cli.StringFlag{Name: "repo", Usage: "repository URL the guest fetches (empty: no git checkout)"},
			&cli.StringFlag{Name: "ref", Value: "main"},
			&cli.StringFlag{Name: "sha", Usage: "commit to check out (empty: the tip of --ref)"},
			&cli.IntFlag{Name: "git-depth", Usage: "shallow fetch depth (0: full)"},
			&cli.StringFlag{Name: "image", Usage: "the job's image: name"},
			&cli.StringSliceFlag{Name: "script", Usage: "script command (repeatable)"},
			&cli.StringSliceFlag{Name: "after-script", Usage: "after_script command (repeatable)"},
			&cli.StringSliceFlag{Name: "var", Usage: "CI/CD variable K=V (repeatable)"},
			&cli.StringSliceFlag{Name: "masked", Usage: "masked CI/CD variable K=V (repeatable)"},
			&cli.DurationFlag{Name: "timeout", Value: time.Hour, Usage: "job timeout"},
			&cli.DurationFlag{Name: "script-timeout", Usage: "RUNNER_SCRIPT_TIMEOUT (0: none)"},
			&cli.DurationFlag{Name: "cancel-after", Usage: "cancel the job after this long (0: never)"},
			&cli.StringFlag{Name: "builds-dir", Usage: "config.toml builds_dir (config_exec may override)"},
			&cli.BoolFlag{Name: "build-exit-code-file", Usage: "set BUILD_EXIT_CODE_FILE (runner >= 17.11)"},
			&cli.DurationFlag{Name: "config-timeout", Value: time.Hour},
			&cli.DurationFlag{Name: "prepare-timeout", Value: time.Hour},
			&cli.DurationFlag{Name: "cleanup-timeout", Value: time.Hour},
			&cli.DurationFlag{Name: "graceful-kill", Value: 600 * time.Second, Usage: "SIGTERM to SIGKILL delay"},
			&cli.DurationFlag{Name: "force-kill", Value: 10 * time.Second, Usage: "SIGKILL to abandon delay"},
			&cli.DurationFlag{Name: "retry-pause", Value: 3 * time.Second, Usage: "pause between prepare attempts"},
			&cli.StringFlag{Name: "workdir", Usage: "parent of the custom-executorNNN dirs (default: $TMPDIR)"},
			&cli.BoolFlag{Name: "keep-workdir", Usage: "keep the work dirs (they hold the job token)"},
			&cli.BoolFlag{Name: "debug", Usage: "show cleanup's output and harness details on stderr"},
		},
		Action: runAction,
	}
}

func runAction(c *cli.Context) error {
	vars, err := keyValues(c.StringSlice("var"))
	if err != nil {
		return err
	}
	masked, err := keyValues(c.StringSlice("masked"))
	if err != nil {
		return err
	}
	common := c.StringSlice("exec-arg")
	with := func(flag string) []string { return append(append([]string(nil), common...), c.StringSlice(flag)...) }
	debug := debugLog(c)
	opts := harness.Options{
		Exec: harness.Executables{
			Config: c.String("config-exec"), Prepare: c.String("prepare-exec"),
			Run: c.String("run-exec"), Cleanup: c.String("cleanup-exec"),
			ConfigArgs: with("config-arg"), PrepareArgs: with("prepare-arg"),
			RunArgs: with("run-arg"), CleanupArgs: with("cleanup-arg"),
		},
		WorkDir:           c.String("workdir"),
		KeepWorkDir:       c.Bool("keep-workdir"),
		BuildsDir:         c.String("builds-dir"),
		BuildExitCodeFile: c.Bool("build-exit-code-file"),
		StageTimeouts: harness.StageTimeouts{
			Config: c.Duration("config-timeout"), Prepare: c.Duration("prepare-timeout"), Cleanup: c.Duration("cleanup-timeout"),
		},
		GracefulKill: c.Duration("graceful-kill"),
		ForceKill:    c.Duration("force-kill"),
		RetryPause:   c.Duration("retry-pause"),
		Log:          os.Stdout,
		DebugLog:     debug,
	}
	job := harness.Job{
		ID: c.Int64("job-id"), Name: c.String("job-name"), ProjectPath: c.String("project-path"),
		RepoURL: c.String("repo"), Ref: c.String("ref"), SHA: c.String("sha"), GitDepth: c.Int("git-depth"),
		Image:  c.String("image"),
		Script: c.StringSlice("script"), AfterScript: c.StringSlice("after-script"),
		Variables: vars, Masked: masked,
		Timeout: c.Duration("timeout"), ScriptTimeout: c.Duration("script-timeout"),
	}
	ctx := c.Context
	if d := c.Duration("cancel-after"); d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	return runAndReport(ctx, opts, job)
}

// runAndReport runs the job (its log goes to opts.Log) and prints a summary.
func runAndReport(ctx context.Context, opts harness.Options, job harness.Job) error {
	res, err := harness.RunJob(ctx, opts, job)
	if err != nil {
		return err
	}
	fmt.Println("\n=== lve-harness summary")
	if err := res.WriteSummary(os.Stdout); err != nil {
		return err
	}
	if res.State != harness.StateSuccess {
		return errJobFailed
	}
	return nil
}

func keyValues(items []string) (map[string]string, error) {
	out := map[string]string{}
	for _, it := range items {
		k, v, ok := strings.Cut(it, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("want K=V, got %q", it)
		}
		out[k] = v
	}
	return out, nil
}

// debugLog is stderr with a prefix when --debug is set, else nil (discard).
func debugLog(c *cli.Context) io.Writer {
	if c.Bool("debug") {
		return &prefixWriter{w: os.Stderr, prefix: "[debug] "}
	}
	return nil
}

// prefixWriter starts every output line with prefix.
type prefixWriter struct {
	w       io.Writer
	prefix  string
	midLine bool
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	var sb strings.Builder
	for _, l := range strings.SplitAfter(string(b), "\n") {
		if l == "" {
			continue
		}
		if !p.midLine {
			sb.WriteString(p.prefix)
		}
		sb.WriteString(l)
		p.midLine = !strings.HasSuffix(l, "\n")
	}
	if _, err := io.WriteString(p.w, sb.String()); err != nil {
		return 0, err
	}
	return len(b), nil
}
