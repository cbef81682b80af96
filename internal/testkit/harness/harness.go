// Package harness drives the four Custom executor executables (config,
// prepare, run, cleanup) the way GitLab Runner 16.11 does, so the driver can be
// tested end to end without a GitLab instance or a runner.
//
// It reproduces what the runner is recorded doing in
// shared/fixtures/gitlab-runner-16.11-trace and described in
// shared/docs/custom-executor-protocol.md: a fresh /tmp/custom-executorNNN work
// directory per prepare attempt (cwd and TMPDIR of every stage), a
// JOB_RESPONSE_FILE payload, BUILD_FAILURE_EXIT_CODE / SYSTEM_FAILURE_EXIT_CODE
// and the CUSTOM_ENV_* variables, config_exec's JSON, three prepare attempts
// with cleanup after each failed one, one bash script per run stage
// (.../scriptNNN/script.) shaped like the runner's, the runner's exit-code
// table, process-group signalling on timeout and cancel (SIGTERM, SIGKILL
// after the graceful period, abandon after the force period), after_script
// after a failed or canceled build, and cleanup_exec always at the end.
//
// The job log (Options.Log and Result.Log) holds what a user would see: the
// harness's own lines, config's stderr, prepare's and run's output. cleanup's
// output goes to Options.DebugLog. The job token and masked variables are
// replaced by [MASKED] in both.
//
// Deliberate differences from the real runner are documented on the fields
// that control them (for example Options.BuildExitCodeFile for runner 17.11
// behaviour). Caches, artifacts, services and file-type variables are not
// emulated; ExtraStages lets a test run any other stage name.
package harness

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"
)

// Runner version the harness imitates; it appears in CUSTOM_ENV_CI_RUNNER_*.
const (
	RunnerVersion  = "16.11.4"
	RunnerRevision = "50736d6d"
)

// Exit codes the harness hands to every stage, as GitLab Runner does today.
const (
	BuildFailureExitCode  = 1
	SystemFailureExitCode = 2
)

// Job states and failure reasons reported in Result.
const (
	StateSuccess = "success"
	StateFailed  = "failed"

	ReasonScriptFailure = "script_failure"
	ReasonSystemFailure = "runner_system_failure"
	ReasonJobTimeout    = "job_execution_timeout"
	// ReasonCanceled is not a GitLab failure reason (GitLab marks such jobs
	// canceled itself); the harness reports it so tests can tell.
	ReasonCanceled = "canceled"
)

// Executables are the driver's four programs and their fixed arguments, as
// config.toml's [runners.custom] *_exec / *_args. Config, Prepare and Cleanup
// may be empty (the stage is then skipped, as the runner does); Run is required.
type Executables struct {
	Config, Prepare, Run, Cleanup                 string
	ConfigArgs, PrepareArgs, RunArgs, CleanupArgs []string
}

// Job is what GitLab would send for one job. Zero values get defaults (see
// each field).
type Job struct {
	// ID is the job id (payload id, CI_JOB_ID, CI_BUILD_ID). Default: a random
	// number in [100000, 999999], so parallel tests do not collide.
	ID int64
	// Name is CI_JOB_NAME. Default "test". Stage is CI_JOB_STAGE, default "test".
	Name, Stage string
	// ProjectID is CI_PROJECT_ID. Default 1.
	ProjectID int64
	// ProjectPath is "namespace/project" (CI_PROJECT_PATH). Default "lab/demo".
	ProjectPath string
	// Token is the job token (payload token, CI_JOB_TOKEN). It is a secret:
	// masked in every log. Default: random "glcbt-harness-<hex>".
	Token string
	// RepoURL, Ref and SHA are git_info. For http(s) URLs the token is embedded
	// as https://gitlab-ci-token:TOKEN@host/... as GitLab does, so a driver
	// that logs the URL leaks it (and the harness masks it). An empty RepoURL
	// means GIT_STRATEGY none: get_sources only creates the project dir. An
	// empty SHA checks out the fetched branch refs/remotes/origin/<Ref>.
	// Ref defaults to "main".
	RepoURL, Ref, SHA string
	// GitDepth > 0 makes get_sources fetch with --depth.
	GitDepth int
	// Image is the job's image: name (payload image.name, CI_JOB_IMAGE).
	Image string
	// Script is the job's before_script+script; AfterScript its after_script.
	// Each entry is one command, echoed in green before it runs.
	Script, AfterScript []string
	// ExtraStages run after after_script, when the job has succeeded so far,
	// as the runner runs archive_cache or upload_artifacts_on_success. Use it
	// to check that run_exec accepts any stage name.
	ExtraStages []ExtraStage
	// Variables are project CI/CD variables (public=false, masked=false);
	// Masked ones are masked in the log. Both reach every stage as CUSTOM_ENV_*
	// and the scripts as exports, and may override predefined ones (e.g.
	// CI_JOB_ID), as a job can in GitLab; the payload keeps both entries.
	Variables, Masked map[string]string
	// Timeout is the job timeout (runner_info.timeout, CI_JOB_TIMEOUT). It
	// covers everything from config to the last run stage; when it fires the
	// running stage's process group gets SIGTERM and the job goes straight to
	// cleanup (no after_script), as recorded with runner 16.11. Default 1h.
	Timeout time.Duration
	// ScriptTimeout, if set, is RUNNER_SCRIPT_TIMEOUT: it stops build_script
	// only; after_script still runs. Reported as job_execution_timeout.
	ScriptTimeout time.Duration
	// ConcurrentID is CI_CONCURRENT_ID and CI_CONCURRENT_PROJECT_ID.
	ConcurrentID int
	// ServerURL is the GitLab instance the job comes from (CI_SERVER_URL,
	// first in the payload's variables). Default harness.ServerURL.
	ServerURL string
}

