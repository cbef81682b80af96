package jobapi

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// stepRunnerEnv names the step-runner binary of the tests (see
// deploy/rig/test-tool.sh).
const stepRunnerEnv = "LVE_E2E_STEP_RUNNER"

// requireStepRunner is the tests' step-runner, or a skip (a failure under
// LVE_E2E_REQUIRED).
func requireStepRunner(t *testing.T) string {
	t.Helper()
	p := os.Getenv(stepRunnerEnv)
	if p == "" {
		if os.Getenv("LVE_E2E_REQUIRED") != "" {
			t.Fatalf("LVE_E2E_REQUIRED is set but %s is not", stepRunnerEnv)
		}
		t.Skipf("no step-runner: %s is not set", stepRunnerEnv)
	}
	return p
}

// multi starts `gitlab-runner run` with the Custom executor whose run
// stage runs the runner's script with bash, PATH having pathDir first; the
// test's end stops it and checks it stopped cleanly.
func (r *rig) multi(pathDir string) {
	t := r.t
	run := filepath.Join(t.TempDir(), "run")
	require.NoError(t, os.WriteFile(run, []byte(`#!/bin/sh
echo "custom run stage: $2 STEPS set: ${CUSTOM_ENV_STEPS:+yes} image=$CUSTOM_ENV_CI_JOB_IMAGE"
PATH=$LVE_TEST_PATH:$PATH exec bash "$1"
`), 0o755))
	o := RunMultiOptions{
		Binary: r.bin, URL: r.srv.URL(), Token: r.srv.RunnerToken(),
		// One job at a time: the Custom executor's jobs of one project
		// share a builds directory here, and a second job's cleanup
		// removed the first one's files mid-stage (a clean-clone make
		// test failed on it).
		Executor: "custom", BuildsDir: t.TempDir(), CacheDir: r.cacheDir, Concurrent: 1,
		Custom: &CustomConfig{RunExec: run},
		Env:    []string{"HOME=" + r.home, "PATH=" + os.Getenv("PATH"), "LVE_TEST_PATH=" + pathDir, "TMPDIR=" + t.TempDir()},
		Dir:    t.TempDir(),
		Stdout: r.out, Stderr: r.out,
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- RunMulti(ctx, o) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err, "gitlab-runner run stops cleanly when asked")
		case <-time.After(2*multiStopGrace + 15*time.Second):
			t.Error("gitlab-runner run did not exit")
		}
	})
}

func TestRealRunnerMultiSteps(t *testing.T) {
	t.Parallel()
	sr := requireStepRunner(t)
	dir := t.TempDir()
	require.NoError(t, os.Symlink(sr, filepath.Join(dir, "step-runner")))
	r := newRig(t)
	ok := r.srv.Enqueue(Job{Name: "steps", Stage: "test",
		Run: `[{"name":"hello","script":"echo hello-from-step; echo job=$CI_JOB_NAME"},{"name":"two","script":"echo second-step"}]`})
	fail := r.srv.Enqueue(Job{Name: "steps-fail", Stage: "test",
		Run: `[{"name":"bad","script":"echo failing; exit 3"}]`})
	malformed := r.srv.Enqueue(Job{Name: "steps-malformed", Stage: "test", Run: `{"not":"a list"}`})
	both := r.srv.Enqueue(Job{Name: "steps-and-script", Stage: "test", Script: []string{"echo nope"},
		Run: `[{"name":"hello","script":"echo hi"}]`})
	r.multi(dir)

	// Only multi-runner mode converts a run: job: the Custom executor gets
	// one build_script stage running step-runner ci, with STEPS set.
	res := r.wait(ok)
	assert.Equal(t, StateSuccess, res.State, res.Trace)
	assert.Contains(t, res.Trace, "custom run stage: build_script STEPS set: yes image=registry.gitlab.com/gitlab-org/step-runner:v0",
		"an image-less run: job gets the step-runner image")
	assert.Contains(t, res.Trace, "$ step-runner ci")
	assert.Regexp(t, `(?s)hello-from-step.*second-step`, res.Trace, "both steps, in order")

	// Any failed step fails step-runner ci with 1, not the step's code.
	res = r.wait(fail)
	assert.Equal(t, StateFailed, res.State)
	assert.Equal(t, "script_failure", res.FailureReason)
	assert.Equal(t, 1, res.ExitCode)
	assert.Contains(t, res.Trace, `step "bad": exec: exit status 3`)

	// A run: that is no list of steps: step-runner's error, not a hang.
	res = r.wait(malformed)
	assert.Equal(t, StateFailed, res.State)
	assert.Equal(t, "script_failure", res.FailureReason)
	assert.Contains(t, res.Trace, "reading STEPS")

	// run: with script: is the runner's own refusal; no stage runs.
	res = r.wait(both)
	assert.Equal(t, StateFailed, res.State)
	assert.Equal(t, "runner_system_failure", res.FailureReason)
	assert.Contains(t, res.Trace, "the `run` and `script` keywords cannot be used together")
	assert.NotContains(t, res.Trace, "custom run stage")
}

