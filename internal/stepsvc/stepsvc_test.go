package stepsvc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"
)

// These tests run the real step-runner (serve and proxy) on this machine,
// the "guest" being a local shell: what they check is the client, the
// guest commands and the re-attach, against the service itself.

const stepRunnerEnv = "LVE_E2E_STEP_RUNNER"

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

// localGuest runs commands with sh on this machine, step-runner on PATH.
type localGuest struct {
	path string
	mu   sync.Mutex
	// proxies are the running `step-runner proxy` processes.
	proxies map[*exec.Cmd]bool
}

func newLocalGuest(t *testing.T) *localGuest {
	sr := requireStepRunner(t)
	bin := t.TempDir()
	require.NoError(t, os.Symlink(sr, filepath.Join(bin, "step-runner")))
	return &localGuest{path: bin + ":" + os.Getenv("PATH"), proxies: map[*exec.Cmd]bool{}}
}

func (g *localGuest) stream(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error {
	c := exec.CommandContext(ctx, "sh", "-c", cmd)
	c.Env = []string{"PATH=" + g.path, "HOME=" + os.Getenv("HOME")}
	c.Stdout = stdout
	c.WaitDelay = 2 * time.Second
	proxy := strings.Contains(cmd, "step-runner proxy")
	in, err := c.StdinPipe()
	if err != nil {
		return err
	}
	if err := c.Start(); err != nil {
		return err
	}
	// Not waited for: a stdin that never ends must not hold the stream
	// open past the process.
	go func() {
		_, _ = io.Copy(in, stdin)
		_ = in.Close()
	}()
	if proxy {
		g.mu.Lock()
		g.proxies[c] = true
		g.mu.Unlock()
		defer func() {
			g.mu.Lock()
			delete(g.proxies, c)
			g.mu.Unlock()
		}()
	}
	err = c.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if proxy && err != nil {
		// What sshexec says of a session whose connection ended.
		return exitcodes.System(fmt.Errorf("%w: %v", sshexec.ErrConnectionLost, err))
	}
	return err
}

// killProxies kills the running proxies (the connection drops).
func (g *localGuest) killProxies() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for c := range g.proxies {
		_ = c.Process.Kill()
		n++
	}
	return n
}

func (g *localGuest) runner(t *testing.T, out io.Writer) (*Runner, string) {
	dir := filepath.Join(t.TempDir(), "svc")
	var notes bytes.Buffer
	r := &Runner{Stream: g.stream, Dir: dir, Out: out, StopGrace: time.Second, Log: slog.New(slog.NewTextHandler(os.Stderr, nil)),
		Note: func(f string, a ...any) { fmt.Fprintf(&notes, f+"\n", a...) }}
	t.Cleanup(func() {
		// Whatever a test left: the service's session goes.
		_ = g.stream(context.Background(), stopCommand(dir, time.Second), strings.NewReader(""), io.Discard)
		t.Logf("notes:\n%s", notes.String())
	})
	return r, dir
}

func TestNativeRunSucceedsAndFails(t *testing.T) {
	t.Parallel()
	g := newLocalGuest(t)
	var out bytes.Buffer
	r, dir := g.runner(t, &out)
	build := t.TempDir()
	err := r.Run(context.Background(), Request{ID: "11", BuildDir: build,
		Env:       map[string]string{"GREETING": "hello-env", "SECRET_FILE": FilePath(dir, "11", "SECRET_FILE")},
		Variables: []Variable{{Key: "GREETING", Value: "hello-env"}, {Key: "SECRET_FILE", Value: "file-content", File: true}},
		Steps:     `[{"name":"a","script":"echo one; echo; pwd; echo $GREETING; cat $SECRET_FILE; echo"},{"name":"b","script":"printf 'two\r\nthree\n'"}]`})
	require.NoError(t, err)
	require.Equal(t, "Running step \"a\"\none\n"+build+"\nhello-env\nfile-content\nRunning step \"b\"\ntwo\nthree\n", out.String())
	// The service and its directory (file variables) are gone.
	require.NoDirExists(t, dir)

	out.Reset()
	err = r.Run(context.Background(), Request{ID: "12", BuildDir: build, Steps: `[{"name":"bad","script":"echo failing; exit 3"}]`})
	var se *exitcodes.ScriptError
	require.ErrorAs(t, err, &se)
	require.Equal(t, 3, se.Code)
	require.Contains(t, out.String(), "failing")

	// Steps the service cannot load: the job's fault, said in the log.
	err = r.Run(context.Background(), Request{ID: "13", BuildDir: build, Steps: `[{"name":"x","step":"./nowhere/to/be/found"}]`})
	require.ErrorAs(t, err, &se)
	require.Equal(t, 1, se.Code)
}

