package sshexec

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// target reaches ts. The keepalive is generous (10s without a reply) for a
// loaded test host; the keepalive test sets its own.
func target(ts *sshtest.Server) Target {
	return Target{Addr: ts.Addr(), User: "root", Signer: ts.ClientSigner(), HostKey: ts.HostKey(),
		KeepaliveInterval: time.Second, KeepaliveCount: 10}
}

func dial(t *testing.T, tg Target) *Client {
	t.Helper()
	c, err := Dial(context.Background(), tg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	if bin := os.Getenv(agentEnv); bin != "" {
		// TestWrapperTestsThroughTheAgent: the stages of this connection
		// go through one agent, as a job's will.
		a, err := c.StartAgent(context.Background(), "exec "+ShellQuote(bin))
		require.NoError(t, err)
		t.Cleanup(func() { _ = a.Close() })
		agents.Store(c, a)
	}
	return c
}

// agentEnv names the agent binary the wrapper's tests run through (set by
// TestWrapperTestsThroughTheAgent for the run of this test binary it
// starts); agents is each connection's agent then.
const agentEnv = "LVE_SSHEXEC_TEST_AGENT"

var agents sync.Map // *Client -> *AgentSession

func run(c *Client, ctx context.Context, script string) (string, string, error) {
	var out, errb sshtest.Buffer
	// Graces shorter than the defaults (2 s for the leftovers, 5 s to
	// kill), to keep the package's tests short: what the tests look at
	// happens well within them, or is what follows them.
	o := RunOptions{Shell: "bash", Stdout: &out, Stderr: &errb, KillGrace: time.Second, LeftoverGrace: 500 * time.Millisecond}
	if a, ok := agents.Load(c); ok {
		o.Agent = a.(*AgentSession)
	}
	err := c.Run(ctx, []byte(script), o)
	return out.String(), errb.String(), err
}

func TestRunExitCodes(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	for _, code := range []int{0, 1, 2, 3, 42, 255} {
		out, _, err := run(c, context.Background(), fmt.Sprintf("#!/usr/bin/env bash\necho hello\nexit %d\n", code))
		require.Equal(t, "hello\n", out)
		if code == 0 {
			require.NoError(t, err)
			continue
		}
		require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "code %d: %v", code, err)
		got, ok := exitcodes.ScriptCode(err)
		require.True(t, ok)
		require.Equal(t, code, got)
	}
}

func TestRunStreamsStderrAndClosesStdin(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	out, errOut, err := run(c, context.Background(), "echo to-err >&2\nif read -r line; then echo got-stdin; else echo stdin-closed; fi\n")
	require.NoError(t, err)
	require.Equal(t, "to-err\nstdin-closed\n", out, "stderr is merged into the stage's output in the guest")
	require.Empty(t, errOut)
}

// A compiler error stays next to the command that caused it: stdout and
// stderr are merged in the guest, so their relative order survives.
func TestStdoutAndStderrKeepTheirOrder(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	out, _, err := run(c, context.Background(), "for i in $(seq 1 2000); do echo out-$i; echo err-$i >&2; done\n")
	require.NoError(t, err)
	var want strings.Builder
	for i := 1; i <= 2000; i++ {
		fmt.Fprintf(&want, "out-%d\nerr-%d\n", i, i)
	}
	require.Equal(t, want.String(), out)
}

// loginShells are the login shells guests run the driver's wrapper with:
// bash (Debian's root), dash (Debian's /bin/sh, useradd's default) and
// busybox ash (Alpine, the tiny image's busybox). make deps installs all
// three; a missing one fails the test rather than skipping it.
var loginShells = map[string][]string{"bash": {"bash"}, "dash": {"dash"}, "busybox-ash": {"busybox", "sh"}}

func eachLoginShell(t *testing.T, f func(t *testing.T, ts *sshtest.Server)) {
	for name, argv := range loginShells {
		if os.Getenv(agentEnv) != "" && name != "bash" {
			continue // through the agent the login shell only starts it
		}
		t.Run(name, func(t *testing.T) {
			_, err := exec.LookPath(argv[0])
			require.NoError(t, err, "%s is needed to test the wrapper under %s (make deps installs it)", argv[0], name)
			ts := sshtest.Start(t)
			ts.SetLogin(argv...)
			f(t, ts)
		})
	}
}

