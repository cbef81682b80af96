package detachctx

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type key struct{}

// The detached context outlives its parent's cancel, keeps its values and
// ends at its own deadline.
func TestWithTimeout(t *testing.T) {
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), key{}, "v"))
	ctx, stop := WithTimeout(parent, 50*time.Millisecond)
	defer stop()
	cancel()
	require.NoError(t, ctx.Err(), "the parent's cancel does not reach it")
	require.Equal(t, "v", ctx.Value(key{}))
	select {
	case <-ctx.Done():
		require.ErrorIs(t, ctx.Err(), context.DeadlineExceeded)
	case <-time.After(5 * time.Second):
		t.Fatal("the detached context did not end at its deadline")
	}
}
