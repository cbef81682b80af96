//go:build e2e

package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

// stageBound is how long a stage whose script is done at once may take on a
// loaded 2-core CI machine: SSH connection and login under TCG, the script,
// and the stop of what it left behind (SIGTERM, SIGKILL after 2 s). Before
// the fix such stages ran until the job timeout.
const stageBound = 20 * time.Second

// Jobs as users write them: a script that leaves a process running in the
// background ends when its shell ends, with its own result; what it left in
// its process group is stopped; a service started with setsid survives into
// later stages (it dies with the VM); a backgrounded service serves the rest
// of its own stage.
// changed is a shell condition: the file's content changes (to something
// not empty) within 10 s. The file may not exist yet (the background loop
// that writes it may not have run): a failed read is an empty content, not
// the end of the job's script (which runs with errexit).
func changed(file string) string {
	read := `$(cat ` + file + ` 2>/dev/null || true)`
	return `a=` + read + `; b=$a; for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do sleep 0.5; b=` + read + `; [ -n "$b" ] && [ "$a" != "$b" ] && break; done; [ -n "$b" ] && [ "$a" != "$b" ]`
}

// Both ways a stage runs: through the guest agent (the default) and
// through the wrapper (an image without the agent, or agent = "none").
func TestBackgroundProcessesEndWithTheirStage(t *testing.T) {
	r := setup(t)
	t.Run("agent", func(t *testing.T) { backgroundProcesses(t, r, true) })
	t.Run("wrapper", func(t *testing.T) {
		backgroundProcesses(t, r.withConfig(t, func(s string) string {
			return strings.Replace(s, "[guest_tools]\n", "[guest_tools]\nagent = \"none\"\n", 1)
		}), false)
	})
}

func backgroundProcesses(t *testing.T, r *rig, agent bool) {
	// The script's own failure still decides the class, promptly: a job of
	// its own, in a VM of its own, run beside the first (one vCPU each, the
	// host has two cores) and looked at after it.
	failOpts, failLog := r.options(t)
	type result struct {
		res *harness.Result
		err error
	}
	failed := make(chan result, 1)
	go func() {
		res, err := harness.RunJob(context.Background(), failOpts, harness.Job{
			Timeout: 5 * time.Minute,
			Script:  []string{"sleep 300 &", "echo failing-now", "exit 4"},
		})
		failed <- result{res, err}
	}()
	// (A test that fails before it reads the result still waits for the
	// job, so that its VM is gone before the leftover check.)
	var fail result
	var got bool
	t.Cleanup(func() {
		if !got {
			<-failed
		}
	})

	opts, lw := r.options(t)
	start := time.Now()
	res, err := harness.RunJob(context.Background(), opts, harness.Job{
		Timeout: 5 * time.Minute,
		Script: []string{
			"sleep 300 & echo $! > /tmp/bg.pid",
			"nohup sleep 301 >/dev/null 2>&1 & echo $! > /tmp/nohup.pid",
			"(while true; do date +%s%N > /tmp/beat; sleep 0.2; done) &",
			"setsid sh -c 'while true; do date +%s%N > /tmp/beat2; sleep 0.2; done' >/dev/null 2>&1 &",
			// Waits for a change for up to 10 s: a loaded host can starve
			// the guest's background loop for a second.
			changed("/tmp/beat") + " && echo SERVICE-SERVED-$((40+2))",
			"echo script-done",
		},
		AfterScript: []string{
			`for f in bg nohup; do if kill -0 "$(cat /tmp/$f.pid)" 2>/dev/null; then echo $f-ALIVE; else echo $f-GONE; fi; done`,
			"a=$(cat /tmp/beat); sleep 1; b=$(cat /tmp/beat); test \"$a\" = \"$b\" && echo INSTAGE-SERVICE-STOPPED",
			changed("/tmp/beat2") + " && echo DETACHED-SERVICE-ALIVE",
			"sleep 300 &",
			"echo after-done",
		},
	})
	require.NoError(t, err)
	require.Equal(t, harness.StateSuccess, res.State, "%s: %s", res.FailureReason, res.Message)
	log := lw.buf.String()
	if agent {
		require.Contains(t, log, agentSaid)
	} else {
		require.NotContains(t, log, agentSaid)
		require.NotContains(t, log, "the guest has no agent", "agent = \"none\" is the admin's choice: nothing to say")
	}
	for _, want := range []string{"SERVICE-SERVED-42", "script-done", "bg-GONE", "nohup-GONE",
		"INSTAGE-SERVICE-STOPPED", "DETACHED-SERVICE-ALIVE", "after-done",
		"stopping the processes it left running"} {
		require.Contains(t, log, want)
	}
	for _, stage := range []string{"build_script", "after_script"} {
		s := stageExit(t, res, stage)
		require.Equal(t, 0, s.ExitCode, stage)
		require.False(t, s.OutputLeftOpen, "%s: run_exec's output was closed when it exited", stage)
		// build_script sleeps 2 s itself, after_script 2 s.
		require.Less(t, s.Duration, stageBound, "%s ends within seconds of its script", stage)
	}
	t.Logf("job with background processes: %s in all", time.Since(start).Round(time.Second))

	fail, got = <-failed, true
	res, err = fail.res, fail.err
	require.NoError(t, err)
	require.Equal(t, harness.ReasonScriptFailure, res.FailureReason, res.Message)
	require.Equal(t, 4, res.ScriptExitCode)
	build := stageExit(t, res, "build_script")
	require.Equal(t, 1, build.ExitCode)
	require.Less(t, build.Duration, stageBound)
	require.Contains(t, failLog.buf.String(), "failing-now")
}
