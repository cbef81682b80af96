// Package stepsvc runs a GitLab Steps job natively: through the Step
// Runner's gRPC service in the guest (`step-runner serve`), reached by
// `step-runner proxy` on an SSH session of the job's connection, so that no
// port is opened in the guest. It starts the service once per job, sends
// Run, streams FollowLogs to the job log, and re-attaches when the session
// or the connection under it drops: the steps go on in the guest, and the
// log resumes where it was, without a gap or a line twice. Status says how
// the run ended; Close and the end of the service's session stop what is
// left. RunJob is the run stage's way in: it reads the job's run: and
// variables from the runner's payload (package gitlab only decides that a
// stage runs its steps natively, and the run stage's executable alone
// links this package's gRPC client). It knows nothing of SSH (the caller
// gives a StreamFunc: the job's session).
package stepsvc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"gitlab.com/gitlab-org/step-runner/proto"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// Request is one run of steps.
type Request struct {
	// ID names the run in the service (the CI job id: digits only).
	ID string
	// BuildDir is where the steps run (the job's project directory).
	BuildDir string
	// Env is the steps' environment (the job's variables, file variables
	// as the paths the service writes them at: FilePath).
	Env map[string]string
	// Variables are the job's variables for ${{ job.X }}; the service
	// writes the file ones into the run's own directory (removed by
	// Close).
	Variables []Variable
	// Steps is the job's `run:` as the payload has it (JSON).
	Steps string
}

// Variable is one job variable.
type Variable struct {
	Key, Value   string
	File, Masked bool
}

// ValidKey says a variable name can be handed to the service: it writes a
// file variable at its output directory joined with the name, so a name
// with a slash or dots would write elsewhere.
func ValidKey(k string) bool { return validKey.MatchString(k) }

var validKey = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

var validID = regexp.MustCompile(`^[0-9]{1,19}$`)

// FilePath is where the service writes file variable key of run id.
func FilePath(dir, id, key string) string {
	return dir + "/step-runner-output-" + id + "/" + key
}

// Runner runs one Request.
type Runner struct {
	// Stream runs a fixed command in the guest (see StreamFunc). It is
	// called again for each reconnection; it makes its connection again
	// itself when the one it had was lost.
	Stream StreamFunc
	// Dir is the service's directory in the guest (DefaultDir).
	Dir string
	// Out receives the steps' output (the job log).
	Out io.Writer
	// Note receives the driver's own lines for the job log (stderr).
	Note func(format string, args ...any)
	// Log receives the driver's log.
	Log *slog.Logger
	// ReconnectFor bounds how long a lost connection is tried again
	// before the stage fails (a dead guest fails it at once). Default 60s.
	ReconnectFor time.Duration
	// StartWait bounds the service's start. Default 20s.
	StartWait time.Duration
	// StopGrace is how long the steps' processes get between SIGTERM and
	// SIGKILL at the end. Default 5s.
	StopGrace time.Duration
	// Reattached, if set, is told of each reconnection (tests, metrics).
	Reattached func(offset int64)
}

// ErrNoStepRunner means the guest has no step-runner on its PATH.
var ErrNoStepRunner = errors.New("the guest has no step-runner on its PATH")

func (r *Runner) defaults() {
	if r.Dir == "" {
		r.Dir = DefaultDir
	}
	if r.ReconnectFor <= 0 {
		r.ReconnectFor = 60 * time.Second
	}
	if r.StartWait <= 0 {
		r.StartWait = 20 * time.Second
	}
	if r.StopGrace <= 0 {
		r.StopGrace = 5 * time.Second
	}
	if r.Log == nil {
		r.Log = slog.New(slog.DiscardHandler)
	}
	if r.Note == nil {
		r.Note = func(string, ...any) {}
	}
	if r.Out == nil {
		r.Out = io.Discard
	}
}

