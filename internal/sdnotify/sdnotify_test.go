package sdnotify

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Listen is a notification socket in a temporary folder, as systemd's, and
// sets $NOTIFY_SOCKET to it for the test; read returns the next datagram.
func Listen(t *testing.T) (read func() string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "sdn") // short: a socket's path has 108 bytes
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	path := filepath.Join(dir, "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	t.Setenv(EnvSocket, path)
	return func() string {
		buf := make([]byte, 4096)
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
		n, err := conn.Read(buf)
		require.NoError(t, err)
		return string(buf[:n])
	}
}

func TestNotify(t *testing.T) {
	t.Setenv(EnvSocket, "")
	sent, err := Notify("READY=1")
	require.NoError(t, err)
	require.False(t, sent, "no socket: nothing sent")

	read := Listen(t)
	sent, err = Notify("READY=1\nSTATUS=up")
	require.NoError(t, err)
	require.True(t, sent)
	require.Equal(t, "READY=1\nSTATUS=up", read())

	_, err = Notify("RELOADING=1")
	require.NoError(t, err)
	got := read()
	require.True(t, strings.HasPrefix(got, "RELOADING=1\nMONOTONIC_USEC="), got)

	t.Setenv(EnvSocket, "relative")
	_, err = Notify("READY=1")
	require.ErrorContains(t, err, "neither a path nor an abstract socket")
}
