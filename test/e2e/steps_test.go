//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// GitLab Steps (run:) in shim mode: only `gitlab-runner run` (multi-runner
// mode, as the runner runs as a service) converts a run: job into one
// build_script stage running `step-runner ci`; run-single ignores run:.

// stepRunnerExpected says whether the tests were given a step-runner
// (deploy/rig/test-tool.sh): then the rig must give it to the guests.
func requireGuestStepRunner(t *testing.T, r *rig) {
	t.Helper()
	if r.cfg.GuestTools.StepRunner == "none" {
		if os.Getenv("LVE_E2E_STEP_RUNNER") != "" {
			t.Fatal("a step-runner binary is provided, but the rig's configuration gives the guests none (guest_tools.step_runner = \"none\"): start the rig with LVE_RIG_STEP_RUNNER (make test does)")
		}
		t.Skip("the rig gives the guests no step-runner (start it with LVE_RIG_STEP_RUNNER=/path/to/step-runner)")
	}
}

// runMulti queues jobs and runs them through one `gitlab-runner run` with
// concurrent jobs at once; it stops the runner (SIGQUIT) once all have a
// final state and returns their results in order.
func (rr *realRunner) runMulti(t *testing.T, concurrent int, jobs ...jobapi.Job) []jobapi.Result {
	t.Helper()
	return rr.runMultiCancel(t, concurrent, -1, "", jobs...)
}

// runMultiCancel is runMulti that cancels job cancel (an index of jobs;
// -1: none) once its log has the line after.
func (rr *realRunner) runMultiCancel(t *testing.T, concurrent, cancel int, after string, jobs ...jobapi.Job) []jobapi.Result {
	t.Helper()
	ids := make([]int64, len(jobs))
	for i, j := range jobs {
		ids[i] = rr.api.Enqueue(j)
	}
	if cancel >= 0 {
		id := ids[cancel]
		go func() {
			deadline := time.Now().Add(5 * time.Minute)
			for !strings.Contains(rr.api.Trace(id), after) && time.Now().Before(deadline) {
				time.Sleep(200 * time.Millisecond) // polling the fake API's trace
			}
			rr.api.Cancel(id) // without the line in time: the test's assertions say so
		}()
	}
	var out sshtest.Buffer
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- jobapi.RunMulti(ctx, jobapi.RunMultiOptions{
			Binary: rr.r.readableRunner(rr.bin), RunAs: rr.r.cred(), URL: rr.api.URL(), Token: rr.api.RunnerToken(), Executor: "custom",
			Custom: rr.custom(), BuildsDir: "/builds", CacheDir: "/cache", Concurrent: concurrent,
			Env: []string{"PATH=" + os.Getenv("PATH"), "HOME=" + rr.home},
			Dir: rr.workDir, Stdout: &out, Stderr: &out,
		})
	}()
	stopped := false
	stopRunner := func() {
		if stopped {
			return
		}
		stopped = true
		stop()
		err := <-done
		t.Logf("gitlab-runner run:\n%s", out.String())
		require.NoError(t, err, "gitlab-runner run stops cleanly once its jobs are done")
	}
	t.Cleanup(stopRunner) // a test that fails early still stops it before the leftover check
	res := make([]jobapi.Result, len(ids))
	for i, id := range ids {
		wctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		var err error
		res[i], err = rr.api.Wait(wctx, id)
		cancel()
		require.NoError(t, err, "job %d got no final state", id)
		t.Logf("job %d: %s %s exit %d in %s\n%s", id, res[i].State, res[i].FailureReason, res[i].ExitCode, res[i].Duration, res[i].Trace)
	}
	stopRunner()
	return res
}

// stepsJSON is a run: value as GitLab sends it: a JSON string of the steps.
func stepsJSON(t *testing.T, steps ...map[string]any) string {
	t.Helper()
	b, err := json.Marshal(steps)
	require.NoError(t, err)
	return string(b)
}