// Run runs req and returns nil when the steps succeeded, an
// *exitcodes.ScriptError with the failed step's exit code when they
// failed, and a system failure when the driver could not run them or lost
// the guest. When ctx ends (the runner's SIGTERM: cancel, timeout) the run
// is closed and its processes stopped.
func (r *Runner) Run(ctx context.Context, req Request) error {
	r.defaults()
	if err := checkDir(r.Dir); err != nil {
		return exitcodes.System(err)
	}
	if !validID.MatchString(req.ID) {
		return exitcodes.System(fmt.Errorf("run id %q: only 1 to 19 digits are allowed", req.ID))
	}
	t0 := time.Now()
	if err := r.start(ctx); err != nil {
		return err
	}
	r.Note("libvirt-executor: step-runner service ready in the VM in %s", time.Since(t0).Round(10*time.Millisecond))
	s := &session{r: r, req: req, tailAt: -1}
	t1 := time.Now()
	err := s.run(ctx)
	r.Log.Debug("steps ended", "took", time.Since(t1), "err", err)
	// Close the run (its output directory with the file variables goes)
	// and end the service with what the steps left running, whatever
	// became of the run, on a context of its own: a cancelled stage
	// still stops its steps.
	cctx, cancel := detachctx.WithTimeout(ctx, r.StopGrace+20*time.Second)
	defer cancel()
	if !errors.Is(err, sshexec.ErrDeadGuest) {
		if ctx.Err() != nil || s.c == nil || s.p == nil || s.p.ended() != nil {
			// The connection went with the stage's context (or was lost):
			// a new one for the Close.
			if cerr := s.connect(cctx); cerr != nil {
				r.Log.Warn("connecting to close the run failed", "err", cerr)
			}
		}
		if s.c != nil {
			if _, cerr := s.c.Close(cctx, &proto.CloseRequest{Id: req.ID}); cerr != nil {
				r.Log.Warn("closing the run failed", "err", cerr)
			}
		}
		s.drop()
		t2 := time.Now()
		out, serr := r.output(cctx, stopCommand(r.Dir, r.StopGrace))
		switch {
		case serr != nil:
			r.Log.Warn("stopping the step-runner service failed", "err", serr)
		case strings.Contains(string(out), "killed"):
			r.Note("libvirt-executor: the steps left processes running that ignored SIGTERM for %s: killed", r.StopGrace)
		case strings.Contains(string(out), "left"):
			r.Note("libvirt-executor: stopped the processes the steps left running")
		}
		r.Log.Debug("step-runner service stopped", "took", time.Since(t2))
	}
	s.drop()
	return err
}

// start starts the service (or finds it running).
func (r *Runner) start(ctx context.Context) error {
	out, err := r.output(ctx, startCommand(r.Dir, r.StartWait))
	if err != nil {
		return exitcodes.System(fmt.Errorf("starting the step-runner service in the guest: %w", err))
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	switch answer := lines[len(lines)-1]; {
	case lines[0] == answerServeEnded:
		return exitcodes.System(fmt.Errorf("step-runner serve ended at once in the guest: %s", printable(strings.Join(lines[1:], " "), 500)))
	case answer == answerReady:
		return nil
	case answer == answerNoRunner:
		return exitcodes.System(ErrNoStepRunner)
	case answer == answerNoSetsid, answer == answerNoAwk:
		return exitcodes.System(fmt.Errorf("the guest lacks %s, which native steps need (use [steps] mode = \"shim\" for this image)", strings.TrimPrefix(answer, "no-")))
	case answer == answerNotOwned:
		return exitcodes.System(fmt.Errorf("%s in the guest is not a directory of the job's user: refusing to use it", r.Dir))
	case answer == answerServeSlow:
		return exitcodes.System(fmt.Errorf("step-runner serve did not open its socket within %s", r.StartWait))
	default:
		return exitcodes.System(fmt.Errorf("unexpected answer from the guest while starting step-runner serve: %q", printable(answer, 200)))
	}
}

// ErrServiceGone means the service ended during the steps.
var ErrServiceGone = errors.New("the step-runner service ended during the steps")

// serviceGone checks, after a failed reconnection, whether the service
// itself ended (a step that signals its own process group, `kill 0`, ends
// it too: the steps run in its group). That is the steps' doing, as the
// same signal ends the shim's `step-runner ci`: a build failure, said in
// the job log, instead of reconnecting in vain.
func (r *Runner) serviceGone(ctx context.Context) error {
	out, err := r.output(ctx, aliveCommand(r.Dir))
	if err != nil || strings.TrimSpace(string(out)) != answerGone {
		return nil
	}
	r.Note("libvirt-executor: %v: did a step signal its process group (kill 0)? The steps' result is lost", ErrServiceGone)
	return fmt.Errorf("%w: %w", ErrServiceGone, &exitcodes.ScriptError{Code: 1})
}

// output runs a fixed command and returns its stdout (bounded).
func (r *Runner) output(ctx context.Context, cmd string) ([]byte, error) {
	out := &capped{limit: 64 << 10}
	// Each command is bounded: a guest that takes it and never answers
	// must not hold the stage.
	ctx, cancel := context.WithTimeout(ctx, r.StartWait+r.StopGrace+30*time.Second)
	defer cancel()
	err := r.Stream(ctx, cmd, strings.NewReader(""), out)
	return out.take(), err
}

// capped keeps the first limit bytes written to it. A StreamFunc may return
// when its context ends while its copy still writes (sshexec.Stream does):
// what was kept is read only through take, which ends the keeping.
type capped struct {
	mu    sync.Mutex
	taken bool
	b     []byte
	limit int
}

func (c *capped) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if room := c.limit - len(c.b); room > 0 && !c.taken {
		c.b = append(c.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

// take returns what was kept; later writes are dropped, so the bytes
// returned are the caller's alone.
func (c *capped) take() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.taken = true
	return c.b
}

// session is one run's client side: the current gRPC connection and where
// the log stands.
type session struct {
	r   *Runner
	req Request
	p   *pipe
	cc  *grpc.ClientConn
	c   proto.StepRunnerClient

	// lines is how many of the log's non-empty lines were received, and
	// open whether the last one still lacks its "\n": together they say
	// where to resume.
	lines int64
	open  bool
	// tailAt is where the copy of the log file stands (-1: not started).
	tailAt int64
}

// connect makes a gRPC connection over a new proxy.
func (s *session) connect(ctx context.Context) error {
	s.drop()
	p := openPipe(ctx, s.r.Stream, proxyCommand(s.r.Dir))
	used := false
	cc, err := grpc.NewClient("passthrough:///step-runner",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) {
			if used {
				return nil, errPipeUsed
			}
			used = true
			return conn{p}, nil
		}))
	if err != nil {
		_ = p.Close()
		return exitcodes.System(err)
	}
	s.p, s.cc, s.c = p, cc, proto.NewStepRunnerClient(cc)
	return nil
}