// pidAlive reports whether a process exists and is not a zombie.
func pidAlive(pid string) bool {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return false
	}
	f := strings.Fields(string(b))
	return len(f) > 2 && f[2] != "Z"
}

// cancelOnceWritten cancels once path holds something (a script wrote its
// child's pid there), polling until ctx ends; either way it cancels. The
// channel says, once, whether the file was seen: the test goroutine reads
// it after the stage, so that a marker that never came fails the test
// (bounded by ctx) instead of leaving a goroutine polling forever.
func cancelOnceWritten(ctx context.Context, path string, cancel context.CancelFunc) <-chan error {
	seen := make(chan error, 1)
	go func() {
		defer cancel()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
				seen <- nil
				return
			}
			select {
			case <-ctx.Done():
				seen <- fmt.Errorf("%s was never written (%w)", path, context.Cause(ctx))
				return
			case <-tick.C:
			}
		}
	}()
	return seen
}

func readPid(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

// A stage whose script leaves a process running in the background ends when
// the script's shell ends, with the script's own exit code; what it left in
// its process group is stopped. Before, the background process held the
// channel's output open and the stage ran until the job timeout.
func TestBackgroundProcessDoesNotHoldTheStage(t *testing.T) {
	eachLoginShell(t, func(t *testing.T, ts *sshtest.Server) {
		c := dial(t, target(ts))
		for _, tc := range []struct {
			name, start string
			code        int
		}{
			{"plain", "sleep 300 &", 0},
			{"plain then failure", "sleep 300 &", 3},
			{"nohup with redirects", "nohup sleep 300 >/dev/null 2>&1 &", 0},
			// The script waits until the trap is set (READY): a TERM that came
			// first would kill it, not test the escalation.
			{"ignores TERM", "(trap '' TERM; : > READY; while true; do sleep 0.1; done) &\nuntil [ -e READY ]; do sleep 0.01; done", 0},
		} {
			t.Run(tc.name, func(t *testing.T) {
				pidfile := filepath.Join(t.TempDir(), "bg.pid")
				bg := strings.ReplaceAll(tc.start, "READY", pidfile+".ready")
				script := fmt.Sprintf("#!/usr/bin/env bash\n%s\necho $! > %s\necho started\nexit %d\n", bg, pidfile, tc.code)
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				start := time.Now()
				out, errOut, err := run(c, ctx, script)
				took := time.Since(start)
				require.Less(t, took, 6*time.Second, "the stage ends within seconds of its script")
				require.Contains(t, out, "started")
				if tc.code == 0 {
					require.NoError(t, err)
				} else {
					code, ok := exitcodes.ScriptCode(err)
					require.True(t, ok, "%v", err)
					require.Equal(t, tc.code, code)
				}
				require.Contains(t, errOut, "stopping the processes it left running", "the job log says what happened")
				require.NotContains(t, errOut, "detached process", "nothing detached here")
				if tc.name == "ignores TERM" {
					require.Contains(t, errOut, "ignored SIGTERM")
				}
				pid := readPid(t, pidfile)
				require.Eventually(t, func() bool { return !pidAlive(pid) }, 3*time.Second, 20*time.Millisecond,
					"the background process %s must be stopped", pid)
			})
		}
	})
}

// A process that detaches into a session of its own (setsid) is not the
// stage's to stop: it keeps running (until the VM is destroyed), but it
// cannot hold the stage open, even when it still writes to the stage's
// output.
func TestDetachedProcessCannotHoldTheStage(t *testing.T) {
	eachLoginShell(t, func(t *testing.T, ts *sshtest.Server) {
		c := dial(t, target(ts))
		dir := t.TempDir()
		pidfile, ticks := filepath.Join(dir, "bg.pid"), filepath.Join(dir, "ticks")
		// Each tick is counted in a file only after it was written to the
		// stage's output: a count that grows after the stage proves that
		// the writes still succeed (no SIGPIPE).
		script := fmt.Sprintf("setsid bash -c 'echo $$ > %s; i=0; while true; do echo tick; i=$((i+1)); echo $i > %s.new; mv %s.new %s; sleep 0.05; done' &\nsleep 0.5\necho started\n",
			pidfile, ticks, ticks, ticks)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		start := time.Now()
		out, errOut, err := run(c, ctx, script)
		require.NoError(t, err)
		require.Less(t, time.Since(start), 6*time.Second)
		require.Contains(t, out, "started")
		require.Contains(t, errOut, "a detached process still writes to the stage's output")
		pid := readPid(t, pidfile)
		p, err := os.FindProcess(mustAtoi(t, pid))
		require.NoError(t, err)
		defer func() { _ = p.Kill() }()
		// It keeps writing after the stage: it must not die of SIGPIPE.
		count := func() int {
			b, _ := os.ReadFile(ticks)
			n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
			return n
		}
		after := count()
		require.Eventually(t, func() bool { return count() >= after+10 }, 10*time.Second, 20*time.Millisecond,
			"the detached process keeps writing after the stage (%d ticks at its end)", after)
		require.True(t, pidAlive(pid), "a detached process survives the stage")
	})
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	var n int
	_, err := fmt.Sscan(s, &n)
	require.NoError(t, err)
	return n
}

// A service started in the background serves later commands of the same
// stage (before_script and script run in one stage).
func TestBackgroundServiceServesTheRestOfTheStage(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	dir := t.TempDir()
	// The later command looks for a new beat for up to 10 s (a loaded host
	// may not run the loop for a while).
	script := fmt.Sprintf("(while true; do date +%%s%%N > %[1]s/beat; sleep 0.05; done) &\nsleep 0.5\na=$(cat %[1]s/beat); i=0\nwhile [ $i -lt 100 ]; do sleep 0.1; b=$(cat %[1]s/beat); [ \"$a\" != \"$b\" ] && break; i=$((i+1)); done\n[ \"$a\" != \"$b\" ] && echo service-alive\n", dir)
	out, _, err := run(c, context.Background(), script)
	require.NoError(t, err)
	require.Contains(t, out, "service-alive")
}

// However the guest's SSH server behaves, the stage returns once the exit
// status arrived: a server that keeps the channel open afterwards costs at
// most the drain grace, and the class is the script's.
func TestChannelHeldOpenAfterExitStatus(t *testing.T) {
	ts := sshtest.Start(t)
	ts.HoldOpen(true)
	c := dial(t, target(ts))
	for _, code := range []int{0, 7} {
		var out sshtest.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		start := time.Now()
		err := c.Run(ctx, []byte(fmt.Sprintf("echo hi\nexit %d\n", code)), RunOptions{Shell: "bash", Stdout: &out, DrainGrace: 300 * time.Millisecond})
		cancel()
		require.Less(t, time.Since(start), 3*time.Second)
		require.Equal(t, "hi\n", out.String())
		if code == 0 {
			require.NoError(t, err)
		} else {
			got, ok := exitcodes.ScriptCode(err)
			require.True(t, ok, "%v", err)
			require.Equal(t, code, got)
		}
	}
}

func TestScriptNeverOnCommandLineAndNotLeftBehind(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	secret := "canary-" + t.Name()
	_, _, err := run(c, context.Background(), "X="+secret+"\necho ok\n")
	require.NoError(t, err)
	for _, cmd := range ts.Commands() {
		require.NotContains(t, cmd, secret)
	}
	for _, f := range leftRegularFiles(t) {
		b, _ := os.ReadFile(f)
		require.NotContains(t, string(b), secret, "script left at %s", f)
	}
	// A failing script is removed too.
	_, _, err = run(c, context.Background(), "Y="+secret+"-2\nexit 5\n")
	require.Error(t, err)
	for _, f := range leftRegularFiles(t) {
		b, _ := os.ReadFile(f)
		require.NotContains(t, string(b), secret+"-2", "script left at %s", f)
	}
}

// leftRegularFiles lists the regular files of the wrapper's naming in /tmp.
// A FIFO of a stage still running elsewhere on the host (another test
// process) is no script, and reading it would block.
func leftRegularFiles(t *testing.T) []string {
	t.Helper()
	matches, err := filepath.Glob("/tmp/lve-run-*")
	require.NoError(t, err)
	var files []string
	for _, f := range matches {
		if st, err := os.Lstat(f); err == nil && st.Mode().IsRegular() {
			files = append(files, f)
		}
	}
	return files
}

// The script runs with the shell's own umask, not the private one used to
// write it into the guest.
func TestScriptKeepsTheUsersUmask(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	ts.SetPrefix("umask 0022; ")
	out, _, err := run(c, context.Background(), "umask\n")
	require.NoError(t, err)
	require.Equal(t, "0022\n", out)
}

// A script that cannot be written into the guest (here: cat fails, as on a
// full /tmp) is an infrastructure failure, never the job's, whatever the
// shell says.
func TestUploadFailureIsSystemFailure(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	fakebin := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(fakebin, "cat"), []byte("#!/bin/sh\necho 'cat: write error: No space left on device' >&2\nexit 1\n"), 0o755))
	ts.SetPrefix("PATH=" + fakebin + ":$PATH; ")
	_, errOut, err := run(c, context.Background(), "echo never-ran\n")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "copy script into guest failed")
	require.NotContains(t, errOut, "never-ran")
	require.NoError(t, c.Dead(), "the connection itself is fine")
	// A script that kills its own shell, or its whole process group, with
	// the same signal is still the job's (128+10), not an upload failure.
	ts.SetPrefix("")
	for _, script := range []string{"kill -USR1 $$\n", "kill -USR1 0\n"} {
		_, _, err = run(c, context.Background(), script)
		code, ok := exitcodes.ScriptCode(err)
		require.True(t, ok, "%s: %v", script, err)
		require.Equal(t, 128+10, code, script)
	}
}

