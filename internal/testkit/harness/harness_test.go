package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSuccessfulJobStagesArgvAndEnv(t *testing.T) {
	t.Parallel()
	f := newFake(t, nil)
	opts := f.opts(t)
	job := Job{
		ID: 4242, Name: "build", ProjectPath: "grp/app", Image: "debian-12",
		Script:      []string{"echo hello from build", `echo "user var: $MY_VAR"`},
		AfterScript: []string{`echo "after status=$CI_JOB_STATUS"`},
		Variables:   map[string]string{"MY_VAR": "it's \"quoted\" $x"},
	}
	res := run(t, opts, job)

	require.Equal(t, StateSuccess, res.State, res.Log)
	assert.Empty(t, res.FailureReason)
	assert.Equal(t, []string{"config", "prepare", "run-prepare_script", "run-get_sources", "run-build_script", "run-after_script", "cleanup"}, f.stages(t))
	assert.Equal(t, []string{"config", "prepare", "prepare_script", "get_sources", "build_script", "after_script", "cleanup"}, res.StageNames())
	assert.Equal(t, 1, res.PrepareAttempts)

	// argv: run_exec <dir>/scriptNNN/script. <stage>; every stage in its own
	// process group, cwd the custom-executor work dir.
	require.Len(t, res.WorkDirs, 1)
	workDir := res.WorkDirs[0]
	assert.True(t, strings.HasPrefix(filepath.Base(workDir), "custom-executor"))
	for _, line := range f.sequence(t) {
		fields := strings.Fields(line)
		assert.Equal(t, strings.TrimPrefix(fields[1], "pid="), strings.TrimPrefix(fields[2], "pgid="), "own process group: %s", line)
		assert.Equal(t, "cwd="+workDir, fields[3])
		if strings.HasPrefix(fields[0], "run-") {
			require.Len(t, fields, 7, line)
			script := strings.Trim(fields[5], "[]")
			assert.True(t, strings.HasSuffix(script, "/script."), script)
			assert.True(t, strings.HasPrefix(filepath.Base(filepath.Dir(script)), "script"), script)
			assert.Equal(t, workDir, filepath.Dir(filepath.Dir(script)))
			assert.Equal(t, "["+strings.TrimPrefix(fields[0], "run-")+"]", fields[6])
		} else {
			assert.Len(t, fields, 5, "no extra args for %s", line)
		}
	}
	_, err := os.Stat(workDir)
	assert.True(t, os.IsNotExist(err), "work dir removed after the job")

	// Environment: config sees no builds dir; later stages do, plus job_env.
	cfgEnv := f.env(t, "config", 0)
	assert.Equal(t, "1", cfgEnv["BUILD_FAILURE_EXIT_CODE"])
	assert.Equal(t, "2", cfgEnv["SYSTEM_FAILURE_EXIT_CODE"])
	assert.Equal(t, filepath.Join(workDir, "response.json"), cfgEnv["JOB_RESPONSE_FILE"])
	assert.Equal(t, workDir, cfgEnv["TMPDIR"])
	assert.Equal(t, "4242", cfgEnv["CUSTOM_ENV_CI_JOB_ID"])
	assert.Equal(t, "4242", cfgEnv["CUSTOM_ENV_CI_BUILD_ID"])
	assert.Equal(t, "debian-12", cfgEnv["CUSTOM_ENV_CI_JOB_IMAGE"])
	assert.Equal(t, "running", cfgEnv["CUSTOM_ENV_CI_JOB_STATUS"])
	assert.Equal(t, "3600", cfgEnv["CUSTOM_ENV_CI_JOB_TIMEOUT"])
	assert.Contains(t, cfgEnv, "CUSTOM_ENV_CI_BUILDS_DIR")
	assert.Empty(t, cfgEnv["CUSTOM_ENV_CI_BUILDS_DIR"])
	assert.Empty(t, cfgEnv["CUSTOM_ENV_CI_PROJECT_DIR"])
	assert.NotContains(t, cfgEnv, "FAKE_FROM_CONFIG")
	assert.NotContains(t, cfgEnv, "BUILD_EXIT_CODE_FILE")
	for _, k := range []string{"CI_JOB_TOKEN", "CI_RUNNER_ID", "CI_CONCURRENT_ID", "CI_CONCURRENT_PROJECT_ID", "CI_REPOSITORY_URL", "CI_JOB_NAME", "CI_PROJECT_PATH", "CI_RUNNER_VERSION", "FF_SKIP_NOOP_BUILD_STAGES"} {
		assert.Contains(t, cfgEnv, "CUSTOM_ENV_"+k)
	}
	assert.Equal(t, job.Variables["MY_VAR"], cfgEnv["CUSTOM_ENV_MY_VAR"])

	prepEnv := f.env(t, "prepare", 0)
	assert.Equal(t, f.builds, prepEnv["CUSTOM_ENV_CI_BUILDS_DIR"])
	// A repo URL that is not a URL gives <builds_dir>/project-<id>, as in the trace.
	assert.Equal(t, f.builds+"/project-1", prepEnv["CUSTOM_ENV_CI_PROJECT_DIR"])
	assert.Equal(t, f.builds+"/project-1.tmp", prepEnv["CUSTOM_ENV_RUNNER_TEMP_PROJECT_DIR"])
	assert.Equal(t, "hello-from-config", prepEnv["FAKE_FROM_CONFIG"])
	assert.Equal(t, "success", f.env(t, "run-after_script", 0)["CUSTOM_ENV_CI_JOB_STATUS"])
	assert.Equal(t, "success", f.env(t, "cleanup", 0)["CUSTOM_ENV_CI_JOB_STATUS"])

	// JOB_RESPONSE_FILE: valid JSON shaped like the recorded response.json.
	var p map[string]any
	require.NoError(t, json.Unmarshal([]byte(f.file(t, "response.json")), &p))
	assert.EqualValues(t, 4242, p["id"])
	assert.Equal(t, res.Config.Driver.Name, "fake")
	for _, k := range []string{"token", "job_info", "git_info", "runner_info", "variables", "steps", "image", "features"} {
		assert.Contains(t, p, k)
	}
	assert.Equal(t, "debian-12", p["image"].(map[string]any)["name"])
	assert.EqualValues(t, 3600, p["runner_info"].(map[string]any)["timeout"])

	// Scripts: runner shape, variables exported, user commands echoed and run.
	script := f.file(t, "004-build_script.script")
	assert.True(t, strings.HasPrefix(script, "#!/usr/bin/env bash\n\ntrap exit 1 TERM\n\n"), script)
	assert.True(t, strings.HasSuffix(script, "\nexit 0\n"))
	assert.Contains(t, script, `: | eval $'`)
	assert.Contains(t, script, `export CI_JOB_ID=4242\n`)
	assert.Contains(t, res.Log, "hello from build")
	assert.Contains(t, res.Log, `user var: it's "quoted" $x`)
	assert.Contains(t, res.Log, "\x1b[32;1m$ echo hello from build\x1b[0;m")
	assert.Contains(t, res.Log, "after status=success")
	assert.Contains(t, res.Log, "Using Custom executor with driver fake 0.1...")
	assert.Contains(t, res.Log, "config: stderr goes to the job log")
	assert.Contains(t, res.Log, "prepare: stdout")
	assert.Contains(t, res.Log, "prepare: stderr")
	assert.Contains(t, res.Log, "Running on ")
	assert.Contains(t, res.Log, "via fake-host...")
	assert.Contains(t, res.Log, "--- stage build_script (")
	assert.Contains(t, res.Log, "Job succeeded")
	assert.NotContains(t, res.Log, "cleanup: status=", "cleanup output stays out of the job log")
}

