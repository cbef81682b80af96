package sshexec

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// Probe checks cheaply that an SSH server answers at addr: a TCP connect
// and the server's version line ("SSH-2.0-..."), within ctx. It proves the
// guest's network and sshd are alive; it does not authenticate (the host
// key was verified when the connection that Probe stands in for was
// first made).
func Probe(ctx context.Context, addr string) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetReadDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetReadDeadline(time.Now()) })
	defer stop()
	// RFC 4253 4.2: lines before the version line are allowed, each of at
	// most 255 bytes; a peer that sends more is not an SSH server.
	r := bufio.NewReaderSize(io.LimitReader(conn, 8*256), 256)
	for range 8 {
		line, err := r.ReadString('\n')
		if strings.HasPrefix(line, "SSH-") {
			return nil
		}
		if err != nil {
			return fmt.Errorf("no SSH version line from %s: %w", addr, err)
		}
	}
	return fmt.Errorf("no SSH version line from %s", addr)
}

// ProbeTCP checks that something accepts TCP connections at addr (the
// guest's kernel answers for its listening sshd), within ctx; it does not
// wait for the server's version line, which an sshd that forks per
// connection sends only after a fork (half a second on a loaded TCG guest).
func ProbeTCP(ctx context.Context, addr string) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	return conn.Close()
}
