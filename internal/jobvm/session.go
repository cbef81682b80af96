package jobvm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// Session is one way into the job's guest. Run (a stage's script) and
// Stream (a command with its input and output) go through the job's
// connection holder when it answers, else over a direct SSH connection of
// the session's own (Client), made on first use and again after Forget:
// the front ends do not choose between them. It is the one place a job's
// guest connections are made.
type Session struct {
	// Who names, in the job log's note, what connects directly when the
	// holder does not take a Stream ("the steps"); "" is "this session's
	// commands".
	Who string

	j        *Job
	mu       sync.Mutex
	direct   *sshexec.Client
	noHolder atomic.Bool // the holder failed to take a stream: Stream connects directly
}

// Session is a new session into the job's guest; it connects on first
// use, not here (a stage that goes through the holder never connects).
// The caller closes it.
func (j *Job) Session() *Session { return &Session{j: j} }

// Holder says whether the job's stages go through a connection holder
// ([ssh] connection_holder).
func (s *Session) Holder() bool { return s.j.js.h.m.Cfg.SSH.HolderEnabled() }

// socket is the job machine's holder's socket.
func (s *Session) socket() (string, error) {
	jm, err := s.j.Machine()
	if err != nil {
		return "", err
	}
	return s.j.js.h.HolderSocket(jm.Name), nil
}

// heldStage runs a stage through the job's connection holder
// (holder.RunStage): holder.ErrUnavailable when the holder is gone or
// could not take it (nothing of the stage was started).
func (s *Session) heldStage(ctx context.Context, st holder.Stage) (mid bool, err error) {
	sock, err := s.socket()
	if err != nil {
		return false, fmt.Errorf("%w: %w", holder.ErrUnavailable, err)
	}
	return holder.RunStage(ctx, sock, st)
}

// heldStream runs cmd through the job's connection holder with stdin and
// stdout (holder.RunStream); holder.ErrUnavailable as heldStage.
func (s *Session) heldStream(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error {
	sock, err := s.socket()
	if err != nil {
		return fmt.Errorf("%w: %w", holder.ErrUnavailable, err)
	}
	return holder.RunStream(ctx, sock, cmd, stdin, stdout)
}

// Client is the session's direct connection to the job's guest (with the
// machine's record), made on first use: state.ErrNoMachine when the job
// has no machine.
func (s *Session) Client(ctx context.Context) (*state.Machine, *sshexec.Client, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.direct != nil {
		rec, err := s.j.Record()
		return rec, s.direct, err
	}
	jm, err := s.j.Machine()
	if err != nil {
		return nil, nil, err
	}
	mach, c, err := s.j.js.h.connect(ctx, jm.Name)
	if err != nil {
		return mach, nil, err
	}
	s.direct = c
	return mach, c, nil
}

// Take is Client whose connection the caller owns from then on (closes
// it): the session forgets it.
func (s *Session) Take(ctx context.Context) (*state.Machine, *sshexec.Client, error) {
	mach, c, err := s.Client(ctx)
	if err == nil {
		s.mu.Lock()
		s.direct = nil
		s.mu.Unlock()
	}
	return mach, c, err
}

// Forget closes c, the session's direct connection found lost: the next
// Client makes a new one.
func (s *Session) Forget(c *sshexec.Client) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.direct == c && c != nil {
		_ = c.Close()
		s.direct = nil
	}
}

// Close closes the session's direct connection, if it made one.
func (s *Session) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.direct != nil {
		_ = s.direct.Close()
		s.direct = nil
	}
}

// Stage is a stage's script for Session.Run.
type Stage struct {
	// Name is the stage's name for the host's log ("build_script").
	Name string
	// Script runs in the machine's shell; Stdout and Stderr get its
	// output.
	Script         []byte
	Stdout, Stderr io.Writer
	// Span, if set, gets how long the script ran in the guest.
	Span *time.Duration
}

