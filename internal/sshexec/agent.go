package sshexec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/agent"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// AgentSession is the job's agent in the guest (internal/agent), running
// in one session of the connection for as long as the session lasts.
type AgentSession struct {
	*agent.Client
	ch     ssh.Channel
	stderr *capped // what the agent says of itself (bounded)
}

// ErrNoAgent is StartAgent's error when the guest has no agent to start
// (the command is not there or did not speak the protocol).
var ErrNoAgent = errors.New("no agent in the guest")

// StartAgent runs command (a fixed command line of the host's, never job
// input: the agent's path on the guest tools disk) in one session of the
// connection and returns the agent once it said hello (within ctx).
// Closing it ends the session: the agent stops a stage it still runs and
// exits.
func (c *Client) StartAgent(ctx context.Context, command string) (*AgentSession, error) {
	ch, reqs, err := c.c.OpenChannel("session", nil)
	if err != nil {
		return nil, c.lost(err)
	}
	s := &session{ch: ch, exited: make(chan exitResult, 1), drained: make(chan struct{})}
	go s.watch(reqs)
	ok, err := ch.SendRequest("exec", true, ssh.Marshal(struct{ Command string }{command}))
	if err == nil && !ok {
		err = errors.New("the guest refused to run a command")
	}
	if err != nil {
		_ = ch.Close()
		return nil, c.lost(err)
	}
	a := &AgentSession{ch: ch, stderr: &capped{limit: 4 << 10}}
	stderrDone := make(chan struct{})
	go func() { _, _ = io.Copy(a.stderr, ch.Stderr()); close(stderrDone) }()
	if a.Client, err = agent.NewClient(ctx, ch, ch, ch); err != nil {
		if c.Dead() != nil {
			_ = ch.Close()
			return nil, c.lost(err)
		}
		select { // what the guest said of it, once it has said it
		case <-stderrDone:
		case <-time.After(time.Second):
		}
		_ = ch.Close()
		if said := strings.TrimSpace(a.stderr.String()); said != "" {
			err = fmt.Errorf("%w (the guest said: %s)", err, said)
		}
		return nil, fmt.Errorf("%w: %w", ErrNoAgent, err)
	}
	return a, nil
}

// ErrAgentGone is a stage whose agent ended (or broke its protocol) while
// the connection lived on: a system failure; the connection can still run
// stages through the wrapper.
var ErrAgentGone = errors.New("the guest's agent ended mid-stage")

// agentGoneNotice bounds the wait, after the agent's channel ended, for
// the connection's own end (a dropped connection ends both at once).
const agentGoneNotice = 500 * time.Millisecond

// connectionEnded reports whether the connection has ended, or ends
// within d.
func (c *Client) connectionEnded(d time.Duration) bool {
	if c.Dead() != nil {
		return true
	}
	select {
	case <-c.ended:
		return true
	case <-time.After(d):
		return false
	}
}

func cut(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// stopGroup stops a stage whose agent the host gave up on, from a
// session of its own: the agent (pid, if it still runs: a stalled one
// holds the stage's output) gets SIGKILL, the stage's process group g
// SIGTERM, then SIGKILL after grace (default 5 s) if it is still there.
// pid and g are numbers the agent said, never text.
func (c *Client) stopGroup(pid, g int, grace time.Duration) error {
	ticks := int(orDefault(grace, 5*time.Second) / (100 * time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), orDefault(grace, 5*time.Second)+10*time.Second)
	defer cancel()
	cmd := strings.NewReplacer("{pid}", strconv.Itoa(max(pid, 0)), "{g}", strconv.Itoa(g), "{ticks}", strconv.Itoa(ticks)).Replace(
		`[ {pid} -gt 1 ] && [ "$(cat /proc/{pid}/comm 2>/dev/null)" = lve-agent ] && kill -KILL {pid} 2>/dev/null; ` +
			`if kill -TERM -{g} 2>/dev/null; then i=0; while kill -0 -{g} 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; ` +
			`kill -KILL -{g} 2>/dev/null; fi; exit 0`)
	_, err := c.Output(ctx, cmd)
	return err
}

// Close ends the agent's session.
func (a *AgentSession) Close() error { return a.ch.Close() }

// runOnAgent is Run through the agent, with Run's result classes: nil,
// *exitcodes.ScriptError, or a system failure (a cancel, the agent or the
// connection gone, the agent refusing the stage).
func (c *Client) runOnAgent(ctx context.Context, script []byte, o RunOptions) error {
	stdout, stderr := newGate(orDiscard(o.Stdout)), newGate(orDiscard(o.Stderr))
	defer stdout.shut()
	defer stderr.shut()
	began := time.Now()
	x, err := o.Agent.Run(ctx, script, agent.RunOptions{Shell: o.Shell, Output: stdout, Notes: stderr,
		LeftoverGrace: o.LeftoverGrace, DrainGrace: o.DrainGrace, KillGrace: o.KillGrace})
	if o.Span != nil {
		*o.Span = time.Since(began)
	}
	switch {
	case err != nil && (errors.Is(err, agent.ErrGone) || errors.Is(err, agent.ErrProtocol) || c.Dead() != nil):
		if c.connectionEnded(agentGoneNotice) {
			return c.lost(err)
		}
		// The connection lives on: the agent alone is gone (killed, or
		// it broke the protocol). The stage's result is unknown, and its
		// shell may still run (nothing stops it now): it is stopped as a
		// cancel would, over a session of its own.
		if said := strings.TrimSpace(o.Agent.stderr.String()); said != "" {
			err = fmt.Errorf("%w (the agent said: %q)", err, cut(said, 500))
		}
		if g := o.Agent.Group(); g > 1 {
			if serr := c.stopGroup(o.Agent.Hello().PID, g, o.KillGrace); serr != nil {
				err = fmt.Errorf("%w; its stage's processes (group %d) could not be stopped: %v", err, g, serr)
			} else {
				err = fmt.Errorf("%w; its stage's processes were stopped", err)
			}
		}
		return exitcodes.System(fmt.Errorf("%w: %w", ErrAgentGone, err))
	case err != nil:
		return exitcodes.System(err)
	case x.Cancelled || ctx.Err() != nil:
		return exitcodes.System(fmt.Errorf("script stopped: %w", context.Cause(ctx)))
	case x.Code == 0:
		return nil
	}
	return &exitcodes.ScriptError{Code: x.Code}
}
