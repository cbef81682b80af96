package vm_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

var lostConnection = vmtest.LostConnection("Cannot recv data: Connection reset by peer")

func TestReconnectingRetriesOnceAfterLostConnection(t *testing.T) {
	ctx := context.Background()
	first, second := vmtest.New(), vmtest.New()
	second.Domains["lve-a-1"] = &vmtest.Domain{Active: true}
	first.FailOn["DomainNames"] = lostConnection
	dials := 0
	r := NewReconnecting(func(context.Context) (Hypervisor, error) {
		dials++
		if dials == 1 {
			return first, nil
		}
		return second, nil
	})
	var causes []error
	r.OnReconnect = func(c error) { causes = append(causes, c) }

	names, err := r.DomainNames(ctx)
	require.NoError(t, err, "repeated on the new connection")
	require.Equal(t, []string{"lve-a-1"}, names)
	require.Equal(t, 1, r.Reconnects())
	require.Len(t, causes, 1)

	// Errors that are not about the connection are returned, no reconnect.
	_, err = r.IsActive(ctx, "nope")
	require.ErrorIs(t, err, ErrNotFound)
	require.Equal(t, 1, r.Reconnects())

	// A second loss on the new connection: reconnect once more, then give up
	// if dialing fails.
	second.FailOn["DomainNames"] = lostConnection
	dialErr := errors.New("libvirtd not running")
	r2 := NewReconnecting(func(context.Context) (Hypervisor, error) {
		if dials++; dials > 3 {
			return nil, dialErr
		}
		return second, nil
	})
	r2.Wait, r2.Interval = 100*time.Millisecond, 10*time.Millisecond
	start := time.Now()
	_, err = r2.DomainNames(ctx)
	require.ErrorIs(t, err, ErrConnectionLost)
	require.ErrorContains(t, err, "libvirtd not running")
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "kept redialling for Wait")
}

func TestReconnectingWaitsForTheDaemon(t *testing.T) {
	first, second := vmtest.New(), vmtest.New()
	first.FailOn["DomainNames"] = lostConnection
	second.Domains["lve-a-1"] = &vmtest.Domain{}
	dials := 0
	r := NewReconnecting(func(context.Context) (Hypervisor, error) {
		dials++
		switch {
		case dials == 1:
			return first, nil
		case dials < 5: // the daemon is still restarting
			return nil, errors.New("Failed to connect socket")
		}
		return second, nil
	})
	r.Interval = time.Millisecond
	names, err := r.DomainNames(context.Background())
	require.NoError(t, err)
	require.Equal(t, []string{"lve-a-1"}, names)
	require.Equal(t, 5, dials)
}

// The connection is made on the first call (or Dial), once; after Close no
// call dials again.
func TestReconnectingConnectsOnFirstUse(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	dials := 0
	r := NewReconnecting(func(context.Context) (Hypervisor, error) { dials++; return hv, nil })
	require.Zero(t, dials, "nothing dialled before it is needed")
	require.NoError(t, r.Close(), "closing what was never opened")

	r = NewReconnecting(func(context.Context) (Hypervisor, error) { dials++; return hv, nil })
	require.NoError(t, r.Dial(ctx))
	require.NoError(t, r.Dial(ctx))
	_, err := r.DomainNames(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, dials)
	require.NoError(t, r.Close())
	_, err = r.DomainNames(ctx)
	require.Error(t, err, "closed")
	require.Equal(t, 1, dials, "no dial after Close")

	refused := errors.New("connection refused")
	r = NewReconnecting(func(context.Context) (Hypervisor, error) { return nil, refused })
	require.ErrorIs(t, r.Dial(ctx), refused)
}

// Redialling after a lost connection ends with the caller's ctx, long before
// Wait.
func TestReconnectingRedialEndsWithCtx(t *testing.T) {
	first := vmtest.New()
	first.FailOn["DomainNames"] = lostConnection
	dials := 0
	r := NewReconnecting(func(context.Context) (Hypervisor, error) {
		if dials++; dials == 1 {
			return first, nil
		}
		return nil, errors.New("Failed to connect socket")
	})
	r.Wait, r.Interval = time.Minute, 10*time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	_, err := r.DomainNames(ctx)
	require.Less(t, time.Since(start), 5*time.Second, "Wait is a minute; ctx ended after 1s")
	require.ErrorIs(t, err, ErrConnectionLost)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Greater(t, dials, 2, "it did redial until then")
}

// A call that hangs (libvirtd stopped answering; the call itself ignores
// ctx, as libvirt's C calls do) is abandoned when ctx ends.
func TestReconnectingAbandonsAHungCall(t *testing.T) {
	hv := vmtest.New()
	hv.Domains["lve-a-1"] = &vmtest.Domain{Active: true}
	hang := make(chan struct{})
	hv.Hang = hang
	r := NewReconnecting(func(context.Context) (Hypervisor, error) { return hv, nil })
	ctx, cancel := context.WithTimeoutCause(context.Background(), 50*time.Millisecond, errors.New("cleanup timeout"))
	defer cancel()
	start := time.Now()
	_, err := r.IsActive(ctx, "lve-a-1")
	require.Less(t, time.Since(start), 5*time.Second)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "cleanup timeout")
	require.Equal(t, 1, hv.Hung())

	// libvirtd answers again: the connection is still good.
	hv.Lock()
	hv.Hang = nil
	hv.Unlock()
	close(hang)
	active, err := r.IsActive(context.Background(), "lve-a-1")
	require.NoError(t, err)
	require.True(t, active)
}

// Only errors marked ErrConnectionLost make it reconnect: a failure of
// the call itself is returned as is, on the same connection.
func TestReconnectingReconnectsOnlyOnALostConnection(t *testing.T) {
	hv := vmtest.New()
	refused := errors.New("operation failed: domain is not running")
	hv.FailOn["DomainNames"] = refused
	dials := 0
	r := NewReconnecting(func(context.Context) (Hypervisor, error) { dials++; return hv, nil })
	_, err := r.DomainNames(context.Background())
	require.ErrorIs(t, err, refused)
	require.NotErrorIs(t, err, ErrConnectionLost)
	require.Equal(t, 1, dials)
	require.Zero(t, r.Reconnects())

	hv.FailOn["DomainNames"] = fmt.Errorf("wrapped twice: %w", lostConnection)
	_, err = r.DomainNames(context.Background())
	require.ErrorIs(t, err, ErrConnectionLost, "the same fake fails again after the reconnect")
	require.Equal(t, 2, dials)
	require.Equal(t, 1, r.Reconnects())
}

// A connect to a libvirtd that accepts but never answers blocks before any
// keepalive exists: it is bounded by Wait, not only by the caller's ctx.
func TestReconnectingBoundsAHungConnect(t *testing.T) {
	r := NewReconnecting(func(ctx context.Context) (Hypervisor, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	})
	r.Wait = 200 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err := r.DomainNames(ctx)
	require.Error(t, err)
	require.Less(t, time.Since(start), 3*time.Second, "gave up after Wait, not at the caller's deadline")
}
