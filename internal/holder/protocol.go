// Package holder keeps one SSH connection to a machine's guest for the
// whole life of a job and runs every stage of the job over it, in the
// spirit of OpenSSH's ControlMaster. The holder is a small process of its
// own per machine (a crash of one holder touches one job), started when the
// machine is ready and listening on a unix socket in the machine's 0700
// state directory; a stage connects to the socket, sends its script and
// streams the script's output back. It knows nothing of GitLab.
//
// The wire format on the socket is a sequence of frames (internal/frame,
// shared with the guest agent): one type byte, a 4-byte big-endian length
// and the payload. A stage sends one request frame
// and, if it is stopped, a cancel frame; the holder answers with output
// frames and one result frame. A stream (protocol 2: a fixed command whose
// stdin and stdout are a byte stream, such as `step-runner proxy`) also
// sends its input as frames, then the input's end.
package holder

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/frame"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// Files of the holder in the machine's state directory.
const (
	// SocketFile is the unix socket stages connect to (0600, in the 0700
	// machine directory).
	SocketFile = "holder.sock"
	// PidFile records the holder's process (pid and start time), so that
	// only that very process is ever signalled.
	PidFile = "holder.pid"
	// LogFile receives the holder's own log (no secrets); it goes with
	// the machine's directory.
	LogFile = "holder.log"
)

// protocolVersion is the request format of a stage; a holder refuses one it
// does not know as unavailable, and the stage connects directly.
// streamVersion is a stream's (a holder that only knows stages refuses it).
const (
	protocolVersion = 1
	streamVersion   = 2
)

// maxStdinFrame bounds one frame of a stream's input.
const maxStdinFrame = 1 << 20

// maxScript bounds a stage's script (GitLab's are kilobytes; the biggest
// seen are a few hundred).
const maxScript = 64 << 20

// maxControl bounds a request's or a result's JSON apart from the script.
const maxControl = 1 << 20

const (
	frameRequest byte = 'R' // stage -> holder: Request (JSON)
	frameCancel  byte = 'C' // stage -> holder: stop the stage
	frameStarted byte = 'S' // holder -> stage: the script may start from now on
	frameStdout  byte = 'O' // holder -> stage: script output
	frameStderr  byte = 'E' // holder -> stage: the wrapper's own messages
	frameResult  byte = 'X' // holder -> stage: Result (JSON), the last frame
	frameStdin   byte = 'I' // stream -> holder: input
	frameEOF     byte = 'D' // stream -> holder: the input's end
)

// Request is one stage.
type Request struct {
	Version int `json:"version"`
	// Tag names the stage's files in the guest (sshexec.RunOptions.Tag),
	// so that the stage can stop the script itself if the holder dies.
	Tag    string `json:"tag"`
	Shell  string `json:"shell"`
	Script []byte `json:"script"`
	// KillGrace is how long a cancelled script gets between SIGTERM and
	// SIGKILL (sshexec.RunOptions.KillGrace).
	KillGrace time.Duration `json:"kill_grace"`
	// Command, in a stream (Version streamVersion), is the fixed command
	// whose stdin and stdout are the stream (sshexec.Client.Stream).
	Command string `json:"command,omitempty"`
}

// Result classes.
const (
	classOK          = "ok"
	classScript      = "script"
	classSystem      = "system"
	classUnavailable = "unavailable"
)

// Result is how a stage ended.
type Result struct {
	// Class is ok, script (the script's own non-zero exit: Code), system
	// (anything else: Error), or unavailable: nothing was started in the
	// guest, and the stage may connect directly instead.
	Class string `json:"class"`
	Code  int    `json:"code,omitempty"`
	Error string `json:"error,omitempty"`
	// SpanNs is how long the script ran in the guest (sshexec.RunOptions.
	// Span); DeadAfterNs, for a guest that died, how long it had been
	// silent (sshexec.DeadAfter). Older holders send neither.
	SpanNs      int64 `json:"span_ns,omitempty"`
	DeadAfterNs int64 `json:"dead_after_ns,omitempty"`
	// Lost, for a stream, says the connection to the guest ended under
	// it (or could not be made again): the stream may be tried again.
	Lost bool `json:"lost,omitempty"`
}

// resultOf is the Result for what sshexec.Client.Run returned.
func resultOf(err error) Result {
	if err == nil {
		return Result{Class: classOK}
	}
	if code, ok := exitcodes.ScriptCode(err); ok {
		return Result{Class: classScript, Code: code}
	}
	r := Result{Class: classSystem, Error: err.Error()}
	if d, ok := sshexec.DeadAfter(err); ok {
		r.DeadAfterNs = int64(d)
	}
	return r
}

// ErrUnavailable means the holder could not take the stage and nothing of
// it was started in the guest: the stage may connect directly.
var ErrUnavailable = errors.New("connection holder unavailable")

// err turns a received Result back into the error sshexec.Client.Run
// would have returned.
func (r Result) err() error {
	switch r.Class {
	case classOK:
		return nil
	case classScript:
		return &exitcodes.ScriptError{Code: r.Code}
	case classUnavailable:
		return fmt.Errorf("%w: %s", ErrUnavailable, r.Error)
	case classSystem:
		if r.DeadAfterNs > 0 {
			return exitcodes.System(&deadGuest{msg: r.Error, dead: &sshexec.DeadGuestError{Silent: time.Duration(r.DeadAfterNs)}})
		}
		return exitcodes.System(errors.New(r.Error))
	}
	return exitcodes.System(fmt.Errorf("the connection holder answered with an unknown result %q", r.Class))
}

// writeFrame writes one frame (frame.Write).
func writeFrame(w io.Writer, kind byte, payload []byte) error { return frame.Write(w, kind, payload) }

// writeRequest sends a request frame.
func writeRequest(w io.Writer, req Request) error {
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	return writeFrame(w, frameRequest, b)
}

// readFrame reads one frame of at most limit bytes (frame.Read).
func readFrame(r io.Reader, limit int) (byte, []byte, error) { return frame.Read(r, frame.Max(limit)) }

// deadGuest is the holder's message of a guest that died, carrying the
// sshexec.DeadGuestError (errors.Is ErrDeadGuest, sshexec.DeadAfter)
// without repeating it in the message.
type deadGuest struct {
	msg  string
	dead *sshexec.DeadGuestError
}

func (e *deadGuest) Error() string { return e.msg }
func (e *deadGuest) Unwrap() error { return e.dead }
