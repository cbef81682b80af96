package holder

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// Stage is one stage for RunStage.
type Stage struct {
	Tag    string
	Shell  string
	Script []byte
	// KillGrace: see Request. Default 5s.
	KillGrace time.Duration
	// Stdout and Stderr receive what sshexec.RunOptions' do.
	Stdout, Stderr io.Writer
	// Span, if set, receives how long the script ran in the guest, as the
	// holder measured it (0 from a holder that does not say).
	Span *time.Duration
}

// ErrEnded means the holder ended during the stage, after the script may
// have started.
var ErrEnded = errors.New("the connection holder ended during the stage")

// connectWait bounds the connect to the socket (a connection to a listening
// socket completes in its backlog even before the holder accepts it; a
// holder that died leaves a socket nobody listens on, refused at once).
const connectWait = 2 * time.Second

// RunStage runs a stage through the holder listening at socket and returns
// what sshexec.Client.Run would. An error matching ErrUnavailable means
// nothing of the stage was started in the guest (no holder, or it could not
// take the stage): the caller may connect directly. Any other failure after
// the request was sent is a system failure, since the script may have
// started: stopInGuest is then true, and the caller should stop the script
// in the guest itself (sshexec.Client.StopStage with the stage's Tag).
func RunStage(ctx context.Context, socket string, st Stage) (stopInGuest bool, err error) {
	d := net.Dialer{Timeout: connectWait}
	conn, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return false, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer conn.Close()
	grace := st.KillGrace
	if grace <= 0 {
		grace = 5 * time.Second
	}
	// A cancel (the runner's SIGTERM) reaches the holder as a frame; the
	// holder then stops the script (SIGTERM, the grace, SIGKILL) and
	// answers: the answer is waited for that long and a little more. The
	// hook is in place before the request goes out, so a holder that does
	// not read cannot make the stage ignore its cancel.
	stop := context.AfterFunc(ctx, func() {
		_ = conn.SetWriteDeadline(time.Now().Add(time.Second))
		_ = writeFrame(conn, frameCancel, nil)
		_ = conn.SetDeadline(time.Now().Add(grace + 10*time.Second))
	})
	defer stop()
	if err := writeRequest(conn, Request{Version: protocolVersion, Tag: st.Tag, Shell: st.Shell, Script: st.Script, KillGrace: grace}); err != nil {
		// The holder starts a script only after it read the whole request
		// and said so (frameStarted): nothing ran.
		return false, fmt.Errorf("%w: sending the stage failed: %v", ErrUnavailable, err)
	}
	stdout, stderr := orDiscard(st.Stdout), orDiscard(st.Stderr)
	started := false
	for {
		kind, b, err := readFrame(conn, 2*maxScript+maxControl)
		if err != nil {
			if !started {
				// Ended before it said it starts the script (a holder that
				// exited before it took the stage, or could not start it).
				return false, fmt.Errorf("%w: it ended before it took the stage: %v", ErrUnavailable, err)
			}
			// The holder ended (or hung past the cancel's wait) after it
			// may have started the script: the caller stops it in the
			// guest itself.
			return true, exitcodes.System(fmt.Errorf("%w: %v", ErrEnded, err))
		}
		switch kind {
		case frameStarted:
			started = true
		case frameStdout:
			_, _ = stdout.Write(b)
		case frameStderr:
			_, _ = stderr.Write(b)
		case frameResult:
			var r Result
			if err := json.Unmarshal(b, &r); err != nil {
				return true, exitcodes.System(fmt.Errorf("bad result from the connection holder: %v", err))
			}
			if st.Span != nil {
				*st.Span = time.Duration(r.SpanNs)
			}
			return false, r.err()
		default:
			return true, exitcodes.System(fmt.Errorf("unexpected frame %q from the connection holder", kind))
		}
	}
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// RunStream runs the fixed command cmd through the holder listening at
// socket with stdin as its input and its stdout copied to stdout, as
// sshexec.Client.Stream does over the holder's connection, until the
// command or ctx ends. An error matching ErrUnavailable means nothing was
// started (the caller may connect directly); a holder that ended, or a
// connection the holder lost, is reported as sshexec.ErrConnectionLost
// (a dead guest with its sshexec.DeadGuestError).
func RunStream(ctx context.Context, socket, cmd string, stdin io.Reader, stdout io.Writer) error {
	d := net.Dialer{Timeout: connectWait}
	conn, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		if ctx.Err() != nil {
			// Stopped, not unavailable: the caller must not give up on
			// the holder for it.
			return fmt.Errorf("stream stopped: %w", context.Cause(ctx))
		}
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer conn.Close()
	var wmu sync.Mutex
	send := func(kind byte, p []byte) error {
		wmu.Lock()
		defer wmu.Unlock()
		return writeFrame(conn, kind, p)
	}
	stop := context.AfterFunc(ctx, func() {
		_ = conn.SetWriteDeadline(time.Now().Add(time.Second))
		_ = send(frameCancel, nil)
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	})
	defer stop()
	if err := writeRequest(conn, Request{Version: streamVersion, Command: cmd}); err != nil {
		return fmt.Errorf("%w: sending the stream failed: %v", ErrUnavailable, err)
	}
	started := false
	for {
		kind, b, err := readFrame(conn, 2*maxScript+maxControl)
		if err != nil {
			if !started {
				return fmt.Errorf("%w: it ended before it took the stream: %v", ErrUnavailable, err)
			}
			if ctx.Err() != nil {
				return fmt.Errorf("stream stopped: %w", context.Cause(ctx))
			}
			return exitcodes.System(fmt.Errorf("%w: %w: %v", sshexec.ErrConnectionLost, ErrEnded, err))
		}
		switch kind {
		case frameStarted:
			started = true
			// The input goes from now on (a stream the holder did not
			// take has not consumed any of it).
			go func() {
				buf := make([]byte, 32<<10)
				for {
					n, rerr := stdin.Read(buf)
					if n > 0 {
						if send(frameStdin, buf[:n]) != nil {
							return
						}
					}
					if rerr != nil {
						_ = send(frameEOF, nil)
						return
					}
				}
			}()
		case frameStdout:
			if _, err := stdout.Write(b); err != nil {
				return fmt.Errorf("stream output: %w", err)
			}
		case frameResult:
			var r Result
			if err := json.Unmarshal(b, &r); err != nil {
				return exitcodes.System(fmt.Errorf("bad result from the connection holder: %v", err))
			}
			if ctx.Err() != nil && r.Class != classOK {
				return fmt.Errorf("stream stopped: %w (%s)", context.Cause(ctx), r.Error)
			}
			if r.Lost {
				// The holder's connection ended under the stream: lost,
				// as a direct one would say (with a dead guest's verdict).
				if r.DeadAfterNs > 0 {
					return exitcodes.System(fmt.Errorf("%w: %w", sshexec.ErrConnectionLost, &deadGuest{msg: r.Error, dead: &sshexec.DeadGuestError{Silent: time.Duration(r.DeadAfterNs)}}))
				}
				return exitcodes.System(fmt.Errorf("%w: %s", sshexec.ErrConnectionLost, r.Error))
			}
			return r.err()
		default:
			return exitcodes.System(fmt.Errorf("unexpected frame %q from the connection holder", kind))
		}
	}
}
