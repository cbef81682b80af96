// Package sshexec is the guest shell: it connects to a guest with a pinned
// host key, keeps the connection under a keepalive with a reply deadline, and
// runs scripts whose text travels over the SSH channel, never on a command
// line. It classifies outcomes: the script's own non-zero exit is an
// exitcodes.ScriptError; every other failure is a system failure.
package sshexec

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// Target describes how to reach and trust a guest.
type Target struct {
	// Addr is host:port.
	Addr string
	// User is the guest account.
	User string
	// Signer is the per-job client key.
	Signer ssh.Signer
	// HostKey is the pinned host key. It must be set unless
	// InsecureIgnoreHostKey is true.
	HostKey ssh.PublicKey
	// InsecureIgnoreHostKey disables host key verification (opt-in only).
	InsecureIgnoreHostKey bool
	// ConnectTimeout bounds the TCP connect of Dial, and then the SSH
	// handshake and login. Default 5s. WaitReady bounds its attempts' TCP
	// connects by PollConnectTimeout instead.
	ConnectTimeout time.Duration
	// PollConnectTimeout bounds the TCP connect of each WaitReady attempt
	// (default DefaultPollConnectTimeout; never more than ConnectTimeout).
	PollConnectTimeout time.Duration
	// KeepaliveInterval and KeepaliveCount: the connection is declared dead
	// when no keepalive reply arrived for Interval*Count. Defaults 5s and 3.
	KeepaliveInterval time.Duration
	KeepaliveCount    int

	// dialTCP, if set, replaces the TCP connect (tests stand a guest that
	// drops SYNs in with it). It must give up when its ctx ends.
	dialTCP func(ctx context.Context, network, addr string) (net.Conn, error)
}

// DefaultPollInterval is how often WaitReady starts an attempt by default:
// the rate the benchmark's floor polls at (docs/performance.md). A refused
// connect costs the host and the guest next to nothing.
const DefaultPollInterval = 50 * time.Millisecond

// DefaultPollConnectTimeout bounds each WaitReady attempt's TCP connect by
// default. A guest's address is known from its DHCP lease before the guest
// has configured it, so the first SYN is often lost, and the kernel would
// resend it only after its 1 s initial retransmission timeout. Abandoning
// the connect after 250 ms and starting a new one is quicker; a guest that
// answers at all answers a SYN within a few ms.
const DefaultPollConnectTimeout = 250 * time.Millisecond

// ErrHostKeyMismatch means the server presented a key other than the pinned one.
var ErrHostKeyMismatch = errors.New("host key mismatch: the server is not the expected guest")

// ErrDeadGuest means keepalive replies stopped arriving.
var ErrDeadGuest = errors.New("guest stopped answering SSH keepalives")

// DeadGuestError is ErrDeadGuest with how long the guest had been silent
// when that was noticed: the detection's latency.
type DeadGuestError struct{ Silent time.Duration }

func (e *DeadGuestError) Error() string {
	return fmt.Sprintf("%v for %s", ErrDeadGuest, e.Silent.Round(time.Second))
}

// Is makes errors.Is(err, ErrDeadGuest) hold.
func (e *DeadGuestError) Is(target error) bool { return target == ErrDeadGuest }

// DeadAfter is how long a dead guest had been silent when err (which
// wraps a DeadGuestError) was noticed.
func DeadAfter(err error) (time.Duration, bool) {
	var d *DeadGuestError
	if errors.As(err, &d) {
		return d.Silent, true
	}
	return 0, false
}

func (t Target) config() (*ssh.ClientConfig, error) {
	if t.Signer == nil {
		return nil, errors.New("no client key")
	}
	var hk ssh.HostKeyCallback
	switch {
	case t.InsecureIgnoreHostKey:
		hk = ssh.InsecureIgnoreHostKey()
	case t.HostKey == nil:
		return nil, errors.New("no pinned host key (set one, or opt in to insecure-ignore-host-key)")
	default:
		want := t.HostKey.Marshal()
		hk = func(_ string, _ net.Addr, key ssh.PublicKey) error {
			if !bytes.Equal(key.Marshal(), want) {
				return fmt.Errorf("%w (got %s)", ErrHostKeyMismatch, ssh.FingerprintSHA256(key))
			}
			return nil
		}
	}
	timeout := t.ConnectTimeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	cfg := &ssh.ClientConfig{
		User:            t.User,
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(t.Signer)},
		HostKeyCallback: hk,
		Timeout:         timeout,
	}
	if !t.InsecureIgnoreHostKey {
		cfg.HostKeyAlgorithms = []string{t.HostKey.Type()}
	}
	return cfg, nil
}