// A stand-in runner that shows its argv and config, then waits for SIGQUIT.
func TestRunMultiConfigAndStop(t *testing.T) {
	fake := filepath.Join(t.TempDir(), "gitlab-runner")
	require.NoError(t, os.WriteFile(fake, []byte(`#!/bin/sh
for a in "$@"; do echo "arg=$a"; done
echo "mode=$(stat -c %a "$3")"
cat "$3"
echo "$3" > "$LVE_CFG_PATH"
trap 'echo got QUIT; exit 0' QUIT
while :; do sleep 0.05; done
`), 0o755))
	cfgPath := filepath.Join(t.TempDir(), "where")
	ctx, cancel := context.WithCancel(t.Context())
	out := &sshtest.Buffer{}
	done := make(chan error, 1)
	go func() {
		done <- RunMulti(ctx, RunMultiOptions{
			Binary: fake, URL: "http://127.0.0.1:1/", Token: "sekrit-tok", Executor: "custom", Concurrent: 3,
			Custom: &CustomConfig{RunExec: `/d/r"un`, RunArgs: []string{"a b"}, CleanupExecTimeout: 60},
			Env:    []string{"LVE_CFG_PATH=" + cfgPath, "PATH=/usr/bin:/bin"}, Stdout: out,
		})
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "concurrent") }, 10*time.Second, 20*time.Millisecond)
	cancel()
	require.NoError(t, <-done, "a runner that exits 0 on SIGQUIT stopped cleanly")
	got := out.String()
	assert.Contains(t, got, "arg=run\narg=--config\n")
	assert.NotContains(t, got, "arg=sekrit-tok", "the token is not on the command line")
	assert.Contains(t, got, "mode=600")
	assert.Contains(t, got, "token = 'sekrit-tok'")
	assert.Contains(t, got, "concurrent = 3")
	assert.Contains(t, got, `run_exec = '/d/r"un'`)
	assert.Contains(t, got, "run_args = ['a b']")
	assert.Contains(t, got, "got QUIT")
	where, err := os.ReadFile(cfgPath)
	require.NoError(t, err)
	_, err = os.Stat(strings.TrimSpace(string(where)))
	assert.ErrorIs(t, err, os.ErrNotExist, "the config with the token is removed")

	err = RunMulti(t.Context(), RunMultiOptions{Binary: "/bin/true", URL: "u", Token: "t", Executor: "shell"})
	assert.ErrorContains(t, err, "exited before it was asked to stop")
	err = RunMulti(t.Context(), RunMultiOptions{Binary: fake, URL: "u", Executor: "shell"})
	assert.ErrorContains(t, err, "needs")
}

// A runner that does not stop on SIGQUIT (a job that does not end) gets
// SIGTERM: its jobs are aborted and cleaned up, and RunMulti says so.
func TestRunMultiEscalatesToSIGTERM(t *testing.T) {
	old := multiStopGrace
	multiStopGrace = 300 * time.Millisecond
	t.Cleanup(func() { multiStopGrace = old })
	fake := filepath.Join(t.TempDir(), "gitlab-runner")
	require.NoError(t, os.WriteFile(fake, []byte(`#!/bin/sh
trap 'echo got QUIT' QUIT
trap 'echo got TERM; exit 0' TERM
echo ready
while :; do sleep 0.05; done
`), 0o755))
	out := &sshtest.Buffer{}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- RunMulti(ctx, RunMultiOptions{Binary: fake, URL: "u", Token: "t", Executor: "shell", Env: []string{"PATH=/usr/bin:/bin"}, Stdout: out})
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "ready") }, 10*time.Second, 20*time.Millisecond)
	cancel()
	err := <-done
	require.ErrorContains(t, err, "stopped by SIGTERM")
	require.Contains(t, out.String(), "got QUIT\n")
	require.Contains(t, out.String(), "got TERM\n")
}
