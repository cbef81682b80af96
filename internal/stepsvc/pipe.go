package stepsvc

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// StreamFunc runs a fixed command in the guest with stdin as its input and
// its stdout copied to stdout until the command or ctx ends, as
// sshexec.Client.Stream does (and holder.RunStream through the job's
// connection holder).
type StreamFunc func(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error

// pipe is a command in the guest as a byte stream in both directions: the
// gRPC connection to `step-runner proxy`. It ends when the command does,
// when its transport does, or when it is closed.
type pipe struct {
	stdinW  *io.PipeWriter
	stdoutR *io.PipeReader
	cancel  context.CancelFunc
	done    chan struct{}
	err     error // why it ended, once done is closed
	once    sync.Once
}

// openPipe starts cmd through stream.
func openPipe(ctx context.Context, stream StreamFunc, cmd string) *pipe {
	ctx, cancel := context.WithCancel(ctx)
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	p := &pipe{stdinW: inW, stdoutR: outR, cancel: cancel, done: make(chan struct{})}
	go func() {
		err := stream(ctx, cmd, inR, outW)
		if err == nil {
			err = io.EOF
		}
		p.err = err
		close(p.done)
		_ = inR.CloseWithError(err)
		_ = outW.CloseWithError(err)
	}()
	return p
}

func (p *pipe) Read(b []byte) (int, error)  { return p.stdoutR.Read(b) }
func (p *pipe) Write(b []byte) (int, error) { return p.stdinW.Write(b) }

// Close ends the command (its stdin first, then its context) and waits for
// its stream to return.
func (p *pipe) Close() error {
	p.once.Do(func() {
		_ = p.stdinW.Close()
		p.cancel()
		_ = p.stdoutR.Close()
	})
	<-p.done
	return nil
}

// ended is why the command ended, or nil while it runs.
func (p *pipe) ended() error {
	select {
	case <-p.done:
		return p.err
	default:
		return nil
	}
}

// conn is a pipe as the net.Conn gRPC's transport wants. Deadlines are not
// supported (gRPC's HTTP/2 client does not need them: the calls' contexts
// bound it, and the pipe's SSH connection has a keepalive that ends it when
// the guest stops answering).
type conn struct{ *pipe }

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "step-runner proxy" }

func (conn) LocalAddr() net.Addr              { return pipeAddr{} }
func (conn) RemoteAddr() net.Addr             { return pipeAddr{} }
func (conn) SetDeadline(time.Time) error      { return nil }
func (conn) SetReadDeadline(time.Time) error  { return nil }
func (conn) SetWriteDeadline(time.Time) error { return nil }
func (c conn) Close() error                   { return c.pipe.Close() }
func (c conn) Read(b []byte) (int, error)     { return c.pipe.Read(b) }
func (c conn) Write(b []byte) (int, error)    { return c.pipe.Write(b) }

var _ net.Conn = conn{}

// errPipeUsed is what gRPC gets when it dials a connection whose one pipe
// it already had: a lost transport is made again by the Runner, with the
// offset of the log it had.
var errPipeUsed = errors.New("the step-runner proxy ended; the driver reconnects")
