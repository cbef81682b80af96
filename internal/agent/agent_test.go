package agent

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/agenttest"
)

// agentBin is cmd/lve-agent, built static once for the package's tests:
// they run it as the guest does, a process speaking on stdin and stdout.
var agentBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "lve-agent-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if agentBin, err = agenttest.Build(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// running is an agent process and its client.
type running struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *os.File
	c      *Client
	exited chan struct{} // closed once the agent has exited, with err
	err    error
}

func startAgent(t *testing.T) *running {
	t.Helper()
	cmd := exec.Command(agentBin)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	// Not StdoutPipe: Wait closes that once the agent exits, maybe before
	// the client has read the agent's last frames.
	stdout, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = stdout.Close() })
	cmd.Stdout, cmd.Stderr = w, os.Stderr
	require.NoError(t, cmd.Start())
	require.NoError(t, w.Close())
	a := &running{cmd: cmd, stdin: stdin, exited: make(chan struct{})}
	go func() { a.err = cmd.Wait(); close(a.exited) }()
	t.Cleanup(func() {
		_ = stdin.Close()
		select {
		case <-a.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			t.Error("the agent did not exit when its channel ended")
		}
	})
	a.stdout = stdout
	a.c, err = NewClient(context.Background(), stdout, stdin, nil)
	require.NoError(t, err)
	require.Equal(t, cmd.Process.Pid, a.c.Hello().PID)
	return a
}

// shells are the guest shells the agent must serve: bash, dash and
// busybox's ash (by a link named ash), where the host has them.
func shells(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, s := range []string{"bash", "dash"} {
		if p, err := exec.LookPath(s); err == nil {
			out[s] = p
		}
	}
	if bb, err := exec.LookPath("busybox"); err == nil {
		link := filepath.Join(t.TempDir(), "ash")
		require.NoError(t, os.Symlink(bb, link))
		out["ash"] = link
	}
	require.Contains(t, out, "bash", "bash is needed")
	if os.Getenv("LVE_REQUIRE_SHELLS") != "" {
		require.Len(t, out, 3, "bash, dash and busybox are required (LVE_REQUIRE_SHELLS): %v", out)
	}
	return out
}

// run runs script on a and returns its exit, output and notes.
func run(t *testing.T, a *running, shell, script string, o RunOptions) (Exit, string, string) {
	t.Helper()
	var out, notes syncBuffer
	o.Shell, o.Output, o.Notes = shell, &out, &notes
	x, err := a.c.Run(context.Background(), []byte(script), o)
	require.NoError(t, err)
	require.Positive(t, x.Seq)
	x.Seq = 0 // compared without it
	return x, out.String(), notes.String()
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// gone waits (up to 5 s) until process pid has ended (gone or a zombie).
func gone(pid int) bool {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			return true
		}
		if f := strings.Fields(string(b)); len(f) > 2 && f[2] == "Z" {
			return true
		}
	}
	return false
}

func pidsIn(t *testing.T, file string) []int {
	t.Helper()
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		n, err := strconv.Atoi(f)
		require.NoError(t, err)
		pids = append(pids, n)
	}
	return pids
}

