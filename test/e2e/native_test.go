//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
)

// GitLab Steps in native mode (gitlab.steps = "native"): the step stage
// runs through step-runner serve in the guest, over the job's connection.

// withNativeSteps is the rig's configuration with native steps.
func withNativeSteps(s string) string { return s + "\n[gitlab]\nsteps = \"native\"\n" }

// TestStepsNative: through `gitlab-runner run`, run: jobs in native mode:
// a script step (with an empty line, a CR and a background process) and an
// exec step pass with their output, once, in the job log; the steps get
// the job's variables, a file variable as a path; the background process
// is stopped at the end of the steps; a failing step fails the
// job as a script_failure with the step's own exit code (the shim says 1);
// run: with script: is still the runner's refusal; a job without image:
// gets the default VM image; a job canceled mid-step (the runner's SIGTERM
// to the stage, as at a timeout) stops and leaves nothing (the leftover
// check after the test; TestFaultNativeSteps checks in the guest that the
// step's processes are gone).
func TestStepsNative(t *testing.T) {
	rr := newRealRunner(t)
	requireGuestStepRunner(t, rr.r)
	r := rr.r.withConfig(t, withNativeSteps)
	rr.cfgPath = r.cfgPath
	steps := stepsJSON(t,
		map[string]any{"name": "hello", "script": `echo native-step in $(pwd); echo; printf 'with-cr\r\n'; echo "var=$NATIVE_VAR"; cat "$NATIVE_FILE"; echo; sleep 300 > /dev/null 2>&1 & echo background-started`},
		map[string]any{"name": "define", "script": `mkdir -p gen && printf 'spec:\n---\nexec:\n  command: [sh, -c, "echo exec-step-ran-on-$(uname -s)"]\n' > gen/step.yml`},
		map[string]any{"name": "exec", "step": "./gen"},
	)
	jobs := []jobapi.Job{
		{Name: "native-tiny", Run: steps, Variables: []jobapi.Variable{
			{Key: "NATIVE_VAR", Value: "from-the-job", Public: true},
			{Key: "NATIVE_FILE", Value: "file-variable-body", File: true},
		}},
		{Name: "native-fail", Run: stepsJSON(t, map[string]any{"name": "bad", "script": "echo failing-step; exit 3"})},
		{Name: "native-and-script", Script: []string{"echo never"}, Run: stepsJSON(t, map[string]any{"name": "x", "script": "echo never"})},
		{Name: "native-cancel", Run: stepsJSON(t, map[string]any{"name": "ticks", "script": "for i in $(seq 1 600); do echo tick $i; sleep 1; done"})},
	}
	const canceled = 3
	// Three at once: the refused job boots no VM. (A job timeout is the
	// runner's same SIGTERM as a cancel; a short timeout here would race
	// three cold boots on a loaded host.)
	res := rr.runMultiCancel(t, 3, canceled, "tick 3\n", jobs...)

	ok := res[0]
	require.Equal(t, jobapi.StateSuccess, ok.State, ok.Trace)
	require.Contains(t, ok.Trace, "Running the steps natively")
	require.NotContains(t, ok.Trace, "$ step-runner ci", "the runner's shim script did not run")
	require.Contains(t, ok.Trace, "The runner gave this run: job without image: the image "+gitlab.StepRunnerImage)
	require.Regexp(t, `(?s)Running step "hello"\n+native-step in /builds/[^\n]*\nwith-cr\nvar=from-the-job\nfile-variable-body\nbackground-started\n.*Running step "exec"\nexec-step-ran-on-Linux`, ok.Trace)
	require.Equal(t, 1, strings.Count(ok.Trace, "exec-step-ran-on-Linux\n"), "each line once")
	require.Contains(t, ok.Trace, "stopped the processes the steps left running")

	require.Equal(t, jobapi.StateFailed, res[1].State, res[1].Trace)
	require.Equal(t, "script_failure", res[1].FailureReason)
	require.Equal(t, 3, res[1].ExitCode, "native mode keeps the failed step's exit code")
	require.Contains(t, res[1].Trace, "failing-step")
	require.Contains(t, res[1].Trace, `the steps failed: step "bad": exec: exit status 3`)

	require.Equal(t, jobapi.StateFailed, res[2].State, res[2].Trace)
	require.Contains(t, res[2].Trace, "the `run` and `script` keywords cannot be used together")

	require.Equal(t, jobapi.StateCanceled, res[canceled].State, res[canceled].Trace)
	require.Contains(t, res[canceled].Trace, "tick 3")
	require.NotContains(t, res[canceled].Trace, "tick 60\n", "the step stopped at the cancel")
}

