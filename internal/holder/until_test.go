package holder

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// A standby machine's holder starts with the machine's deadline; the job
// that claims the machine gives it the job's (SetUntil), which replaces
// the first, later or earlier.
func TestUntilFileReplacesTheDeadline(t *testing.T) {
	ts := sshtest.Start(t)
	serve := func(until time.Time) (dir string, sock string, done chan error, cancel context.CancelFunc) {
		d, err := os.MkdirTemp("", "lveu")
		require.NoError(t, err)
		t.Cleanup(func() { _ = os.RemoveAll(d) })
		ln, err := net.Listen("unix", Socket(d))
		require.NoError(t, err)
		tg := sshexec.Target{Addr: ts.Addr(), User: "root", Signer: ts.ClientSigner(), HostKey: ts.HostKey(), KeepaliveInterval: time.Second, KeepaliveCount: 10}
		s := &Server{
			Dial:       func(ctx context.Context) (*sshexec.Client, error) { return sshexec.Dial(ctx, tg) },
			Until:      until,
			UntilFile:  UntilFile(d),
			CheckEvery: 20 * time.Millisecond,
			Connected:  func(ok bool) { _ = MarkReady(d, ok) }, // the directory may be gone at the end
		}
		ctx, c := context.WithCancel(context.Background())
		done = make(chan error, 1)
		go func() { done <- s.Serve(ctx, ln) }()
		t.Cleanup(c)
		return d, Socket(d), done, c
	}
	stage := func(sock string) error {
		var out sshtest.Buffer
		tag, _ := sshexec.NewTag()
		_, err := RunStage(context.Background(), sock, Stage{Tag: tag, Shell: "sh", Script: []byte("echo ok\n"), Stdout: &out, KillGrace: time.Second})
		if err == nil {
			require.Equal(t, "ok\n", out.String())
		}
		return err
	}

	// The machine's deadline is an hour away; the job's, given later, has
	// passed: the holder ends.
	dir, sock, done, _ := serve(time.Now().Add(time.Hour))
	require.Eventually(t, func() bool { return readyState(dir) == "up" },
		5*time.Second, 10*time.Millisecond, "Connected is called once the first connection is made")
	require.False(t, Ready(dir), "Ready also asks for the recorded process, which this in-process holder has not")
	require.False(t, Usable(dir), "as Usable does")
	require.NoError(t, MarkReady(dir, false))
	require.Equal(t, "down", readyState(dir))
	require.NoError(t, stage(sock))
	require.NoError(t, SetUntil(dir, time.Now().Add(-time.Second)))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("the holder outlived the deadline it was given")
	}

	// The machine's deadline passes while the job's is later: it serves on.
	// The first deadline leaves a loaded machine time to move it.
	dir, sock, done, cancel := serve(time.Now().Add(1500 * time.Millisecond))
	require.NoError(t, SetUntil(dir, time.Now().Add(time.Hour)))
	time.Sleep(2 * time.Second) // past the first deadline: what is asserted is that nothing ends
	require.NoError(t, stage(sock))
	select {
	case err := <-done:
		t.Fatalf("the holder ended at the machine's deadline although the job's is later: %v", err)
	default:
	}
	cancel()
	require.NoError(t, <-done)
}