func TestRunExitCodes(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name       string
		snippet    string
		exitFile   bool
		reason     string
		scriptCode int
		msg        string
	}{
		{name: "build failure", snippet: "", reason: ReasonScriptFailure, scriptCode: 1, msg: "exit status 1"},
		{name: "build failure with exit code file", snippet: "", exitFile: true, reason: ReasonScriptFailure, scriptCode: 3, msg: "exit status 3"},
		{name: "system failure", snippet: "exit 2", reason: ReasonSystemFailure, msg: "exit status 2"},
		{name: "unknown code", snippet: "exit 7", reason: ReasonSystemFailure, msg: "unknown Custom executor executable exit code 7"},
		{name: "killed", snippet: "kill -KILL $$", reason: ReasonSystemFailure, msg: "killed by a signal"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFake(t, map[string]string{"run:build_script": tc.snippet})
			opts := f.opts(t)
			opts.BuildExitCodeFile = tc.exitFile
			res := run(t, opts, Job{
				Script:      []string{"echo about to exit 3", "exit 3"},
				AfterScript: []string{`echo "after status=$CI_JOB_STATUS"`},
			})
			assert.Equal(t, StateFailed, res.State)
			assert.Equal(t, tc.reason, res.FailureReason)
			assert.Equal(t, tc.scriptCode, res.ScriptExitCode)
			assert.Contains(t, res.Message, tc.msg)
			assert.Equal(t, []string{"config", "prepare", "run-prepare_script", "run-get_sources", "run-build_script", "run-after_script", "cleanup"}, f.stages(t))
			assert.Equal(t, "failed", f.env(t, "run-after_script", 0)["CUSTOM_ENV_CI_JOB_STATUS"])
			assert.Equal(t, "failed", f.env(t, "cleanup", 0)["CUSTOM_ENV_CI_JOB_STATUS"])
			assert.Contains(t, res.Log, "after status=failed")
			if tc.exitFile {
				assert.NotEmpty(t, f.env(t, "run-build_script", 0)["BUILD_EXIT_CODE_FILE"])
			} else {
				assert.NotContains(t, f.env(t, "run-build_script", 0), "BUILD_EXIT_CODE_FILE")
			}
		})
	}
}

