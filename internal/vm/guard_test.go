package vm

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Guard returns when ctx ends, whatever the call does; a result the call
// returns later is released, and nothing of Guard's waits after that.
func TestGuardAbandonsACallThatOutlivesCtx(t *testing.T) {
	unblock := make(chan struct{})
	released := make(chan int, 1)
	ctx, cancel := context.WithTimeoutCause(context.Background(), 20*time.Millisecond, errors.New("cleanup timeout reached"))
	defer cancel()
	start := time.Now()
	_, err := Guard(ctx, func() (int, error) { <-unblock; return 7, nil }, func(v int) { released <- v })
	require.Less(t, time.Since(start), 5*time.Second)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "cleanup timeout reached")
	require.ErrorContains(t, err, "gave up waiting for libvirt")

	close(unblock)
	select {
	case v := <-released:
		require.Equal(t, 7, v, "the late result is freed")
	case <-time.After(5 * time.Second):
		t.Fatal("the abandoned call's result was not released")
	}
}

func TestGuardPassesResultsAndSkipsCallsAfterCtx(t *testing.T) {
	v, err := Guard(context.Background(), func() (string, error) { return "ok", nil }, nil)
	require.NoError(t, err)
	require.Equal(t, "ok", v)
	boom := errors.New("boom")
	_, err = Guard(context.Background(), func() (string, error) { return "", boom }, nil)
	require.ErrorIs(t, err, boom)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	called := false
	_, err = Guard(ctx, func() (string, error) { called = true; return "", nil }, nil)
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, called, "not started once ctx has ended")
}
