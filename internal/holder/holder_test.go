package holder

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// rig is a holder serving an sshtest server (commands run on this host).
type rig struct {
	ts     *sshtest.Server
	sock   string
	cancel context.CancelFunc
	done   chan error
	alive  atomic.Bool
	dials  atomic.Int32
	// firstGone is closed when the holder's first connection has ended.
	firstGone chan struct{}
}

// agentEnv names the agent binary every holder of this test binary
// starts in its guest (TestHolderTestsThroughTheAgent sets it for the run
// it starts).
const agentEnv = "LVE_HOLDER_TEST_AGENT"

func startHolder(t *testing.T, tune func(*sshexec.Target)) *rig {
	t.Helper()
	return startHolderWith(t, tune, "")
}

// startHolderWith is startHolder whose holder starts the agent with
// agentCommand ("": as agentEnv says).
func startHolderWith(t *testing.T, tune func(*sshexec.Target), agentCommand string) *rig {
	t.Helper()
	r := &rig{ts: sshtest.Start(t), done: make(chan error, 1), firstGone: make(chan struct{})}
	r.alive.Store(true)
	dir, err := os.MkdirTemp("", "lveh")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	r.sock = Socket(dir)
	ln, err := net.Listen("unix", r.sock)
	require.NoError(t, err)
	tg := sshexec.Target{Addr: r.ts.Addr(), User: "root", Signer: r.ts.ClientSigner(), HostKey: r.ts.HostKey(),
		KeepaliveInterval: time.Second, KeepaliveCount: 10}
	if tune != nil {
		tune(&tg)
	}
	s := &Server{
		Dial: func(ctx context.Context) (*sshexec.Client, error) {
			n := r.dials.Add(1)
			c, err := sshexec.Dial(ctx, tg)
			if err == nil && n == 1 {
				go func() { _ = c.Wait(); close(r.firstGone) }()
			}
			return c, err
		},
		Alive:        r.alive.Load,
		CheckEvery:   50 * time.Millisecond,
		AgentCommand: agentCommand,
	}
	if agentCommand == "" {
		if bin := os.Getenv(agentEnv); bin != "" {
			s.AgentCommand = "exec " + sshexec.ShellQuote(bin)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.done <- s.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-r.done:
			require.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Error("the holder did not end")
		}
	})
	return r
}

func (r *rig) stage(ctx context.Context, script string) (out string, stopInGuest bool, err error) {
	var stdout, errb sshtest.Buffer
	tag, _ := sshexec.NewTag()
	stopInGuest, err = RunStage(ctx, r.sock, Stage{Tag: tag, Shell: "bash", Script: []byte(script), Stdout: &stdout, Stderr: &errb, KillGrace: 2 * time.Second})
	return stdout.String(), stopInGuest, err
}

func TestStagesShareOneConnection(t *testing.T) {
	r := startHolder(t, nil)
	for i, code := range []int{0, 3, 0, 42} {
		out, stopInGuest, err := r.stage(context.Background(), fmt.Sprintf("echo stage %d\necho to-stderr >&2\nexit %d\n", i, code))
		require.False(t, stopInGuest)
		require.Equal(t, fmt.Sprintf("stage %d\nto-stderr\n", i), out, "output in order, stderr merged as with a direct connection")
		if code == 0 {
			require.NoError(t, err)
			continue
		}
		got, ok := exitcodes.ScriptCode(err)
		require.True(t, ok, "a script's exit is a build failure: %v", err)
		require.Equal(t, code, got)
	}
	require.Equal(t, 1, r.ts.Logins(), "four stages, one SSH login")
	require.EqualValues(t, 1, r.dials.Load())
}

func TestLargeScriptAndOutput(t *testing.T) {
	r := startHolder(t, nil)
	big := strings.Repeat("x", 1<<20)
	out, _, err := r.stage(context.Background(), "# "+big+"\nhead -c 3000000 /dev/zero | tr '\\0' y\n")
	require.NoError(t, err)
	require.Len(t, out, 3000000)
}

