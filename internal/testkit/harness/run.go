package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// PrepareAttempts is how many times the runner tries config+prepare.
const PrepareAttempts = 3

// failure is why the job failed. retry marks a prepare failure the runner
// retries.
type failure struct {
	reason string
	msg    string
	retry  bool
}

func sysFailure(retry bool, format string, args ...any) *failure {
	return &failure{reason: ReasonSystemFailure, msg: fmt.Sprintf(format, args...), retry: retry}
}

// stopFailure turns the cause of a stop into the job's failure.
func stopFailure(cause error, j *Job) *failure {
	switch cause {
	case errCanceled:
		return &failure{reason: ReasonCanceled, msg: "canceled"}
	case errJobTimeout:
		return &failure{reason: ReasonJobTimeout, msg: fmt.Sprintf("execution took longer than %v seconds", j.Timeout)}
	case errScriptTimeout:
		return &failure{reason: ReasonJobTimeout, msg: fmt.Sprintf("script timeout of %v exceeded", j.ScriptTimeout)}
	}
	return nil
}

// jobRun is the state of one RunJob call.
type jobRun struct {
	opts  Options
	job   Job
	res   *Result
	log   *masker // job log
	debug *masker

	workDir    string
	cfg        *ConfigOutput
	buildsDir  string
	projectDir string
	hostname   string
	jobEnv     map[string]string
}

// RunJob runs one job through the driver's executables as GitLab Runner 16.11
// would, and reports what the runner would report. ctx is the job's cancel
// button: cancelling it SIGTERMs the running stage, after_script still runs
// (if the build had started), then cleanup. The error is only for problems of
// the harness itself (bad options, no work dir); everything the driver does
// wrong is in the Result.
func RunJob(ctx context.Context, opts Options, job Job) (*Result, error) {
	resolved, err := opts.Exec.resolve()
	if err != nil {
		return nil, err
	}
	opts.Exec = resolved
	job, err = job.withDefaults()
	if err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	hostname, _ := os.Hostname()
	r := &jobRun{
		opts:     opts,
		job:      job,
		res:      &Result{},
		log:      newMasker(opts.Log, job.secrets()),
		debug:    newMasker(opts.DebugLog, job.secrets()),
		hostname: hostname,
	}

	// deadline: the job timeout only. run: also the cancel button.
	deadline, cancelDeadline := context.WithTimeoutCause(context.WithoutCancel(ctx), job.Timeout, errJobTimeout)
	defer cancelDeadline()
	runCtx, cancelRun := context.WithCancelCause(deadline)
	defer cancelRun(nil)
	stopAfter := context.AfterFunc(ctx, func() { cancelRun(errCanceled) })
	defer stopAfter()

	r.logf("Running with gitlab-runner %s (%s) emulated by lve-harness\n", RunnerVersion, RunnerRevision)
	r.logf("  on lve-harness %s, job %d\n", runnerShortToken, job.ID)

	f, err := r.prepare(ctx, runCtx)
	if err != nil {
		return nil, err
	}
	if f == nil {
		f = r.runStages(runCtx, deadline)
		status := StateSuccess
		if f != nil {
			status = StateFailed
		}
		r.cleanup(ctx, status)
	}
	r.finish(f)
	return r.res, nil
}

func (r *jobRun) logf(format string, args ...any) { fmt.Fprintf(r.log, format, args...) }

func (r *jobRun) debugf(format string, args ...any) { fmt.Fprintf(r.debug, format, args...) }

func (r *jobRun) header(title string) { r.logf("%s%s%s\n", ansiCyan, title, ansiReset) }

func (r *jobRun) finish(f *failure) {
	r.log.Flush()
	if f == nil {
		r.res.State = StateSuccess
		r.logf("%sJob succeeded%s\n", ansiGreen, ansiReset)
	} else {
		r.res.State = StateFailed
		r.res.FailureReason = f.reason
		r.res.Message = f.msg
		if f.reason == ReasonSystemFailure {
			r.logf("%sERROR: Job failed (system failure): %s%s\n", ansiRed, f.msg, ansiReset)
		} else {
			r.logf("%sERROR: Job failed: %s%s\n", ansiRed, f.msg, ansiReset)
		}
	}
	r.log.Flush()
	r.debug.Flush()
	r.res.Config = r.cfg
	r.res.BuildsDir = r.buildsDir
	r.res.ProjectDir = r.projectDir
	r.res.Log = r.log.String()
}