// nativeStage is a stage runner whose job is a run: job, on a rig with
// native steps; its step stage runs in the background.
func nativeStage(t *testing.T, r *rig, script string) *stageRunner {
	t.Helper()
	s := newStageRunner(t, r)
	var id int64
	for _, e := range s.env {
		if v, ok := strings.CutPrefix(e, "CUSTOM_ENV_CI_JOB_ID="); ok {
			_, _ = fmt.Sscan(v, &id)
		}
	}
	run, err := json.Marshal([]map[string]any{{"name": "lines", "script": script}})
	require.NoError(t, err)
	payload, err := json.Marshal(map[string]any{"id": id, "token": "glcbt-e2e-secret", "runner_info": map[string]any{"timeout": 3600},
		"image": map[string]any{"name": ""}, "run": string(run)})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(s.dir, "response.json"), payload, 0o600))
	s.env = append(s.env, "CUSTOM_ENV_CI_PROJECT_DIR=/tmp/lve-native-build", "CUSTOM_ENV_STEPS="+string(run))
	return s
}

// gatedLinesScript prints "line 1".."line n", each followed by an empty
// line, one every 200 ms, and after "line at" waits until the guest file
// flag exists: what a test does there happens mid-step however slow the
// guest or the host is.
func gatedLinesScript(n, at int, flag string) string {
	return fmt.Sprintf(`for i in $(seq 1 %d); do echo "line $i"; echo; if [ "$i" = %d ]; then while [ ! -e %s ]; do sleep 0.2; done; fi; sleep 0.2; done`, n, at, flag)
}

// requireLinesOnce checks that out has "line 1".."line n", each once, in
// order.
func requireLinesOnce(t *testing.T, out string, n int) {
	t.Helper()
	var got []string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "line ") {
			got = append(got, l)
		}
	}
	want := make([]string, n)
	for i := range want {
		want[i] = fmt.Sprintf("line %d", i+1)
	}
	require.Equal(t, want, got, "every line once, in order: no gap, no duplicate")
}