func TestGetSourcesFailureSkipsBuildAndAfterScript(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"run:get_sources": "exit 2"})
	res := run(t, f.opts(t), Job{Script: []string{"true"}, AfterScript: []string{"true"}})
	assert.Equal(t, ReasonSystemFailure, res.FailureReason)
	assert.Equal(t, []string{"config", "prepare", "run-prepare_script", "run-get_sources", "cleanup"}, f.stages(t))
}

func TestPrepareRetries(t *testing.T) {
	t.Parallel()
	counter := `n=$(cat "$rec/count" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$rec/count"
`
	cases := []struct {
		name     string
		snippets map[string]string
		attempts int
		stages   []string
		state    string
		reason   string
	}{
		{
			name:     "prepare fails twice then succeeds",
			snippets: map[string]string{"prepare": counter + `[ $n -lt 3 ] && { echo "prepare attempt $n fails"; exit 2; }`},
			attempts: 3,
			stages: []string{"config", "prepare", "cleanup", "config", "prepare", "cleanup", "config", "prepare",
				"run-prepare_script", "run-get_sources", "run-build_script", "cleanup"},
			state: StateSuccess,
		},
		{
			name:     "prepare exit 1 is not retried",
			snippets: map[string]string{"prepare": "exit 1"},
			attempts: 1,
			stages:   []string{"config", "prepare", "cleanup"},
			state:    StateFailed, reason: ReasonScriptFailure,
		},
		{
			name:     "config exit 1 is not retried",
			snippets: map[string]string{"config": "exit 1"},
			attempts: 1,
			stages:   []string{"config", "cleanup"},
			state:    StateFailed, reason: ReasonScriptFailure,
		},
		{
			name:     "invalid config JSON is retried",
			snippets: map[string]string{"config": counter + `[ $n -lt 2 ] && { echo 'not json'; exit 0; }`},
			attempts: 2,
			stages: []string{"config", "cleanup", "config", "prepare",
				"run-prepare_script", "run-get_sources", "run-build_script", "cleanup"},
			state: StateSuccess,
		},
		{
			name:     "three failures are a system failure",
			snippets: map[string]string{"prepare": "exit 9"},
			attempts: 3,
			stages:   []string{"config", "prepare", "cleanup", "config", "prepare", "cleanup", "config", "prepare", "cleanup"},
			state:    StateFailed, reason: ReasonSystemFailure,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFake(t, tc.snippets)
			opts := f.opts(t)
			start := time.Now()
			res := run(t, opts, Job{Script: []string{"true"}})
			assert.Equal(t, tc.state, res.State, res.Log)
			assert.Equal(t, tc.reason, res.FailureReason)
			assert.Equal(t, tc.attempts, res.PrepareAttempts)
			assert.Equal(t, tc.stages, f.stages(t))
			assert.Len(t, res.WorkDirs, tc.attempts, "a fresh work dir per attempt")
			assert.GreaterOrEqual(t, time.Since(start), time.Duration(tc.attempts-1)*opts.RetryPause)
			// cleanups after failed attempts see CI_JOB_STATUS=running.
			for i := 0; i < tc.attempts-1; i++ {
				assert.Equal(t, "running", f.env(t, "cleanup", i)["CUSTOM_ENV_CI_JOB_STATUS"])
			}
		})
	}
}

