//go:build linux

package sshexec

import (
	"context"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// boundSocket is a TCP socket bound to a free port on 127.0.0.1 and not yet
// listening: the kernel refuses connections to it until listen.
func boundSocket(t *testing.T) (sock *os.File, addr string) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	sock = os.NewFile(uintptr(fd), "socket")
	t.Cleanup(func() { _ = sock.Close() })
	require.NoError(t, syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
	sa, err := syscall.Getsockname(fd)
	require.NoError(t, err)
	return sock, net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
}

// listen makes the bound socket a listener with the given backlog.
func listen(t *testing.T, sock *os.File, backlog int) net.Listener {
	t.Helper()
	require.NoError(t, syscall.Listen(int(sock.Fd()), backlog))
	ln, err := net.FileListener(sock)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

type waitResult struct {
	c        *Client
	attempts int
	err      error
}

// waitReady runs WaitReady in the background.
func waitReady(tg Target, interval time.Duration) <-chan waitResult {
	done := make(chan waitResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, attempts, err := WaitReady(ctx, tg, interval, time.Second)
		done <- waitResult{c, attempts, err}
	}()
	return done
}

// realDial connects to addr as WaitReady does by default.
func realDial(addr string) func(ctx context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	}
}

// awaitAttempts waits until log holds at least n ended attempts.
func awaitAttempts(t *testing.T, log *attemptLog, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return len(log.durations()) >= n }, 5*time.Second, 5*time.Millisecond,
		"WaitReady made %d attempts, want %d", len(log.durations()), n)
}

// (a) A server that starts listening while WaitReady polls (the guest's
// sshd starting after its lease) is found within about one interval.
func TestWaitReadyFindsALateListenerWithinAnInterval(t *testing.T) {
	const interval = 50 * time.Millisecond
	ts := sshtest.Start(t)
	sock, addr := boundSocket(t)
	tg := target(ts)
	tg.Addr = addr
	var log attemptLog
	tg.dialTCP = log.dial(realDial(addr))
	done := waitReady(tg, interval)
	// Refused attempts first: it listens only after WaitReady was refused
	// ten times (a backoff after refusals would be long by then).
	awaitAttempts(t, &log, 10)
	accepted := make(chan time.Time, 1)
	ln := listen(t, sock, 128)
	appeared := time.Now()
	forward(t, ln, ts.Addr(), 0, accepted)
	r := <-done
	require.NoError(t, r.err)
	_ = r.c.Close()
	lag := (<-accepted).Sub(appeared)
	require.Less(t, lag, interval+400*time.Millisecond, "connected %s after the server started listening", lag)
	require.Greater(t, r.attempts, 9, "refused attempts before it listened")
}

// (a, c) The first SYN to a guest that has not configured its address yet
// is lost. A listener whose accept queue is full drops SYNs the same way;
// once it has room again, WaitReady connects within PollConnectTimeout
// and an interval, not when the kernel resends the lost SYN 1 s after it.
func TestWaitReadyGetsPastALostSYN(t *testing.T) {
	const interval = 50 * time.Millisecond
	ts := sshtest.Start(t)
	sock, addr := boundSocket(t)
	ln := listen(t, sock, 0) // room for one connection not yet accepted
	filler, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer filler.Close()
	if c, err := net.DialTimeout("tcp", addr, 150*time.Millisecond); err == nil {
		_ = c.Close()
		t.Skip("this kernel does not drop SYNs to a listener with a full accept queue")
	}

	tg := target(ts)
	tg.Addr = addr
	var log attemptLog
	tg.dialTCP = log.dial(realDial(addr))
	done := waitReady(tg, interval)
	// An attempt whose SYN was dropped has been abandoned (an attempt is
	// logged when it ends) before the queue has room again.
	awaitAttempts(t, &log, 1)
	first, err := ln.Accept() // the filler: the queue has room again
	require.NoError(t, err)
	_ = first.Close()
	appeared := time.Now()
	accepted := make(chan time.Time, 1)
	forward(t, ln, ts.Addr(), 0, accepted)
	r := <-done
	require.NoError(t, r.err)
	_ = r.c.Close()
	lag := (<-accepted).Sub(appeared)
	// The kernel's resend of a lost SYN comes 1 s after it; the abandoned
	// attempt's successor connects within PollConnectTimeout and an
	// interval. The bound leaves a loaded machine room below the resend.
	require.Less(t, lag, 900*time.Millisecond, "connected %s after the queue had room", lag)
	require.GreaterOrEqual(t, r.attempts, 2, "the attempt whose SYN was lost was abandoned")
}
