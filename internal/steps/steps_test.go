package steps

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func recorder(log *[]string, name string, fail error) Step {
	return Step{
		Name: name,
		Do: func(ctx context.Context) error {
			*log = append(*log, "do "+name)
			return fail
		},
		Undo: func(ctx context.Context) error {
			if ctx.Err() != nil {
				*log = append(*log, "undo "+name+" with dead context")
				return ctx.Err()
			}
			*log = append(*log, "undo "+name)
			return nil
		},
	}
}

func TestRunSuccess(t *testing.T) {
	var log []string
	var timed []string
	r := Runner{OnDone: func(n string, _ time.Duration) { timed = append(timed, n) }}
	require.NoError(t, r.Run(context.Background(), []Step{recorder(&log, "a", nil), recorder(&log, "b", nil)}))
	require.Equal(t, []string{"do a", "do b"}, log)
	require.Equal(t, []string{"a", "b"}, timed)
}

func TestRunFailureUndoesInReverse(t *testing.T) {
	var log []string
	boom := errors.New("boom")
	err := Runner{}.Run(context.Background(), []Step{
		recorder(&log, "a", nil), recorder(&log, "b", nil), recorder(&log, "c", boom), recorder(&log, "d", nil),
	})
	require.ErrorIs(t, err, boom)
	require.ErrorContains(t, err, "c: boom")
	require.Equal(t, []string{"do a", "do b", "do c", "undo b", "undo a"}, log)
}

func TestCancelledContextStillUndoes(t *testing.T) {
	var log []string
	ctx, cancel := context.WithCancel(context.Background())
	cancelling := Step{Name: "cancel", Do: func(context.Context) error { cancel(); return nil }}
	err := Runner{}.Run(ctx, []Step{recorder(&log, "a", nil), cancelling, recorder(&log, "b", nil)})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, []string{"do a", "undo a"}, log, "undo runs on a fresh context")
}

func TestUndoErrorsAreReported(t *testing.T) {
	bad := Step{Name: "x", Do: func(context.Context) error { return nil }, Undo: func(context.Context) error { return errors.New("stuck") }}
	fail := Step{Name: "y", Do: func(context.Context) error { return errors.New("nope") }}
	var undone, failed []string
	err := Runner{
		OnUndo:   func(n string, err error) { undone = append(undone, n) },
		OnFailed: func(n string, _ time.Duration, err error) { failed = append(failed, n+": "+err.Error()) },
	}.Run(context.Background(), []Step{bad, fail})
	require.Equal(t, []string{"y: nope"}, failed)
	require.ErrorContains(t, err, "y: nope")
	require.ErrorContains(t, err, "undo x: stuck")
	require.Equal(t, []string{"x"}, undone)
}

// A last step that ignores a cancellation (say, a best-effort check that logs
// and carries on) must not turn a cancelled run into a success.
func TestCancelDuringLastStepUndoesAll(t *testing.T) {
	var log []string
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	last := Step{Name: "check", Do: func(context.Context) error {
		log = append(log, "do check")
		cancel()
		return nil
	}}
	err := Runner{}.Run(ctx, []Step{recorder(&log, "a", nil), last})
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "after check")
	require.Equal(t, []string{"do a", "do check", "undo a"}, log)
}
