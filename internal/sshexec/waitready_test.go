package sshexec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// forward accepts on ln until the test ends and relays each connection to
// addr, after delay. The time of each accept goes to accepted, if set (it
// must have room: sends are not waited for).
func forward(t *testing.T, ln net.Listener, addr string, delay time.Duration, accepted chan<- time.Time) {
	t.Helper()
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			if accepted != nil {
				select {
				case accepted <- time.Now():
				default:
				}
			}
			wg.Go(func() {
				defer in.Close()
				time.Sleep(delay)
				out, err := net.Dial("tcp", addr)
				if err != nil {
					return
				}
				defer out.Close()
				go func() { _, _ = io.Copy(out, in); _ = out.Close() }()
				_, _ = io.Copy(in, out)
			})
		}
	})
}

// attemptLog is a dialTCP stand-in that records when each attempt started
// and how long it took.
type attemptLog struct {
	mu    sync.Mutex
	start []time.Time
	took  []time.Duration
	bound []time.Duration // the attempt's context's deadline, from its start (0: none)
	errs  []error
}

func (l *attemptLog) dial(do func(ctx context.Context) (net.Conn, error)) func(context.Context, string, string) (net.Conn, error) {
	return func(ctx context.Context, _, _ string) (net.Conn, error) {
		began := time.Now()
		var bound time.Duration
		if dl, ok := ctx.Deadline(); ok {
			bound = dl.Sub(began)
		}
		c, err := do(ctx)
		l.mu.Lock()
		l.start, l.took = append(l.start, began), append(l.took, time.Since(began))
		l.bound, l.errs = append(l.bound, bound), append(l.errs, err)
		l.mu.Unlock()
		return c, err
	}
}

func (l *attemptLog) durations() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]time.Duration(nil), l.took...)
}

func (l *attemptLog) bounds() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]time.Duration(nil), l.bound...)
}

func (l *attemptLog) lastErr() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.errs) == 0 {
		return nil
	}
	return l.errs[len(l.errs)-1]
}

// (b) An attempt starts every interval, however long the failed one before
// it took (up to an interval): with attempts that fail after 60 ms and a
// 100 ms interval, sleeping an interval after each failure would make one
// attempt per 160 ms (0.625 of the rate). The interval is long enough that
// a loaded machine's late wake-ups do not cost ticks.
func TestWaitReadyPollsAtAFixedRate(t *testing.T) {
	const interval = 100 * time.Millisecond
	for _, tc := range []struct {
		name string
		fail time.Duration // how long a failed attempt takes; 0: a real refused connect
	}{
		{"refused at once", 0},
		{"failing after 60ms", 60 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg := Target{Addr: "127.0.0.1:1", User: "root", Signer: sshtest.NewSigner(t), HostKey: sshtest.NewSigner(t).PublicKey()}
			var log attemptLog
			if tc.fail > 0 {
				tg.dialTCP = log.dial(func(ctx context.Context) (net.Conn, error) {
					time.Sleep(tc.fail)
					return nil, errors.New("connect: connection refused")
				})
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			start := time.Now()
			_, attempts, err := WaitReady(ctx, tg, interval, time.Second)
			elapsed := time.Since(start)
			require.ErrorContains(t, err, "connection refused")
			want := float64(elapsed) / float64(interval)
			require.GreaterOrEqual(t, float64(attempts), 0.8*want, "%d attempts in %s: one per %s expected", attempts, elapsed, interval)
			require.LessOrEqual(t, float64(attempts), want+2, "%d attempts in %s: not more than one per %s", attempts, elapsed, interval)
		})
	}
}