// A script that arrives cut short (the connection dropped during the
// upload, so the guest saw the end of its input early) never runs.
func TestTruncatedUploadNeverRuns(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	fakebin := t.TempDir()
	// A cat that keeps only the first line of what it is given.
	require.NoError(t, os.WriteFile(filepath.Join(fakebin, "cat"), []byte("#!/bin/sh\nhead -n 1\n"), 0o755))
	ts.SetPrefix("PATH=" + fakebin + ":$PATH; ")
	marker := filepath.Join(t.TempDir(), "ran")
	out, _, err := run(c, context.Background(), "true\ntouch "+marker+"\necho second-line\n")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "copy script into guest failed")
	require.NotContains(t, out, "second-line")
	require.NoFileExists(t, marker, "half a script must not run")
}

func TestScriptKilledBySignalIsBuildFailure(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	_, _, err := run(c, context.Background(), "kill -SEGV $$\n")
	code, ok := exitcodes.ScriptCode(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, 128+11, code)
}

func TestCancelKillsRemoteProcessGroup(t *testing.T) {
	eachLoginShell(t, testCancelKillsRemoteProcessGroup)
}

func testCancelKillsRemoteProcessGroup(t *testing.T, ts *sshtest.Server) {
	c := dial(t, target(ts))
	marker := filepath.Join(t.TempDir(), "child.pid")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	script := fmt.Sprintf("#!/usr/bin/env bash\ntrap exit 1 TERM\nsleep 300 &\necho $! > %s\necho started\nwait\n", marker)
	seen := cancelOnceWritten(ctx, marker, cancel)
	start := time.Now()
	_, _, err := run(c, ctx, script)
	require.NoError(t, <-seen)
	require.Error(t, err)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "a cancel is never the script's failure: %v", err)
	require.Less(t, time.Since(start), 10*time.Second)
	b, err := os.ReadFile(marker)
	require.NoError(t, err)
	pid := strings.TrimSpace(string(b))
	require.Eventually(t, func() bool {
		_, err := os.Stat("/proc/" + pid)
		return os.IsNotExist(err)
	}, 5*time.Second, 50*time.Millisecond, "background child %s of the script must be gone", pid)
}