func TestJobTimeoutSignalsProcessGroup(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"run:build_script": `
trap 'echo TERM >> "$rec/term-main"; exit 2' TERM
bash -c 'trap "echo TERM >> \"$0/term-child\"; exit 0" TERM; while :; do sleep 0.05; done' "$rec" &
wait
exit 2`})
	opts := f.opts(t)
	// The timeout must fall in build_script (it loops forever), also when the
	// earlier stages are slow on a loaded machine (-race, all packages).
	res := run(t, opts, Job{Timeout: 5 * time.Second, Script: []string{"true"}, AfterScript: []string{"echo after"}})

	assert.Equal(t, StateFailed, res.State)
	assert.Equal(t, ReasonJobTimeout, res.FailureReason)
	assert.True(t, f.exists("term-main"), "run_exec got SIGTERM")
	assert.True(t, f.exists("term-child"), "a child in run_exec's process group got SIGTERM")
	b := res.Stage("build_script")
	require.Len(t, b, 1)
	assert.Equal(t, "job_timeout", b[0].Stopped)
	assert.False(t, b[0].SIGKILLed)
	assert.Equal(t, 2, b[0].ExitCode)
	// On a job timeout the runner goes straight to cleanup.
	assert.Equal(t, []string{"config", "prepare", "run-prepare_script", "run-get_sources", "run-build_script", "cleanup"}, f.stages(t))
	assert.Equal(t, "failed", f.env(t, "cleanup", 0)["CUSTOM_ENV_CI_JOB_STATUS"])
}

func TestSIGKILLAfterGracePeriod(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"run:build_script": `trap '' TERM; while :; do sleep 0.05; done`})
	opts := f.opts(t)
	opts.GracefulKill = 700 * time.Millisecond
	// See TestJobTimeoutSignalsProcessGroup: the timeout must fall in build_script.
	res := run(t, opts, Job{Timeout: 5 * time.Second, Script: []string{"true"}})
	assert.Equal(t, ReasonJobTimeout, res.FailureReason)
	b := res.Stage("build_script")
	require.Len(t, b, 1)
	assert.True(t, b[0].SIGKILLed)
	assert.True(t, b[0].Signaled)
	assert.False(t, b[0].Abandoned)
	assert.GreaterOrEqual(t, b[0].Duration, opts.GracefulKill)
	assert.Equal(t, "cleanup", res.Stages[len(res.Stages)-1].Name)
}

func TestCancelRunsAfterScriptThenCleanup(t *testing.T) {
	t.Parallel()
	f := newFake(t, nil)
	opts := f.opts(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opts.OnStage = func(name string, pid int) {
		if name == "build_script" {
			time.AfterFunc(300*time.Millisecond, cancel)
		}
	}
	start := time.Now()
	res, err := RunJob(ctx, opts, Job{
		Script:      []string{"sleep 20"},
		AfterScript: []string{`echo "after status=$CI_JOB_STATUS"`},
	})
	require.NoError(t, err)
	assert.Less(t, time.Since(start), 10*time.Second)
	assert.Equal(t, StateFailed, res.State)
	assert.Equal(t, ReasonCanceled, res.FailureReason)
	assert.Equal(t, "canceled", res.Stage("build_script")[0].Stopped)
	assert.Equal(t, []string{"config", "prepare", "run-prepare_script", "run-get_sources", "run-build_script", "run-after_script", "cleanup"}, f.stages(t))
	assert.Equal(t, "canceled", f.env(t, "run-after_script", 0)["CUSTOM_ENV_CI_JOB_STATUS"])
	assert.Equal(t, "failed", f.env(t, "cleanup", 0)["CUSTOM_ENV_CI_JOB_STATUS"])
	assert.Contains(t, res.Log, "after status=canceled")
}

func TestCancelDuringPrepare(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"prepare": `trap 'exit 2' TERM; sleep 20 & wait`})
	opts := f.opts(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opts.OnStage = func(name string, pid int) {
		if name == "prepare" {
			time.AfterFunc(200*time.Millisecond, cancel)
		}
	}
	res, err := RunJob(ctx, opts, Job{Script: []string{"true"}})
	require.NoError(t, err)
	assert.Equal(t, ReasonCanceled, res.FailureReason)
	assert.Equal(t, 1, res.PrepareAttempts, "no retry after a cancel")
	assert.Equal(t, []string{"config", "prepare", "cleanup"}, f.stages(t))
}

