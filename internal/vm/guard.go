package vm

import (
	"context"
	"errors"
	"fmt"
)

// Guard runs call in a goroutine of its own and returns its result, or, as
// soon as ctx ends, ctx's error (see abandoned). It is for calls that nothing
// can interrupt: libvirt's C calls wait for libvirtd however long it takes.
// The abandoned call goes on in its goroutine; if it later succeeds, release
// (when not nil) frees what it returned. A call blocked on a hung libvirtd
// stays blocked until the connection's keepalive gives up on it or the
// process exits; a stage process exits soon after its deadline, so nothing
// waits for it. A call is not started at all when ctx has already ended.
func Guard[T any](ctx context.Context, call func() (T, error), release func(T)) (T, error) {
	var zero T
	if ctx.Err() != nil {
		return zero, abandoned(ctx)
	}
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := call()
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
	}
	select {
	case r := <-done: // it returned just as ctx ended: keep the answer
		return r.v, r.err
	default:
	}
	if release != nil {
		go func() {
			if r := <-done; r.err == nil {
				release(r.v)
			}
		}()
	}
	return zero, abandoned(ctx)
}

// ErrClosed is the error of a call on a hypervisor connection after its
// Close.
var ErrClosed = errors.New("libvirt connection already closed")

// abandoned is the error of a hypervisor call that ctx ended first. It
// matches ctx.Err() and ctx's cause.
func abandoned(ctx context.Context) error {
	return fmt.Errorf("gave up waiting for libvirt: %w", ctxError(ctx))
}

// ctxError is ctx's error with its cause, if the cause says more: it matches
// both with errors.Is.
func ctxError(ctx context.Context) error {
	err, cause := ctx.Err(), context.Cause(ctx)
	if cause == nil || errors.Is(cause, err) {
		return err
	}
	return fmt.Errorf("%w (%w)", cause, err)
}