// prepare makes up to PrepareAttempts attempts of config -> prepare, with
// cleanup (CI_JOB_STATUS=running) after each failed one. On success the
// attempt's work dir stays for the run stages.
func (r *jobRun) prepare(ctx, runCtx context.Context) (*failure, error) {
	r.header(`Preparing the "custom" executor`)
	var f *failure
	for attempt := 1; attempt <= PrepareAttempts; attempt++ {
		if attempt > 1 {
			r.logf("Will be retried in %v ...\n", r.opts.RetryPause)
			t := time.NewTimer(r.opts.RetryPause)
			select {
			case <-runCtx.Done():
				t.Stop()
				return stopFailure(context.Cause(runCtx), &r.job), nil
			case <-t.C:
			}
		}
		r.res.PrepareAttempts = attempt
		if err := r.newWorkDir(); err != nil {
			return nil, err
		}
		f = r.prepareAttempt(runCtx, attempt)
		if f == nil {
			return nil, nil
		}
		r.cleanup(ctx, "running")
		if sf := stopFailure(context.Cause(runCtx), &r.job); sf != nil {
			return sf, nil
		}
		if !f.retry {
			return f, nil
		}
		r.logf("%sWARNING: Preparation failed: %s%s\n", ansiWarn, f.msg, ansiReset)
	}
	return f, nil
}

// handOver gives the files the harness made for a stage to the RunAs user.
func (r *jobRun) handOver(paths ...string) error {
	if r.opts.RunAs == nil {
		return nil
	}
	for _, p := range paths {
		if err := os.Lchown(p, int(r.opts.RunAs.Uid), int(r.opts.RunAs.Gid)); err != nil {
			return err
		}
	}
	return nil
}

// newWorkDir creates a fresh custom-executorNNN dir with the payload.
func (r *jobRun) newWorkDir() error {
	dir, err := os.MkdirTemp(r.opts.WorkDir, "custom-executor")
	if err != nil {
		return fmt.Errorf("harness: work dir: %w", err)
	}
	data, err := r.job.payloadJSON()
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, "response.json"), data, 0o600)
	}
	if err == nil {
		err = r.handOver(dir, filepath.Join(dir, "response.json"))
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		return fmt.Errorf("harness: job payload: %w", err)
	}
	r.workDir = dir
	r.res.WorkDirs = append(r.res.WorkDirs, dir)
	r.cfg, r.jobEnv, r.buildsDir, r.projectDir = nil, nil, "", ""
	return nil
}

func (r *jobRun) prepareAttempt(ctx context.Context, attempt int) *failure {
	if f := r.config(ctx, attempt); f != nil {
		return f
	}
	if r.opts.Exec.Prepare == "" {
		return nil
	}
	sctx, cancel := context.WithTimeoutCause(ctx, r.opts.StageTimeouts.Prepare, errStageTimeout)
	defer cancel()
	res := r.exec(sctx, "prepare", "prepare", attempt, r.opts.Exec.Prepare, r.opts.Exec.PrepareArgs,
		r.env("running", false), procSpec{stdout: r.log}, r.log)
	return prepareExit("prepare_exec", res)
}

// prepareExit applies the table for config and prepare: 1 fails the job at
// once, anything else non-zero (or a timeout) is retried.
func prepareExit(what string, res StageResult) *failure {
	switch {
	case res.Stopped == errStageTimeout.Error():
		return sysFailure(true, "%s timed out", what)
	case res.StartError != "":
		return sysFailure(true, "%s: %s", what, res.StartError)
	case res.Signaled || res.Abandoned:
		return sysFailure(true, "%s: killed by a signal", what)
	case res.ExitCode == 0:
		return nil
	case res.ExitCode == BuildFailureExitCode:
		return &failure{reason: ReasonScriptFailure, msg: fmt.Sprintf("%s: exit status %d", what, res.ExitCode)}
	default:
		return sysFailure(true, "%s: exit status %d", what, res.ExitCode)
	}
}