// TestFaultNativeSteps: native steps in one tiny VM, stage after stage:
// every SSH connection to the guest killed mid-step, and later in the same
// step the connection holder SIGKILLed: the step goes on, the stage
// re-attaches each time and succeeds, and its log has every line once. A stage stopped (SIGTERM:
// cancel, timeout) mid-step stops the step and what it left running. The
// guest destroyed mid-step is a system failure within the dead-guest bound
// that says what became of the VM.
func TestFaultNativeSteps(t *testing.T) {
	r := setup(t)
	requireGuestStepRunner(t, r)
	r = r.withConfig(t, withNativeSteps)
	const n, gate, flag = 40, 20, "/tmp/lve-e2e-go-on"
	s := nativeStage(t, r, gatedLinesScript(n, gate, flag))
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	script := filepath.Join(s.dir, "script.")
	require.NoError(t, os.WriteFile(script, []byte("echo the runner's shim script, not used in native mode\nexit 99\n"), 0o700))

	// One step, two drops: every SSH connection killed at line 5 (the
	// stream comes back through the holder, which connects again), then
	// the holder SIGKILLed at line 20 (it comes back directly). The step
	// waits after line 20 until the test lets it go on, so that both
	// drops come mid-step on a host of any speed.
	t.Run("SSH connections and then the holder killed", func(t *testing.T) {
		rn := s.start(t, "run", script, "build_script")
		waitFor(t, 2*time.Minute, "line 5 in the stage's output", func() bool { return strings.Contains(rn.out.String(), "line 5\n") })
		holderPID := s.holderPID(t)
		// Every sshd serving a connection in the guest (the stage's own
		// and this one's included); the service runs in its own session.
		// reattached waits for the stage's k-th re-attach, failing at once
		// if the stage ends first.
		reattached := func(k int) {
			waitFor(t, time.Minute, fmt.Sprintf("re-attach %d", k), func() bool {
				if rn.ended() {
					t.Fatalf("the stage ended before its re-attach %d:\n%s", k, rn.err.String())
				}
				return strings.Count(rn.err.String(), "re-attached, the log goes on") == k
			})
		}
		s.runScript(t, "prepare_script", guestProcs("sshd*@notty*", "kill -KILL $p")+"true\n")
		reattached(1)
		waitFor(t, time.Minute, "line 20 in the stage's output", func() bool { return strings.Contains(rn.out.String(), fmt.Sprintf("line %d\n", gate)) })
		killHolder(t, holderPID)
		reattached(2)
		require.NotContains(t, rn.out.String(), fmt.Sprintf("line %d\n", gate+1), "the step waits for the test")
		goOn := s.runScript(t, "prepare_script", "touch "+flag+"\n")
		require.Equal(t, 0, goOn.code, goOn.stderr)
		res := rn.wait(t, 3*time.Minute)
		require.Equal(t, 0, res.code, res.stderr)
		require.Equal(t, 2, strings.Count(res.stderr, "re-attached, the log goes on"), res.stderr)
		requireLinesOnce(t, res.stdout, n)
	})
	t.Run("stage stopped", func(t *testing.T) {
		// The same job: its payload now has the sleeping step.
		b := mustRead(t, filepath.Join(s.dir, "response.json"))
		var p map[string]any
		require.NoError(t, json.Unmarshal(b, &p))
		run, _ := json.Marshal([]map[string]any{{"name": "sleeper", "script": `sleep 600 & echo "bg $!"; echo started; sleep 600`}})
		p["run"] = string(run)
		b, _ = json.Marshal(p)
		require.NoError(t, os.WriteFile(filepath.Join(s.dir, "response.json"), b, 0o600))
		rn := s.start(t, "run", script, "build_script")
		waitFor(t, 2*time.Minute, "the step started", func() bool { return strings.Contains(rn.out.String(), "started\n") })
		waitFor(t, 10*time.Second, "the stage handles SIGTERM", func() bool { return rn.catches(syscall.SIGTERM) })
		before := s.runScript(t, "prepare_script", guestProcs(`"sleep 600"*`, "echo sleep-left $p")+"true\n")
		require.Equal(t, 2, strings.Count(before.stdout, "sleep-left"), "the check sees the step and its background sleep")
		rn.signal(syscall.SIGTERM)
		res := rn.wait(t, time.Minute)
		require.NotEqual(t, 0, res.code)
		check := s.runScript(t, "prepare_script", guestProcs(`"sleep 600"*`, "echo sleep-left $p")+"[ -e /tmp/lve-steps ] && echo service-dir-left; true\n")
		require.NotContains(t, check.stdout, "sleep-left")
		require.NotContains(t, check.stdout, "service-dir-left")
	})
	t.Run("guest destroyed", func(t *testing.T) {
		rn := s.start(t, "run", script, "build_script")
		waitFor(t, 2*time.Minute, "the step started", func() bool { return strings.Contains(rn.out.String(), "started\n") })
		require.NoError(t, r.destroyJobDomain())
		t0 := time.Now()
		res := rn.wait(t, time.Minute)
		took := time.Since(t0)
		figures.fault()
		figures.class(res.code, 2)
		figures.detected(took)
		require.Equal(t, 2, res.code, res.stderr)
		require.Less(t, took, 25*time.Second, "within the dead-guest bound")
		require.Contains(t, res.stderr, s.name(t)+" is shut off", "the stage says what became of the VM")
	})
	require.Equal(t, 0, s.run(t, "cleanup").code)
}

// guestProcs is a guest script that runs action (with $p set to the pid)
// for each process whose command line matches the shell pattern (busybox
// guests have no pkill; every guest has /proc).
func guestProcs(pattern, action string) string {
	return `for d in /proc/[0-9]*; do c=$(tr '\0' ' ' < $d/cmdline 2>/dev/null); p=${d#/proc/}; case "$c" in ` + pattern + `) ` + action + `;; esac; done
`
}
