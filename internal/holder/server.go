package holder

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// Server is the holder: it owns the connection and serves stages.
type Server struct {
	// Dial opens the connection to the guest (with the pinned host key).
	Dial func(ctx context.Context) (*sshexec.Client, error)
	// Alive reports whether the machine still exists (its state
	// directory); when it does not, the holder ends: it never outlives
	// its machine.
	Alive func() bool
	// Until is when the holder ends at the latest (the job's deadline).
	// A deadline written to UntilFile (SetUntil) replaces it: a
	// standby machine's holder is started with the machine, and the job
	// that claims the machine gives it the job's deadline.
	Until     time.Time
	UntilFile string
	// Log receives the holder's own messages (never a script or its
	// output).
	Log *slog.Logger
	// CheckEvery is how often Alive is asked. Default 1s.
	CheckEvery time.Duration
	// AgentCommand, when set, starts the job's agent in the guest on
	// every connection the holder makes (a fixed command of the host's:
	// the agent's path on the guest tools disk, never job input): the
	// stages then go through it, one fork in the guest each, instead of
	// a session and the wrapper. A guest without it keeps the wrapper,
	// and the next stage says so once.
	AgentCommand string
	// Connected, if set, is told whether each connection the holder
	// makes (the first and any made again) succeeded, and again (false)
	// when that connection ends: whether the holder has a connection to
	// offer now.
	Connected func(ok bool)

	mu      sync.Mutex
	redial  sync.Mutex    // one reconnection at a time
	ready   chan struct{} // closed once the first dial ended
	client  *sshexec.Client
	dialErr error
	broken  <-chan struct{} // closed when client's connection ended (its Ended)
	// agent is client's agent (nil: none, or it ended); agentNote is what
	// the next stage tells the job log about it ("" once told).
	agent     *sshexec.AgentSession
	agentNote string
	badUntil  sync.Once // the deadline file's complaint, once
}

// Serve dials the guest and serves stages on ln until ctx ends, the
// machine is gone or Until passes. It closes ln.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	if s.CheckEvery <= 0 {
		s.CheckEvery = time.Second
	}
	if s.Log == nil {
		s.Log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if s.deadlinePassed() {
		return nil
	}
	s.ready = make(chan struct{})
	go func() {
		s.connect(ctx)
		close(s.ready)
	}()
	go s.watch(ctx, cancel)
	stopAccept := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer func() { _ = ln.Close() }()
	defer stopAccept()
	var stages sync.WaitGroup
	defer func() {
		// Stages cancelled by the holder's end stop their scripts in the
		// guest over the connection: it is closed only after them (bounded).
		done := make(chan struct{})
		go func() { stages.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(stopStagesWait):
			s.Log.Warn("stages did not end in time; closing the connection under them")
		}
		s.closeClient()
	}()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				s.Log.Info("holder ends", "why", context.Cause(ctx))
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		}
		stages.Add(1)
		go func() {
			defer stages.Done()
			s.serve(ctx, conn)
		}()
	}
}

// stopStagesWait bounds how long an ending holder waits for its stages to
// stop their scripts (SIGTERM, the kill grace, SIGKILL).
const stopStagesWait = 20 * time.Second

// lostNoticeWait bounds how long a stage whose connection was lost waits
// for the holder to notice the connection's end before it gets its result.
const lostNoticeWait = 2 * time.Second

// frameWriteWait bounds one frame's write to a stage: a stage that stops
// reading for this long is dropped (its script is stopped in the guest).
const frameWriteWait = 60 * time.Second

// watch ends the holder when the machine is gone or its deadline passed.
func (s *Server) watch(ctx context.Context, cancel context.CancelCauseFunc) {
	t := time.NewTicker(s.CheckEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if s.Alive != nil && !s.Alive() {
				s.Log.Info("the machine is gone")
				cancel(errors.New("the machine is gone"))
				return
			}
			if s.deadlinePassed() {
				cancel(context.DeadlineExceeded)
				return
			}
		}
	}
}

// deadline is when the holder ends: the deadline in UntilFile if there is
// one, else Until (zero: none).
func (s *Server) deadline() time.Time {
	if s.UntilFile != "" {
		if b, err := os.ReadFile(s.UntilFile); err == nil {
			var sec int64
			if _, err := fmt.Sscan(string(b), &sec); err == nil && sec > 0 {
				return time.Unix(sec, 0)
			}
			s.badUntil.Do(func() {
				s.Log.Warn("unreadable deadline file: keeping the deadline the holder was started with", "file", s.UntilFile, "until", s.Until)
			})
		}
	}
	return s.Until
}