// drop closes the current connection.
func (s *session) drop() {
	if s.cc != nil {
		_ = s.cc.Close()
	}
	if s.p != nil {
		_ = s.p.Close()
	}
	s.p, s.cc, s.c = nil, nil, nil
}

// lost says whether err is the connection's end (a reconnect may help),
// and returns the error to fail with when it may not: a dead guest. A
// StreamFunc reports a lost connection as sshexec.ErrConnectionLost.
func (s *session) lost(err error) (bool, error) {
	end := err
	if s.p != nil {
		if e := s.p.ended(); e != nil && !errors.Is(e, io.EOF) {
			end = e
		}
	}
	if errors.Is(end, sshexec.ErrDeadGuest) || errors.Is(err, sshexec.ErrDeadGuest) {
		return false, exitcodes.System(fmt.Errorf("the steps' connection: %w", end))
	}
	if errors.Is(err, sshexec.ErrConnectionLost) || errors.Is(end, sshexec.ErrConnectionLost) {
		return true, nil
	}
	if st, ok := status.FromError(err); ok {
		return st.Code() == codes.Unavailable || st.Code() == codes.Canceled, nil
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF), nil
}

// maxReconnects bounds the reconnections of one run (a connection that
// keeps dropping and coming back).
const maxReconnects = 20

// Phases of a run on the client side.
const (
	phaseRun     = iota // send Run
	phaseFollow         // stream the log (from where it stands)
	phaseWaitEnd        // the stream broke off: wait for the run's end
	phaseTail           // then copy the rest of the log file
	phaseStatus         // ask how it ended
)