// config runs config_exec and applies its JSON.
func (r *jobRun) config(ctx context.Context, attempt int) *failure {
	var stdout bytes.Buffer
	cfg := &ConfigOutput{}
	if r.opts.Exec.Config != "" {
		sctx, cancel := context.WithTimeoutCause(ctx, r.opts.StageTimeouts.Config, errStageTimeout)
		defer cancel()
		res := r.exec(sctx, "config", "config", attempt, r.opts.Exec.Config, r.opts.Exec.ConfigArgs,
			r.env("running", true), procSpec{stdout: &limitedBuffer{buf: &stdout, max: 1 << 20}, stderr: r.log}, r.log)
		if f := prepareExit("config_exec", res); f != nil {
			return f
		}
		if out := bytes.TrimSpace(stdout.Bytes()); len(out) > 0 {
			if err := json.Unmarshal(out, cfg); err != nil {
				return sysFailure(true, "config_exec: error while parsing JSON output: %v", err)
			}
		}
	}
	if cfg.Shell != "" && cfg.Shell != "bash" {
		return sysFailure(true, "config_exec: shell %q: the harness only writes bash scripts", cfg.Shell)
	}
	if cfg.Driver != nil && cfg.Driver.Name != "" {
		r.logf("Using Custom executor with driver %s %s...\n", cfg.Driver.Name, cfg.Driver.Version)
	} else {
		r.logf("Using Custom executor...\n")
	}
	r.cfg = cfg
	r.jobEnv = cfg.JobEnv
	r.buildsDir = r.opts.BuildsDir
	if cfg.BuildsDir != "" {
		r.buildsDir = cfg.BuildsDir
	}
	if r.buildsDir == "" {
		return sysFailure(true, "builds_dir is not configured (neither Options.BuildsDir nor config_exec's builds_dir)")
	}
	shared := cfg.BuildsDirIsShared != nil && *cfg.BuildsDirIsShared
	r.projectDir = r.job.projectDir(r.buildsDir, shared)
	if cfg.Hostname != "" {
		r.hostname = cfg.Hostname
	}
	return nil
}

// env is the environment of one invocation: the host's, config's job_env
// (not for config itself), the protocol variables, CUSTOM_ENV_*.
func (r *jobRun) env(status string, forConfig bool) []string {
	env := append([]string(nil), r.opts.Env...)
	buildsDir, projectDir := r.buildsDir, r.projectDir
	if forConfig {
		buildsDir, projectDir = "", ""
	} else {
		for _, k := range sortedKeys(r.jobEnv) {
			env = append(env, k+"="+r.jobEnv[k])
		}
	}
	env = append(env,
		"BUILD_FAILURE_EXIT_CODE="+strconv.Itoa(BuildFailureExitCode),
		"SYSTEM_FAILURE_EXIT_CODE="+strconv.Itoa(SystemFailureExitCode),
		"JOB_RESPONSE_FILE="+filepath.Join(r.workDir, "response.json"),
		"TMPDIR="+r.workDir,
		"PWD="+r.workDir,
	)
	for _, v := range r.job.stageVars(buildsDir, projectDir, status) {
		env = append(env, "CUSTOM_ENV_"+v.key+"="+v.value)
	}
	return env
}

// exec runs one executable in the work dir and records it. The stage line
// goes to lineTo.
func (r *jobRun) exec(ctx context.Context, kind, name string, attempt int, path string, args, env []string, spec procSpec, lineTo io.Writer) StageResult {
	spec.argv = append([]string{path}, args...)
	spec.env = env
	spec.dir = r.workDir
	spec.cred = r.opts.RunAs
	r.debugf("exec %s: %q\n", name, spec.argv)
	res := runProc(ctx, spec, procTimes{graceful: r.opts.GracefulKill, force: r.opts.ForceKill, sampleRSS: r.opts.SampleRSS}, func(pid int) {
		if r.opts.OnStage != nil {
			r.opts.OnStage(name, pid)
		}
	})
	res.Exec, res.Name, res.Attempt = kind, name, attempt
	r.res.Stages = append(r.res.Stages, res)
	r.log.Flush()
	r.debug.Flush()
	fmt.Fprintf(lineTo, "--- stage %s (%s)\n", name, describe(res))
	if res.OutputLeftOpen {
		fmt.Fprintf(lineTo, "%sWARNING: %s exited but a process it started kept stdout/stderr open for more than %v%s\n",
			ansiWarn, name, r.opts.ForceKill, ansiReset)
	}
	return res
}