func (s *Server) deadlinePassed() bool {
	d := s.deadline()
	return !d.IsZero() && !time.Now().Before(d)
}

// UntilFile is where SetUntil records a holder's new deadline in the
// machine directory dir.
func UntilFile(dir string) string { return filepath.Join(dir, untilFile) }

const untilFile = "holder-until"

// readyFile is written in the machine directory once the holder's first
// connection was made (MarkReady).
const readyFile = "holder-ready"

// MarkReady records in the machine directory dir whether its holder has a
// connection to offer (Server.Connected): "up" or "down"; no record yet
// while its first connection is being made.
func MarkReady(dir string, ok bool) error {
	state := "down\n"
	if ok {
		state = "up\n"
	}
	p := filepath.Join(dir, readyFile)
	if err := os.WriteFile(p+".new", []byte(state), 0o600); err != nil {
		return err
	}
	return os.Rename(p+".new", p)
}

func readyState(dir string) string {
	b, err := os.ReadFile(filepath.Join(dir, readyFile))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// Ready reports whether the holder of dir has a connection to offer
// (MarkReady) and still runs.
func Ready(dir string) bool { return readyState(dir) == "up" && Running(dir) != 0 }

// Usable reports whether the holder of dir still runs and has not lost
// its connection or failed to make it: connected, or still making its
// first connection (a stage then waits for it).
func Usable(dir string) bool { return readyState(dir) != "down" && Running(dir) != 0 }

// SetUntil gives the holder of the machine directory dir the deadline
// until (written whole: a temporary file renamed). The holder looks at
// it once a second.
func SetUntil(dir string, until time.Time) error {
	tmp := UntilFile(dir) + ".new"
	if err := os.WriteFile(tmp, []byte(fmt.Sprintf("%d\n", until.Unix())), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, UntilFile(dir))
}

// connect (re)makes the connection, and starts the guest's agent on it
// (AgentCommand).
func (s *Server) connect(ctx context.Context) {
	t0 := time.Now()
	c, err := s.Dial(ctx)
	var a *sshexec.AgentSession
	note := ""
	if err == nil && s.AgentCommand != "" {
		t1 := time.Now()
		var aerr error
		if a, aerr = c.StartAgent(ctx, s.AgentCommand); aerr != nil {
			s.Log.Warn("the guest's agent did not start: stages use the wrapper", "err", aerr)
			note = fmt.Sprintf("libvirt-executor: the guest has no agent (%v): stages run through the wrapper (a session and a few processes each)", aerr)
		} else {
			took := time.Since(t1)
			s.Log.Info("the guest's agent started", "took", took, "version", fmt.Sprintf("%q", a.Hello().Version))
			note = fmt.Sprintf("libvirt-executor: the stages run through the guest agent (started in %s): one process in the guest per stage", took.Round(time.Millisecond))
		}
	}
	if s.Connected != nil {
		defer s.Connected(err == nil) // after the lock: it may be slow
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.client, s.dialErr = c, err
	if err != nil {
		s.Log.Warn("connecting to the guest failed", "err", err, "took", time.Since(t0))
		return
	}
	s.Log.Info("connected to the guest", "took", time.Since(t0))
	s.agent, s.agentNote = a, note
	s.broken = c.Ended()
	if s.Connected != nil {
		go func() { <-c.Ended(); s.Connected(false) }()
	}
}

func (s *Server) closeClient() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client != nil {
		_ = s.client.Close()
	}
}

// clientFor returns the connection for a stage: the held one, or a new
// one if the held one ended without the keepalive declaring the guest dead
// (an sshd restarted in the guest). A dead guest is reported at once: a
// stage must not wait for a new connection's timeout to learn it.
//
// ended closes when the returned connection ends.
func (s *Server) clientFor(ctx context.Context) (c *sshexec.Client, ended <-chan struct{}, res Result) {
	select {
	case <-s.ready:
	case <-ctx.Done():
		return nil, nil, Result{Class: classUnavailable, Error: "the holder is ending"}
	}
	s.mu.Lock()
	c, dialErr, broken := s.client, s.dialErr, s.broken
	s.mu.Unlock()
	if c == nil {
		return nil, nil, Result{Class: classUnavailable, Error: fmt.Sprintf("it could not connect to the guest: %v", dialErr)}
	}
	select {
	case <-broken:
	default:
		return c, broken, Result{}
	}
	if dead := c.Dead(); dead != nil {
		r := resultOf(dead)
		r.Error = fmt.Sprintf("connection to guest lost: %v", dead)
		return nil, nil, r
	}
	s.redial.Lock()
	defer s.redial.Unlock()
	s.mu.Lock()
	same := s.client == c
	s.mu.Unlock()
	if same {
		// Not yet made again by a stage that came at the same time.
		s.Log.Warn("the connection to the guest ended; connecting again")
		_ = c.Close()
		s.connect(ctx)
	}
	s.mu.Lock()
	c, dialErr, broken = s.client, s.dialErr, s.broken
	s.mu.Unlock()
	if c == nil {
		return nil, nil, Result{Class: classSystem, Error: fmt.Sprintf("connection to guest lost, and connecting again failed: %v", dialErr)}
	}
	return c, broken, Result{}
}

// serve runs one stage.
func (s *Server) serve(ctx context.Context, conn net.Conn) {
	defer conn.Close()
	if err := samePeer(conn); err != nil {
		s.Log.Warn("refused a connection", "err", err)
		return
	}
	// The stage sends its request at once.
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	kind, b, err := readFrame(conn, 2*maxScript+maxControl)
	_ = conn.SetReadDeadline(time.Time{})
	if err != nil || kind != frameRequest {
		s.Log.Warn("bad request", "err", err, "frame", kind)
		return
	}
	var req Request
	out := &frameWriter{conn: conn}
	err = json.Unmarshal(b, &req)
	if err == nil && req.Version == streamVersion && req.Command != "" {
		s.serveStream(ctx, conn, out, req)
		return
	}
	if err != nil || req.Version != protocolVersion {
		_ = out.result(Result{Class: classUnavailable, Error: fmt.Sprintf("the holder speaks protocols %d and %d (request: %d, %v)", protocolVersion, streamVersion, req.Version, err)})
		return
	}
	if len(req.Script) > maxScript {
		_ = out.result(Result{Class: classUnavailable, Error: fmt.Sprintf("script of %d bytes exceeds the holder's limit of %d", len(req.Script), maxScript)})
		return
	}
	c, ended, res := s.clientFor(ctx)
	if c == nil {
		s.Log.Warn("stage not run", "class", res.Class, "err", res.Error)
		_ = out.result(res)
		return
	}
	// The stage is cancelled by a cancel frame, by the stage's process
	// going away (its end of the socket closes), or by the holder ending.
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		kind, _, err := readFrame(conn, 0)
		switch {
		case err == nil && kind == frameCancel:
			cancel(errors.New("the stage was stopped"))
		case errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed):
			cancel(errors.New("the stage's process went away"))
		default:
			cancel(fmt.Errorf("the stage's connection to the holder failed: %v", err))
		}
	}()
	// From here on the script may start: the stage must not run it again
	// elsewhere.
	if err := out.frame(frameStarted, nil); err != nil {
		s.Log.Warn("the stage went away before it started", "err", err)
		return
	}
	t0 := time.Now()
	var span time.Duration
	a, note := s.agentFor(c)
	if note != "" {
		_ = out.frame(frameStderr, []byte(note+"\n"))
	}
	err = c.Run(sctx, req.Script, sshexec.RunOptions{
		Shell: req.Shell, Tag: req.Tag, KillGrace: req.KillGrace,
		Stdout: out.stream(frameStdout), Stderr: out.stream(frameStderr), Span: &span, Agent: a,
	})
	if errors.Is(err, sshexec.ErrAgentGone) {
		s.agentGone(a, err)
	}
	awaitLost(ctx, err, ended)
	res = resultOf(err)
	res.SpanNs = int64(span)
	s.Log.Info("stage ended", "class", res.Class, "code", res.Code, "took", time.Since(t0), "err", logErr(err))
	if err := out.result(res); err != nil && sctx.Err() == nil {
		s.Log.Warn("the stage did not receive its result", "err", err)
	}
}

