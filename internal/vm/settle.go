package vm

import (
	"context"
	"sync"
	"time"
)

// MutationGrace is how long a hypervisor call that changes something (create,
// upload, delete, define, start, destroy, undefine, set metadata) may go on
// after its ctx ended. Such a call is not abandoned at once: libvirt would
// finish it anyway, and a step that gave up on a start that then happened
// would leave a running domain its undo does not know about (a cancelled
// prepare must leave nothing). A live libvirtd finishes these calls in well
// under a second; a dead one is noticed by the connection's keepalive in
// about 8 s, which fails the call. Only a hung libvirtd makes a stage wait the
// whole grace beyond its deadline. Tests may shorten it.
var MutationGrace = 10 * time.Second

// settle returns a context for one mutating call: it ends MutationGrace after
// ctx ends (with ctx's error), not when ctx ends. If ctx has already ended the
// returned context has too, so no new change starts after a cancel. Call done
// when the call has returned.
func settle(ctx context.Context) (sctx context.Context, done func()) {
	c, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	if ctx.Err() != nil {
		cancel(ctxError(ctx))
		return c, func() {}
	}
	var mu sync.Mutex
	var timer *time.Timer
	stop := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		timer = time.AfterFunc(MutationGrace, func() { cancel(ctxError(ctx)) })
	})
	return c, func() {
		stop()
		mu.Lock()
		if timer != nil {
			timer.Stop()
		}
		mu.Unlock()
		cancel(nil)
	}
}

// change runs one mutating hypervisor call under settle.
func change(ctx context.Context, call func(context.Context) error) error {
	sctx, done := settle(ctx)
	defer done()
	return call(sctx)
}

// changeV is change for a call that also returns a value.
func changeV[T any](ctx context.Context, call func(context.Context) (T, error)) (T, error) {
	sctx, done := settle(ctx)
	defer done()
	return call(sctx)
}
