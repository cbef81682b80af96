package failure

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Every reason comes from the error's type, wrapped or not; a cancel wins
// over what it caused; an unknown error is "other".
func TestClassify(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("stage: %w", err) }
	for _, tc := range []struct {
		err       error
		cancelled bool
		want      string
	}{
		{nil, false, ReasonNone},
		{nil, true, ReasonCancelled},
		{wrap(sshexec.ErrDeadGuest), true, ReasonCancelled},
		{&exitcodes.ScriptError{Code: 3}, false, ReasonScript},
		{wrap(&exitcodes.ScriptError{Code: 3}), false, ReasonScript},
		{wrap(sshexec.ErrDeadGuest), false, ReasonDeadGuest},
		{exitcodes.System(wrap(lifecycle.ErrBootTimeout)), false, ReasonBootTimeout},
		{wrap(lifecycle.ErrNoRoom), false, ReasonNoRoom},
		{wrap(sshexec.ErrHostKeyMismatch), false, ReasonHostKey},
		{wrap(vm.ErrConnectionLost), false, ReasonLibvirt},
		{wrap(&vm.HypervisorError{Err: errors.New("virError")}), false, ReasonLibvirt},
		{wrap(holder.ErrEnded), false, ReasonHolder},
		{errors.New("something else"), false, ReasonOther},
	} {
		require.Equal(t, tc.want, Classify(tc.err, tc.cancelled), "%v (cancelled %v)", tc.err, tc.cancelled)
		require.Contains(t, Reasons, tc.want)
	}
}