// agentFor is the agent of connection c (nil: the wrapper), and the
// note for the job log about it, once.
func (s *Server) agentFor(c *sshexec.Client) (*sshexec.AgentSession, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client != c {
		return nil, ""
	}
	note := s.agentNote
	s.agentNote = ""
	return s.agent, note
}

// agentGone: agent a ended while its connection lived on; the stages
// after it use the wrapper, and the next one says so.
func (s *Server) agentGone(a *sshexec.AgentSession, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.agent != a {
		return
	}
	_ = a.Close()
	s.agent = nil
	s.agentNote = "libvirt-executor: the guest's agent ended during the previous stage: the stages after it run through the wrapper"
	s.Log.Warn("the guest's agent ended; stages use the wrapper", "err", err)
}

// serveStream runs one stream: a fixed command whose stdin comes in
// frames and whose stdout goes back in frames (the gRPC connection of
// native GitLab Steps). It ends with the command, with a cancel frame, with
// the stream's process going away or with the holder; its result says how
// (a lost connection as for a stage: the stream may reconnect through the
// holder, which connects again).
func (s *Server) serveStream(ctx context.Context, conn net.Conn, out *frameWriter, req Request) {
	c, ended, res := s.clientFor(ctx)
	if c == nil {
		s.Log.Warn("stream not run", "class", res.Class, "err", res.Error)
		res.Lost = res.Class == classSystem
		_ = out.result(res)
		return
	}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stdinR, stdinW := io.Pipe()
	go func() {
		for {
			kind, b, err := readFrame(conn, maxStdinFrame)
			switch {
			case err == nil && kind == frameStdin:
				if _, werr := stdinW.Write(b); werr != nil {
					return
				}
				continue
			case err == nil && kind == frameEOF:
				_ = stdinW.Close()
				continue
			case err == nil && kind == frameCancel:
				cancel(errors.New("the stream was stopped"))
			case errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed):
				cancel(errors.New("the stream's process went away"))
			default:
				cancel(fmt.Errorf("the stream's connection to the holder failed: %v (frame %q)", err, kind))
			}
			_ = stdinW.CloseWithError(io.ErrClosedPipe)
			return
		}
	}()
	if err := out.frame(frameStarted, nil); err != nil {
		return
	}
	t0 := time.Now()
	err := c.Stream(sctx, req.Command, stdinR, out.stream(frameStdout))
	_ = stdinR.Close()
	awaitLost(ctx, err, ended)
	res = resultOf(err)
	if res.Class == classScript {
		// A stream's command is the driver's own: its exit is no script's.
		res = Result{Class: classSystem, Error: err.Error()}
	}
	res.Lost = errors.Is(err, sshexec.ErrConnectionLost)
	s.Log.Info("stream ended", "class", res.Class, "took", time.Since(t0), "err", logErr(err))
	if err := out.result(res); err != nil && sctx.Err() == nil {
		s.Log.Warn("the stream did not receive its result", "err", err)
	}
}

