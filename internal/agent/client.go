package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"
)

// Client is the host's side of one agent: stages one at a time.
type Client struct {
	w      io.Writer
	closer io.Closer // the channel, closed when the client gives up on it
	frames chan inFrame
	hello  Hello

	mu  sync.Mutex // one stage at a time
	seq int        // the last stage's Start.Seq
	err error      // the channel's end, once seen
	// group is the process group of the last stage's shell, once the
	// agent said it (0 before); read by Group while Run runs.
	group atomic.Int64
}

// Group is the process group (and session) of the last stage's shell in
// the guest, as the agent said it started it; 0 when it has not said so.
// When the agent is gone mid-stage, the host stops that group itself.
func (c *Client) Group() int { return int(c.group.Load()) }

// ErrGone is the agent's channel ending (the connection, the agent or the
// guest is gone); a stage running then has no exit status.
var ErrGone = errors.New("the agent's channel ended")

// helloTimeout bounds the wait for the agent's first frame.
const helloTimeout = 10 * time.Second

// NewClient reads the agent's Hello from r (within ctx and 10 s) and
// returns the client that sends requests on w. closer (nil: none) ends
// the channel: the client closes it when it gives up on the agent (a
// protocol error, a cancel it could not deliver), so that the agent, seeing
// its channel end, stops what it runs.
func NewClient(ctx context.Context, r io.Reader, w io.Writer, closer io.Closer) (*Client, error) {
	c := &Client{w: w, closer: closer, frames: make(chan inFrame, 16)}
	go func() {
		for {
			typ, b, err := readFrame(r, hostLimit)
			c.frames <- inFrame{typ, b, err}
			if err != nil {
				return
			}
		}
	}()
	hctx, cancel := context.WithTimeout(ctx, helloTimeout)
	defer cancel()
	select {
	case f := <-c.frames:
		if f.err != nil {
			return nil, fmt.Errorf("agent: no hello: %w", f.err)
		}
		if f.typ != frameHello {
			return nil, fmt.Errorf("%w: first frame %q, not a hello", ErrProtocol, f.typ)
		}
		if err := json.Unmarshal(f.payload, &c.hello); err != nil {
			return nil, fmt.Errorf("%w: hello: %v", ErrProtocol, err)
		}
		if c.hello.Protocol != Protocol {
			return nil, fmt.Errorf("%w: the agent speaks protocol %d, this host %d", ErrProtocol, c.hello.Protocol, Protocol)
		}
		return c, nil
	case <-hctx.Done():
		return nil, fmt.Errorf("agent: no hello within %s: %w", helloTimeout, context.Cause(hctx))
	}
}

// Hello is what the agent said of itself.
func (c *Client) Hello() Hello { return c.hello }

// RunOptions are a stage's.
type RunOptions struct {
	Shell string
	// Output receives the script's output, Notes the agent's own lines
	// (each with its newline).
	Output, Notes io.Writer
	// LeftoverGrace, DrainGrace: see Start; KillGrace: see Cancel. Zero
	// is the agent's default.
	LeftoverGrace, DrainGrace, KillGrace time.Duration
}

// stopSlack is how long after a cancel's grace (and the leftovers' and
// the drain's) the host waits for the stage's exit before it gives up on
// the agent.
const stopSlack = 5 * time.Second

