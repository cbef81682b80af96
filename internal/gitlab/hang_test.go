package gitlab

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// A hung libvirtd, whose calls block whatever their ctx says (as libvirt's C
// calls do), cannot hold a stage past its deadline: prepare (the stage's
// ctx), run's explanation of a guest that stopped answering (the stage's
// ctx) and cleanup (its own timeouts.cleanup) each return by then with a
// system failure. Afterwards no goroutine of ours waits on anything but the
// hung calls themselves, and those end once libvirtd answers again.
func TestStagesReturnByTheirDeadlineWhenLibvirtHangs(t *testing.T) {
	const deadline = 300 * time.Millisecond
	cfg := testConfig(t)
	cfg.Timeouts.Cleanup = config.Duration(deadline)
	hv := vmtest.New()
	hang := make(chan struct{})
	hv.Hang = hang
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(hang) }) }
	t.Cleanup(release)
	e := Env{Getenv: envOf(map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json"}),
		Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{}, Log: slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)),
		Connect: fake(hv)}

	t.Run("prepare", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		_ = requireSystemFailureBy(t, deadline, func() error { return Prepare(ctx, e, cfg) })
	})
	t.Run("run explains a dead guest", func(t *testing.T) {
		recordUnreachableMachine(t, e, cfg)
		script := filepath.Join(t.TempDir(), "script.")
		require.NoError(t, os.WriteFile(script, []byte("exit 0\n"), 0o600))
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		err := requireSystemFailureBy(t, deadline, func() error { return Run(ctx, e, cfg, script, "build_script") })
		require.ErrorContains(t, err, "connection refused", "the stage's own error, unexplained")
	})
	t.Run("cleanup", func(t *testing.T) {
		_ = requireSystemFailureBy(t, deadline, func() error { return Cleanup(context.Background(), e, cfg) })
	})
	require.GreaterOrEqual(t, hv.Hung(), 3, "each stage met the hung libvirtd")

	ours := ourGoroutines()
	require.NotEmpty(t, ours, "the hung calls are still blocked")
	for _, g := range ours {
		require.Contains(t, g, "vmtest.(*Fake).wait", "a goroutine of ours blocked elsewhere:\n%s", g)
	}
	release()
	require.Eventually(t, func() bool { return len(ourGoroutines()) == 0 }, 5*time.Second, 10*time.Millisecond,
		"goroutines of ours left after libvirtd answered again: %q", ourGoroutines())
}

// requireSystemFailureBy runs a stage, requires that it returns within
// deadline (plus slack for a loaded test host) with a system failure, and
// returns its error. The slack stays below lifecycle's explainWait (5 s):
// a stage that waited that out instead of its own deadline fails the test.
func requireSystemFailureBy(t *testing.T, deadline time.Duration, stage func() error) error {
	t.Helper()
	const slack = 4 * time.Second
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- stage() }()
	select {
	case err := <-done:
		t.Logf("returned after %s: %v", time.Since(start).Round(time.Millisecond), err)
		require.Error(t, err)
		require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
		return err
	case <-time.After(deadline + slack):
		t.Fatalf("still running %s after a deadline of %s", deadline+slack, deadline)
		return nil
	}
}

// recordUnreachableMachine records the job's machine at an address where
// nothing listens, as if its guest had died.
func recordUnreachableMachine(t *testing.T, e Env, cfg *config.Config) {
	t.Helper()
	j, err := e.load(cfg)
	require.NoError(t, err)
	defer j.jobs.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	keys, err := guestinit.NewKeys("test")
	require.NoError(t, err)
	_, err = state.Store{Dir: j.cfg.StateDir}.Create(j.name)
	require.NoError(t, err)
	require.NoError(t, state.Store{Dir: j.cfg.StateDir}.SaveKey(j.name, keys.ClientPEM))
	require.NoError(t, state.Store{Dir: j.cfg.StateDir}.Save(state.Machine{Name: j.name, Address: "127.0.0.1", Port: port, User: "root", Shell: "bash", HostKey: keys.HostPublicLine()}))
}

// ourGoroutines returns the stacks of the goroutines that run this module's
// code (not its tests), leaving out libvirt's event loop: it runs for the
// whole process once a test has connected to libvirt.
func ourGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if runsOurCode(g) && !strings.Contains(g, "libvirtvm.runEventLoop") {
			out = append(out, g)
		}
	}
	return out
}

// runsOurCode reports whether a goroutine's stack has a frame of this
// module's code outside its test files and its test tooling
// (internal/testkit: an earlier test's SSH test server may still be ending
// its last command on a loaded host). A frame is a function line followed
// by its file line.
func runsOurCode(stack string) bool {
	const module = "gitlab.com/libvirt-executor/libvirt-executor/internal/"
	lines := strings.Split(stack, "\n")
	for i := 0; i+1 < len(lines); i++ {
		fn := strings.TrimPrefix(lines[i], "created by ")
		if strings.HasPrefix(fn, module) && !strings.HasPrefix(fn, module+"testkit/") && !strings.Contains(lines[i+1], "_test.go:") {
			return true
		}
	}
	return false
}
