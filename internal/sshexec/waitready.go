package sshexec

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// DefaultPollInterval is how often WaitReady starts an attempt by default:
// the rate the benchmark's floor polls at (docs/performance.md). A refused
// connect costs the host and the guest next to nothing.
const DefaultPollInterval = 50 * time.Millisecond

// DefaultPollConnectTimeout bounds each WaitReady attempt's TCP connect by
// default. A guest's address is known from its DHCP lease before the guest
// has configured it, so the first SYN is often lost, and the kernel would
// resend it only after its 1 s initial retransmission timeout. Abandoning
// the connect after 250 ms and starting a new one is quicker; a guest that
// answers at all answers a SYN within a few ms.
const DefaultPollConnectTimeout = 250 * time.Millisecond

// WaitReady dials until the SSH handshake with the pinned host key and the
// public-key authentication both succeed, or ctx ends, and returns the
// number of attempts made. An attempt starts every interval (default
// DefaultPollInterval), at a fixed rate: not an interval after the last one
// failed; one that took longer is followed by the next at once. Each
// attempt's TCP connect is bounded by t.PollConnectTimeout (a lost SYN costs
// that, not the kernel's 1 s retransmission), its handshake and login by
// t.ConnectTimeout. A host key mismatch is retried only for mismatchGrace
// (a guest may still be installing its per-job key), then reported. When
// ctx ends, the error carries the last answer that came from the guest's
// side rather than the abort.
func WaitReady(ctx context.Context, t Target, interval, mismatchGrace time.Duration) (*Client, int, error) {
	if interval <= 0 {
		interval = DefaultPollInterval
	}
	connect := t.PollConnectTimeout
	if connect <= 0 {
		connect = DefaultPollConnectTimeout
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	var lastErr error
	var firstMismatch time.Time
	attempts := 0
	for {
		attempts++
		c, err := dialWith(ctx, t, connect)
		if err == nil {
			return c, attempts, nil
		}
		if !expired(ctx) || lastErr == nil {
			// Keep the guest's last real answer rather than our own abort.
			lastErr = err
		}
		if errors.Is(err, ErrHostKeyMismatch) {
			if firstMismatch.IsZero() {
				firstMismatch = time.Now()
			}
			if time.Since(firstMismatch) >= mismatchGrace {
				return nil, attempts, fmt.Errorf("%w; refusing to send anything to it (does the image install the per-job host key? see docs/images.md)", err)
			}
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
			if ctx.Err() == nil { // both are ready after a slow attempt: ctx wins
				continue
			}
		}
		return nil, attempts, fmt.Errorf("SSH not ready at %s after %d attempts: last error: %v (%w)", t.Addr, attempts, lastErr, context.Cause(ctx))
	}
}

// expired reports whether ctx has ended or its deadline has passed (the
// dialer gives up at the deadline a moment before ctx.Err is set).
func expired(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	d, ok := ctx.Deadline()
	return ok && !time.Now().Before(d)
}