func TestScriptTimeoutStillRunsAfterScript(t *testing.T) {
	t.Parallel()
	f := newFake(t, nil)
	res := run(t, f.opts(t), Job{
		ScriptTimeout: 500 * time.Millisecond,
		Script:        []string{"sleep 20"},
		AfterScript:   []string{"echo after"},
	})
	assert.Equal(t, ReasonJobTimeout, res.FailureReason)
	assert.Equal(t, "script_timeout", res.Stage("build_script")[0].Stopped)
	assert.Equal(t, []string{"config", "prepare", "run-prepare_script", "run-get_sources", "run-build_script", "run-after_script", "cleanup"}, f.stages(t))
}

func TestStageTimeoutRetriesPrepare(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"prepare": `n=$(cat "$rec/count" 2>/dev/null || echo 0); echo $((n+1)) > "$rec/count"; [ $n -eq 0 ] && sleep 20`})
	opts := f.opts(t)
	// Long enough for the fast second attempt on a loaded machine (-race).
	opts.StageTimeouts.Prepare = 2 * time.Second
	res := run(t, opts, Job{Script: []string{"true"}})
	assert.Equal(t, StateSuccess, res.State, res.Log)
	assert.Equal(t, 2, res.PrepareAttempts)
	assert.Equal(t, "stage_timeout", res.Stage("prepare")[0].Stopped)
}

func TestMaskedValuesNeverInLog(t *testing.T) {
	t.Parallel()
	const token = "glcbt-test-token-0123456789"
	const secret = "s3cr3t-Value-XYZ"
	f := newFake(t, map[string]string{
		"config":  `echo "config leaks $CUSTOM_ENV_CI_JOB_TOKEN" >&2`,
		"prepare": `printf 'split: %s' "${CUSTOM_ENV_MY_SECRET:0:5}"; sleep 0.1; printf '%s\n' "${CUSTOM_ENV_MY_SECRET:5}"`,
		"cleanup": `echo "cleanup leaks $CUSTOM_ENV_CI_JOB_TOKEN"`,
	})
	opts := f.opts(t)
	var debug strings.Builder
	opts.DebugLog = &debug
	res := run(t, opts, Job{
		Token:   token,
		RepoURL: "http://127.0.0.1:1/grp/proj.git",
		Masked:  map[string]string{"MY_SECRET": secret},
		Script:  []string{`echo "token=$CI_JOB_TOKEN secret=$MY_SECRET url=$CI_REPOSITORY_URL"`},
	})
	// get_sources fails (nothing listens on port 1): the URL with the token
	// is in git's error output too.
	assert.Equal(t, StateFailed, res.State)
	assert.NotContains(t, res.Log, token)
	assert.NotContains(t, res.Log, secret)
	assert.Contains(t, res.Log, "config leaks [MASKED]")
	assert.Contains(t, res.Log, "split: [MASKED]")
	assert.NotContains(t, debug.String(), token)
	assert.Contains(t, debug.String(), "cleanup leaks [MASKED]")
	// The token is embedded in http(s) repo URLs, as GitLab does.
	assert.Equal(t, "http://gitlab-ci-token:"+token+"@127.0.0.1:1/grp/proj.git", f.env(t, "prepare", 0)["CUSTOM_ENV_CI_REPOSITORY_URL"])
	assert.Equal(t, f.builds+"/grp/proj", f.env(t, "prepare", 0)["CUSTOM_ENV_CI_PROJECT_DIR"])
}