// Every shell, stage after stage on one agent (as in a job): output in
// order with stderr merged, exit codes and signals as wait reports them,
// stdin closed, 4 MiB of output exact, the script read from a pipe by name
// (no file) that nothing the script starts inherits, plain background
// processes and nohup ending with the stage while a setsid service lives
// on, a detached writer that holds the output not holding the stage.
func TestStagesOnEveryShell(t *testing.T) {
	for name, sh := range shells(t) {
		t.Run(name, func(t *testing.T) {
			a := startAgent(t)
			dir := t.TempDir()

			x, out, _ := run(t, a, sh, "echo a; echo b >&2; echo c; printf d >&2; printf e\n", RunOptions{})
			require.Equal(t, Exit{}, x)
			require.Equal(t, "a\nb\nc\nde", out)

			for script, want := range map[string]Exit{
				"exit 42":        {Code: 42},
				"false":          {Code: 1},
				"exit 255":       {Code: 255},
				"kill -TERM $$":  {Code: 143, Signal: "TERM"},
				"kill -KILL $$":  {Code: 137, Signal: "KILL"},
				"kill -USR1 $$":  {Code: 138, Signal: "USR1"},
				"echo ok; true ": {},
			} {
				x, _, _ := run(t, a, sh, script, RunOptions{})
				require.Equal(t, want, x, script)
			}

			x, out, _ = run(t, a, sh, "if read x; then echo got \"$x\"; else echo eof; fi; cat; echo after", RunOptions{})
			require.Equal(t, Exit{}, x)
			require.Equal(t, "eof\nafter\n", out, "stdin is closed")

			x, out, _ = run(t, a, sh, "head -c 4194304 /dev/zero | tr '\\0' x; echo; echo end >&2", RunOptions{})
			require.Equal(t, Exit{}, x)
			require.Equal(t, strings.Repeat("x", 4<<20)+"\nend\n", out)

			// $0 is the agent's pipe; a child of the script has stdin,
			// stdout, stderr and nothing else (ls's own directory aside)
			x, out, _ = run(t, a, sh, `echo "$0"; ls /proc/self/fd | tr '\n' ' '`, RunOptions{})
			require.Equal(t, Exit{}, x)
			lines := strings.SplitN(out, "\n", 2)
			require.Regexp(t, `^/proc/`+strconv.Itoa(a.c.Hello().PID)+`/fd/[0-9]+$`, lines[0])
			require.Equal(t, "0 1 2 3 ", lines[1], "what a child of the script has open")

			// leftovers: plain & and nohup end with the stage, setsid lives
			// (once it has detached: the script waits for its session of
			// its own; one still on its way when the script ends is in the
			// stage's group, and goes with it)
			pids := filepath.Join(dir, "pids")
			service := filepath.Join(dir, "service")
			x, out, notes := run(t, a, sh, fmt.Sprintf(`sleep 1000 & echo $! > %[1]s
nohup sleep 1000 > /dev/null 2>&1 & echo $! >> %[1]s
setsid sleep 1000 < /dev/null > /dev/null 2>&1 & s=$!; echo $s > %[2]s
while [ "$(cut -d' ' -f6 /proc/$s/stat)" != "$s" ]; do sleep 0.01; done
echo started`, pids, service), RunOptions{LeftoverGrace: time.Second})
			require.Equal(t, Exit{}, x)
			require.Equal(t, "started\n", out)
			require.Contains(t, notes, "stopping the processes it left running")
			for _, pid := range pidsIn(t, pids) {
				require.True(t, gone(pid), "process %d of the stage's group outlived it", pid)
			}
			svc := pidsIn(t, service)[0]
			t.Cleanup(func() { _ = syscall.Kill(svc, syscall.SIGKILL) })
			require.NoError(t, syscall.Kill(svc, 0), "the setsid service died with the stage")

			// a detached writer that keeps the output open: the stage
			// ends after the drain grace without it, saying so
			writer := filepath.Join(dir, "writer")
			t0 := time.Now()
			// (The stage waits for the writer's first tick: on a loaded host
			// the writer may not have run at all within a fixed wait.)
			x, out, notes = run(t, a, sh, fmt.Sprintf(`setsid sh -c 'echo $$ > %[1]s; while :; do echo tick; : > %[1]s.ticked; sleep 0.05; done' &
until [ -e %[1]s.ticked ]; do sleep 0.01; done; echo done`, writer), RunOptions{DrainGrace: 300 * time.Millisecond})
			require.Less(t, time.Since(t0), 5*time.Second)
			require.True(t, x.Detached, "%+v", x)
			require.Equal(t, 0, x.Code)
			require.Contains(t, out, "tick\n")
			require.Contains(t, out, "done\n")
			require.Contains(t, notes, "a detached process still writes to the stage's output")
			w := pidsIn(t, writer)[0]
			require.NoError(t, syscall.Kill(w, syscall.SIGKILL))

			// the next stage is not disturbed by the detached writer's output
			x, out, _ = run(t, a, sh, "echo next", RunOptions{})
			require.Equal(t, Exit{}, x)
			require.Equal(t, "next\n", out)
		})
	}
}