func TestCancelStopsTheScriptInTheGuest(t *testing.T) {
	r := startHolder(t, nil)
	marker := filepath.Join(t.TempDir(), "child.pid")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	seen := make(chan error, 1)
	go func() { seen <- waitFile(ctx, marker); cancel() }()
	start := time.Now()
	_, stopInGuest, err := r.stage(ctx, fmt.Sprintf("sleep 300 &\necho $! > %s\nwait\n", marker))
	require.NoError(t, <-seen)
	require.False(t, stopInGuest)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "a cancel is never the script's failure: %v", err)
	require.Less(t, time.Since(start), 10*time.Second)
	requireGone(t, marker)
}

func TestStageProcessGoneStopsTheScript(t *testing.T) {
	r := startHolder(t, nil)
	marker := filepath.Join(t.TempDir(), "child.pid")
	conn, err := net.Dial("unix", r.sock)
	require.NoError(t, err)
	tag, _ := sshexec.NewTag()
	require.NoError(t, writeRequest(conn, Request{Version: protocolVersion, Tag: tag, Shell: "bash",
		Script: []byte(fmt.Sprintf("sleep 300 &\necho $! > %s\nwait\n", marker)), KillGrace: time.Second}))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, waitFile(ctx, marker))
	require.NoError(t, conn.Close()) // as if the run stage were SIGKILLed
	requireGone(t, marker)
}

func TestNoHolderIsUnavailable(t *testing.T) {
	dir := t.TempDir()
	stopInGuest, err := RunStage(context.Background(), Socket(dir), Stage{Script: []byte("true")})
	require.ErrorIs(t, err, ErrUnavailable)
	require.False(t, stopInGuest)
	// A socket left by a holder that died between stages.
	ln, err := net.Listen("unix", Socket(dir))
	require.NoError(t, err)
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, ln.Close())
	stopInGuest, err = RunStage(context.Background(), Socket(dir), Stage{Script: []byte("true")})
	require.ErrorIs(t, err, ErrUnavailable)
	require.False(t, stopInGuest)
}

func TestHolderThatCannotConnectIsUnavailable(t *testing.T) {
	r := startHolder(t, func(tg *sshexec.Target) { tg.HostKey = sshtest.NewSigner(t).PublicKey() })
	_, stopInGuest, err := r.stage(context.Background(), "true\n")
	require.ErrorIs(t, err, ErrUnavailable, "nothing ran: the stage may connect directly")
	require.ErrorContains(t, err, "host key mismatch")
	require.False(t, stopInGuest)
	require.Empty(t, r.ts.Commands())
}

func TestHolderDyingMidStageIsSystemFailure(t *testing.T) {
	sock := fakeHolder(t, func(c net.Conn) {
		_, _, _ = readFrame(c, 1<<20)
		_ = writeFrame(c, frameStarted, nil)
		_ = writeFrame(c, frameStdout, []byte("half"))
		_ = c.Close() // SIGKILLed after it started the stage
	})
	var out sshtest.Buffer
	stopInGuest, err := RunStage(context.Background(), sock, Stage{Tag: "0123456789abcdef", Script: []byte("true"), Stdout: &out})
	require.True(t, stopInGuest, "the caller must stop the script in the guest itself")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.NotErrorIs(t, err, ErrUnavailable, "it may have run: never retried as if it had not")
	require.Equal(t, "half", out.String())
}

// A holder that ends after it read the request but before it said it
// starts the script (it was still connecting; it was stopped): nothing ran,
// and the stage may connect directly.
func TestHolderEndingBeforeItStartedIsUnavailable(t *testing.T) {
	sock := fakeHolder(t, func(c net.Conn) {
		_, _, _ = readFrame(c, 1<<20)
		_ = c.Close()
	})
	stopInGuest, err := RunStage(context.Background(), sock, Stage{Tag: "0123456789abcdef", Script: []byte("true")})
	require.ErrorIs(t, err, ErrUnavailable)
	require.False(t, stopInGuest)
}

// A holder that does not read: the stage's cancel still ends it (a large
// script fills the socket's buffer).
func TestCancelWhileTheHolderDoesNotRead(t *testing.T) {
	dir := t.TempDir()
	ln, err := net.Listen("unix", Socket(dir))
	require.NoError(t, err)
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = RunStage(ctx, Socket(dir), Stage{Tag: "0123456789abcdef", Script: make([]byte, 8<<20), KillGrace: time.Second})
	require.Error(t, err)
	require.Less(t, time.Since(start), 15*time.Second, "bounded by the cancel")
	select {
	case c := <-accepted:
		_ = c.Close()
	default:
	}
}

