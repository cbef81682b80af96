package jobapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"
)

// RunnerBinaryEnv names the gitlab-runner binary for tests and selftest.
const RunnerBinaryEnv = "LVE_E2E_GITLAB_RUNNER"

// RunnerBinary finds a gitlab-runner binary: $LVE_E2E_GITLAB_RUNNER, else
// gitlab-runner on PATH. When there is none, path is empty and why says what
// was looked for.
func RunnerBinary() (path string, why string) {
	if p := os.Getenv(RunnerBinaryEnv); p != "" {
		fi, err := os.Stat(p) //nolint:gosec // G703: the operator names the binary to run; nothing of a job does
		switch {
		case err != nil:
			return "", fmt.Sprintf("%s=%s: %v", RunnerBinaryEnv, p, err)
		case fi.IsDir() || fi.Mode()&0o111 == 0:
			return "", fmt.Sprintf("%s=%s is not an executable file", RunnerBinaryEnv, p)
		}
		return p, ""
	}
	p, err := exec.LookPath("gitlab-runner")
	if err != nil {
		return "", fmt.Sprintf("no gitlab-runner: %s is not set and gitlab-runner is not on PATH (%v)", RunnerBinaryEnv, err)
	}
	return p, ""
}

// CustomConfig holds the Custom executor's settings for run-single.
type CustomConfig struct {
	ConfigExec, PrepareExec, RunExec, CleanupExec string
	ConfigArgs, PrepareArgs, RunArgs, CleanupArgs []string
	// Timeouts in seconds; 0 keeps the runner's default.
	ConfigExecTimeout, PrepareExecTimeout, CleanupExecTimeout int
	GracefulKillTimeout, ForceKillTimeout                     int
}

// RunSingleOptions are the arguments of RunSingle.
type RunSingleOptions struct {
	Binary string // gitlab-runner; see RunnerBinary
	URL    string // Server.URL()
	Token  string // Server.RunnerToken()
	// Executor is "custom" (with Custom set) or "shell".
	Executor            string
	BuildsDir, CacheDir string
	Custom              *CustomConfig
	// MaxBuilds is how many jobs to run before exiting (default 1).
	MaxBuilds int
	// WaitTimeout makes the runner give up when no job came for this long
	// (whole seconds; 0: wait until ctx ends).
	WaitTimeout time.Duration
	// Env is the runner's environment (nil: this process's), passed on to
	// jobs and executor stages. Point HOME at a scratch directory.
	Env []string
	// Dir is the runner's working directory ("" for this process's).
	Dir            string
	Stdout, Stderr io.Writer
}

// RunSingle runs `gitlab-runner run-single` until it has run MaxBuilds jobs
// (or WaitTimeout passed without one), and returns when it exits. When ctx
// ends, the runner gets SIGTERM (it aborts the job and reports it) and, if it
// is still there 30 s later, SIGKILL.
//
// The runner token goes through the environment (CI_SERVER_TOKEN, which
// run-single reads for --token), not argv, which every local user can read in
// /proc. The runner hands its whole environment, token included, to what it
// starts: the shell executor's jobs (which run as the runner's user and could
// read its /proc files anyway) and the Custom executor's stages, i.e. the
// driver; a guest sees it only if the driver forwards it. So pass a curated
// Env rather than this process's.
func RunSingle(ctx context.Context, o RunSingleOptions) error {
	if o.Binary == "" || o.URL == "" || o.Token == "" || o.Executor == "" {
		return errors.New("jobapi: RunSingle needs Binary, URL, Token and Executor")
	}
	if (o.Executor == "custom") != (o.Custom != nil) {
		return errors.New(`jobapi: RunSingle: Custom is for, and needed by, the "custom" executor`)
	}
	maxBuilds := o.MaxBuilds
	if maxBuilds <= 0 {
		maxBuilds = 1
	}
	args := []string{"run-single",
		"--url", o.URL,
		"--executor", o.Executor,
		"--max-builds", strconv.Itoa(maxBuilds),
	}
	if o.WaitTimeout > 0 {
		secs := (o.WaitTimeout + time.Second - 1) / time.Second // rounded up: 0 would mean forever
		args = append(args, "--wait-timeout", strconv.Itoa(int(secs)))
	}
	if o.BuildsDir != "" {
		args = append(args, "--builds-dir", o.BuildsDir)
	}
	if o.CacheDir != "" {
		args = append(args, "--cache-dir", o.CacheDir)
	}
	if c := o.Custom; c != nil {
		args = append(args, customArgs(c)...)
	}

	cmd := exec.CommandContext(ctx, o.Binary, args...)
	env := o.Env
	if env == nil {
		env = os.Environ()
	}
	cmd.Env = append(env[:len(env):len(env)], "CI_SERVER_TOKEN="+o.Token)
	cmd.Dir = o.Dir
	cmd.Stdout, cmd.Stderr = o.Stdout, o.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("gitlab-runner run-single: %w", err)
	}
	return nil
}

func customArgs(c *CustomConfig) []string {
	var args []string
	exe := func(stage, path string, stageArgs []string, timeout int) {
		if path == "" {
			return
		}
		args = append(args, "--custom-"+stage+"-exec", path)
		for _, a := range stageArgs {
			args = append(args, "--custom-"+stage+"-args", a)
		}
		if timeout > 0 {
			args = append(args, "--custom-"+stage+"-exec-timeout", strconv.Itoa(timeout))
		}
	}
	exe("config", c.ConfigExec, c.ConfigArgs, c.ConfigExecTimeout)
	exe("prepare", c.PrepareExec, c.PrepareArgs, c.PrepareExecTimeout)
	exe("run", c.RunExec, c.RunArgs, 0) // run has no timeout of its own: the job's applies
	exe("cleanup", c.CleanupExec, c.CleanupArgs, c.CleanupExecTimeout)
	if c.GracefulKillTimeout > 0 {
		args = append(args, "--custom-graceful-kill-timeout", strconv.Itoa(c.GracefulKillTimeout))
	}
	if c.ForceKillTimeout > 0 {
		args = append(args, "--custom-force-kill-timeout", strconv.Itoa(c.ForceKillTimeout))
	}
	return args
}