// readyWriter signals once the output holds "ready".
type readyWriter struct {
	syncBuffer
	once  sync.Once
	ready chan struct{}
}

func (r *readyWriter) Write(p []byte) (int, error) {
	n, err := r.syncBuffer.Write(p)
	if strings.Contains(r.String(), "ready") {
		r.once.Do(func() { close(r.ready) })
	}
	return n, err
}

// A cancel: SIGTERM to the script's group (a trap runs), SIGKILL after
// the grace for a script that ignores it; the agent serves the next stage.
func TestCancel(t *testing.T) {
	for name, sh := range shells(t) {
		t.Run(name, func(t *testing.T) {
			a := startAgent(t)
			for _, tc := range []struct {
				script string
				grace  time.Duration
				want   Exit
				out    string
			}{
				// (the shell may report its killed sleep: "Terminated")
				{"trap 'echo trapped; exit 7' TERM; echo ready; while :; do sleep 0.05; done", 5 * time.Second, Exit{Code: 7, Cancelled: true}, "trapped\n"},
				{"trap '' TERM; echo ready; while :; do sleep 0.05; done", 300 * time.Millisecond, Exit{Code: 137, Signal: "KILL", Cancelled: true}, ""},
			} {
				ctx, cancel := context.WithCancel(context.Background())
				out := &readyWriter{ready: make(chan struct{})}
				go func() {
					select {
					case <-out.ready:
					case <-time.After(10 * time.Second):
					}
					cancel()
				}()
				x, err := a.c.Run(ctx, []byte(tc.script), RunOptions{Shell: sh, Output: out, KillGrace: tc.grace, LeftoverGrace: 200 * time.Millisecond})
				cancel()
				require.NoError(t, err)
				x.Seq = 0
				require.Equal(t, tc.want, x, tc.script)
				require.True(t, strings.HasPrefix(out.String(), "ready\n") && strings.HasSuffix(out.String(), tc.out), "%q", out.String())
			}
			x, out, _ := run(t, a, sh, "echo after", RunOptions{})
			require.Equal(t, Exit{}, x)
			require.Equal(t, "after\n", out)
		})
	}
}

// The channel's end (the job's connection gone) stops the running stage,
// its group included, and the agent exits; a script that has not arrived
// whole never runs.
func TestChannelEnd(t *testing.T) {
	dir := t.TempDir()
	a := startAgent(t)
	pids := filepath.Join(dir, "pids")
	out := &readyWriter{ready: make(chan struct{})}
	result := make(chan error, 1)
	var x Exit
	go func() {
		var err error
		x, err = a.c.Run(context.Background(), []byte(fmt.Sprintf("sleep 1000 & echo $! > %s; echo $$ >> %s; echo ready; wait", pids, pids)),
			RunOptions{Shell: "/bin/sh", Output: out})
		result <- err
	}()
	select {
	case <-out.ready:
	case <-time.After(10 * time.Second):
		t.Fatal("the stage did not start")
	}
	require.NoError(t, a.stdin.Close())
	select {
	case <-a.exited:
		require.NoError(t, a.err, "the agent exits cleanly when its channel ends")
	case <-time.After(15 * time.Second):
		t.Fatal("the agent did not exit")
	}
	require.NoError(t, <-result, "the host's half closed: the agent still says how the stage ended")
	require.True(t, x.Cancelled, "%+v", x)
	for _, pid := range pidsIn(t, pids) {
		require.True(t, gone(pid), "process %d outlived the channel", pid)
	}
	_, err := a.c.Run(context.Background(), []byte("true"), RunOptions{Shell: "/bin/sh"})
	require.ErrorIs(t, err, ErrGone, "nothing runs once the agent is gone")

	// half a script
	marker := filepath.Join(dir, "ran")
	cmd := exec.Command(agentBin)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	cmd.Stdout = io.Discard
	require.NoError(t, cmd.Start())
	script := []byte("touch " + marker + "\n" + strings.Repeat("#", 1000))
	require.NoError(t, writeJSON(stdin, frameStart, Start{Shell: "/bin/sh", ScriptSize: len(script)}))
	require.NoError(t, writeFrame(stdin, frameScript, script[:len(script)/2]))
	require.NoError(t, stdin.Close())
	require.NoError(t, cmd.Wait())
	_, err = os.Stat(marker)
	require.True(t, errors.Is(err, os.ErrNotExist), "half a script ran")
}

