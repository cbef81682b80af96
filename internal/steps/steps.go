// Package steps runs an ordered list of steps, each with an optional undo.
// When a step fails or the context is cancelled, the undos of the steps that
// completed run in reverse order on a fresh context with its own deadline, so
// a cancelled operation still releases what it created.
package steps

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
)

// Step is one unit of work.
type Step struct {
	// Name appears in errors and progress reports.
	Name string
	// Do performs the step.
	Do func(ctx context.Context) error
	// Undo reverts a completed Do. It must treat "already gone" as success.
	Undo func(ctx context.Context) error
}

// Runner runs steps.
type Runner struct {
	// UndoTimeout bounds the whole undo phase. Zero means one minute.
	UndoTimeout time.Duration
	// OnDone, if set, is told how long each successful step took.
	OnDone func(name string, took time.Duration)
	// OnFailed, if set, is told how long the step that failed took, and its
	// error.
	OnFailed func(name string, took time.Duration, err error)
	// OnUndo, if set, is told about each undo and its error (nil on success).
	OnUndo func(name string, err error)
}

// Run runs steps in order. On the first failure, or a cancelled context
// between steps or after the last one, it undoes the completed steps in
// reverse order and returns the step's error joined with any undo errors. A
// step that swallows a cancellation therefore cannot turn a cancelled run
// into a success.
func (r Runner) Run(ctx context.Context, steps []Step) error {
	var done []Step
	for _, s := range steps {
		if err := ctx.Err(); err != nil {
			return r.undo(ctx, done, fmt.Errorf("before %s: %w", s.Name, err))
		}
		start := time.Now()
		if err := s.Do(ctx); err != nil {
			if r.OnFailed != nil {
				r.OnFailed(s.Name, time.Since(start), err)
			}
			return r.undo(ctx, done, fmt.Errorf("%s: %w", s.Name, err))
		}
		if r.OnDone != nil {
			r.OnDone(s.Name, time.Since(start))
		}
		done = append(done, s)
	}
	if ctx.Err() != nil && len(steps) > 0 {
		return r.undo(ctx, done, fmt.Errorf("after %s: %w", steps[len(steps)-1].Name, context.Cause(ctx)))
	}
	return nil
}

func (r Runner) undo(ctx context.Context, done []Step, cause error) error {
	timeout := r.UndoTimeout
	if timeout <= 0 {
		timeout = time.Minute
	}
	uctx, cancel := detachctx.WithTimeout(ctx, timeout)
	defer cancel()
	errs := []error{cause}
	for i := len(done) - 1; i >= 0; i-- {
		s := done[i]
		if s.Undo == nil {
			continue
		}
		err := s.Undo(uctx)
		if r.OnUndo != nil {
			r.OnUndo(s.Name, err)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("undo %s: %w", s.Name, err))
		}
	}
	return errors.Join(errs...)
}