// A step that signals its own process group (kill 0) ends the service too:
// the steps' doing, a build failure at once, not a reconnection in vain.
// Whether the service said the step failed before it died, or died first
// (ErrServiceGone), is the signal's interleaving: either is exit 1.
func TestNativeStepKillsItsGroup(t *testing.T) {
	t.Parallel()
	g := newLocalGuest(t)
	var out syncbuf.Buffer
	r, dir := g.runner(t, &out)
	r.ReconnectFor = time.Minute
	t0 := time.Now()
	err := r.Run(context.Background(), Request{ID: "51", BuildDir: t.TempDir(), Steps: `[{"name":"k","script":"echo before; kill -TERM 0; sleep 5"}]`})
	code, ok := exitcodes.ScriptCode(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, 1, code)
	require.Less(t, time.Since(t0), 30*time.Second, "no reconnecting for a minute")
	require.NoDirExists(t, dir)
}

func TestNativeNoStepRunner(t *testing.T) {
	t.Parallel()
	g := &localGuest{path: "/usr/bin:/bin", proxies: map[*exec.Cmd]bool{}}
	r := &Runner{Stream: g.stream, Dir: filepath.Join(t.TempDir(), "svc")}
	err := r.Run(context.Background(), Request{ID: "1", BuildDir: t.TempDir(), Steps: `[]`})
	require.ErrorIs(t, err, ErrNoStepRunner)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
}

// A dropped connection mid-step: the step goes on, the driver re-attaches
// and the log has every line once, empty lines and CRs included.
func TestNativeReattach(t *testing.T) {
	t.Parallel()
	g := newLocalGuest(t)
	var out syncbuf.Buffer
	r, _ := g.runner(t, &out)
	var reattached atomic.Int32
	r.Reattached = func(int64) { reattached.Add(1) }
	marker := filepath.Join(t.TempDir(), "go")
	// Lines before the drop (with an empty one and a CRLF), then the step
	// waits for the test to drop the connection, then more lines.
	script := fmt.Sprintf(`for i in 1 2 3; do echo before-$i; echo; printf 'cr-%%s\r\n' $i; done; while [ ! -e %s ]; do sleep 0.05; done; for i in 1 2 3; do echo after-$i; done`, marker)
	done := make(chan error, 1)
	go func() {
		done <- r.Run(context.Background(), Request{ID: "21", BuildDir: t.TempDir(), Steps: fmt.Sprintf(`[{"name":"s","script":%q}]`, script)})
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "cr-3\n") }, 30*time.Second, 20*time.Millisecond, "output: %q", out.String())
	require.Positive(t, g.killProxies())
	require.Eventually(t, func() bool { return reattached.Load() > 0 }, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, os.WriteFile(marker, nil, 0o600))
	require.NoError(t, <-done)
	want := "Running step \"s\"\n"
	for i := 1; i <= 3; i++ {
		want += fmt.Sprintf("before-%d\ncr-%d\n", i, i)
	}
	want += "after-1\nafter-2\nafter-3\n"
	require.Equal(t, want, out.String())
}

// Cancel mid-step: the run is closed and every process of the steps,
// background ones included, is stopped.
func TestNativeCancelStopsEverything(t *testing.T) {
	t.Parallel()
	g := newLocalGuest(t)
	var out syncbuf.Buffer
	r, dir := g.runner(t, &out)
	pidFile := filepath.Join(t.TempDir(), "bg.pid")
	script := fmt.Sprintf(`sleep 600 & echo $! > %s; echo started; sleep 600`, pidFile)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- r.Run(ctx, Request{ID: "31", BuildDir: t.TempDir(), Steps: fmt.Sprintf(`[{"name":"s","script":%q}]`, script)})
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "started") }, 30*time.Second, 20*time.Millisecond, "output: %q", out.String())
	b, err := os.ReadFile(pidFile)
	require.NoError(t, err)
	var pid int
	_, err = fmt.Sscan(string(b), &pid)
	require.NoError(t, err)
	cancel()
	err = <-done
	require.Error(t, err)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.Eventually(t, func() bool { return !alive(pid) }, 10*time.Second, 20*time.Millisecond, "the step's background process survived")
	require.NoDirExists(t, dir)
}