func TestDeadGuestFailsTheNextStageFast(t *testing.T) {
	r := startHolder(t, func(tg *sshexec.Target) { tg.KeepaliveInterval, tg.KeepaliveCount = 100*time.Millisecond, 3 })
	_, _, err := r.stage(context.Background(), "true\n")
	require.NoError(t, err)
	r.ts.Freeze(true) // the guest dies while only the holder is connected
	select {          // the holder's keepalive declares the frozen guest dead and closes the connection
	case <-r.firstGone:
	case <-time.After(10 * time.Second):
		t.Fatal("the holder's connection to a frozen guest did not end")
	}
	start := time.Now()
	_, stopInGuest, err := r.stage(context.Background(), "true\n")
	require.False(t, stopInGuest)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "stopped answering SSH keepalives")
	require.Less(t, time.Since(start), 3*time.Second, "no new connect timeout to wait for")
}

func TestLostConnectionIsMadeAgain(t *testing.T) {
	r := startHolder(t, nil)
	r.ts.DropOn("DROP-NOW")
	_, _, err := r.stage(context.Background(), "echo DROP-NOW\nsleep 5\n")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	r.ts.DropOn("")
	out, _, err := r.stage(context.Background(), "echo again\n")
	require.NoError(t, err)
	require.Equal(t, "again\n", out)
	require.EqualValues(t, 2, r.dials.Load())
}

func TestHolderEndsWithItsMachine(t *testing.T) {
	r := startHolder(t, nil)
	r.alive.Store(false)
	select {
	case err := <-r.done:
		require.NoError(t, err)
		r.done <- err // for the cleanup
	case <-time.After(5 * time.Second):
		t.Fatal("the holder outlived its machine")
	}
	_, _, err := r.stage(context.Background(), "true\n")
	require.ErrorIs(t, err, ErrUnavailable)
}

func TestBadRequestsAreRefused(t *testing.T) {
	r := startHolder(t, nil)
	conn, err := net.Dial("unix", r.sock)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, writeRequest(conn, Request{Version: 99, Script: []byte("touch /tmp/never")}))
	kind, b, err := readFrame(conn, maxControl)
	require.NoError(t, err)
	require.Equal(t, frameResult, kind)
	require.Contains(t, string(b), classUnavailable)
	// An oversized frame header is refused without reading it.
	conn2, err := net.Dial("unix", r.sock)
	require.NoError(t, err)
	defer conn2.Close()
	_, err = conn2.Write([]byte{frameRequest, 0xff, 0xff, 0xff, 0xff})
	require.NoError(t, err)
	_ = conn2.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, _, err = readFrame(conn2, maxControl)
	require.Error(t, err, "the holder closes the connection")
	require.Empty(t, r.ts.Commands())
}

func TestStartRecordsAndStopProvesTheProcess(t *testing.T) {
	dir := t.TempDir()
	sleep, err := exec.LookPath("sleep")
	require.NoError(t, err)
	pid, err := Start(dir, sleep, []string{"300"}, nil)
	require.NoError(t, err)
	require.Equal(t, pid, Running(dir))
	fi, err := os.Stat(Socket(dir))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "owner-only socket")
	// Its own session: not in the caller's process group.
	pgid, err := syscall.Getpgid(pid)
	require.NoError(t, err)
	require.Equal(t, pid, pgid)

	// A record naming the pid with another start time (a reused pid) is
	// not that process: never signalled.
	require.NoError(t, os.WriteFile(filepath.Join(dir, PidFile), []byte(fmt.Sprintf("%d 1\n", pid)), 0o600))
	require.Zero(t, Running(dir))
	require.False(t, Stop(dir))
	require.NoError(t, syscall.Kill(pid, 0), "a process not proven to be the holder is left alone")

	start, _, err := startTime(pid)
	require.NoError(t, err)
	require.NoError(t, writePid(dir, pid, start))
	require.True(t, Stop(dir))
	require.Zero(t, Running(dir))
	require.NoFileExists(t, Socket(dir))
	require.NoFileExists(t, filepath.Join(dir, PidFile))
}

func TestStartRefusesTooLongSocketPath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 120))
	require.NoError(t, os.MkdirAll(dir, 0o700))
	_, err := Start(dir, "/bin/true", nil, nil)
	require.ErrorContains(t, err, "unix socket allows")
}