// What the agent sends is bounded and checked: an oversized frame, an
// unknown one, an exit status out of range, a protocol of another
// version, silence — each an error, never a script's result.
func TestClientRefusesHostileAgent(t *testing.T) {
	hello := func(w io.Writer, proto int) { _ = writeJSON(w, frameHello, Hello{Protocol: proto}) }
	cases := map[string]func(w io.Writer){
		"oversized output": func(w io.Writer) {
			var hdr [5]byte
			hdr[0] = frameOutput
			binary.BigEndian.PutUint32(hdr[1:], 1<<30)
			_, _ = w.Write(hdr[:])
		},
		"unknown frame":  func(w io.Writer) { _ = writeFrame(w, 'Z', nil) },
		"oversized note": func(w io.Writer) { _ = writeFrame(w, frameNote, bytes.Repeat([]byte("n"), maxControl+1)) },
		"oversized refusal": func(w io.Writer) {
			_ = writeFrame(w, frameError, bytes.Repeat([]byte("e"), maxControl+1))
		},
		"another stage's exit":    func(w io.Writer) { _ = writeJSON(w, frameExit, Exit{Seq: 7}) },
		"another stage's refusal": func(w io.Writer) { _ = writeJSON(w, frameError, Refusal{Seq: 7, Reason: "x"}) },
		"exit 300":                func(w io.Writer) { _ = writeJSON(w, frameExit, Exit{Seq: 1, Code: 300}) },
		"exit not json":           func(w io.Writer) { _ = writeFrame(w, frameExit, []byte("{")) },
		"hello again":             func(w io.Writer) { hello(w, Protocol) },
		"channel closes":          func(w io.Writer) {},
	}
	for name, send := range cases {
		t.Run(name, func(t *testing.T) {
			fromAgent, agentOut := io.Pipe()
			go func() {
				hello(agentOut, Protocol)
				send(agentOut)
				_ = agentOut.Close()
			}()
			c, err := NewClient(context.Background(), fromAgent, io.Discard, nil)
			require.NoError(t, err)
			_, err = c.Run(context.Background(), []byte("true"), RunOptions{Shell: "sh"})
			require.Error(t, err)
			if name == "channel closes" {
				require.ErrorIs(t, err, ErrGone)
			} else {
				require.ErrorIs(t, err, ErrProtocol)
			}
			_, again := c.Run(context.Background(), []byte("true"), RunOptions{Shell: "sh"})
			require.Equal(t, err, again, "a client whose channel failed runs nothing more")
		})
	}
	fromAgent, agentOut := io.Pipe()
	go hello(agentOut, Protocol+1)
	_, err := NewClient(context.Background(), fromAgent, io.Discard, nil)
	require.ErrorContains(t, err, fmt.Sprintf("the agent speaks protocol %d", Protocol+1))

	silent, _ := io.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = NewClient(ctx, silent, io.Discard, nil)
	require.ErrorContains(t, err, "no hello")
}

// A shell that does not exist is refused as a request, and the agent
// serves the next stage.
func TestUnknownShellRefused(t *testing.T) {
	a := startAgent(t)
	_, err := a.c.Run(context.Background(), []byte("true"), RunOptions{Shell: "/nonexistent/sh"})
	require.ErrorContains(t, err, `the agent refused the stage: "start /nonexistent/sh`)
	x, out, _ := run(t, a, "/bin/sh", "echo fine", RunOptions{})
	require.Equal(t, Exit{}, x)
	require.Equal(t, "fine\n", out)
}

