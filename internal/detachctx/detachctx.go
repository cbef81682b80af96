// Package detachctx owns the one way undo and cleanup get a context that
// survives the cancellation of the work they undo: the house rule
// "cleanup survives cancellation" (context.WithoutCancel plus a deadline
// of its own), written once instead of at each call site.
package detachctx

import (
	"context"
	"time"
)

// WithTimeout is a context that keeps ctx's values but not its
// cancellation or deadline, and ends after d: a teardown, undo or stop
// that must run to its end when the job was cancelled, but not forever.
func WithTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}
