package jobapi

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/pelletier/go-toml/v2"
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
	// TLSCAFile, if set, is the CA certificates file the runner trusts for
	// URL (--tls-ca-file); the runner hands it to the job too
	// (CI_SERVER_TLS_CA_FILE), for git and its helper in the guest.
	TLSCAFile string
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
	if o.TLSCAFile != "" {
		args = append(args, "--tls-ca-file", o.TLSCAFile)
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

// RunMultiOptions are the arguments of RunMulti.
type RunMultiOptions struct {
	Binary string // gitlab-runner; see RunnerBinary
	URL    string // Server.URL()
	Token  string // Server.RunnerToken()
	// Executor is "custom" (with Custom set) or "shell".
	Executor            string
	BuildsDir, CacheDir string
	Custom              *CustomConfig
	// Concurrent is how many jobs run at once (default 1).
	Concurrent int
	// Env is the runner's environment (nil: this process's); see RunSingle.
	Env []string
	// TLSCAFile, if set, is the CA certificates file the runner trusts for
	// URL (--tls-ca-file); the runner hands it to the job too
	// (CI_SERVER_TLS_CA_FILE), for git and its helper in the guest.
	TLSCAFile string
	// Dir is the runner's working directory ("" for this process's).
	Dir            string
	Stdout, Stderr io.Writer
	// RunAs, if set, runs the runner as this user (as systemd's User=
	// does): its config.toml and the directory holding it are given to it.
	RunAs *syscall.Credential
}

// multiConfig is the config.toml RunMulti writes (gitlab-runner's
// common.Config, reduced to what the tests set).
type multiConfig struct {
	Concurrent      int           `toml:"concurrent"`
	CheckInterval   int           `toml:"check_interval"`
	ShutdownTimeout int           `toml:"shutdown_timeout"`
	LogLevel        string        `toml:"log_level"`
	Runners         []multiRunner `toml:"runners"`
}

type multiRunner struct {
	Name      string       `toml:"name"`
	URL       string       `toml:"url"`
	Token     string       `toml:"token"`
	Executor  string       `toml:"executor"`
	Limit     int          `toml:"limit"`
	BuildsDir string       `toml:"builds_dir,omitempty"`
	CacheDir  string       `toml:"cache_dir,omitempty"`
	Custom    *multiCustom `toml:"custom,omitempty"`
}

type multiCustom struct {
	ConfigExec          string   `toml:"config_exec,omitempty"`
	ConfigArgs          []string `toml:"config_args,omitempty"`
	ConfigExecTimeout   int      `toml:"config_exec_timeout,omitempty"`
	PrepareExec         string   `toml:"prepare_exec,omitempty"`
	PrepareArgs         []string `toml:"prepare_args,omitempty"`
	PrepareExecTimeout  int      `toml:"prepare_exec_timeout,omitempty"`
	RunExec             string   `toml:"run_exec"`
	RunArgs             []string `toml:"run_args,omitempty"`
	CleanupExec         string   `toml:"cleanup_exec,omitempty"`
	CleanupArgs         []string `toml:"cleanup_args,omitempty"`
	CleanupExecTimeout  int      `toml:"cleanup_exec_timeout,omitempty"`
	GracefulKillTimeout int      `toml:"graceful_kill_timeout,omitempty"`
	ForceKillTimeout    int      `toml:"force_kill_timeout,omitempty"`
}

// multiStopGrace is how long RunMulti waits after each way of asking the
// runner to stop: SIGQUIT (it finishes the jobs it runs, for as long as they
// take, and takes no new one), then SIGTERM (it aborts them and runs their
// cleanup, within the config's shutdown_timeout), then SIGKILL.
var multiStopGrace = 45 * time.Second // a variable for the tests

// RunMulti runs `gitlab-runner run` (multi-runner mode, the way GitLab
// Runner runs as a service) with a config.toml of one runner until ctx
// ends: then the runner gets SIGQUIT, finishes the jobs it runs and exits;
// SIGTERM if it is still there multiStopGrace later (its jobs are aborted
// and cleaned up), SIGKILL after as long again. Some things happen only
// in this mode: `run:` (GitLab Steps) jobs are converted for executors
// without native steps here, and run-single ignores `run`.
//
// The config.toml, which holds the runner token, is written mode 0600 to a
// private temporary directory and removed when RunMulti returns. It
// returns nil when the runner ran until it was asked to stop and then
// exited cleanly.
func RunMulti(ctx context.Context, o RunMultiOptions) error {
	if o.Binary == "" || o.URL == "" || o.Token == "" || o.Executor == "" {
		return errors.New("jobapi: RunMulti needs Binary, URL, Token and Executor")
	}
	if (o.Executor == "custom") != (o.Custom != nil) {
		return errors.New(`jobapi: RunMulti: Custom is for, and needed by, the "custom" executor`)
	}
	concurrent := max(o.Concurrent, 1)
	r := multiRunner{
		Name: "lve-test", URL: o.URL, Token: o.Token, Executor: o.Executor, Limit: concurrent,
		BuildsDir: o.BuildsDir, CacheDir: o.CacheDir,
	}
	if c := o.Custom; c != nil {
		r.Custom = &multiCustom{
			ConfigExec: c.ConfigExec, ConfigArgs: c.ConfigArgs, ConfigExecTimeout: c.ConfigExecTimeout,
			PrepareExec: c.PrepareExec, PrepareArgs: c.PrepareArgs, PrepareExecTimeout: c.PrepareExecTimeout,
			RunExec: c.RunExec, RunArgs: c.RunArgs,
			CleanupExec: c.CleanupExec, CleanupArgs: c.CleanupArgs, CleanupExecTimeout: c.CleanupExecTimeout,
			GracefulKillTimeout: c.GracefulKillTimeout, ForceKillTimeout: c.ForceKillTimeout,
		}
	}
	data, err := toml.Marshal(multiConfig{
		Concurrent: concurrent, CheckInterval: 1, ShutdownTimeout: 30, LogLevel: "info",
		Runners: []multiRunner{r},
	})
	if err != nil {
		return fmt.Errorf("jobapi: RunMulti: config.toml: %w", err)
	}
	dir, err := os.MkdirTemp("", "lve-runner-config-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }() // a private temp dir; holds the token
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, data, 0o600); err != nil {
		return err
	}
	if o.RunAs != nil {
		for _, p := range []string{dir, cfgPath} {
			if err := os.Chown(p, int(o.RunAs.Uid), int(o.RunAs.Gid)); err != nil {
				return err
			}
		}
	}

	cmd := exec.Command(o.Binary, "run", "--config", cfgPath, "--working-directory", cmp.Or(o.Dir, dir)) //nolint:gosec // G204: the operator's binary, a path this function made
	if o.RunAs != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: o.RunAs}
	}
	cmd.Env = o.Env
	cmd.Dir = o.Dir
	cmd.Stdout, cmd.Stderr = o.Stdout, o.Stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("gitlab-runner run: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		return fmt.Errorf("gitlab-runner run exited before it was asked to stop: %w", orExit0(err))
	case <-ctx.Done():
	}
	_ = cmd.Process.Signal(syscall.SIGQUIT) // exited meanwhile: Wait says so below
	select {
	case err := <-exited:
		if err != nil {
			return fmt.Errorf("gitlab-runner run, asked to stop: %w", err)
		}
		return nil
	case <-time.After(multiStopGrace):
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		return fmt.Errorf("gitlab-runner run did not stop within %s of SIGQUIT: stopped by SIGTERM, its jobs aborted (%v)", multiStopGrace, orExit0(err))
	case <-time.After(multiStopGrace):
	}
	_ = cmd.Process.Kill()
	if err := <-exited; err != nil {
		return fmt.Errorf("gitlab-runner run did not stop within %s of SIGQUIT nor of SIGTERM: killed (%w)", multiStopGrace, err)
	}
	return fmt.Errorf("gitlab-runner run did not stop within %s of SIGQUIT nor of SIGTERM: killed", multiStopGrace)
}

// orExit0 says "exit status 0" for a nil error.
func orExit0(err error) error {
	if err == nil {
		return errors.New("exit status 0")
	}
	return err
}

// DriverStages is the Custom executor's settings for this project's four
// executables, libvirt-executor-{config,prepare,run,cleanup} in binDir,
// each given --config cfgPath.
func DriverStages(binDir, cfgPath string) *CustomConfig {
	exe := func(stage string) string { return filepath.Join(binDir, "libvirt-executor-"+stage) }
	args := []string{"--config", cfgPath}
	return &CustomConfig{
		ConfigExec: exe("config"), PrepareExec: exe("prepare"), RunExec: exe("run"), CleanupExec: exe("cleanup"),
		ConfigArgs: args, PrepareArgs: args, RunArgs: args, CleanupArgs: args,
	}
}