// Run runs a stage's script in the job's guest, through the job's
// connection holder when it answers, else over the session's direct
// connection. A holder that is off, gone or cannot take the stage started
// nothing of it: the stage connects directly, and the stage's Stderr and
// the host's log say so. A holder that ends during the stage may leave the
// script running in the guest: it is stopped there over a direct
// connection (bounded), and the stage fails as a system failure. What the
// script's own status is comes back as sshexec.Client.Run gives it.
func (s *Session) Run(ctx context.Context, st Stage) error {
	if s.Holder() {
		held, err := s.runHeld(ctx, st)
		if held {
			return err
		}
	}
	mach, c, err := s.Client(ctx)
	if err != nil {
		return exitcodes.System(err)
	}
	s.j.log.Debug("running stage", "stage", st.Name, "address", mach.Address, "holder", false)
	return c.Run(ctx, st.Script, sshexec.RunOptions{Shell: mach.Shell, Stdout: st.Stdout, Stderr: st.Stderr, Span: st.Span})
}

// runHeld is Run through the holder; held is false when nothing of the
// stage started there.
func (s *Session) runHeld(ctx context.Context, st Stage) (held bool, err error) {
	mach, err := s.j.Record()
	if err != nil {
		return false, nil // the direct path reports it
	}
	tag, err := sshexec.NewTag()
	if err != nil {
		return true, exitcodes.System(err)
	}
	mid, err := s.heldStage(ctx, holder.Stage{
		Tag: tag, Shell: mach.Shell, Script: st.Script, Stdout: st.Stdout, Stderr: st.Stderr, Span: st.Span,
	})
	if errors.Is(err, holder.ErrUnavailable) {
		s.direct1(st.Stderr, "this stage connects directly", err)
		return false, nil
	}
	if mid {
		// The holder ended during the stage: the script may still run in
		// the guest. Stop it over a connection of our own (bounded), so
		// that nothing of the stage outlives it.
		sctx, cancel := detachctx.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		_, c, cerr := s.Client(sctx)
		if cerr == nil {
			cerr = c.StopStage(sctx, tag, 5*time.Second)
			s.Forget(c)
		}
		if cerr != nil {
			err = fmt.Errorf("%w; stopping the stage in the guest failed: %v", err, cerr)
		} else {
			err = fmt.Errorf("%w; the stage was stopped in the guest", err)
		}
		err = exitcodes.System(err)
	}
	return true, err
}

// Stream runs cmd in the job's guest with stdin and stdout: through the
// job's connection holder while it answers, else over the session's direct
// connection (once the holder failed to take one, the session's later
// streams connect directly: the stage's Stderr and the host's log say so
// once). A direct connection found lost is made again by the next call; a
// failed dial is a lost connection (ErrConnectionLost), so that a caller
// that retries lost connections retries it.
func (s *Session) Stream(ctx context.Context, cmd string, stdin io.Reader, stdout, stderr io.Writer) error {
	if !s.noHolder.Load() && s.Holder() {
		err := s.heldStream(ctx, cmd, stdin, stdout)
		if !errors.Is(err, holder.ErrUnavailable) {
			return err
		}
		if s.noHolder.CompareAndSwap(false, true) {
			who := cmp.Or(s.Who, "this session's commands")
			s.direct1(stderr, who+" connect directly", err)
		}
	}
	_, c, err := s.Client(ctx)
	if errors.Is(err, state.ErrNoMachine) {
		return exitcodes.System(err)
	}
	if err != nil {
		return exitcodes.System(fmt.Errorf("%w: %w", sshexec.ErrConnectionLost, err))
	}
	err = c.Stream(ctx, cmd, stdin, stdout)
	if errors.Is(err, sshexec.ErrConnectionLost) {
		s.Forget(c)
	}
	return err
}

// direct1 says, in the stage's output and the host's log, that the holder
// did not take the work and why.
func (s *Session) direct1(stderr io.Writer, what string, err error) {
	if stderr != nil {
		fmt.Fprintf(stderr, "libvirt-executor: %v; %s\n", err, what)
	}
	s.j.log.Warn(what, "err", err)
}
