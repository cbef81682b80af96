package admin

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sdnotify"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// serve tells systemd READY once its first look is done and STOPPING when
// it stops, over $NOTIFY_SOCKET; SIGHUP reloads the configuration file,
// and a bad file is refused and said in the log.
func TestServeNotifiesAndReloadsOnSIGHUP(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, registrytest.Qcow2(1<<30, nil), 0o644))
	text := `domain_type = "qemu"
state_dir = "` + filepath.Join(dir, "state") + `"
[serve]
metrics_listen = "off"
interval = "10s"
[images.ok]
base = "` + base + `"
`
	path := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(path, []byte(text), 0o600))
	cfg, err := config.Load(path)
	require.NoError(t, err)

	sock, err := os.MkdirTemp("", "sdn") // short: a socket's path has 108 bytes
	require.NoError(t, err)
	defer func() { _ = os.RemoveAll(sock) }()
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: filepath.Join(sock, "notify"), Net: "unixgram"})
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	t.Setenv(sdnotify.EnvSocket, filepath.Join(sock, "notify"))
	read := func() string {
		t.Helper()
		buf := make([]byte, 4096)
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(20*time.Second)))
		n, err := conn.Read(buf)
		require.NoError(t, err)
		return string(buf[:n])
	}

	hv := vmtest.New()
	log := &sshtest.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, cfg, slog.New(slog.NewTextHandler(log, nil)), func(context.Context, string) (vm.Hypervisor, error) { return hv, nil })
	}()
	defer func() {
		if t.Failed() {
			t.Logf("service log:\n%s", log.String())
		}
	}()
	require.True(t, strings.HasPrefix(read(), "READY=1"))

	// until reads the datagrams up to one that starts with want, and
	// returns those before it. The service also reloads when it sees the
	// file change: a reload may come twice.
	until := func(want string) []string {
		t.Helper()
		var before []string
		for {
			got := read()
			if strings.HasPrefix(got, want) {
				return before
			}
			before = append(before, got)
		}
	}
	logHas := func(s string) bool { return strings.Contains(log.String(), s) }
	// The service also reloads when it sees the file change: written in
	// place, it may read the file truncated and not yet written (refused,
	// as it should be, but this test is about SIGHUP). Replace it whole,
	// as an editor or a configuration manager does.
	replace := func(text string) {
		t.Helper()
		tmp := path + ".new"
		require.NoError(t, os.WriteFile(tmp, []byte(text), 0o600))
		require.NoError(t, os.Rename(tmp, path))
	}

	// A good file: reloaded.
	replace(text + "[images.ok.pool]\nidle_count = 0\nmax_idle = 1\n")
	require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGHUP))
	until("RELOADING=1\nMONOTONIC_USEC=")
	until("READY=1")
	require.Eventually(t, func() bool { return logHas("SIGHUP: reloading the configuration") }, 20*time.Second, 10*time.Millisecond)
	require.True(t, logHas("configuration reloaded"))
	require.True(t, logHas("new standby pool"))

	// A bad one: refused, the old one kept, said in the log.
	replace(text + "bogus_key = 1\n")
	require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGHUP))
	require.Eventually(t, func() bool {
		return strings.Count(log.String(), "SIGHUP: reloading the configuration") == 2 && logHas("configuration refused: kept the one in use")
	}, 20*time.Second, 10*time.Millisecond)
	require.Contains(t, log.String(), "bogus_key")
	require.NotContains(t, log.String(), "level=ERROR msg=\"configuration reloaded")

	cancel()
	for _, n := range until("STOPPING=1") {
		require.Regexp(t, `^(READY|RELOADING)=1`, n)
	}
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
}
