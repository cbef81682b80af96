// Package exitcodes is the one place that decides which exit code a stage
// returns. Every other package returns typed errors; the mains call Resolve.
//
// GitLab Runner's Custom executor distinguishes two failure classes, passed to
// every stage in the environment: BUILD_FAILURE_EXIT_CODE (the user's script,
// or the user's own mistake, failed) and SYSTEM_FAILURE_EXIT_CODE (the
// infrastructure failed; config and prepare are retried). Anything that is not
// positively known to be the user's fault is a system failure.
package exitcodes

import (
	"errors"
	"fmt"
	"os"
	"strconv"
)

// Defaults used when the runner did not set the variables (it always does
// today; the values are documented as 1 and 2).
const (
	DefaultBuildFailure  = 1
	DefaultSystemFailure = 2
)

// ScriptError is a job script that ran and exited non-zero. Code is the
// script's own exit status (or 128+signal when it was killed by a signal).
type ScriptError struct {
	Code int
}

func (e *ScriptError) Error() string { return fmt.Sprintf("job script exited with status %d", e.Code) }

// UserError is a mistake in the job's own definition that retrying cannot fix,
// such as asking for an image the administrator has not configured. The
// message must say what is allowed.
type UserError struct {
	Err error
}

func (e *UserError) Error() string { return e.Err.Error() }
func (e *UserError) Unwrap() error { return e.Err }

// User wraps err as a UserError. A nil err stays nil.
func User(err error) error {
	if err == nil {
		return nil
	}
	return &UserError{Err: err}
}

// Userf formats a UserError.
func Userf(format string, args ...any) error { return &UserError{Err: fmt.Errorf(format, args...)} }

// SystemError marks an infrastructure failure explicitly. Unclassified errors
// are system failures too; the type exists so a lower layer can say so even
// when it wraps something that would otherwise look like a user error.
type SystemError struct {
	Err error
}

func (e *SystemError) Error() string { return e.Err.Error() }
func (e *SystemError) Unwrap() error { return e.Err }

// System wraps err as a SystemError. A nil err stays nil.
func System(err error) error {
	if err == nil {
		return nil
	}
	return &SystemError{Err: err}
}

// Class is the failure class of an error.
type Class int

const (
	// OK means no error.
	OK Class = iota
	// BuildClass is the user's failure: BUILD_FAILURE_EXIT_CODE.
	BuildClass
	// SystemClass is the infrastructure's failure: SYSTEM_FAILURE_EXIT_CODE.
	SystemClass
)

// Classify decides the failure class. An explicit SystemError wins over
// anything it wraps; otherwise ScriptError and UserError are build failures and
// everything else (unknown errors included) is a system failure.
func Classify(err error) Class {
	if err == nil {
		return OK
	}
	var sys *SystemError
	if errors.As(err, &sys) {
		return SystemClass
	}
	var se *ScriptError
	if errors.As(err, &se) {
		return BuildClass
	}
	var ue *UserError
	if errors.As(err, &ue) {
		return BuildClass
	}
	return SystemClass
}

// Codes are the two exit codes the runner asked for.
type Codes struct {
	Build  int
	System int
}

// FromEnv reads BUILD_FAILURE_EXIT_CODE and SYSTEM_FAILURE_EXIT_CODE through
// getenv, falling back to the documented defaults when a variable is missing
// or not a valid exit code.
func FromEnv(getenv func(string) string) Codes {
	return Codes{
		Build:  parseCode(getenv("BUILD_FAILURE_EXIT_CODE"), DefaultBuildFailure),
		System: parseCode(getenv("SYSTEM_FAILURE_EXIT_CODE"), DefaultSystemFailure),
	}
}

func parseCode(s string, def int) int {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 255 {
		return def
	}
	return n
}

// Resolve turns an error into the process exit code.
func (c Codes) Resolve(err error) int {
	switch Classify(err) {
	case OK:
		return 0
	case BuildClass:
		return c.Build
	default:
		return c.System
	}
}

// Resolve is Codes.Resolve with the codes from the process environment.
func Resolve(err error) int { return FromEnv(os.Getenv).Resolve(err) }

// ScriptCode returns the job script's own exit status carried by err, if any.
func ScriptCode(err error) (int, bool) {
	var se *ScriptError
	if errors.As(err, &se) && Classify(err) == BuildClass {
		return se.Code, true
	}
	return 0, false
}