func TestCancelEscalatesToKill(t *testing.T) {
	eachLoginShell(t, testCancelEscalatesToKill)
}

func testCancelEscalatesToKill(t *testing.T, ts *sshtest.Server) {
	c := dial(t, target(ts))
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err := run(c, ctx, "trap '' TERM\nwhile true; do sleep 0.1; done\n")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.Less(t, time.Since(start), 8*time.Second, "SIGKILL after the grace period")
}

func TestConnectionDroppedMidStreamIsSystemFailure(t *testing.T) {
	ts := sshtest.Start(t)
	ts.DropOn("DROP-NOW")
	c := dial(t, target(ts))
	out, _, err := run(c, context.Background(), "echo before\nsleep 0.2\necho DROP-NOW\nsleep 5\nexit 1\n")
	require.Contains(t, out, "before")
	require.Error(t, err)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "connection to guest lost")
}

func TestFrozenGuestDetectedByKeepalive(t *testing.T) {
	ts := sshtest.Start(t)
	tg := target(ts)
	tg.KeepaliveInterval, tg.KeepaliveCount = 100*time.Millisecond, 3
	c := dial(t, tg)
	ts.Freeze(true)
	// The guest stops answering keepalives while a long script "runs".
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	_, _, err := run(c, ctx, "sleep 15\n")
	took := time.Since(start)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorIs(t, err, ErrDeadGuest)
	require.Less(t, took, 5*time.Second, "noticed within the keepalive bound, not at the job timeout")
}