// describe is the short stage summary used in logs.
func describe(s StageResult) string {
	parts := []string{s.Duration.Round(time.Millisecond).String()}
	switch {
	case s.StartError != "":
		parts = append(parts, "not started: "+s.StartError)
	case s.Abandoned:
		parts = append(parts, "abandoned")
	case s.Signaled:
		parts = append(parts, "killed by signal")
	default:
		parts = append(parts, fmt.Sprintf("exit %d", s.ExitCode))
	}
	if s.Stopped != "" {
		stop := "stopped: " + s.Stopped + ", SIGTERM"
		if s.SIGKILLed {
			stop += "+SIGKILL"
		}
		parts = append(parts, stop)
	}
	return strings.Join(parts, ", ")
}

// runStage writes the stage script and calls run_exec <script> <stage> with
// CI_JOB_STATUS=status.
func (r *jobRun) runStage(ctx context.Context, name, status, body string) (StageResult, *failure, error) {
	dir, err := os.MkdirTemp(r.workDir, "script")
	if err != nil {
		return StageResult{}, nil, fmt.Errorf("harness: script dir: %w", err)
	}
	if !r.opts.KeepWorkDir {
		defer func() { _ = os.RemoveAll(dir) }()
	}
	script := filepath.Join(dir, "script.")
	if err := os.WriteFile(script, []byte(renderScript(body)), 0o700); err != nil {
		return StageResult{}, nil, fmt.Errorf("harness: script: %w", err)
	}
	if err := r.handOver(dir, script); err != nil {
		return StageResult{}, nil, fmt.Errorf("harness: script: %w", err)
	}
	env := r.env(status, false)
	exitFile := ""
	if r.opts.BuildExitCodeFile {
		exitFile = filepath.Join(dir, "exit-code")
		env = append(env, "BUILD_EXIT_CODE_FILE="+exitFile)
	}
	args := append(append([]string(nil), r.opts.Exec.RunArgs...), script, name)
	res := r.exec(ctx, "run", name, r.res.PrepareAttempts, r.opts.Exec.Run, args, env, procSpec{stdout: r.log}, r.log)
	return res, r.runExit(ctx, res, exitFile), nil
}

// runExit applies the runner's exit-code table for run_exec.
func (r *jobRun) runExit(ctx context.Context, res StageResult, exitFile string) *failure {
	if res.Stopped != "" {
		if f := stopFailure(context.Cause(ctx), &r.job); f != nil {
			return f
		}
		return sysFailure(false, "%s: stopped (%s)", res.Name, res.Stopped)
	}
	switch {
	case res.StartError != "":
		return sysFailure(false, "run_exec: %s", res.StartError)
	case res.Signaled || res.Abandoned:
		return sysFailure(false, "run_exec: killed by a signal")
	case res.ExitCode == 0:
		if code, ok := readExitFile(exitFile); ok && code != 0 {
			r.logf("%sWARNING: run_exec exited 0 but BUILD_EXIT_CODE_FILE says %d%s\n", ansiWarn, code, ansiReset)
		}
		return nil
	case res.ExitCode == BuildFailureExitCode:
		code := res.ExitCode
		if exitFile != "" {
			if c, ok := readExitFile(exitFile); ok {
				code = c
			} else {
				r.logf("%sWARNING: run_exec exited BUILD_FAILURE without writing BUILD_EXIT_CODE_FILE%s\n", ansiWarn, ansiReset)
			}
		}
		r.res.ScriptExitCode = code
		return &failure{reason: ReasonScriptFailure, msg: fmt.Sprintf("exit status %d", code)}
	case res.ExitCode == SystemFailureExitCode:
		return sysFailure(false, "exit status %d", res.ExitCode)
	default:
		return sysFailure(false, "unknown Custom executor executable exit code %d; executable execution terminated with: exit status %d", res.ExitCode, res.ExitCode)
	}
}