func TestMaskedInBuildOutput(t *testing.T) {
	t.Parallel()
	f := newFake(t, nil)
	res := run(t, f.opts(t), Job{
		Masked: map[string]string{"MY_SECRET": "hunter2-hunter2"},
		Script: []string{`echo "secret=$MY_SECRET token=$CI_JOB_TOKEN"`},
	})
	assert.Equal(t, StateSuccess, res.State)
	assert.Contains(t, res.Log, "secret=[MASKED] token=[MASKED]")
	assert.NotContains(t, res.Log, "hunter2")
}

func TestBuildsDirIsSharedAndVariableOverride(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"config": `echo '{"builds_dir": "/b", "builds_dir_is_shared": true}'; exit 0`})
	opts := f.opts(t)
	opts.Exec.Run = writeScript(t, `exit 0`)
	res := run(t, opts, Job{
		ID: 77, ConcurrentID: 3, RepoURL: "https://gitlab.invalid/grp/sub/proj.git",
		Variables: map[string]string{"CI_JOB_ID": "666"},
		Script:    []string{"true"},
	})
	require.Equal(t, StateSuccess, res.State, res.Log)
	assert.Equal(t, "/b/harness1/3/grp/sub/proj", res.ProjectDir)
	env := f.env(t, "cleanup", 0)
	assert.Equal(t, "666", env["CUSTOM_ENV_CI_JOB_ID"], "job variables override predefined ones")
	var p payload
	require.NoError(t, json.Unmarshal([]byte(f.file(t, "response.json")), &p))
	assert.EqualValues(t, 77, p.ID, "JOB_RESPONSE_FILE keeps the real id")
}

func TestExtraStagesAndMissingOptionalExecutables(t *testing.T) {
	t.Parallel()
	f := newFake(t, nil)
	opts := f.opts(t)
	opts.Exec.Prepare, opts.Exec.Cleanup = "", ""
	res := run(t, opts, Job{
		Script:      []string{"true"},
		ExtraStages: []ExtraStage{{Name: "archive_cache", Commands: []string{"echo archiving"}}, {Name: "cleanup_file_variables"}},
	})
	require.Equal(t, StateSuccess, res.State, res.Log)
	assert.Equal(t, []string{"config", "run-prepare_script", "run-get_sources", "run-build_script", "run-archive_cache", "run-cleanup_file_variables"}, f.stages(t))
	assert.Contains(t, res.Log, "archiving")
}

func TestNoBuildsDirFailsAttempt(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"config": `echo '{}'; exit 0`})
	res := run(t, f.opts(t), Job{Script: []string{"true"}})
	assert.Equal(t, ReasonSystemFailure, res.FailureReason)
	assert.Equal(t, 3, res.PrepareAttempts)
	assert.Contains(t, res.Message, "builds_dir")
}

func TestMissingExecutableIsSystemFailure(t *testing.T) {
	t.Parallel()
	f := newFake(t, nil)
	opts := f.opts(t)
	opts.Exec.Run = filepath.Join(t.TempDir(), "nope")
	res := run(t, opts, Job{Script: []string{"true"}})
	assert.Equal(t, ReasonSystemFailure, res.FailureReason)
	assert.NotEmpty(t, res.Stage("prepare_script")[0].StartError)
	assert.Equal(t, "cleanup", res.Stages[len(res.Stages)-1].Name)
}

func TestOptionsValidation(t *testing.T) {
	t.Parallel()
	_, err := RunJob(context.Background(), Options{}, Job{})
	assert.Error(t, err)
	_, err = RunJob(context.Background(), Options{Exec: Executables{Run: "/bin/true"}}, Job{Variables: map[string]string{"A-B": "x"}})
	assert.Error(t, err)

	o := Options{}.withDefaults()
	assert.Equal(t, 3*time.Second, o.RetryPause)
	assert.Equal(t, 600*time.Second, o.GracefulKill)
	assert.Equal(t, 10*time.Second, o.ForceKill)
	assert.Equal(t, time.Hour, o.StageTimeouts.Config)
	assert.Equal(t, time.Hour, o.StageTimeouts.Prepare)
	assert.Equal(t, time.Hour, o.StageTimeouts.Cleanup)
	j, err := Job{}.withDefaults()
	require.NoError(t, err)
	assert.Equal(t, time.Hour, j.Timeout)
	assert.NotZero(t, j.ID)
	assert.NotEmpty(t, j.Token)
}

