// Package agent is the job-long program in the guest that runs a job's
// stages (cmd/lve-agent), and the host's side of its protocol.
//
// The agent is started once per job, in one SSH session of the job's
// connection, and reads requests on its stdin and answers on its stdout
// (the session's channel). A stage then costs the guest one fork: the
// stage's shell, started in a session of its own with stdin closed and
// the script on a pipe (no file on the guest's disk), its stdout and
// stderr merged into one pipe the agent relays in order. Today's stage
// wrapper (internal/sshexec) costs a new SSH session, a login shell and
// about eight processes per stage; the agent keeps its semantics:
//
//   - the script runs only once it has arrived whole (a connection lost
//     mid-upload never runs half a script);
//   - when the script's shell ends, what it left in its process group
//     (a plain `&`, `nohup`) gets SIGTERM, then SIGKILL after the grace;
//     a process that detached into a session of its own (`setsid`, a
//     daemon) lives on until the VM goes, and if it still holds the
//     output the stage ends without it;
//   - a cancel sends SIGTERM to the script's group, SIGKILL after the
//     grace;
//   - the exit status is the shell's, 128+N for a shell killed by
//     signal N (as `wait` reports it in the wrapper);
//   - when the agent's channel ends (the job's connection is gone), the
//     running stage is stopped as by a cancel and the agent exits.
//
// The wire format, both ways, is a sequence of frames (internal/frame,
// shared with the connection holder's socket): one type byte, a 4-byte
// big-endian length and the payload. The host bounds everything
// the guest sends (frame sizes, JSON sizes): a guest can be hostile.
package agent

import (
	"errors"
	"fmt"
	"io"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/frame"
)

// Protocol is the version of the frames below; the agent says it first.
const Protocol = 2

// Frame types.
const (
	// host -> agent
	frameStart  byte = 'S' // Start (JSON)
	frameScript byte = 'D' // a piece of the script
	frameCancel byte = 'C' // Cancel (JSON)

	// agent -> host
	frameHello  byte = 'H' // Hello (JSON), the agent's first frame
	frameGroup  byte = 'G' // Group (JSON): the stage's shell started, in this process group
	frameOutput byte = 'O' // the script's output (stdout and stderr, merged in order)
	frameNote   byte = 'N' // one line of the agent's own (what it did and why)
	frameExit   byte = 'X' // Exit (JSON), a stage's last frame
	frameError  byte = 'E' // Refusal (JSON): the stage did not run
)

// Bounds of what either side accepts.
const (
	// MaxScript bounds a stage's script (GitLab's are kilobytes; the
	// biggest seen are a few hundred).
	MaxScript = 64 << 20
	// maxChunk bounds one script or output frame.
	maxChunk = 64 << 10
	// maxControl bounds a JSON frame, a note and an error.
	maxControl = 4 << 10
)

// Hello is the agent's first frame.
type Hello struct {
	Protocol int    `json:"protocol"`
	Version  string `json:"version"`
	PID      int    `json:"pid"`
}

// Start asks for a stage: its shell (an absolute path or a name on the
// agent's PATH) runs the script, which follows in script frames,
// ScriptSize bytes in all.
type Start struct {
	// Seq numbers the stages of one agent (1, 2, ...); the stage's exit
	// or refusal carries it back.
	Seq        int    `json:"seq"`
	Shell      string `json:"shell"`
	ScriptSize int    `json:"script_size"`
	// LeftoverGraceMS is how long what the script left in its group gets
	// between SIGTERM and SIGKILL once the script's shell has ended.
	LeftoverGraceMS int `json:"leftover_grace_ms"`
	// DrainGraceMS is how long the agent waits for the output's end once
	// the group is gone (a detached writer may hold it open).
	DrainGraceMS int `json:"drain_grace_ms"`
}

// Cancel stops the running stage: SIGTERM to its group, SIGKILL after
// GraceMS if the script's shell has not ended.
type Cancel struct {
	GraceMS int `json:"grace_ms"`
}

// Refusal is a stage the agent did not run (its shell could not start).
type Refusal struct {
	Seq    int    `json:"seq"`
	Reason string `json:"reason"`
}

// Group says a stage's shell started, leading process group (and
// session) PGID: the host stops that group itself when the agent is gone
// mid-stage (killed), which would leave the stage running.
type Group struct {
	Seq  int `json:"seq"`
	PGID int `json:"pgid"`
}

// Exit ends a stage.
type Exit struct {
	// Seq is the stage's (Start.Seq).
	Seq int `json:"seq"`
	// Code is the shell's exit status, 128+N if signal N killed it.
	Code int `json:"code"`
	// Signal is the signal's name when one killed the shell.
	Signal string `json:"signal,omitempty"`
	// Cancelled: the stage was stopped by a Cancel or by the channel's end.
	Cancelled bool `json:"cancelled,omitempty"`
	// Detached: a process in a session of its own still held the output
	// when the stage ended; its later output is dropped.
	Detached bool `json:"detached,omitempty"`
}

// ErrProtocol is a frame the reader does not accept.
var ErrProtocol = errors.New("agent protocol error")

// writeFrame writes one frame (frame.Write).
func writeFrame(w io.Writer, typ byte, payload []byte) error { return frame.Write(w, typ, payload) }

// writeJSON writes one frame of v as JSON (frame.WriteJSON).
func writeJSON(w io.Writer, typ byte, v any) error { return frame.WriteJSON(w, typ, v) }

// readFrame reads one frame whose payload is at most limit(typ) bytes (an
// unknown type has limit -1 and is refused): frame.Read, whose refusals
// are ErrProtocol here.
func readFrame(r io.Reader, limit func(byte) int) (byte, []byte, error) {
	typ, b, err := frame.Read(r, limit)
	var unknown *frame.UnknownType
	var big *frame.TooLarge
	switch {
	case errors.As(err, &unknown):
		return 0, nil, fmt.Errorf("%w: unknown frame type %q", ErrProtocol, unknown.Type)
	case errors.As(err, &big):
		return 0, nil, fmt.Errorf("%w: frame %q of %d bytes (at most %d)", ErrProtocol, big.Type, big.Size, big.Max)
	}
	return typ, b, err
}

// hostLimit bounds the frames the host reads from the agent.
func hostLimit(typ byte) int {
	switch typ {
	case frameOutput:
		return maxChunk
	case frameHello, frameNote, frameExit, frameError, frameGroup:
		return maxControl
	}
	return -1
}

// agentLimit bounds the frames the agent reads from the host.
func agentLimit(typ byte) int {
	switch typ {
	case frameScript:
		return maxChunk
	case frameStart, frameCancel:
		return maxControl
	}
	return -1
}

// cut is s, at most n bytes of it.
func cut(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