// Run runs script and returns its Exit. When ctx ends first the stage is
// cancelled and Run still returns its Exit (Cancelled set), or an error
// if the agent does not end it in time. An error: the stage's result is
// unknown (ErrGone, ErrProtocol, a refused request) — a system failure,
// never the script's.
func (c *Client) Run(ctx context.Context, script []byte, o RunOptions) (Exit, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return Exit{}, c.err
	}
	if len(script) > MaxScript {
		return Exit{}, fmt.Errorf("a script of %d bytes: at most %d", len(script), MaxScript)
	}
	if err := ctx.Err(); err != nil {
		return Exit{}, fmt.Errorf("stage not started: %w", context.Cause(ctx))
	}
	out, notes := orDiscard(o.Output), orDiscard(o.Notes)
	c.seq++
	seq := c.seq
	c.group.Store(0)
	// The upload may block (an agent that stopped reading fills the
	// channel's window): a cancel must still end the stage, and half a
	// script never runs, so a cancel during it gives the channel up.
	uploaded := make(chan error, 1)
	go func() {
		err := writeJSON(c.w, frameStart, Start{Seq: seq, Shell: o.Shell, ScriptSize: len(script),
			LeftoverGraceMS: int(o.LeftoverGrace.Milliseconds()), DrainGraceMS: int(o.DrainGrace.Milliseconds())})
		for rest := script; err == nil && len(rest) > 0; {
			n := min(len(rest), maxChunk)
			err = writeFrame(c.w, frameScript, rest[:n])
			rest = rest[n:]
		}
		uploaded <- err
	}()
	select {
	case err := <-uploaded:
		if err != nil {
			return Exit{}, c.gone(err)
		}
	case <-ctx.Done():
		return Exit{}, c.gone(fmt.Errorf("%w: cancelled while the script was sent (%v): the channel is given up", ErrGone, context.Cause(ctx)))
	}
	done := ctx.Done()
	var giveUp <-chan time.Time
	for {
		select {
		case f := <-c.frames:
			if f.err != nil {
				return Exit{}, c.gone(f.err)
			}
			switch f.typ {
			case frameOutput:
				_, _ = out.Write(f.payload)
			case frameNote:
				_, _ = fmt.Fprintf(notes, "%s\n", f.payload)
			case frameGroup:
				var g Group
				if err := json.Unmarshal(f.payload, &g); err != nil || g.Seq != seq || g.PGID <= 1 {
					return Exit{}, c.gone(fmt.Errorf("%w: a group for stage %d (this is %d): %q", ErrProtocol, g.Seq, seq, cut(string(f.payload), 200)))
				}
				c.group.Store(int64(g.PGID))
			case frameError:
				var r Refusal
				if err := json.Unmarshal(f.payload, &r); err != nil || r.Seq != seq {
					return Exit{}, c.gone(fmt.Errorf("%w: a refusal of stage %d (this is %d): %q", ErrProtocol, r.Seq, seq, cut(string(f.payload), 200)))
				}
				return Exit{}, fmt.Errorf("the agent refused the stage: %q", cut(r.Reason, 500))
			case frameExit:
				var x Exit
				if err := json.Unmarshal(f.payload, &x); err != nil {
					return Exit{}, c.gone(fmt.Errorf("%w: exit: %v", ErrProtocol, err))
				}
				if x.Code < 0 || x.Code > 255 {
					return Exit{}, c.gone(fmt.Errorf("%w: exit status %d", ErrProtocol, x.Code))
				}
				if x.Seq != seq {
					return Exit{}, c.gone(fmt.Errorf("%w: the exit of stage %d (this is %d)", ErrProtocol, x.Seq, seq))
				}
				return x, nil
			default:
				return Exit{}, c.gone(fmt.Errorf("%w: frame %q during a stage", ErrProtocol, f.typ))
			}
		case <-done:
			done = nil
			grace := o.KillGrace
			if grace <= 0 {
				grace = defaultCancelGrace
			}
			if err := writeJSON(c.w, frameCancel, Cancel{GraceMS: int(grace.Milliseconds())}); err != nil {
				return Exit{}, c.gone(err)
			}
			giveUp = time.After(grace + orDefault(o.LeftoverGrace, defaultLeftoverGraceHost) + orDefault(o.DrainGrace, defaultDrainGraceHost) + stopSlack)
		case <-giveUp:
			return Exit{}, c.gone(fmt.Errorf("%w: the agent did not end the cancelled stage in time", ErrGone))
		}
	}
}

// The agent's defaults, for the host's own deadline.
const (
	defaultCancelGrace       = 5 * time.Second
	defaultLeftoverGraceHost = 2 * time.Second
	defaultDrainGraceHost    = time.Second
)

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// gone records the channel's end, or the agent breaking the protocol:
// every later Run fails at once with the same error.
func (c *Client) gone(err error) error {
	if !errors.Is(err, ErrProtocol) && !errors.Is(err, ErrGone) {
		err = fmt.Errorf("%w: %v", ErrGone, err)
	}
	c.err = err
	if c.closer != nil {
		_ = c.closer.Close()
	}
	return err
}

// Close ends the channel (the agent stops a stage it runs and exits).
func (c *Client) Close() error {
	if c.closer == nil {
		return nil
	}
	return c.closer.Close()
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}