func writeScript(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "s.sh")
	require.NoError(t, os.WriteFile(p, []byte("#!/usr/bin/env bash\n"+body+"\n"), 0o755))
	return p
}

// A run_exec that leaves a background process holding its stdout (say, an
// ssh master) does not hang the harness; the stage is flagged.
func TestOutputLeftOpenIsFlagged(t *testing.T) {
	t.Parallel()
	f := newFake(t, map[string]string{"run:build_script": `sleep 8 & exit 0`})
	opts := f.opts(t)
	opts.ForceKill = 300 * time.Millisecond
	start := time.Now()
	res := run(t, opts, Job{Script: []string{"true"}})
	assert.Equal(t, StateSuccess, res.State)
	assert.Less(t, time.Since(start), 6*time.Second, "the stage is flagged after ForceKill, not when the sleep ends")
	assert.True(t, res.Stage("build_script")[0].OutputLeftOpen)
	assert.False(t, res.Stage("get_sources")[0].OutputLeftOpen)
	assert.Contains(t, res.Log, "kept stdout/stderr open")
}

// With RunAs every stage runs as that user (the runner's own user on a real
// host) and can read the payload and its script and write the exit code file.
func TestRunAsUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to switch users")
	}
	t.Parallel()
	const nobody = 65534
	// t.TempDir's parent is 0700: make directories the other user can enter.
	top, err := os.MkdirTemp("", "harness-runas")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(top) })
	bin, work := filepath.Join(top, "bin"), filepath.Join(top, "work")
	for _, d := range []string{top, bin, work} {
		require.NoError(t, os.MkdirAll(d, 0o755))
		require.NoError(t, os.Chmod(d, 0o755))
	}
	builds := filepath.Join(top, "builds") // the guest's, in a real job
	require.NoError(t, os.Mkdir(builds, 0o700))
	require.NoError(t, os.Chown(builds, nobody, nobody))
	write := func(name, body string) string {
		p := filepath.Join(bin, name)
		require.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o755))
		return p
	}
	opts := Options{
		Exec: Executables{
			Config:  write("config", `echo "config uid=$(id -u)" >&2; echo '{"builds_dir":"`+builds+`"}'`),
			Prepare: write("prepare", `echo "prepare uid=$(id -u) payload=$(head -c 1 "$JOB_RESPONSE_FILE")"`),
			Run: write("run", `echo "run $2 uid=$(id -u)"; bash "$1"; rc=$?
[ "$rc" -eq 0 ] && exit 0
echo "$rc" > "$BUILD_EXIT_CODE_FILE" || exit 2
exit "$BUILD_FAILURE_EXIT_CODE"`),
			Cleanup: write("cleanup", `echo "cleanup uid=$(id -u)"`),
		},
		WorkDir: work, BuildExitCodeFile: true, RetryPause: 100 * time.Millisecond,
		GracefulKill: 5 * time.Second, ForceKill: 2 * time.Second,
		RunAs: &syscall.Credential{Uid: nobody, Gid: nobody},
	}
	var uids []string
	opts.OnStage = func(name string, pid int) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err == nil {
			uids = append(uids, name+":"+regexp.MustCompile(`(?m)^Uid:\s+(\d+)`).FindStringSubmatch(string(b))[1])
		}
	}
	res := run(t, opts, Job{Script: []string{"exit 3"}})
	require.Equal(t, ReasonScriptFailure, res.FailureReason, res.Log)
	require.Equal(t, 3, res.ScriptExitCode, "the exit code file was writable: %s", res.Log)
	require.Contains(t, res.Log, "config uid=65534")
	require.Contains(t, res.Log, "prepare uid=65534 payload={")
	require.Contains(t, res.Log, "run build_script uid=65534")
	require.NotEmpty(t, uids)
	for _, u := range uids {
		// Start returns after the exec, so the switch has happened.
		require.Regexp(t, `:65534$`, u)
	}
}