func (s *session) run(ctx context.Context) error {
	if err := s.connect(ctx); err != nil {
		return err
	}
	phase := phaseRun
	var lostSince time.Time
	reconnects := 0
	for attempt := 0; ; {
		var err error
		switch phase {
		case phaseRun:
			// Run is idempotent for an id the service has: a Run whose
			// answer was lost is sent again.
			if _, err = s.c.Run(ctx, s.runRequest()); err == nil {
				s.r.Log.Debug("steps started", "id", s.req.ID)
				phase = phaseFollow
			}
		case phaseFollow:
			var off int64
			if off, err = s.resumeAt(ctx); err == nil {
				if attempt > 0 {
					s.r.Log.Info("re-attached to the steps", "offset", off, "lines", s.lines)
					if s.lines == 0 {
						s.r.Note("libvirt-executor: the connection to the step-runner service was lost; re-attached, the log goes on from its start")
					} else {
						s.r.Note("libvirt-executor: the connection to the step-runner service was lost; re-attached, the log goes on after line %d", s.lines)
					}
					if s.r.Reattached != nil {
						s.r.Reattached(off)
					}
				}
				if err = s.follow(ctx, off); err == nil {
					phase = phaseStatus
				}
			}
		case phaseWaitEnd:
			if err = s.waitEnd(ctx); err == nil {
				phase = phaseTail
			}
		case phaseTail:
			if err = s.tail(ctx); err == nil {
				phase = phaseStatus
			}
		case phaseStatus:
			var st *proto.Status
			if st, err = s.status(ctx); err == nil {
				if st.Status == proto.StepResult_running || st.Status == proto.StepResult_unspecified {
					// The log ended before the run did.
					phase = phaseWaitEnd
					continue
				}
				return s.verdict(st)
			}
		}
		if err == nil {
			continue
		}
		if ctx.Err() != nil {
			return exitcodes.System(fmt.Errorf("stage stopped: %w", context.Cause(ctx)))
		}
		lost, fatal := s.lost(err)
		if fatal != nil {
			return fatal
		}
		if !lost {
			switch phase {
			case phaseRun:
				if st, ok := status.FromError(err); ok && st.Code() == codes.Unknown {
					return s.refused(err)
				}
			case phaseFollow:
				if st, ok := status.FromError(err); ok && st.Code() == codes.Unknown {
					// The service ended the stream itself (a line over its
					// limit): the log file has the rest.
					s.r.Log.Warn("the step-runner service's log stream failed", "err", err)
					s.r.Note("libvirt-executor: the step-runner service stopped streaming the log (%s); the rest follows when the steps end",
						printable(st.Message(), 300))
					phase = phaseWaitEnd
					continue
				}
			}
			return exitcodes.System(fmt.Errorf("the step-runner service: %s", printable(err.Error(), 1000)))
		}
		// The connection is lost: make it again, for a while.
		s.r.Log.Warn("the connection to the step-runner service was lost", "err", err, "why", s.endOfPipe())
		if lostSince.IsZero() {
			lostSince = time.Now()
		}
		attempt++
		for {
			if time.Since(lostSince) > s.r.ReconnectFor {
				return exitcodes.System(fmt.Errorf("the connection to the step-runner service was lost (%s) and not made again within %s", s.endOfPipe(), s.r.ReconnectFor))
			}
			select {
			case <-ctx.Done():
				return exitcodes.System(fmt.Errorf("stage stopped: %w", context.Cause(ctx)))
			case <-time.After(min(time.Duration(attempt)*100*time.Millisecond, 2*time.Second)):
			}
			reconnects++
			if reconnects > maxReconnects {
				return exitcodes.System(fmt.Errorf("the connection to the step-runner service was lost %d times: giving up", maxReconnects))
			}
			if err := s.connect(ctx); err != nil {
				return err
			}
			// Any answer of the service is the connection made again (a
			// Status of all runs: the run may not be there yet). The
			// attempt is bounded: a guest that takes the command and
			// never runs it must not hold the stage past ReconnectFor.
			actx, cancel := context.WithTimeout(ctx, max(s.r.ReconnectFor-time.Since(lostSince), time.Second))
			_, err := s.c.Status(actx, &proto.StatusRequest{})
			cancel()
			if err != nil {
				if _, fatal := s.lost(err); fatal != nil {
					return fatal
				}
				if ctx.Err() == nil {
					if gone := s.r.serviceGone(ctx); gone != nil {
						return gone
					}
				}
				s.r.Log.Warn("reconnecting to the step-runner service failed", "err", err, "why", s.endOfPipe())
				attempt++
				continue
			}
			lostSince = time.Time{}
			break
		}
	}
}

func (s *session) endOfPipe() string {
	if s.p == nil {
		return ""
	}
	if e := s.p.ended(); e != nil {
		return e.Error()
	}
	return ""
}

// refused is a Run the service answered with an error: the steps could
// not be read or prepared, the job's own fault.
func (s *session) refused(err error) error {
	s.r.Note("libvirt-executor: the step-runner service refused the steps: %s", printable(status.Convert(err).Message(), 2000))
	return &exitcodes.ScriptError{Code: 1}
}

func (s *session) runRequest() *proto.RunRequest {
	vars := make([]*proto.Variable, 0, len(s.req.Variables))
	for _, v := range s.req.Variables {
		vars = append(vars, &proto.Variable{Key: v.Key, Value: v.Value, File: v.File, Masked: v.Masked})
	}
	return &proto.RunRequest{
		Id:      s.req.ID,
		WorkDir: s.req.BuildDir,
		Env:     s.req.Env,
		Job:     &proto.Job{Variables: vars, BuildDir: s.req.BuildDir},
		// The steps document: an empty spec, then the job's run: (JSON is
		// YAML).
		Steps: "{}\n---\nrun: " + s.req.Steps + "\n",
	}
}

