// Package sshexec is the guest shell: it connects to a guest with a pinned
// host key, keeps the connection under a keepalive with a reply deadline, and
// runs scripts whose text travels over the SSH channel, never on a command
// line. It classifies outcomes: the script's own non-zero exit is an
// exitcodes.ScriptError; every other failure is a system failure.
package sshexec

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
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
	// ConnectTimeout bounds one TCP connect plus handshake. Default 5s.
	ConnectTimeout time.Duration
	// KeepaliveInterval and KeepaliveCount: the connection is declared dead
	// when no keepalive reply arrived for Interval*Count. Defaults 5s and 3.
	KeepaliveInterval time.Duration
	KeepaliveCount    int
}

// ErrHostKeyMismatch means the server presented a key other than the pinned one.
var ErrHostKeyMismatch = errors.New("host key mismatch: the server is not the expected guest")

// ErrDeadGuest means keepalive replies stopped arriving.
var ErrDeadGuest = errors.New("guest stopped answering SSH keepalives")

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

// Dial makes one connection attempt.
func Dial(ctx context.Context, t Target) (*Client, error) {
	cfg, err := t.config()
	if err != nil {
		return nil, err
	}
	d := net.Dialer{Timeout: cfg.Timeout}
	conn, err := d.DialContext(ctx, "tcp", t.Addr)
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
				c.deadErr = fmt.Errorf("%w for %s", ErrDeadGuest, time.Since(last).Round(time.Second))
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
// public-key authentication both succeed, retrying every interval, until ctx
// ends. A host key mismatch is retried only for mismatchGrace (a guest may
// still be installing its per-job key), then reported.
func WaitReady(ctx context.Context, t Target, interval, mismatchGrace time.Duration) (*Client, int, error) {
	if interval <= 0 {
		interval = 100 * time.Millisecond
	}
	var lastErr error
	var firstMismatch time.Time
	attempts := 0
	for {
		attempts++
		c, err := Dial(ctx, t)
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
			return nil, attempts, fmt.Errorf("SSH not ready at %s after %d attempts: last error: %v (%w)", t.Addr, attempts, lastErr, context.Cause(ctx))
		case <-time.After(interval):
		}
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
	// Stdout and Stderr receive the script's output live.
	Stdout, Stderr io.Writer
	// KillGrace is how long a cancelled script's process group gets between
	// SIGTERM and SIGKILL. Default 5s.
	KillGrace time.Duration
}

// Run copies script into the guest over the connection, runs it with the
// shell with stdin closed, and streams its output. The result:
//   - nil: the script exited 0;
//   - *exitcodes.ScriptError: the script exited non-zero (or died of a signal);
//   - a system failure: anything else, including ctx cancellation, after the
//     script's whole process group in the guest was terminated.
func (c *Client) Run(ctx context.Context, script []byte, o RunOptions) error {
	tag, err := randomHex(8)
	if err != nil {
		return exitcodes.System(err)
	}
	base := "/tmp/lve-run-" + tag
	path, pidfile := base+".sh", base+".pid"
	// One session does it all (each session costs the guest a shell start).
	// The session's shell is a session and process group leader (the SSH
	// server calls setsid), so $$ is the group to signal; it is recorded
	// first, so a cancel can stop the stage even during the upload. The
	// script arrives on stdin and is written with a private umask and
	// noclobber in a subshell (the job keeps its own umask). Only a file of
	// exactly the script's length runs: a connection lost mid-upload ends
	// the guest's stdin early and must not run half a script. If the upload
	// fails the session shell ends itself with SIGUSR1, which tells an
	// infrastructure failure from anything the script can exit with; from
	// then on the shell ignores USR1 for itself (trap), so a job that sends
	// USR1 to its process group is still judged by its exit code. The
	// script runs with stdin closed and is removed as soon as it ends: it
	// holds the job's variables.
	s, err := c.c.NewSession()
	if err != nil {
		return c.lost(err)
	}
	defer s.Close()
	s.Stdin = bytes.NewReader(script)
	s.Stdout, s.Stderr = o.Stdout, o.Stderr
	cmd := fmt.Sprintf("echo $$ > %[2]s; (umask 077 && set -C && exec cat > %[1]s) && [ $(wc -c < %[1]s) -eq %[3]d ] || "+
		"{ rm -f %[1]s %[2]s; kill -s USR1 $$; exit 1; }; trap : USR1; "+
		"%[4]s %[1]s < /dev/null; rc=$?; rm -f %[1]s %[2]s; exit $rc",
		path, pidfile, len(script), shellQuote(o.Shell))
	if err := s.Start(cmd); err != nil {
		return c.lost(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- s.Wait() }()
	select {
	case err := <-waited:
		return c.classify(err)
	case <-ctx.Done():
		killErr := c.killGroup(pidfile, o.KillGrace, waited)
		cause := fmt.Errorf("script stopped: %w", context.Cause(ctx))
		if killErr != nil {
			cause = fmt.Errorf("%w; stopping it in the guest failed: %v", cause, killErr)
		}
		return exitcodes.System(cause)
	}
}

// uploadFailed is the signal the session shell ends itself with when the
// script could not be written in the guest.
const uploadFailed = "USR1"

func (c *Client) classify(err error) error {
	if err == nil {
		return nil
	}
	var ee *ssh.ExitError
	if errors.As(err, &ee) && c.Dead() == nil {
		if ee.Signal() == uploadFailed {
			return exitcodes.System(errors.New("copy script into guest failed (the guest's message is above)"))
		}
		if sig := ee.Signal(); sig != "" {
			return &exitcodes.ScriptError{Code: 128 + signalNumber(sig)}
		}
		return &exitcodes.ScriptError{Code: ee.ExitStatus()}
	}
	var missing *ssh.ExitMissingError
	if errors.As(err, &missing) {
		return c.lost(errors.New("the script ended without an exit status"))
	}
	return c.lost(err)
}

// killGroup sends SIGTERM to the script's process group through a new
// session, waits up to grace for the script to end, then sends SIGKILL.
func (c *Client) killGroup(pidfile string, grace time.Duration, waited <-chan error) error {
	if grace <= 0 {
		grace = 5 * time.Second
	}
	kill := func(sig string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Output(ctx, fmt.Sprintf("test -s %s && kill -%s -- -$(cat %s)", pidfile, sig, pidfile))
		return err
	}
	if err := kill("TERM"); err != nil {
		return err
	}
	select {
	case <-waited:
	case <-time.After(grace):
		if err := kill("KILL"); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = c.Output(ctx, "rm -f "+pidfile+" "+strings.TrimSuffix(pidfile, ".pid")+".sh")
	return nil
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
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