// Client is a connection to a guest.
type Client struct {
	c    *ssh.Client
	once sync.Once
	done chan struct{}

	mu      sync.Mutex
	deadErr error
}

// Dial makes one connection attempt: a TCP connect, then the SSH handshake
// and login, each bounded by t.ConnectTimeout and by ctx.
func Dial(ctx context.Context, t Target) (*Client, error) {
	return dialWith(ctx, t, 0)
}

// dialWith is Dial with the TCP connect bounded by connectTimeout instead, when
// that is set and shorter than t.ConnectTimeout.
func dialWith(ctx context.Context, t Target, connectTimeout time.Duration) (*Client, error) {
	cfg, err := t.config()
	if err != nil {
		return nil, err
	}
	if connectTimeout <= 0 || connectTimeout > cfg.Timeout {
		connectTimeout = cfg.Timeout
	}
	dialTCP := t.dialTCP
	if dialTCP == nil {
		var d net.Dialer
		dialTCP = d.DialContext
	}
	// A connection, once made, outlives dctx.
	dctx, cancel := context.WithTimeout(ctx, connectTimeout)
	conn, err := dialTCP(dctx, "tcp", t.Addr)
	cancel()
	if err != nil {
		return nil, err
	}
	// Bound the handshake by the connect timeout and by ctx.
	_ = conn.SetDeadline(time.Now().Add(cfg.Timeout))
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	sc, chans, reqs, err := ssh.NewClientConn(conn, t.Addr, cfg)
	stop()
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	_ = conn.SetDeadline(time.Time{})
	c := &Client{c: ssh.NewClient(sc, chans, reqs), done: make(chan struct{})}
	interval, count := t.KeepaliveInterval, t.KeepaliveCount
	if interval <= 0 {
		interval = 5 * time.Second
	}
	if count <= 0 {
		count = 3
	}
	go c.keepalive(interval, time.Duration(count)*interval)
	return c, nil
}

// keepalive sends keepalive@openssh.com every interval. Any reply, positive
// or negative, proves the guest alive. When none arrived for deadAfter the
// connection is closed, which ends every session with an error.
func (c *Client) keepalive(interval, deadAfter time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	replies := make(chan error, 1)
	inflight := false
	last := time.Now()
	for {
		select {
		case <-c.done:
			return
		case err := <-replies:
			inflight = false
			if err != nil {
				return // connection closed
			}
			last = time.Now()
		case <-t.C:
			if time.Since(last) >= deadAfter {
				c.mu.Lock()
				c.deadErr = &DeadGuestError{Silent: time.Since(last)}
				c.mu.Unlock()
				_ = c.c.Close()
				return
			}
			if !inflight {
				inflight = true
				go func() {
					_, _, err := c.c.SendRequest("keepalive@openssh.com", true, nil)
					replies <- err
				}()
			}
		}
	}
}

// Dead returns why the keepalive gave up, or nil.
func (c *Client) Dead() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.deadErr
}

// Close closes the connection.
func (c *Client) Close() error {
	c.once.Do(func() { close(c.done) })
	return c.c.Close()
}