// follow streams the log from offset to Out until the service ends the
// stream (the run has ended and its log is complete) or it fails.
func (s *session) follow(ctx context.Context, offset int64) error {
	stream, err := s.c.FollowLogs(ctx, &proto.FollowLogsRequest{Id: s.req.ID, Offset: offset})
	if err != nil {
		return err
	}
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		s.take(m.GetData())
	}
}

// take writes one message of the log: a line without its newline, or the
// newline.
func (s *session) take(b []byte) {
	if len(b) == 0 {
		return
	}
	if string(b) == "\n" {
		s.open = false
	} else {
		s.lines++
		s.open = true
	}
	_, _ = s.r.Out.Write(b)
}

// resumeAt is the log file's offset after the last line received: asked of
// the guest, since the service's stream leaves out empty lines and CRs. A
// line that came without its newline gets it here.
func (s *session) resumeAt(ctx context.Context) (int64, error) {
	if s.open {
		s.take([]byte("\n"))
	}
	if s.lines == 0 {
		return 0, nil
	}
	out, err := s.r.output(ctx, offsetCommand(s.r.Dir, s.req.ID, s.lines))
	if err != nil {
		return 0, fmt.Errorf("finding where the log stands: %w", err)
	}
	off, perr := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if perr != nil || off < 0 {
		return 0, fmt.Errorf("finding where the log stands: the log has fewer than the %d lines received (%q)", s.lines, printable(string(out), 100))
	}
	return off, nil
}

// waitEnd waits for the run to end (the log stream broke off before).
func (s *session) waitEnd(ctx context.Context) error {
	for {
		st, err := s.status(ctx)
		if err != nil {
			return err
		}
		if st.Status != proto.StepResult_running && st.Status != proto.StepResult_unspecified {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// tail copies the rest of the ended run's log from its file, as it is
// (with its empty lines), resuming where an interrupted copy stopped.
func (s *session) tail(ctx context.Context) error {
	if s.tailAt < 0 {
		off, err := s.resumeAt(ctx)
		if err != nil {
			return err
		}
		s.tailAt = off
	}
	return s.r.Stream(ctx, tailCommand(s.r.Dir, s.req.ID, s.tailAt), strings.NewReader(""), writerFunc(func(b []byte) (int, error) {
		_, err := s.r.Out.Write(b)
		s.tailAt += int64(len(b))
		return len(b), err
	}))
}

type writerFunc func([]byte) (int, error)

func (w writerFunc) Write(p []byte) (int, error) { return w(p) }

func (s *session) status(ctx context.Context) (*proto.Status, error) {
	res, err := s.c.Status(ctx, &proto.StatusRequest{Id: s.req.ID})
	if err != nil {
		return nil, err
	}
	for _, st := range res.GetJobs() {
		if st.GetId() == s.req.ID {
			return st, nil
		}
	}
	return nil, fmt.Errorf("the step-runner service does not know run %s (was it restarted?)", s.req.ID)
}

// verdict turns how the run ended into the stage's result.
func (s *session) verdict(st *proto.Status) error {
	switch st.Status {
	case proto.StepResult_success:
		return nil
	case proto.StepResult_failure:
		msg := printable(st.GetMessage(), 2000)
		s.r.Note("libvirt-executor: the steps failed: %s", msg)
		if code, ok := exitCodeOf(st.GetMessage()); ok {
			return &exitcodes.ScriptError{Code: code}
		}
		return &exitcodes.ScriptError{Code: 1}
	default:
		return exitcodes.System(fmt.Errorf("the steps ended as %s: %s", st.Status, printable(st.GetMessage(), 2000)))
	}
}

var exitStatus = regexp.MustCompile(`exit status (\d{1,3})\s*$`)

// exitCodeOf reads the failed step's exit code out of the service's
// message ("step \"x\": exec: exit status 3"): the only place it says it.
func exitCodeOf(msg string) (int, bool) {
	m := exitStatus.FindStringSubmatch(msg)
	if m == nil {
		return 0, false
	}
	code, err := strconv.Atoi(m[1])
	if err != nil || code < 1 || code > 255 {
		return 0, false
	}
	return code, true
}

// printable cuts s to n bytes and replaces control characters (a guest's
// text for the job log).
func printable(s string, n int) string {
	if len(s) > n {
		s = s[:n] + "..."
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}