// ExtraStage is an additional run stage: Name is passed as argv[2], Commands
// run in CI_PROJECT_DIR.
type ExtraStage struct {
	Name     string
	Commands []string
}

// StageTimeouts are config.toml's config_exec_timeout, prepare_exec_timeout
// and cleanup_exec_timeout. Zero means the runner's default, 1h.
type StageTimeouts struct {
	Config, Prepare, Cleanup time.Duration
}

// Options describe the runner side.
type Options struct {
	Exec Executables
	// Env is the runner host's environment every stage inherits. Nil means
	// os.Environ().
	Env []string
	// WorkDir is where the per-attempt custom-executorNNN directories are
	// created. Default os.TempDir().
	WorkDir string
	// KeepWorkDir keeps those directories (and the script files) after the
	// job for inspection. The runner removes them; they hold the job token.
	KeepWorkDir bool
	// BuildsDir is config.toml's builds_dir; config_exec's builds_dir
	// overrides it. Without either the prepare attempt fails.
	BuildsDir string
	// BuildExitCodeFile sets BUILD_EXIT_CODE_FILE for every run_exec call, as
	// runner 17.11 and later do; Result.ScriptExitCode is then read from it.
	BuildExitCodeFile bool
	StageTimeouts     StageTimeouts
	// AfterScriptTimeout bounds after_script (the runner's 5m default).
	AfterScriptTimeout time.Duration
	// GracefulKill is the time between SIGTERM and SIGKILL to a stage's
	// process group (default 600s, as graceful_kill_timeout); ForceKill the
	// time after SIGKILL before the harness abandons the process (default 10s,
	// as force_kill_timeout). ForceKill also bounds how long the harness waits
	// for stdout/stderr to close after the stage process exited.
	GracefulKill, ForceKill time.Duration
	// RetryPause is the pause between prepare attempts (default 3s).
	RetryPause time.Duration
	// Log receives the job log live, masked. Nil discards (Result.Log still
	// has it). DebugLog receives cleanup's stdout/stderr and harness details.
	Log, DebugLog io.Writer
	// OnStage, if set, is called when a stage process has started: name is
	// "config", "prepare", "cleanup" or the run stage name (argv[2]), pid is
	// the process (and process group) id. It must return quickly. To cancel
	// the job from a test, cancel the context given to RunJob.
	OnStage func(name string, pid int)
	// SampleRSS, if > 0, makes the harness read each stage process's peak
	// RSS (VmHWM, Linux) every SampleRSS while it runs, into
	// StageResult.PeakRSSKiB. Benchmarks use it; the runner does nothing
	// of the kind.
	SampleRSS time.Duration
	// RunAs, if set, runs every stage executable with these credentials, as
	// a runner installed under its own user (gitlab-runner) does: the
	// harness must then run as root, and it hands the per-attempt work
	// directory (payload, scripts, BUILD_EXIT_CODE_FILE) to that user.
	RunAs *syscall.Credential
}

// StageResult is one executable invocation.
type StageResult struct {
	// Exec is "config", "prepare", "run" or "cleanup".
	Exec string
	// Name is Exec, or for run the stage name passed as argv[2].
	Name string
	// Attempt is the prepare attempt (1-3) the invocation belongs to.
	Attempt int
	// ExitCode is the process's exit status, -1 if it was killed by a signal,
	// did not start, or was abandoned.
	ExitCode int
	// Signaled is true when the process was terminated by a signal.
	Signaled bool
	// Stopped says why the harness signalled the process group, if it did:
	// "canceled", "job_timeout", "script_timeout", "stage_timeout" or
	// "after_script_timeout". SIGKILLed is true when SIGTERM was not enough.
	Stopped   string
	SIGKILLed bool
	// Abandoned is true when the process outlived SIGKILL + ForceKill.
	Abandoned bool
	// OutputLeftOpen is true when the process exited but something it started
	// kept its stdout/stderr open longer than ForceKill.
	OutputLeftOpen bool
	// StartError is set when the executable could not be started.
	StartError string
	Duration   time.Duration
	// MaxRSSKiB is ru_maxrss (KiB) of the rusage wait4 returned, 0 when the
	// process was not waited for (not started, abandoned). On Linux it is an
	// upper bound, not the executable's own peak: exec records the peak RSS
	// of the memory it replaces, and the harness starts processes with vfork
	// (Go's os/exec), so the harness's own peak RSS is included. Use
	// PeakRSSKiB for the executable's own figure.
	MaxRSSKiB int64
	// PeakRSSKiB is the executable's own peak resident set size (VmHWM of
	// /proc/PID/status, KiB), the last value read while the process ran when
	// Options.SampleRSS is set; 0 otherwise. Growth in the last sampling
	// interval before the process exits can be missed.
	PeakRSSKiB int64
}

