package sshexec

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// RunOptions configure Run.
type RunOptions struct {
	// Shell runs the script ("bash", "sh" or an absolute path).
	Shell string
	// Stdout receives the script's output live: its stdout and stderr
	// merged in the guest, so they keep their relative order. Stderr
	// receives only what the driver's guest-side wrapper says (an upload
	// failure, processes the stage left behind).
	Stdout, Stderr io.Writer
	// KillGrace is how long a cancelled script's process group gets between
	// SIGTERM and SIGKILL. Default 5s.
	KillGrace time.Duration
	// LeftoverGrace is how long processes that the script left running in
	// its process group get between SIGTERM and SIGKILL once the script's
	// shell has ended. Default 2s.
	LeftoverGrace time.Duration
	// DrainGrace is how long Run waits, after the guest reported the
	// script's exit status, for the rest of its output before it stops
	// listening. Default 2s.
	DrainGrace time.Duration
	// Tag names the stage's files in the guest (16 hex digits; NewTag). A
	// caller that may have to stop the stage from another connection
	// (StopStage) chooses it; empty means a random one.
	Tag string
	// Span, if set, receives how long the stage ran in the guest: from the
	// session's start to the script's exit status (what a stage costs
	// beyond it is its overhead).
	Span *time.Duration
	// Agent, when set, runs the stage: one fork in the guest instead of a
	// session and the wrapper (StartAgent). Tag is then unused: the agent
	// stops its stage itself when its channel ends.
	Agent *AgentSession
}

// NewTag returns a fresh stage tag for RunOptions.Tag.
func NewTag() (string, error) { return randomHex(8) }

// validTag reports whether tag is a stage tag (it becomes part of file
// names in the guest's shell commands).
func validTag(tag string) bool {
	if len(tag) != 16 {
		return false
	}
	for _, r := range tag {
		if !strings.ContainsRune("0123456789abcdef", r) {
			return false
		}
	}
	return true
}

// Run copies script into the guest over the connection, runs it with the
// shell with stdin closed, and streams its output. The stage ends when the
// script's own shell ends: processes it left running in its process group
// are stopped (SIGTERM, then SIGKILL after LeftoverGrace), and a process that
// detached into a session of its own (setsid, a daemon) may keep running but
// cannot hold the stage open. The result:
//   - nil: the script exited 0;
//   - *exitcodes.ScriptError: the script exited non-zero (or died of a signal);
//   - a system failure: anything else, including ctx cancellation, after the
//     script's whole process group in the guest was terminated.
func (c *Client) Run(ctx context.Context, script []byte, o RunOptions) error {
	if o.Agent != nil {
		return c.runOnAgent(ctx, script, o)
	}
	tag := o.Tag
	if tag == "" {
		var err error
		if tag, err = NewTag(); err != nil {
			return exitcodes.System(err)
		}
	} else if !validTag(tag) {
		return exitcodes.System(fmt.Errorf("invalid stage tag %q (16 lowercase hex digits)", tag))
	}
	w := wrapper{base: stageBase(tag), size: len(script), shell: o.Shell,
		leftoverGrace: orDefault(o.LeftoverGrace, 2*time.Second)}
	// Nothing reaches the caller's writers once Run has returned, even if
	// the guest still sends output on a channel that is being closed.
	stdout, stderr := newGate(orDiscard(o.Stdout)), newGate(orDiscard(o.Stderr))
	defer stdout.shut()
	defer stderr.shut()
	s, err := c.start(w.command(), bytes.NewReader(script), stdout, stderr)
	if err != nil {
		return err
	}
	defer s.close()
	began := time.Now()
	select {
	case res := <-s.exited:
		if o.Span != nil {
			*o.Span = time.Since(began)
		}
		if !s.drain(orDefault(o.DrainGrace, 2*time.Second)) {
			fmt.Fprintf(stderr, "libvirt-executor: the stage's script ended but a process it started still holds its output open; not waiting for it\n")
		}
		return c.classify(res)
	case <-ctx.Done():
		killErr := c.killGroup(w.pidfile(), o.KillGrace, s.exited)
		s.drain(time.Second)
		cause := fmt.Errorf("script stopped: %w", context.Cause(ctx))
		if killErr != nil {
			cause = fmt.Errorf("%w; stopping it in the guest failed: %v", cause, killErr)
		}
		return exitcodes.System(cause)
	}
}

// gate passes writes on until it is shut, then drops them.
type gate struct {
	mu   sync.Mutex
	w    io.Writer
	done bool
}

func newGate(w io.Writer) *gate { return &gate{w: w} }

func (g *gate) Write(p []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.done {
		return len(p), nil
	}
	return g.w.Write(p)
}

// shut waits for a write in progress and drops every later one.
func (g *gate) shut() {
	g.mu.Lock()
	g.done = true
	g.mu.Unlock()
}

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// uploadFailed is the signal the session shell ends itself with when the
// script could not be written in the guest.
const uploadFailed = "USR1"

func (c *Client) classify(res exitResult) error {
	if !res.ok || c.Dead() != nil {
		return c.lost(errors.New("the script ended without an exit status"))
	}
	if res.signal == uploadFailed {
		return exitcodes.System(errors.New("copy script into guest failed (the guest's message is above)"))
	}
	if res.signal != "" {
		return &exitcodes.ScriptError{Code: 128 + signalNumber(res.signal)}
	}
	if res.status == 0 {
		return nil
	}
	return &exitcodes.ScriptError{Code: res.status}
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

var signals = map[string]int{
	"HUP": 1, "INT": 2, "QUIT": 3, "ILL": 4, "ABRT": 6, "FPE": 8, "KILL": 9,
	"SEGV": 11, "PIPE": 13, "ALRM": 14, "TERM": 15, "USR1": 10, "USR2": 12,
}

func signalNumber(name string) int {
	if n, ok := signals[strings.TrimPrefix(name, "SIG")]; ok {
		return n
	}
	return 0
}