// fakeHolder listens on a holder socket of a fresh directory and hands the
// first connection to serve (a holder that misbehaves in a given way).
func fakeHolder(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	sock := Socket(t.TempDir())
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		if c, err := ln.Accept(); err == nil {
			serve(c)
		}
	}()
	return sock
}

// waitFile waits until path holds something, or ctx ends (an error).
func waitFile(ctx context.Context, path string) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s was never written (%w)", path, context.Cause(ctx))
		case <-tick.C:
		}
	}
}

func requireGone(t *testing.T, pidFile string) {
	t.Helper()
	b, err := os.ReadFile(pidFile)
	require.NoError(t, err)
	pid := strings.TrimSpace(string(b))
	require.Eventually(t, func() bool {
		_, err := os.Stat("/proc/" + pid)
		return errors.Is(err, os.ErrNotExist)
	}, 10*time.Second, 50*time.Millisecond, "the script's background child %s must be stopped", pid)
}

// A stream: input in, output out, over the held connection.
func TestStreamOverTheHeldConnection(t *testing.T) {
	r := startHolder(t, nil)
	var out sshtest.Buffer
	big := strings.Repeat("z", 3<<20)
	err := RunStream(context.Background(), r.sock, "tr z y", strings.NewReader(big), &out)
	require.NoError(t, err)
	require.Equal(t, strings.Repeat("y", 3<<20), out.String())
	// A stage after it shares the connection.
	o, _, err := r.stage(context.Background(), "echo after\n")
	require.NoError(t, err)
	require.Equal(t, "after\n", o)
	require.EqualValues(t, 1, r.dials.Load())
	// A command that fails is the driver's failure, not a script's.
	err = RunStream(context.Background(), r.sock, "exit 3", strings.NewReader(""), &out)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
}

// A stream whose connection drops reports it as lost (the caller may
// reconnect), and the next stream gets a new connection.
func TestStreamLostConnection(t *testing.T) {
	r := startHolder(t, nil)
	r.ts.DropOn("DROP-NOW")
	pr, pw := io.Pipe()
	defer func() { _ = pw.Close() }()
	var out sshtest.Buffer
	err := RunStream(context.Background(), r.sock, "echo DROP-NOW; cat", pr, &out)
	require.ErrorIs(t, err, sshexec.ErrConnectionLost)
	r.ts.DropOn("")
	err = RunStream(context.Background(), r.sock, "cat", strings.NewReader("again"), &out)
	require.NoError(t, err)
	require.Contains(t, out.String(), "again")
	require.EqualValues(t, 2, r.dials.Load())
}

// A dead guest is a lost connection with the keepalive's verdict.
func TestStreamDeadGuest(t *testing.T) {
	r := startHolder(t, func(tg *sshexec.Target) { tg.KeepaliveInterval, tg.KeepaliveCount = 100*time.Millisecond, 3 })
	pr, pw := io.Pipe()
	defer func() { _ = pw.Close() }()
	done := make(chan error, 1)
	go func() { done <- RunStream(context.Background(), r.sock, "cat", pr, io.Discard) }()
	_, err := pw.Write([]byte("x"))
	require.NoError(t, err)
	r.ts.Freeze(true)
	select {
	case err := <-done:
		require.ErrorIs(t, err, sshexec.ErrDeadGuest)
		require.ErrorIs(t, err, sshexec.ErrConnectionLost)
	case <-time.After(10 * time.Second):
		t.Fatal("a stream to a frozen guest did not end")
	}
}

// Cancelling a stream ends its command; a holder that is gone is
// unavailable before anything started.
func TestStreamCancelAndUnavailable(t *testing.T) {
	r := startHolder(t, nil)
	pr, pw := io.Pipe()
	defer func() { _ = pw.Close() }()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- RunStream(ctx, r.sock, "cat", pr, io.Discard) }()
	_, err := pw.Write([]byte("x"))
	require.NoError(t, err)
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(10 * time.Second):
		t.Fatal("a cancelled stream did not end")
	}
	err = RunStream(context.Background(), filepath.Join(t.TempDir(), "none.sock"), "cat", strings.NewReader(""), io.Discard)
	require.ErrorIs(t, err, ErrUnavailable)
}