// WaitReady dials until the SSH handshake with the pinned host key and the
// public-key authentication both succeed, or ctx ends, and returns the
// number of attempts made. An attempt starts every interval (default
// DefaultPollInterval), at a fixed rate: not an interval after the last one
// failed; one that took longer is followed by the next at once. Each
// attempt's TCP connect is bounded by t.PollConnectTimeout (a lost SYN costs
// that, not the kernel's 1 s retransmission), its handshake and login by
// t.ConnectTimeout. A host key mismatch is retried only for mismatchGrace
// (a guest may still be installing its per-job key), then reported. When
// ctx ends, the error carries the last answer that came from the guest's
// side rather than the abort.
func WaitReady(ctx context.Context, t Target, interval, mismatchGrace time.Duration) (*Client, int, error) {
	if interval <= 0 {
		interval = DefaultPollInterval
	}
	connect := t.PollConnectTimeout
	if connect <= 0 {
		connect = DefaultPollConnectTimeout
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	var lastErr error
	var firstMismatch time.Time
	attempts := 0
	for {
		attempts++
		c, err := dialWith(ctx, t, connect)
		if err == nil {
			return c, attempts, nil
		}
		if !expired(ctx) || lastErr == nil {
			// Keep the guest's last real answer rather than our own abort.
			lastErr = err
		}
		if errors.Is(err, ErrHostKeyMismatch) {
			if firstMismatch.IsZero() {
				firstMismatch = time.Now()
			}
			if time.Since(firstMismatch) >= mismatchGrace {
				return nil, attempts, fmt.Errorf("%w; refusing to send anything to it (does the image install the per-job host key? see docs/images.md)", err)
			}
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
			if ctx.Err() == nil { // both are ready after a slow attempt: ctx wins
				continue
			}
		}
		return nil, attempts, fmt.Errorf("SSH not ready at %s after %d attempts: last error: %v (%w)", t.Addr, attempts, lastErr, context.Cause(ctx))
	}
}

// expired reports whether ctx has ended or its deadline has passed (the
// dialer gives up at the deadline a moment before ctx.Err is set).
func expired(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	d, ok := ctx.Deadline()
	return ok && !time.Now().Before(d)
}

// Output runs a fixed command (never built from job input) and returns its
// stdout. A non-zero exit is returned as an error mentioning stderr.
func (c *Client) Output(ctx context.Context, cmd string) ([]byte, error) {
	s, err := c.c.NewSession()
	if err != nil {
		return nil, c.lost(err)
	}
	defer s.Close()
	var out, errb bytes.Buffer
	s.Stdout, s.Stderr = &out, &errb
	stop := context.AfterFunc(ctx, func() { _ = s.Close() })
	defer stop()
	if err := s.Run(cmd); err != nil {
		var ee *ssh.ExitError
		if errors.As(err, &ee) {
			return out.Bytes(), fmt.Errorf("exit status %d: %s", ee.ExitStatus(), strings.TrimSpace(errb.String()))
		}
		return nil, c.lost(err)
	}
	return out.Bytes(), nil
}

// lost turns a transport failure into a system failure, naming the keepalive
// verdict when there is one.
func (c *Client) lost(err error) error {
	if d := c.Dead(); d != nil {
		return exitcodes.System(fmt.Errorf("connection to guest lost: %w", d))
	}
	return exitcodes.System(fmt.Errorf("connection to guest lost: %w", err))
}

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

// wrapper is the command the guest's login shell runs for one stage. One
// session does it all (each session costs the guest a shell start):
//
//   - The session's shell is a session and process group leader (the SSH
//     server calls setsid), so $$ is the group to signal; it is recorded
//     first, so a cancel can stop the stage even during the upload.
//   - The script arrives on stdin and is written with a private umask and
//     noclobber in a subshell (the job keeps its own umask). Only a file of
//     exactly the script's length runs: a connection lost mid-upload ends
//     the guest's stdin early and must not run half a script. If the upload
//     fails the session shell ends itself with SIGUSR1, which tells an
//     infrastructure failure from anything the script can exit with; from
//     then on the shell ignores USR1 for itself (trap), so a job that sends
//     USR1 to its process group is still judged by its exit code.
//   - The script runs with stdin closed in a session of its own (setsid, if
//     the guest has it), so everything it leaves in its process group can be
//     stopped as a group, and {pid}.g now names that group for a cancel.
//     Its stdout and stderr both go into one FIFO, in order, and a relay
//     (cat) copies the FIFO to the SSH channel: nothing the script starts
//     holds the channel itself.
//   - When the script's shell ends, what it left in its group gets SIGTERM,
//     then SIGKILL after the grace. The relay then gets a moment to copy
//     what is left; a writer that detached (setsid) cannot keep it, and so
//     the stage, open: the relay is stopped. A sink takes over the FIFO's
//     read end first (opened by the wrapper itself, read-write and then
//     read-only, so neither open blocks nor races the relay's end), so the
//     detached writer does not die of SIGPIPE; the sink ends with it.
//   - The script, pidfile and FIFO are removed as soon as the script ends:
//     the script holds the job's variables.
type wrapper struct {
	base          string
	size          int
	shell         string
	leftoverGrace time.Duration
}

func (w wrapper) script() string  { return w.base + ".sh" }
func (w wrapper) pidfile() string { return w.base + ".pid" }
func (w wrapper) fifo() string    { return w.base + ".out" }

func (w wrapper) command() string {
	// Group signals are sent as "kill -SIG -PGID": dash rejects
	// "kill -SIG -- -PGID" and busybox ash fails it, and any of them may be
	// the guest's login shell. The script's group goes into a file of its
	// own, never rewritten (no mv: one process less per stage), and a
	// cancel reads it again while it is still empty (groupOf).
	ticks := int(w.leftoverGrace / (100 * time.Millisecond))
	lines := []string{
		`echo $$ > {pid}`,
		`{ (umask 077 && set -C && exec cat > {sh}) && [ $(wc -c < {sh}) -eq {size} ] && (umask 077 && mkfifo {out}); } || { rm -f {sh} {pid} {out}; kill -s USR1 $$; exit 1; }`,
		`trap : USR1`,
		`cat {out} & r=$!`,
		`if command -v setsid >/dev/null 2>&1; then`,
		`  : > {pid}.g`,
		`  setsid {shell} {sh} < /dev/null > {out} 2>&1 & s=$! g=$s`,
		`  echo $s > {pid}.g`,
		`else`,
		`  {shell} {sh} < /dev/null > {out} 2>&1 & s=$! g=`,
		`fi`,
		`wait $s; rc=$?`,
		`rm -f {sh}`,
		`if [ -n "$g" ] && kill -TERM -$g 2>/dev/null; then`,
		`  echo "libvirt-executor: the script has ended; stopping the processes it left running" >&2`,
		`  i=0; while kill -0 -$g 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done`,
		`  kill -KILL -$g 2>/dev/null && echo "libvirt-executor: they ignored SIGTERM for {grace}: killed" >&2`,
		`fi`,
		`i=0; while kill -0 $r 2>/dev/null && [ $i -lt 100 ]; do sleep 0.01; i=$((i+1)); done`,
		`if kill -0 $r 2>/dev/null; then`,
		`  exec 3<> {out} 4< {out} 3>&-`,
		`  cat <&4 > /dev/null 2>&1 &`,
		`  exec 4<&-`,
		`  kill $r 2>/dev/null`,
		`  echo "libvirt-executor: a detached process still writes to the stage's output; the stage ends without it" >&2`,
		`fi`,
		`wait $r 2>/dev/null`,
		`rm -f {pid} {pid}.g {out}`,
		`exit $rc`,
	}
	return strings.NewReplacer(
		"{pid}", w.pidfile(), "{sh}", w.script(), "{out}", w.fifo(), "{size}", strconv.Itoa(w.size),
		"{shell}", ShellQuote(w.shell), "{ticks}", strconv.Itoa(ticks), "{grace}", w.leftoverGrace.String(),
	).Replace(strings.Join(lines, "\n"))
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

// exitResult is how the guest said a command ended. ok is false when the
// session closed without an exit status or signal.
type exitResult struct {
	ok     bool
	status int
	signal string
}

// session is one command on its own SSH channel. Unlike ssh.Session, whose
// Wait returns only once the channel closes, it reports the exit status as
// soon as the guest sends it: a process the command left behind can keep the
// channel open indefinitely.
type session struct {
	ch      ssh.Channel
	exited  chan exitResult
	drained chan struct{}
}

// start opens a session channel and runs cmd with stdin as its input.
func (c *Client) start(cmd string, stdin io.Reader, stdout, stderr io.Writer) (*session, error) {
	ch, reqs, err := c.c.OpenChannel("session", nil)
	if err != nil {
		return nil, c.lost(err)
	}
	s := &session{ch: ch, exited: make(chan exitResult, 1), drained: make(chan struct{})}
	go s.watch(reqs)
	ok, err := ch.SendRequest("exec", true, ssh.Marshal(struct{ Command string }{cmd}))
	if err == nil && !ok {
		err = errors.New("the guest refused to run a command")
	}
	if err != nil {
		_ = ch.Close()
		return nil, c.lost(err)
	}
	go func() {
		_, _ = io.Copy(ch, stdin)
		_ = ch.CloseWrite()
	}()
	var copies sync.WaitGroup
	copies.Add(2)
	go func() { defer copies.Done(); _, _ = io.Copy(stdout, ch) }()
	go func() { defer copies.Done(); _, _ = io.Copy(stderr, ch.Stderr()) }()
	go func() { copies.Wait(); close(s.drained) }()
	return s, nil
}

// watch reads the channel's requests until it closes and reports the first
// exit-status or exit-signal (or their absence).
func (s *session) watch(reqs <-chan *ssh.Request) {
	sent := false
	report := func(r exitResult) {
		if !sent {
			sent = true
			s.exited <- r
		}
	}
	for r := range reqs {
		switch r.Type {
		case "exit-status":
			if len(r.Payload) >= 4 {
				report(exitResult{ok: true, status: int(binary.BigEndian.Uint32(r.Payload))})
			}
		case "exit-signal":
			var msg struct {
				Signal     string
				CoreDumped bool
				Error      string
				Lang       string
			}
			if ssh.Unmarshal(r.Payload, &msg) == nil {
				report(exitResult{ok: true, status: -1, signal: msg.Signal})
			}
		}
		if r.WantReply {
			_ = r.Reply(false, nil)
		}
	}
	report(exitResult{})
}

// drain waits up to grace for the command's output to end and reports
// whether it did; then the channel is closed either way and the copies end.
func (s *session) drain(grace time.Duration) bool {
	select {
	case <-s.drained:
		return true
	case <-time.After(grace):
		_ = s.ch.Close()
		select {
		case <-s.drained:
		case <-time.After(time.Second):
		}
		return false
	}
}

func (s *session) close() { _ = s.ch.Close() }

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

// stageBase is where a stage's files are in the guest.
func stageBase(tag string) string { return "/tmp/lve-run-" + tag }

// StopStage stops the stage with tag that another connection started
// (whose connection ended mid-stage): its process group gets SIGTERM, and
// SIGKILL after grace if it is still there; its files are removed. Nothing
// happens if that stage has already ended.
func (c *Client) StopStage(ctx context.Context, tag string, grace time.Duration) error {
	if !validTag(tag) {
		return fmt.Errorf("invalid stage tag %q (16 lowercase hex digits)", tag)
	}
	w := wrapper{base: stageBase(tag)}
	pid, sh, out := w.pidfile(), w.script(), w.fifo()
	ticks := int(orDefault(grace, 5*time.Second) / (100 * time.Millisecond))
	cmd := strings.NewReplacer("{pid}", pid, "{sh}", sh, "{out}", out, "{ticks}", strconv.Itoa(ticks)).Replace(
		groupOf + `; if [ -n "$g" ]; then kill -TERM -$g 2>/dev/null; ` +
			`i=0; while kill -0 -$g 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; ` +
			`kill -KILL -$g 2>/dev/null; fi; rm -f {pid} {pid}.g {sh} {out}; exit 0`)
	_, err := c.Output(ctx, cmd)
	return err
}

// Wait blocks until the connection has ended, for whatever reason.
func (c *Client) Wait() error { return c.c.Wait() }

// groupOf sets g to the process group of the stage whose pidfile is {pid}:
// the script's own group ({pid}.g, written once the script runs in a session
// of its own), else the session shell's ({pid}, written first). A {pid}.g
// that exists but is still empty is being written: it is read again.
const groupOf = `g=; i=0; while [ $i -lt 20 ]; do ` +
	`if [ -s {pid}.g ]; then g=$(cat {pid}.g); elif [ ! -e {pid}.g ] && [ -s {pid} ]; then g=$(cat {pid}); fi; ` +
	`[ -n "$g" ] && break; [ -e {pid}.g ] || [ -e {pid} ] || break; i=$((i+1)); sleep 0.01; done; true`

// killGroup sends SIGTERM to the script's process group through a new
// session, waits up to grace for the script to end, then sends SIGKILL.
func (c *Client) killGroup(pidfile string, grace time.Duration, exited <-chan exitResult) error {
	if grace <= 0 {
		grace = 5 * time.Second
	}
	kill := func(sig string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Output(ctx, strings.ReplaceAll(groupOf, "{pid}", pidfile)+` && [ -n "$g" ] && kill -`+sig+` -$g`)
		return err
	}
	if err := kill("TERM"); err != nil {
		return err
	}
	select {
	case <-exited:
	case <-time.After(grace):
		if err := kill("KILL"); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	base := strings.TrimSuffix(pidfile, ".pid")
	_, _ = c.Output(ctx, "rm -f "+pidfile+" "+pidfile+".g "+base+".sh "+base+".out")
	return nil
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// ShellQuote quotes s as one word for a POSIX shell (for fixed commands
// built from configured values, never from job input).
func ShellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
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

// Probe checks cheaply that an SSH server answers at addr: a TCP connect
// and the server's version line ("SSH-2.0-..."), within ctx. It proves the
// guest's network and sshd are alive; it does not authenticate (the host
// key was verified when the connection that Probe stands in for was
// first made).
func Probe(ctx context.Context, addr string) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetReadDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetReadDeadline(time.Now()) })
	defer stop()
	// RFC 4253 4.2: lines before the version line are allowed, each of at
	// most 255 bytes; a peer that sends more is not an SSH server.
	r := bufio.NewReaderSize(io.LimitReader(conn, 8*256), 256)
	for range 8 {
		line, err := r.ReadString('\n')
		if strings.HasPrefix(line, "SSH-") {
			return nil
		}
		if err != nil {
			return fmt.Errorf("no SSH version line from %s: %w", addr, err)
		}
	}
	return fmt.Errorf("no SSH version line from %s", addr)
}

// ProbeTCP checks that something accepts TCP connections at addr (the
// guest's kernel answers for its listening sshd), within ctx; it does not
// wait for the server's version line, which an sshd that forks per
// connection sends only after a fork (half a second on a loaded TCG guest).
func ProbeTCP(ctx context.Context, addr string) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	return conn.Close()
}