func TestHostKeyMismatchSendsNothing(t *testing.T) {
	ts := sshtest.Start(t)
	tg := target(ts)
	tg.HostKey = sshtest.NewSigner(t).PublicKey()
	_, err := Dial(context.Background(), tg)
	require.ErrorIs(t, err, ErrHostKeyMismatch)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _, err = WaitReady(ctx, tg, 20*time.Millisecond, 100*time.Millisecond)
	require.ErrorIs(t, err, ErrHostKeyMismatch)
	require.ErrorContains(t, err, "refusing to send anything")
	require.Empty(t, ts.Commands(), "no command reached the impostor")
}

func TestNoPinnedKeyIsRefused(t *testing.T) {
	ts := sshtest.Start(t)
	tg := target(ts)
	tg.HostKey = nil
	_, err := Dial(context.Background(), tg)
	require.ErrorContains(t, err, "no pinned host key")
	tg.InsecureIgnoreHostKey = true
	c, err := Dial(context.Background(), tg)
	require.NoError(t, err)
	_ = c.Close()
}

func TestAuthFailureAndWaitReadyTimeout(t *testing.T) {
	ts := sshtest.Start(t)
	tg := target(ts)
	tg.Signer = sshtest.NewSigner(t)
	// Long enough for several handshakes on a loaded CI machine (-race, all
	// packages at once); the guest's real answer must be what is reported.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, attempts, err := WaitReady(ctx, tg, 20*time.Millisecond, time.Second)
	require.Error(t, err)
	require.ErrorContains(t, err, "unable to authenticate")
	require.Greater(t, attempts, 2, "retried at a short interval")
}

func TestWaitReadyRetriesUntilServerUp(t *testing.T) {
	ts := sshtest.Start(t)
	tg := target(ts)
	// Point at a port with nothing listening, then at the server: the
	// retry loop must keep going on "connection refused".
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, attempts, err := WaitReady(ctx, tg, 20*time.Millisecond, time.Second)
	require.NoError(t, err)
	require.Equal(t, 1, attempts)
	_ = c.Close()

	tg.Addr = "127.0.0.1:1"
	ctx2, cancel2 := context.WithTimeout(context.Background(), time.Second)
	defer cancel2()
	_, attempts, err = WaitReady(ctx2, tg, 20*time.Millisecond, time.Second)
	require.ErrorContains(t, err, "connection refused")
	require.Greater(t, attempts, 2)
}