// (c) A connect that hangs (a SYN the guest drops while it has not yet
// configured its address) is abandoned after PollConnectTimeout, not after
// ConnectTimeout, and the next attempt follows at once. Each attempt's
// bound is read from the deadline it was given (a loaded machine does not
// move it); how long it took is only held to its bound plus 1 s, and at
// least one attempt must follow the one before it within the interval
// (sleeping after each abandoned attempt would make every gap an interval).
func TestWaitReadyAbandonsAHangingConnect(t *testing.T) {
	hang := func(ctx context.Context) (net.Conn, error) {
		<-ctx.Done()
		return nil, fmt.Errorf("dial tcp: %w", ctx.Err())
	}
	for _, tc := range []struct {
		name             string
		connect, poll    time.Duration
		want             time.Duration
		minimum, maximum int // attempts within 1.3 s
	}{
		{"default per-attempt bound", 5 * time.Second, 0, DefaultPollConnectTimeout, 2, 7},
		{"shorter connect timeout wins", 100 * time.Millisecond, 0, 100 * time.Millisecond, 2, 15},
		{"own per-attempt bound", 5 * time.Second, 600 * time.Millisecond, 600 * time.Millisecond, 2, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log attemptLog
			tg := Target{Addr: "127.0.0.1:22", User: "root", Signer: sshtest.NewSigner(t), HostKey: sshtest.NewSigner(t).PublicKey(),
				ConnectTimeout: tc.connect, PollConnectTimeout: tc.poll, dialTCP: log.dial(hang)}
			ctx, cancel := context.WithTimeout(context.Background(), 1300*time.Millisecond)
			defer cancel()
			_, attempts, err := WaitReady(ctx, tg, 50*time.Millisecond, time.Second)
			require.ErrorContains(t, err, "SSH not ready at 127.0.0.1:22")
			require.ErrorContains(t, err, "deadline exceeded")
			took := log.durations()
			require.Len(t, took, attempts)
			require.GreaterOrEqual(t, attempts, tc.minimum, "attempts took %v", took)
			require.LessOrEqual(t, attempts, tc.maximum, "attempts took %v", took)
			bounds := log.bounds()
			for i, d := range took[:len(took)-1] { // the last one is cut by ctx
				require.LessOrEqual(t, bounds[i], tc.want, "attempt %d's bound (bounds %v)", i, bounds)
				require.Greater(t, bounds[i], tc.want/2, "attempt %d's bound (bounds %v)", i, bounds)
				require.Less(t, d, tc.want+time.Second, "attempts took %v", took)
			}
			log.mu.Lock()
			gap := time.Hour
			for i := 1; i < len(log.start); i++ {
				gap = min(gap, log.start[i].Sub(log.start[i-1].Add(log.took[i-1])))
			}
			log.mu.Unlock()
			require.Less(t, gap, 50*time.Millisecond, "the next attempt follows an abandoned one at once")
		})
	}
}

// The per-attempt bound is for the TCP connect only: a server that takes
// longer than that to send its version line is still logged in to.
func TestWaitReadyHandshakeIsBoundedByConnectTimeout(t *testing.T) {
	ts := sshtest.Start(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	forward(t, ln, ts.Addr(), 2*DefaultPollConnectTimeout, nil)
	tg := target(ts)
	tg.Addr = ln.Addr().String()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, attempts, err := WaitReady(ctx, tg, 50*time.Millisecond, time.Second)
	require.NoError(t, err)
	require.Equal(t, 1, attempts)
	_ = c.Close()

	// ConnectTimeout still bounds the handshake.
	tg.ConnectTimeout = DefaultPollConnectTimeout
	_, err = Dial(ctx, tg)
	require.ErrorContains(t, err, "i/o timeout")
}

// The last real error is kept when the attempts are cut by ctx, and
// cancelling ctx ends a hanging attempt at once.
func TestWaitReadyCancelEndsAHangingAttempt(t *testing.T) {
	var log attemptLog
	tg := Target{Addr: "127.0.0.1:22", User: "root", Signer: sshtest.NewSigner(t), HostKey: sshtest.NewSigner(t).PublicKey(),
		dialTCP: log.dial(func(ctx context.Context) (net.Conn, error) {
			<-ctx.Done()
			return nil, fmt.Errorf("dial tcp: %w", ctx.Err())
		})}
	ctx, cancel := context.WithCancelCause(context.Background())
	time.AfterFunc(600*time.Millisecond, func() { cancel(errors.New("job cancelled")) })
	start := time.Now()
	_, attempts, err := WaitReady(ctx, tg, 50*time.Millisecond, time.Second)
	require.Less(t, time.Since(start), 600*time.Millisecond+3*time.Second)
	require.ErrorIs(t, log.lastErr(), context.Canceled, "the attempt that hung was ended by the cancel, not by its own bound")
	require.ErrorContains(t, err, "job cancelled")
	require.ErrorContains(t, err, "last error: dial tcp: context deadline exceeded", "the per-attempt timeout is the last real answer")
	require.Equal(t, len(log.durations()), attempts)
	require.GreaterOrEqual(t, attempts, 2)
}