// The guest's end of the connection reports a dead guest: no reconnect,
// a system failure at once.
func TestNativeDeadGuest(t *testing.T) {
	t.Parallel()
	g := newLocalGuest(t)
	var out syncbuf.Buffer
	r, _ := g.runner(t, &out)
	r.ReconnectFor = time.Minute
	var dead atomic.Bool
	r.Stream = func(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error {
		if dead.Load() && !strings.Contains(cmd, "kill -TERM") {
			return exitcodes.System(fmt.Errorf("%w: %w", sshexec.ErrConnectionLost, &sshexec.DeadGuestError{Silent: 15 * time.Second}))
		}
		err := g.stream(ctx, cmd, stdin, stdout)
		if dead.Load() {
			return exitcodes.System(fmt.Errorf("%w: %w", sshexec.ErrConnectionLost, &sshexec.DeadGuestError{Silent: 15 * time.Second}))
		}
		return err
	}
	done := make(chan error, 1)
	go func() {
		done <- r.Run(context.Background(), Request{ID: "41", BuildDir: t.TempDir(), Steps: `[{"name":"s","script":"echo started; sleep 600"}]`})
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "started") }, 30*time.Second, 20*time.Millisecond)
	dead.Store(true)
	t0 := time.Now()
	g.killProxies()
	err := <-done
	require.ErrorIs(t, err, sshexec.ErrDeadGuest)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.Less(t, time.Since(t0), 10*time.Second)
}

func TestExitCodeOf(t *testing.T) {
	for msg, want := range map[string]int{
		`step "d": exec: exit status 137`: 137,
		`step "b": exec: exit status 3`:   3,
		`exit status 0`:                   -1,
		`exit status 300`:                 -1,
		`loading step: nope`:              -1,
		`exit status 3 and more`:          -1,
	} {
		code, ok := exitCodeOf(msg)
		if want < 0 {
			require.False(t, ok, msg)
			continue
		}
		require.True(t, ok, msg)
		require.Equal(t, want, code, msg)
	}
}

func TestOffsetCommand(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "step-runner-output-5"), 0o700))
	log := "a\n\nbb\r\n\r\nccc\n"
	require.NoError(t, os.WriteFile(logFile(dir, "5"), []byte(log), 0o600))
	for lines, want := range map[int64]string{1: "2", 2: "7", 3: "13", 4: "-1"} {
		out, err := exec.Command("sh", "-c", offsetCommand(dir, "5", lines)).Output()
		require.NoError(t, err)
		require.Equal(t, want, strings.TrimSpace(string(out)), "after line %d", lines)
	}
}

func TestBadInput(t *testing.T) {
	r := &Runner{Stream: func(context.Context, string, io.Reader, io.Writer) error { return errors.New("must not run") }}
	err := r.Run(context.Background(), Request{ID: "1; rm -rf /"})
	require.ErrorContains(t, err, "only 1 to 19 digits")
	r.Dir = "/tmp/x y"
	err = r.Run(context.Background(), Request{ID: "1"})
	require.ErrorContains(t, err, "only an absolute path")
	require.True(t, ValidKey("CI_JOB_TOKEN"))
	require.False(t, ValidKey("../x"))
	require.False(t, ValidKey("A/B"))
}

func alive(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err == nil && !strings.Contains(string(b), ") Z ")
}

// A StreamFunc returns when its context ends while its copy may still write
// (sshexec.Stream does): output must not read what it kept while that copy
// still appends to it (go test -race -run TestOutputWhenItsContextEnds).
func TestOutputWhenItsContextEnds(t *testing.T) {
	stop := make(chan struct{})
	copied := make(chan struct{})
	t.Cleanup(func() { close(stop); <-copied })
	r := &Runner{StartWait: time.Second, Stream: func(ctx context.Context, _ string, _ io.Reader, w io.Writer) error {
		go func() {
			defer close(copied)
			tick := time.NewTicker(time.Millisecond) // a slow guest: the limit is never reached
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
					_, _ = w.Write([]byte("tick\n"))
				}
			}
		}()
		<-ctx.Done()
		return ctx.Err()
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	out, err := r.output(ctx, "true")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.True(t, strings.HasPrefix(strings.Repeat("tick\n", len(out)/5+1), string(out)), "only the ticks: %q", out)
	for i := range out {
		out[i] = 'x' // the caller owns what output returned
	}
}
