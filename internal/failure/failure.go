// Package failure owns the one classifier of why something failed: the
// bounded words (Reasons) that the stages' records, garm's instance
// operations and the metrics give, decided from the error's type
// (Classify). It names no front end; it reads the typed errors of the
// layers below (exitcodes, sshexec, holder, vm, lifecycle).
package failure

import (
	"errors"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Failure reasons: the bounded words metrics and logs give for why
// something failed (Classify).
const (
	ReasonNone        = "none"
	ReasonScript      = "script"
	ReasonUser        = "user"
	ReasonCancelled   = "cancelled"
	ReasonDeadGuest   = "dead_guest"
	ReasonBootTimeout = "boot_timeout"
	ReasonNoRoom      = "no_room"
	ReasonHostKey     = "host_key"
	ReasonLibvirt     = "libvirt"
	ReasonHolder      = "holder"
	ReasonOther       = "other"
)

// Reasons lists every failure reason, ReasonNone first.
var Reasons = []string{ReasonNone, ReasonScript, ReasonUser, ReasonCancelled, ReasonDeadGuest,
	ReasonBootTimeout, ReasonNoRoom, ReasonHostKey, ReasonLibvirt, ReasonHolder, ReasonOther}

// Classify says in one bounded word why err failed; cancelled tells
// that the operation was stopped (a signal: the job was cancelled or timed
// out), which wins over what the stop caused.
func Classify(err error, cancelled bool) string {
	switch {
	case err == nil && !cancelled:
		return ReasonNone
	case cancelled:
		return ReasonCancelled
	}
	if exitcodes.Classify(err) == exitcodes.BuildClass {
		if _, ok := exitcodes.ScriptCode(err); ok {
			return ReasonScript
		}
		return ReasonUser
	}
	var hv *vm.HypervisorError
	switch {
	case errors.Is(err, sshexec.ErrDeadGuest):
		return ReasonDeadGuest
	case errors.Is(err, lifecycle.ErrBootTimeout):
		return ReasonBootTimeout
	case errors.Is(err, lifecycle.ErrNoRoom):
		return ReasonNoRoom
	case errors.Is(err, sshexec.ErrHostKeyMismatch):
		return ReasonHostKey
	case errors.Is(err, vm.ErrConnectionLost), errors.As(err, &hv):
		return ReasonLibvirt
	case errors.Is(err, holder.ErrEnded):
		return ReasonHolder
	}
	return ReasonOther
}