// awaitLost: when err says the connection was lost, the result goes out
// once the holder has seen the connection end (bounded), so that the job's
// next stage or stream gets a new connection, not the one that just failed
// under this one.
func awaitLost(ctx context.Context, err error, ended <-chan struct{}) {
	if !errors.Is(err, sshexec.ErrConnectionLost) {
		return
	}
	select {
	case <-ended:
	case <-ctx.Done():
	case <-time.After(lostNoticeWait):
	}
}

// logErr is err for the log, unless it is the script's own exit.
func logErr(err error) any {
	if _, ok := exitcodes.ScriptCode(err); ok || err == nil {
		return nil
	}
	return err.Error()
}

// samePeer refuses a peer running as another user (the socket's 0600 mode
// and the 0700 directory already keep others out; this does not depend on
// them).
func samePeer(conn net.Conn) error {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return errors.New("not a unix socket")
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	var cred *syscall.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if credErr != nil {
		return credErr
	}
	if int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("peer uid %d is not the holder's (%d)", cred.Uid, os.Geteuid())
	}
	return nil
}

// frameWriter serialises the frames of one stage. A frame the stage does
// not take within frameWriteWait ends the stage's connection (the stage
// then sees it end mid-stage, and the holder stops the script: its
// context ends with the connection).
type frameWriter struct {
	mu     sync.Mutex
	conn   net.Conn
	failed error
}

func (f *frameWriter) frame(kind byte, p []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed != nil {
		return f.failed
	}
	_ = f.conn.SetWriteDeadline(time.Now().Add(frameWriteWait))
	if f.failed = writeFrame(f.conn, kind, p); f.failed != nil {
		_ = f.conn.Close()
	}
	return f.failed
}

func (f *frameWriter) result(r Result) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return f.frame(frameResult, b)
}

// stream is an io.Writer of frames of one kind. A failed write is dropped
// (the stage went away; the script still gets to its end or its cancel).
func (f *frameWriter) stream(kind byte) io.Writer {
	return writerFunc(func(p []byte) (int, error) {
		_ = f.frame(kind, p)
		return len(p), nil
	})
}

type writerFunc func([]byte) (int, error)

func (w writerFunc) Write(p []byte) (int, error) { return w(p) }