// TestStepsShim: run: jobs in shim mode on every image (the Debian and
// podman guests only without the cloud-init one), each in a fresh VM:
// a script step and an exec step (a step definition the job wrote) pass
// with their output in the job log; a failing step is a script_failure
// (step-runner ci exits 1 whatever the step's code); run: with script: is
// the runner's own refusal and starts no VM; a step canceled mid-step
// stops, leaving nothing (the leftover check after the test); a job without
// image: gets the default VM image. (The job timeout is the runner's
// SIGTERM to the stage, as a cancel is: TestRealRunnerJobTimeout checks it
// for a stage, and TestFaultNativeSteps the SIGTERM of a native step stage.)
func TestStepsShim(t *testing.T) {
	rr := newRealRunner(t)
	requireGuestStepRunner(t, rr.r)
	steps := func(tag string) string {
		return stepsJSON(t,
			map[string]any{"name": "hello", "script": "echo script-step-" + tag + " in $(pwd); sleep 30 & echo background-started"},
			map[string]any{"name": "define", "script": `mkdir -p gen && printf 'spec:\n---\nexec:\n  command: [sh, -c, "echo exec-step-ran-on-$(uname -s)"]\n' > gen/step.yml`},
			map[string]any{"name": "exec", "step": "./gen"},
		)
	}
	jobs := []jobapi.Job{
		{Name: "steps-tiny", Run: steps("tiny")},
		{Name: "steps-fail", Run: stepsJSON(t, map[string]any{"name": "bad", "script": "echo failing-step; exit 3"})},
		{Name: "steps-and-script", Script: []string{"echo never"}, Run: stepsJSON(t, map[string]any{"name": "x", "script": "echo never"})},
		{Name: "steps-cancel", Run: stepsJSON(t, map[string]any{"name": "ticks", "script": "for i in $(seq 1 600); do echo tick $i; sleep 1; done"})},
	}
	// The other images but the Debian and podman guests when the
	// cloud-init guest is there: all three are Debian 12 (the podman image
	// is the Debian one plus a container runtime); the cloud one adds a
	// user that is not root (sudo) and cloud-init; root runs the steps on
	// the tiny guest. The Debian one added only a 70 s job under TCG, the
	// podman one a 30 s job after the cloud one's.
	var others []string
	all := otherImages(t, rr.r)
	for _, img := range all {
		if (img == "debian" || img == "podman") && slices.Contains(all, "cloud") {
			continue
		}
		others = append(others, img)
	}
	for _, img := range others {
		jobs = append(jobs, jobapi.Job{Name: "steps-" + img, Image: img, Run: steps(img)})
	}
	const canceled = 3
	res := rr.runMultiCancel(t, 2, canceled, "tick 3\n", jobs...)

	ok := func(r jobapi.Result, tag string) {
		t.Helper()
		require.Equal(t, jobapi.StateSuccess, r.State, r.Trace)
		require.Contains(t, r.Trace, "GitLab Steps job (run:)")
		require.Contains(t, r.Trace, "step-runner for the guest (GitLab Steps):")
		require.Contains(t, r.Trace, "$ step-runner ci")
		require.Regexp(t, `(?s)Running step "hello".*script-step-`+tag+` in /builds/.*Running step "exec".*exec-step-ran-on-Linux`, r.Trace)
	}
	ok(res[0], "tiny")
	require.Contains(t, res[0].Trace, "The runner gave this run: job without image: the image "+gitlab.StepRunnerImage)
	require.Contains(t, res[0].Trace, `Preparing a fresh tiny VM`)

	require.Equal(t, jobapi.StateFailed, res[1].State, res[1].Trace)
	require.Equal(t, "script_failure", res[1].FailureReason)
	require.Equal(t, 1, res[1].ExitCode, "step-runner ci exits 1 for any failed step")
	require.Contains(t, res[1].Trace, `step "bad": exec: exit status 3`)

	require.Equal(t, jobapi.StateFailed, res[2].State, res[2].Trace)
	require.Equal(t, "runner_system_failure", res[2].FailureReason)
	require.Contains(t, res[2].Trace, "the `run` and `script` keywords cannot be used together")
	require.NotContains(t, res[2].Trace, "Preparing a fresh", "no VM for a job the runner refuses")

	require.Equal(t, jobapi.StateCanceled, res[canceled].State, res[canceled].Trace)
	require.Contains(t, res[canceled].Trace, "tick 3")
	require.NotContains(t, res[canceled].Trace, "tick 60\n", "the step stopped at the cancel")

	for i, img := range others {
		r := res[4+i]
		ok(r, img)
		require.Contains(t, r.Trace, "Preparing a fresh "+img+" VM")
	}
}

// TestStepsWithoutStepRunner: a run: job on a driver whose guests get no
// step-runner fails at prepare as a system failure naming the fix; no
// stage of the job runs, and the VM is gone. The runner tries prepare three
// times: only the first boots a VM, the others fail on the remembered check.
// (A run: that is not a list of steps is step-runner's own error, not a
// hang: internal/jobapi TestRealRunnerMultiSteps, with the real runner and
// step-runner.)
func TestStepsWithoutStepRunner(t *testing.T) {
	rr := newRealRunner(t)
	r := rr.r.withConfig(t, func(s string) string {
		return regexp.MustCompile(`(?m)^step_runner = .*$`).ReplaceAllString(s, `step_runner = "none"`)
	})
	require.Equal(t, "none", r.cfg.GuestTools.StepRunner)
	rr.cfgPath = r.cfgPath
	res := rr.runMulti(t, 1, jobapi.Job{Name: "no-step-runner", Run: stepsJSON(t, map[string]any{"name": "x", "script": "echo STEP-RAN"})})[0]
	require.Equal(t, jobapi.StateFailed, res.State, res.Trace)
	require.Equal(t, "runner_system_failure", res.FailureReason)
	require.Contains(t, res.Trace, "this run: job (GitLab Steps) needs step-runner in the guest")
	require.Contains(t, res.Trace, "[guest_tools] step_runner")
	require.NotContains(t, strings.ReplaceAll(res.Trace, `"echo STEP-RAN"`, ""), "STEP-RAN")
	require.Equal(t, 1, strings.Count(res.Trace, "Booted, address"), "one VM for three tries of prepare")
	require.Equal(t, 2, strings.Count(res.Trace, "No VM is booted: the guest tool check of this image (remembered) found no step-runner"))
}

// TestStepsWarm: a run: job on a standby VM of the pool (warm start) runs
// its steps like a cold one.
func TestStepsWarm(t *testing.T) {
	rr := newRealRunner(t)
	requireGuestStepRunner(t, rr.r)
	r := rr.r.withConfig(t, func(s string) string { return poolsvc.WithPool(s, "tiny", 1) })
	rr.cfgPath = r.cfgPath
	r.serve(t)
	r.waitIdle(t, 1, 3*time.Minute)
	res := rr.runMulti(t, 1, jobapi.Job{Name: "steps-warm", Run: stepsJSON(t,
		map[string]any{"name": "warm", "script": "echo warm-step-ran"})})[0]
	require.Equal(t, jobapi.StateSuccess, res.State, res.Trace)
	require.Regexp(t, warmRE, res.Trace, "a standby VM was claimed")
	require.Contains(t, res.Trace, "step-runner for the guest (GitLab Steps):")
	require.Contains(t, res.Trace, "warm-step-ran")
}