// A script that reads its own file ("$0") reads a copy of its own offset:
// the rest of the script still runs (a pipe would have given the child
// the unread tail). Bigger than a frame and a pipe's buffer.
func TestScriptReadingItselfRunsWhole(t *testing.T) {
	for name, sh := range shells(t) {
		t.Run(name, func(t *testing.T) {
			a := startAgent(t)
			script := "wc -c < \"$0\" > /dev/null; cat \"$0\" > /dev/null\n" + strings.Repeat("# padding\n", 10000) + "echo TAIL-RAN; exit 3\n"
			x, out, _ := run(t, a, sh, script, RunOptions{})
			require.Equal(t, Exit{Code: 3}, x)
			require.Equal(t, "TAIL-RAN\n", out)
		})
	}
}

// As under the wrapper (an asynchronous command of a non-interactive
// shell), a script starts with SIGINT and SIGQUIT ignored.
func TestScriptIgnoresINTAndQUITAsUnderTheWrapper(t *testing.T) {
	a := startAgent(t)
	x, out, _ := run(t, a, "bash", "kill -INT $$; kill -QUIT $$; echo survived", RunOptions{})
	require.Equal(t, Exit{}, x)
	require.Equal(t, "survived\n", out)
}

// The agent's stdout closed mid-stage (sshd closing the channel): the
// agent does not die of SIGPIPE leaving the stage behind; it stops the
// stage's group and exits.
func TestOutputClosedMidStage(t *testing.T) {
	dir := t.TempDir()
	a := startAgent(t)
	pids := filepath.Join(dir, "pids")
	out := &readyWriter{ready: make(chan struct{})}
	go func() {
		_, _ = a.c.Run(context.Background(), []byte(fmt.Sprintf("sleep 1000 & echo $! > %s; echo $$ >> %s; echo ready; while :; do echo tick; sleep 0.01; done", pids, pids)),
			RunOptions{Shell: "/bin/sh", Output: out})
	}()
	select {
	case <-out.ready:
	case <-time.After(10 * time.Second):
		t.Fatal("the stage did not start")
	}
	require.NoError(t, a.stdout.Close())
	select {
	case <-a.exited:
		var ee *exec.ExitError
		if errors.As(a.err, &ee) {
			require.False(t, ee.Sys().(syscall.WaitStatus).Signaled(), "the agent died of a signal: %v", a.err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the agent did not exit")
	}
	for _, pid := range pidsIn(t, pids) {
		require.True(t, gone(pid), "process %d outlived the channel", pid)
	}
}

// The host's side keeps its bounds against an agent that stops answering:
// a cancel it ignores is given up on after the graces and the slack, and
// a cancel during an upload the agent does not read gives the channel up
// at once; either way the channel is closed.
func TestClientGivesUpOnSilentAgent(t *testing.T) {
	newAgent := func(t *testing.T, read bool) (*Client, chan struct{}) {
		fromAgent, agentOut := io.Pipe()
		toAgentR, toAgent := io.Pipe()
		closed := make(chan struct{})
		var once sync.Once
		go func() { _ = writeJSON(agentOut, frameHello, Hello{Protocol: Protocol}) }()
		if read {
			go func() { _, _ = io.Copy(io.Discard, toAgentR) }()
		}
		c, err := NewClient(context.Background(), fromAgent, toAgent, closerFunc(func() error {
			once.Do(func() { close(closed); _ = toAgentR.Close(); _ = agentOut.Close() })
			return nil
		}))
		require.NoError(t, err)
		return c, closed
	}

	c, closed := newAgent(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	_, err := c.Run(ctx, []byte("sleep 100"), RunOptions{Shell: "sh", KillGrace: 10 * time.Millisecond, LeftoverGrace: 10 * time.Millisecond, DrainGrace: 10 * time.Millisecond})
	require.ErrorIs(t, err, ErrGone)
	require.ErrorContains(t, err, "did not end the cancelled stage in time")
	require.Less(t, time.Since(t0), stopSlack+3*time.Second)
	<-closed

	c, closed = newAgent(t, false)
	ctx2, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel2()
	t0 = time.Now()
	_, err = c.Run(ctx2, bytes.Repeat([]byte("x"), 1<<20), RunOptions{Shell: "sh"})
	require.ErrorIs(t, err, ErrGone)
	require.ErrorContains(t, err, "cancelled while the script was sent")
	require.Less(t, time.Since(t0), 3*time.Second)
	<-closed
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }
