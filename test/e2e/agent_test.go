//go:build e2e

package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// agentSaid is what the job log says when the stages run through the
// guest agent (said with the job's first stage).
const agentSaid = "the stages run through the guest agent"

// TestFaultAgentKilledMidStage: the guest agent is SIGKILLed while a
// stage's script runs (here by the script itself). The stage is a system
// failure (never the script's class), what it left running is stopped by
// the holder, and the stages after it run through the wrapper over the same
// connection, with their own classes, the next one saying why.
func TestFaultAgentKilledMidStage(t *testing.T) {
	r := setup(t)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	first := s.runScript(t, "prepare_script", "echo first\n")
	require.Equal(t, 0, first.code)
	require.Contains(t, first.stderr, agentSaid, "the guest's agent runs the stages")
	holder := s.holderPID(t)

	res := s.runScript(t, "build_script", "echo $$ > /tmp/lve-agent-killed.pid\necho started\nkill -KILL $PPID\nsleep 600\necho never\n")
	figures.fault()
	figures.class(res.code, 2)
	require.Equal(t, 2, res.code, "SYSTEM_FAILURE: the agent died, not the script")
	require.NotContains(t, res.stdout, "never")
	require.Contains(t, res.stderr, "its stage's processes were stopped")

	next := s.runScript(t, "after_script", "if kill -0 $(cat /tmp/lve-agent-killed.pid) 2>/dev/null; then echo still-running; else echo stopped; fi\n")
	require.Equal(t, 0, next.code)
	require.Contains(t, next.stdout, "stopped", "nothing of the interrupted stage runs on")
	require.Contains(t, next.stderr, "the guest's agent ended during the previous stage")
	fail := s.runScript(t, "build_script", "exit 3\n")
	figures.class(fail.code, 1)
	require.Equal(t, 1, fail.code, "the script's own failure stays a build failure on the wrapper")
	require.Equal(t, holder, s.holderPID(t), "the same holder and connection")
	require.Equal(t, 0, s.run(t, "cleanup").code)
}

// TestFaultAgentChannelStalls: the agent stops answering while its stage
// runs (SIGSTOP: its channel stalls, the guest and its sshd live on). The
// keepalive, not the agent's silence, decides about the guest: the stage
// runs on until the runner cancels it; the cancel ends it within its bound
// as a system failure, the stalled agent and the stage's processes are
// stopped, and the job goes on through the wrapper on the same connection.
func TestFaultAgentChannelStalls(t *testing.T) {
	// A short keepalive (1 s x 3: a dead guest given up within 3-4 s), so
	// that the wait below, longer than it takes, is short too.
	r := setup(t).withConfig(t, func(s string) string {
		s = regexp.MustCompile(`(?m)^keepalive_(interval|count) = .*\n`).ReplaceAllString(s, "")
		const keys = "keepalive_interval = \"1s\"\nkeepalive_count = 3\n"
		if strings.Contains(s, "\n[ssh]\n") {
			return strings.Replace(s, "\n[ssh]\n", "\n[ssh]\n"+keys, 1)
		}
		return s + "\n[ssh]\n" + keys
	})
	keepalive := r.cfg.SSH.KeepaliveInterval.D()
	require.Equal(t, time.Second, keepalive)
	require.Equal(t, 3, r.cfg.SSH.KeepaliveCount)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	holder := s.holderPID(t)
	path := filepath.Join(s.dir, "script.")
	// The script stops its agent 3 s after its line (which the agent relays
	// at once): the test sees it.
	require.NoError(t, os.WriteFile(path, []byte("#!/usr/bin/env bash\necho $$ > /tmp/lve-stalled-stage.pid\necho $PPID > /tmp/lve-stalled-agent.pid\necho started\nsleep 3\nkill -STOP $PPID\nsleep 600\n"), 0o700))
	rn := s.start(t, "run", path, "build_script")
	waitFor(t, 60*time.Second, "script started", func() bool { return strings.Contains(rn.out.String(), "started") })
	// What is asserted is that nothing happens for longer than the
	// keepalive takes to give up a dead guest (count intervals without a
	// reply, one more for the first probe to go out: 4 s), the 3 s before
	// the stall, and as much again as the keepalive's own time for the
	// verdict to reach the stage: the guest is not dead, and nothing takes
	// it for dead. (A fixed wait is the assertion here: that nothing
	// happens.)
	time.Sleep(3*time.Second + 2*keepalive*time.Duration(r.cfg.SSH.KeepaliveCount+1))
	require.False(t, rn.ended(), "a stalled agent is not a dead guest: the stage runs until it is cancelled")
	t0 := time.Now()
	rn.signal(syscall.SIGTERM)
	res := rn.wait(t, 60*time.Second)
	took := time.Since(t0)
	figures.fault()
	figures.class(res.code, 2)
	require.Equal(t, 2, res.code, "SYSTEM_FAILURE")
	// The kill grace (5 s), the leftovers' and the drain's (3 s), the
	// host's slack (5 s), then the stop from a session of its own.
	require.Less(t, took, 30*time.Second, "the cancel ended the stage within its bound")
	require.Contains(t, res.stderr, "did not end the cancelled stage in time")

	next := s.runScript(t, "after_script", "for f in stage agent; do if kill -0 $(cat /tmp/lve-stalled-$f.pid) 2>/dev/null; then echo $f-running; else echo $f-stopped; fi; done\n")
	require.Equal(t, 0, next.code)
	require.Contains(t, next.stdout, "stage-stopped", "the stage's processes were stopped")
	require.Contains(t, next.stdout, "agent-stopped", "the stalled agent was stopped")
	require.Contains(t, next.stderr, "the guest's agent ended during the previous stage")
	require.Equal(t, holder, s.holderPID(t), "the same holder and connection: the guest was never taken for dead")
	require.Equal(t, 0, s.run(t, "cleanup").code)
}