// ConfigOutput is the part of config_exec's JSON the runner reads.
type ConfigOutput struct {
	BuildsDir         string            `json:"builds_dir"`
	CacheDir          string            `json:"cache_dir"`
	BuildsDirIsShared *bool             `json:"builds_dir_is_shared"`
	Hostname          string            `json:"hostname"`
	Driver            *DriverInfo       `json:"driver"`
	JobEnv            map[string]string `json:"job_env"`
	Shell             string            `json:"shell"`
}

// DriverInfo is config_exec's "driver" object.
type DriverInfo struct {
	Name    string `json:"name"`
	Version string `json:"version"`
}

// Result is the outcome of one job as the runner would report it.
type Result struct {
	// State is "success" or "failed".
	State string
	// FailureReason is empty on success, else one of the Reason* constants.
	FailureReason string
	// Message is the runner's error text ("exit status 1", "unknown Custom
	// executor executable exit code 7", ...).
	Message string
	// ScriptExitCode is set on a script_failure: the number in
	// BUILD_EXIT_CODE_FILE when Options.BuildExitCodeFile is on and run_exec
	// wrote one, else run_exec's own exit code (1), which is what 16.11 reports.
	ScriptExitCode int
	// Stages lists every invocation in order, cleanup included.
	Stages []StageResult
	// PrepareAttempts is how many config/prepare attempts were made.
	PrepareAttempts int
	// Config is the last parsed config_exec output (nil if none).
	Config *ConfigOutput
	// BuildsDir and ProjectDir are CI_BUILDS_DIR and CI_PROJECT_DIR as used.
	BuildsDir, ProjectDir string
	// WorkDirs are the custom-executorNNN directories, one per prepare
	// attempt; removed after the job unless Options.KeepWorkDir.
	WorkDirs []string
	// Log is the whole masked job log.
	Log string
}

// Stage returns the results of every invocation named name, in order.
func (r *Result) Stage(name string) []StageResult {
	var out []StageResult
	for _, s := range r.Stages {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// StageNames returns the stage names in invocation order.
func (r *Result) StageNames() []string {
	out := make([]string, len(r.Stages))
	for i, s := range r.Stages {
		out[i] = s.Name
	}
	return out
}

var varName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// resolve checks e and makes relative paths absolute: stages run in the work
// dir, where a relative path would not resolve. Names without a slash are
// looked up in PATH when the stage starts.
func (e Executables) resolve() (Executables, error) {
	if e.Run == "" {
		return e, errors.New("harness: Executables.Run is required")
	}
	for _, p := range []*string{&e.Config, &e.Prepare, &e.Run, &e.Cleanup} {
		if strings.Contains(*p, "/") {
			abs, err := filepath.Abs(*p)
			if err != nil {
				return e, fmt.Errorf("harness: %s: %w", *p, err)
			}
			*p = abs
		}
	}
	return e, nil
}

func (o Options) withDefaults() Options {
	if o.Env == nil {
		o.Env = os.Environ()
	}
	if o.WorkDir == "" {
		o.WorkDir = os.TempDir()
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&o.StageTimeouts.Config, time.Hour)
	def(&o.StageTimeouts.Prepare, time.Hour)
	def(&o.StageTimeouts.Cleanup, time.Hour)
	def(&o.AfterScriptTimeout, 5*time.Minute)
	def(&o.GracefulKill, 600*time.Second)
	def(&o.ForceKill, 10*time.Second)
	def(&o.RetryPause, 3*time.Second)
	if o.Log == nil {
		o.Log = io.Discard
	}
	if o.DebugLog == nil {
		o.DebugLog = io.Discard
	}
	return o
}

func (j Job) withDefaults() (Job, error) {
	if j.ID == 0 {
		j.ID = 100000 + int64(randUint32()%900000)
	}
	if j.Name == "" {
		j.Name = "test"
	}
	if j.Stage == "" {
		j.Stage = "test"
	}
	if j.ProjectID == 0 {
		j.ProjectID = 1
	}
	if j.ProjectPath == "" {
		j.ProjectPath = "lab/demo"
	}
	if j.ServerURL == "" {
		j.ServerURL = ServerURL
	}
	if j.Token == "" {
		j.Token = fmt.Sprintf("glcbt-harness-%08x%08x", randUint32(), randUint32())
	}
	if j.Ref == "" {
		j.Ref = "main"
	}
	if j.Timeout <= 0 {
		j.Timeout = time.Hour
	}
	for _, m := range []map[string]string{j.Variables, j.Masked} {
		for k := range m {
			if !varName.MatchString(k) {
				return j, fmt.Errorf("harness: invalid variable name %q", k)
			}
		}
	}
	for _, s := range j.ExtraStages {
		if s.Name == "" {
			return j, errors.New("harness: ExtraStage without a name")
		}
	}
	return j, nil
}