func readExitFile(path string) (int, bool) {
	if path == "" {
		return 0, false
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	code, err := strconv.Atoi(strings.TrimSpace(string(data)))
	return code, err == nil
}

// runStages runs the run_exec stages in the runner's order: prepare_script,
// get_sources, build_script, after_script (also after a failed or canceled
// build, not after a job timeout), then the extra stages if all went well.
func (r *jobRun) runStages(runCtx, deadline context.Context) *failure {
	j := &r.job
	stage := func(ctx context.Context, name, title, status string, body func(vars []kv) string) (StageResult, *failure) {
		if ctx.Err() != nil {
			if f := stopFailure(context.Cause(ctx), j); f != nil {
				return StageResult{}, f
			}
			return StageResult{}, sysFailure(false, "%s not started: %v", name, context.Cause(ctx))
		}
		r.header(title)
		res, f, err := r.runStage(ctx, name, status, body(j.stageVars(r.buildsDir, r.projectDir, status)))
		if err != nil {
			return res, sysFailure(false, "%v", err)
		}
		return res, f
	}
	user := func(banner string, cmds []string) func([]kv) string {
		return func(vars []kv) string { return userBody(vars, r.projectDir, banner, cmds) }
	}

	if _, f := stage(runCtx, "prepare_script", "Preparing environment", "running",
		func([]kv) string { return prepareScriptBody(r.hostname) }); f != nil {
		return f
	}
	if _, f := stage(runCtx, "get_sources", "Getting source from Git repository", "running",
		func(vars []kv) string { return getSourcesBody(j, vars, r.projectDir) }); f != nil {
		return f
	}

	var f *failure
	if len(j.Script) > 0 {
		bctx, cancel := runCtx, context.CancelFunc(func() {})
		if j.ScriptTimeout > 0 {
			bctx, cancel = context.WithTimeoutCause(runCtx, j.ScriptTimeout, errScriptTimeout)
		}
		_, f = stage(bctx, "build_script", `Executing "step_script" stage of the job script`, "running", user("", j.Script))
		cancel()
	}
	if context.Cause(deadline) == errJobTimeout {
		return stopFailure(errJobTimeout, j) // straight to cleanup, as recorded
	}

	if len(j.AfterScript) > 0 {
		status := StateSuccess
		if f != nil {
			status = StateFailed
			if f.reason == ReasonCanceled {
				status = "canceled"
			}
		}
		actx, cancel := context.WithTimeoutCause(deadline, r.opts.AfterScriptTimeout, errAfterScriptTimeout)
		res, af := stage(actx, "after_script", "Running after_script", status, user("Running after script...", j.AfterScript))
		cancel()
		if af != nil {
			r.logf("%sWARNING: after_script failed, but job will continue unaffected: %s (%s)%s\n", ansiWarn, af.msg, describe(res), ansiReset)
		}
		if context.Cause(deadline) == errJobTimeout {
			return stopFailure(errJobTimeout, j)
		}
	}
	if f != nil {
		return f
	}
	for _, s := range j.ExtraStages {
		if _, f := stage(runCtx, s.Name, fmt.Sprintf("Running %q stage", s.Name), StateSuccess, user("", s.Commands)); f != nil {
			return f
		}
	}
	return nil
}

// cleanup runs cleanup_exec on a context of its own (it must run after a
// cancel or timeout), sends its output to the debug log and removes the work
// dir. Its exit code never changes the result.
func (r *jobRun) cleanup(ctx context.Context, status string) {
	if r.opts.Exec.Cleanup != "" {
		cctx, cancel := context.WithTimeoutCause(context.WithoutCancel(ctx), r.opts.StageTimeouts.Cleanup, errStageTimeout)
		defer cancel()
		r.exec(cctx, "cleanup", "cleanup", r.res.PrepareAttempts, r.opts.Exec.Cleanup, r.opts.Exec.CleanupArgs,
			r.env(status, false), procSpec{stdout: r.debug}, r.debug)
	}
	if !r.opts.KeepWorkDir {
		if err := os.RemoveAll(r.workDir); err != nil {
			r.debugf("remove %s: %v\n", r.workDir, err)
		}
	}
}

// limitedBuffer keeps at most max bytes (config's stdout).
type limitedBuffer struct {
	buf *bytes.Buffer
	max int
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := l.max - l.buf.Len(); room > 0 {
		l.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}
