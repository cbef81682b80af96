// Package sdnotify tells systemd a service's state (sd_notify(3)) over
// the datagram socket systemd names in $NOTIFY_SOCKET: READY=1 for
// Type=notify, RELOADING=1, STOPPING=1, STATUS=.... It is the protocol's
// few lines, written here rather than taken from go-systemd: one
// sendto(2) of a datagram.
package sdnotify

import (
	"fmt"
	"net"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// EnvSocket is the variable systemd sets to its notification socket.
const EnvSocket = "NOTIFY_SOCKET"

// Notify sends state ("READY=1", "STOPPING=1", lines joined by "\n") to
// $NOTIFY_SOCKET; without one (not run by systemd, or not Type=notify) it
// does nothing and returns false. "RELOADING=1" is sent with
// MONOTONIC_USEC, as systemd asks of a reload.
func Notify(state string) (sent bool, err error) {
	addr := os.Getenv(EnvSocket)
	if addr == "" {
		return false, nil
	}
	if strings.HasPrefix(addr, "@") { // an abstract socket
		addr = "\x00" + addr[1:]
	} else if !strings.HasPrefix(addr, "/") {
		return false, fmt.Errorf("%s=%q: neither a path nor an abstract socket (@NAME)", EnvSocket, addr)
	}
	if strings.HasPrefix(state, "RELOADING=1") && !strings.Contains(state, "MONOTONIC_USEC=") {
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err == nil {
			state += fmt.Sprintf("\nMONOTONIC_USEC=%d", ts.Nano()/1000)
		}
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		return false, fmt.Errorf("%s: %w", EnvSocket, err)
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.Write([]byte(state)); err != nil {
		return false, fmt.Errorf("%s: %w", EnvSocket, err)
	}
	return true, nil
}