func TestOutput(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	out, err := c.Output(context.Background(), "echo hi")
	require.NoError(t, err)
	require.Equal(t, "hi\n", string(out))
	_, err = c.Output(context.Background(), "echo nope >&2; exit 4")
	require.ErrorContains(t, err, `exit status 4: "nope"`)
}

// A guest without setsid: the script runs in the session shell's process
// group. A cancel still stops it and what it started (the group of the
// session shell), and a leftover cannot hold the stage open; leftovers of a
// normal end are not stopped (docs/images.md).
func TestWithoutSetsid(t *testing.T) {
	ts := sshtest.Start(t)
	bin := t.TempDir()
	for _, tool := range []string{"bash", "cat", "wc", "mkfifo", "mv", "rm", "sleep", "env"} {
		p, err := exec.LookPath(tool)
		require.NoError(t, err)
		require.NoError(t, os.Symlink(p, filepath.Join(bin, tool)))
	}
	ts.SetPrefix("PATH=" + bin + "; ")
	c := dial(t, target(ts))

	pidfile := filepath.Join(t.TempDir(), "bg.pid")
	start := time.Now()
	out, _, err := run(c, context.Background(), fmt.Sprintf("sleep 300 &\necho $! > %s\necho started\n", pidfile))
	require.NoError(t, err)
	require.Contains(t, out, "started")
	require.Less(t, time.Since(start), 6*time.Second, "the stage ends on time without setsid too")
	left := readPid(t, pidfile)
	defer func() {
		if p, err := os.FindProcess(mustAtoi(t, left)); err == nil {
			_ = p.Kill()
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	marker := filepath.Join(t.TempDir(), "child.pid")
	seen := cancelOnceWritten(ctx, marker, cancel)
	_, _, err = run(c, ctx, fmt.Sprintf("sleep 300 &\necho $! > %s\nwait\n", marker))
	require.NoError(t, <-seen)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.NotContains(t, err.Error(), "stopping it in the guest failed")
	pid := readPid(t, marker)
	require.Eventually(t, func() bool { return !pidAlive(pid) }, 5*time.Second, 20*time.Millisecond,
		"a cancel stops the script's children without setsid too")
}

// Probe wants an SSH version line and reads at most a few lines of junk
// before it; ProbeTCP only wants the connection.
func TestProbe(t *testing.T) {
	serve := func(greeting string) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		t.Cleanup(func() { _ = ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go func() {
					defer c.Close()
					_, _ = io.WriteString(c, greeting) // then EOF: what was sent is all there is
				}()
			}
		}()
		return ln.Addr().String()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, Probe(ctx, serve("SSH-2.0-OpenSSH_9.2\r\n")))
	require.NoError(t, Probe(ctx, serve("hello\r\nSSH-2.0-x\r\n")), "lines before the version line are allowed")
	require.Error(t, Probe(ctx, serve("HTTP/1.0 200 OK\r\n\r\n")))
	require.Error(t, Probe(ctx, serve(strings.Repeat("x", 100000))), "an endless line is cut off")
	require.NoError(t, ProbeTCP(ctx, serve("")))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	require.Error(t, ProbeTCP(ctx, addr), "nothing listens")
	require.Error(t, Probe(ctx, addr))
}

// The client offers ChaCha20-Poly1305 first (2x faster than AES-GCM in a
// guest without AES-NI, e.g. under TCG) and only ciphers x/crypto supports
// and does not list as insecure.
func TestCipherPreference(t *testing.T) {
	signer, err := ssh.NewSignerFromKey(ed25519.NewKeyFromSeed(make([]byte, ed25519.SeedSize)))
	require.NoError(t, err)
	cfg, err := Target{User: "u", Signer: signer, InsecureIgnoreHostKey: true}.config()
	require.NoError(t, err)
	require.Equal(t, ssh.CipherChaCha20Poly1305, cfg.Ciphers[0])
	supported := ssh.SupportedAlgorithms().Ciphers
	for _, c := range cfg.Ciphers {
		require.Contains(t, supported, c)
	}
}
