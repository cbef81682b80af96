package sshexec

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/agent"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/agenttest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// wrapperTests are the stage tests whose guarantees the agent keeps as the
// wrapper does (the wrapper's own mechanics, an upload to a full disk, a
// guest without setsid, an SSH server holding the stage's channel, are
// not the agent's).
var wrapperTests = []string{
	"TestRunExitCodes", "TestRunStreamsStderrAndClosesStdin", "TestStdoutAndStderrKeepTheirOrder",
	"TestBackgroundProcessDoesNotHoldTheStage", "TestDetachedProcessCannotHoldTheStage",
	"TestBackgroundServiceServesTheRestOfTheStage", "TestScriptNeverOnCommandLineAndNotLeftBehind",
	"TestScriptKilledBySignalIsBuildFailure", "TestCancelKillsRemoteProcessGroup", "TestCancelEscalatesToKill",
	"TestConnectionDroppedMidStreamIsSystemFailure", "TestFrozenGuestDetectedByKeepalive",
}

// The wrapper's stage tests, every one of them, through the agent: this
// test binary runs them again with every connection's stages going
// through one agent (started in a session of the connection, as a job's).
func TestWrapperTestsThroughTheAgent(t *testing.T) {
	if os.Getenv(agentEnv) != "" {
		t.Skip("this is the run through the agent")
	}
	bin := agenttest.BuildT(t)
	cmd := exec.Command(os.Args[0], "-test.run", "^("+strings.Join(wrapperTests, "|")+")$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), agentEnv+"="+bin)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, name := range wrapperTests {
		require.Contains(t, string(out), "--- PASS: "+name+" ", "%s did not run through the agent", name)
	}
}

// The agent's failures are the infrastructure's: a guest without the
// agent (its path not there) is ErrNoAgent, naming what the guest said;
// the agent killed mid-stage, or its session cut, is a lost connection,
// never the script's class (ErrAgentGone: the connection lives); the
// connection keeps working for the wrapper.
func TestAgentFailuresAreSystemFailures(t *testing.T) {
	bin := agenttest.BuildT(t)
	ts := sshtest.Start(t)
	c, err := Dial(context.Background(), target(ts))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })

	_, err = c.StartAgent(context.Background(), "exec /nonexistent/lve-agent")
	require.ErrorIs(t, err, ErrNoAgent)
	require.ErrorContains(t, err, "/nonexistent/lve-agent")

	a, err := c.StartAgent(context.Background(), "exec "+ShellQuote(bin))
	require.NoError(t, err)
	defer func() { _ = a.Close() }()
	var out sshtest.Buffer
	pidfile := filepath.Join(t.TempDir(), "script.pid")
	result := make(chan error, 1)
	go func() {
		result <- c.Run(context.Background(), []byte("echo $$ > "+pidfile+"; echo ready; sleep 30; exit 3"), RunOptions{Shell: "bash", Stdout: &out, Agent: a})
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "ready") }, 10*time.Second, 10*time.Millisecond)
	// A SIGKILLed agent cannot stop its stage: the host does, by the
	// group the agent said, from a session of its own.
	script := mustAtoi(t, readPid(t, pidfile))
	t.Cleanup(func() { _ = syscall.Kill(-script, syscall.SIGKILL) })
	require.NoError(t, syscall.Kill(a.Hello().PID, syscall.SIGKILL))
	err = <-result
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorIs(t, err, ErrAgentGone, "the connection lives: the agent alone is gone")
	require.NotErrorIs(t, err, ErrConnectionLost)
	require.ErrorContains(t, err, "its stage's processes were stopped")
	require.Eventually(t, func() bool { return !pidRunning(script) || zombie(script) }, 5*time.Second, 20*time.Millisecond)
	_, err = a.Run(context.Background(), []byte("true"), agent.RunOptions{Shell: "bash"})
	require.Error(t, err, "a dead agent runs nothing more")

	// the connection itself is fine: the wrapper still runs stages on it
	var again sshtest.Buffer
	require.NoError(t, c.Run(context.Background(), []byte("echo wrapper"), RunOptions{Shell: "bash", Stdout: &again}))
	require.Equal(t, "wrapper\n", again.String())
	require.False(t, pidRunning(a.Hello().PID))
}

func pidRunning(pid int) bool { return pidAlive(strconv.Itoa(pid)) }

func zombie(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	return err == nil && strings.Contains(string(b), ") Z ")
}

// An agent that breaks the protocol mid-stage (here: an unknown frame) is
// given up like a dead one: ErrAgentGone (the holder then falls back to
// the wrapper), never a stage result, and the connection stays usable.
func TestAgentBreakingTheProtocolIsGone(t *testing.T) {
	ts := sshtest.Start(t)
	c, err := Dial(context.Background(), target(ts))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	hello := []byte(`{"protocol":` + strconv.Itoa(agent.Protocol) + `,"version":"fake","pid":0}`)
	frame := func(typ byte, payload []byte) string {
		b := append([]byte{typ, 0, 0, 0, byte(len(payload))}, payload...)
		var q strings.Builder
		for _, c := range b {
			fmt.Fprintf(&q, "\\%03o", c)
		}
		return "printf '" + q.String() + "'"
	}
	fake := frame('H', hello) + "; head -c 1 > /dev/null; " + frame('Z', nil) + "; sleep 10"
	a, err := c.StartAgent(context.Background(), fake)
	require.NoError(t, err)
	defer func() { _ = a.Close() }()
	err = c.Run(context.Background(), []byte("echo never"), RunOptions{Shell: "sh", Agent: a})
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorIs(t, err, ErrAgentGone)
	require.ErrorIs(t, err, agent.ErrProtocol)
	var again sshtest.Buffer
	require.NoError(t, c.Run(context.Background(), []byte("echo wrapper"), RunOptions{Shell: "sh", Stdout: &again}))
	require.Equal(t, "wrapper\n", again.String())
}

// BenchmarkNoopStage: a no-op stage through the wrapper (a session, the
// login shell and the wrapper's processes) and through the agent (one
// fork), over the in-process SSH server on this host: the difference is
// what the guest saves per stage, before TCG multiplies it.
func BenchmarkNoopStage(b *testing.B) {
	bin := agenttest.BuildT(b)
	ts := sshtest.Start(b)
	c, err := Dial(context.Background(), target(ts))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	a, err := c.StartAgent(context.Background(), "exec "+ShellQuote(bin))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = a.Close() }()
	for _, mode := range []struct {
		name  string
		agent *AgentSession
	}{{"wrapper", nil}, {"agent", a}} {
		b.Run(mode.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if err := c.Run(context.Background(), []byte("true\n"), RunOptions{Shell: "bash", Agent: mode.agent}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
