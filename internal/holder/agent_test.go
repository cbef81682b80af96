package holder

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/agenttest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// The holder's stage tests through the agent: this test binary runs them
// again with every holder starting the agent on its connections (the
// process tests, which start no stage, aside).
func TestHolderTestsThroughTheAgent(t *testing.T) {
	if os.Getenv(agentEnv) != "" {
		t.Skip("this is the run through the agent")
	}
	bin := agenttest.BuildT(t)
	tests := []string{"TestStagesShareOneConnection", "TestLargeScriptAndOutput", "TestCancelStopsTheScriptInTheGuest",
		"TestStageProcessGoneStopsTheScript", "TestHolderDyingMidStageIsSystemFailure", "TestCancelWhileTheHolderDoesNotRead",
		"TestDeadGuestFailsTheNextStageFast", "TestLostConnectionIsMadeAgain", "TestStreamOverTheHeldConnection",
		"TestStreamLostConnection", "TestStreamDeadGuest", "TestStreamCancelAndUnavailable", "TestAgentRunsTheStages"}
	cmd := exec.Command(os.Args[0], "-test.run", "^("+strings.Join(tests, "|")+")$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), agentEnv+"="+bin)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, name := range tests {
		require.Contains(t, string(out), "--- PASS: "+name+" ", "%s did not run through the agent", name)
	}
}

// With the agent the guest runs one command for the whole job: the
// agent; every stage after it is a frame on its channel.
func TestAgentRunsTheStages(t *testing.T) {
	if os.Getenv(agentEnv) == "" {
		t.Skip("run by TestHolderTestsThroughTheAgent")
	}
	r := startHolder(t, nil)
	for i := 0; i < 3; i++ {
		var out, errb sshtest.Buffer
		tag, _ := sshexec.NewTag()
		_, err := RunStage(context.Background(), r.sock, Stage{Tag: tag, Shell: "bash", Script: []byte("echo stage\n"), Stdout: &out, Stderr: &errb, KillGrace: 2 * time.Second})
		require.NoError(t, err)
		require.Equal(t, "stage\n", out.String())
		errOut := errb.String()
		if i == 0 {
			require.Regexp(t, `^libvirt-executor: the stages run through the guest agent \(started in \d+ms\): one process in the guest per stage\n$`, errOut, "the job log says it once")
		} else {
			require.Empty(t, errOut)
		}
	}
	cmds := r.ts.Commands()
	require.Len(t, cmds, 1, "one command in the guest for three stages: %q", cmds)
	require.Contains(t, cmds[0], "lve-agent")
}

// A guest without the agent keeps the wrapper, and the first stage says
// so once; an agent that ends mid-stage fails that stage as a system
// failure (never the script's class), and the stages after it use the
// wrapper, the next one saying so.
func TestAgentMissingOrEndedFallsBackToTheWrapper(t *testing.T) {
	r := startHolderWith(t, nil, "exec /nonexistent/lve-agent")
	var errb sshtest.Buffer
	run := func(script string) (string, error) {
		var out sshtest.Buffer
		errb = sshtest.Buffer{}
		tag, _ := sshexec.NewTag()
		_, err := RunStage(context.Background(), r.sock, Stage{Tag: tag, Shell: "bash", Script: []byte(script), Stdout: &out, Stderr: &errb, KillGrace: 2 * time.Second})
		return out.String(), err
	}
	out, err := run("echo one\n")
	require.NoError(t, err)
	require.Equal(t, "one\n", out)
	require.Contains(t, errb.String(), "the guest has no agent")
	_, err = run("echo two\n")
	require.NoError(t, err)
	require.Empty(t, errb.String(), "said once")

	bin := agenttest.BuildT(t)
	r = startHolderWith(t, nil, "exec "+sshexec.ShellQuote(bin))
	pidfile := filepath.Join(t.TempDir(), "agent.pid")
	// The script finds its agent: its shell's parent.
	result := make(chan error, 1)
	go func() {
		_, err := run("echo $PPID $$ > " + pidfile + ".new; mv " + pidfile + ".new " + pidfile + "; sleep 30; exit 3\n")
		result <- err
	}()
	var agentPID, script int
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(pidfile)
		if err != nil {
			return false
		}
		f := strings.Fields(string(b))
		if len(f) != 2 {
			return false
		}
		agentPID, _ = strconv.Atoi(f[0])
		script, _ = strconv.Atoi(f[1])
		return agentPID > 1 && script > 1
	}, 10*time.Second, 10*time.Millisecond)
	// A SIGKILLed agent cannot stop its stage: the holder does, from a
	// session of its own.
	t.Cleanup(func() { _ = syscall.Kill(-script, syscall.SIGKILL) })
	require.NoError(t, syscall.Kill(agentPID, syscall.SIGKILL))
	err = <-result
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "its stage's processes were stopped")
	require.Eventually(t, func() bool { return syscall.Kill(script, 0) != nil || zombie(script) },
		5*time.Second, 20*time.Millisecond, "the stage's shell was stopped")
	out, err = run("echo after\n")
	require.NoError(t, err)
	require.Equal(t, "after\n", out)
	require.Contains(t, errb.String(), "the guest's agent ended during the previous stage")
}

// zombie says process pid has ended and waits for its parent.
func zombie(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	return err == nil && strings.Contains(string(b), ") Z ")
}
