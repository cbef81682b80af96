// Package sshtest is test tooling, imported only from tests: an in-process
// SSH server that stands for a guest's sshd.
//
// A Server is a real golang.org/x/crypto/ssh server on 127.0.0.1:0. It runs
// every exec request the way OpenSSH does: with the account's login shell
// ("shell -c command", bash unless SetLogin says otherwise) in a new session
// (setsid), stdin, stdout and stderr on pipes. It sends exit-status, or
// exit-signal for a command killed by a signal, as soon as the command
// exits, and it ends the channel (EOF, then close) only once the command's
// output has ended: a process the command left holding its stdout or stderr
// keeps the channel open, as on a real guest.
//
// It misbehaves on demand: it stops answering keepalives (Freeze), drops
// the TCP connection when a marker appears in a command's stdout (DropOn),
// puts a prefix in front of every command (SetPrefix), keeps channels open
// after the exit status (HoldOpen) and refuses sessions altogether
// (RejectSessions). Its host key and the client key it accepts can be
// replaced while it runs (SetHostKey, SetAuthorizedKey), as a freshly booted
// guest installs the keys of its job. It records every command it was asked
// to run (Commands) and counts logins (Logins).
//
// When the test ends, the server stops: its listener and its connections
// are closed. Commands still running are left to end by themselves, as on a
// guest whose client went away (a guest-side wrapper still cleans up after
// itself).
package sshtest

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"golang.org/x/crypto/ssh"
)

// NewSigner returns a fresh ed25519 key.
func NewSigner(t testing.TB) ssh.Signer {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatalf("sshtest: generate key: %v", err)
	}
	s, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatalf("sshtest: signer: %v", err)
	}
	return s
}

// Server is an SSH server for one test. Its methods are safe for concurrent
// use.
type Server struct {
	addr   *net.TCPAddr
	client ssh.Signer

	freeze   atomic.Bool
	holdOpen atomic.Bool
	reject   atomic.Bool
	// stopped is closed when the test ends.
	stopped chan struct{}

	mu         sync.Mutex
	hostSigner ssh.Signer
	authorized ssh.PublicKey
	dropOn     string
	prefix     string
	login      []string
	conns      []net.Conn
	cmds       []string
	logins     int
}

// Start starts a server with a fresh host key that accepts a fresh client
// key (ClientSigner). It stops when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{client: NewSigner(t), hostSigner: NewSigner(t), stopped: make(chan struct{})}
	s.authorized = s.client.PublicKey()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("sshtest: listen: %v", err)
	}
	s.addr = ln.Addr().(*net.TCPAddr)
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			select {
			case <-s.stopped:
				s.mu.Unlock()
				_ = nc.Close()
				continue
			default:
			}
			s.conns = append(s.conns, nc)
			s.mu.Unlock()
			go s.serve(nc)
		}
	}()
	t.Cleanup(func() {
		s.mu.Lock()
		close(s.stopped)
		_ = ln.Close()
		for _, c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
	})
	return s
}

// Addr is the server's address, host:port.
func (s *Server) Addr() string { return s.addr.String() }

// Host is the server's IP address (127.0.0.1).
func (s *Server) Host() string { return s.addr.IP.String() }

// Port is the server's TCP port.
func (s *Server) Port() int { return s.addr.Port }

// ClientSigner is the client key that Start generated; the server accepts it
// until SetAuthorizedKey replaces it.
func (s *Server) ClientSigner() ssh.Signer { return s.client }

// HostSigner is the server's current host key.
func (s *Server) HostSigner() ssh.Signer {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hostSigner
}

// HostKey is the public part of the server's current host key: what a
// client pins.
func (s *Server) HostKey() ssh.PublicKey { return s.HostSigner().PublicKey() }

// SetHostKey replaces the host key for connections made from now on.
func (s *Server) SetHostKey(k ssh.Signer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hostSigner = k
}

// SetAuthorizedKey replaces the one client key the server accepts, for
// logins from now on.
func (s *Server) SetAuthorizedKey(k ssh.PublicKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.authorized = k
}

// Freeze makes the server stop answering global requests (keepalives), as a
// frozen guest does: requests that arrive while it is frozen never get a
// reply, whatever comes later.
func (s *Server) Freeze(on bool) { s.freeze.Store(on) }

// DropOn makes the server close the TCP connection as soon as marker
// appears in a command's stdout (a guest that vanishes mid-stream); the
// output that holds the marker is not sent. "" turns it off.
func (s *Server) DropOn(marker string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropOn = marker
}

// SetPrefix puts prefix in front of every command (to change the guest's
// environment, or to break its shell). "" turns it off.
func (s *Server) SetPrefix(prefix string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.prefix = prefix
}

// SetLogin sets the account's login shell, which runs every command as
// "argv... -c command": for example "dash", or "busybox", "sh". Without
// arguments it is bash again.
func (s *Server) SetLogin(argv ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.login = append([]string(nil), argv...)
}

// HoldOpen keeps every session channel open after its exit status, output
// included, until the client closes it or the test ends: a server whose
// command left a process holding its output.
func (s *Server) HoldOpen(on bool) { s.holdOpen.Store(on) }

// RejectSessions makes the server refuse every session channel: a guest
// that lets clients log in but runs nothing.
func (s *Server) RejectSessions(on bool) { s.reject.Store(on) }

// Commands returns the commands of every exec request so far, in order.
func (s *Server) Commands() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.cmds...)
}

// Logins counts the accepted client keys (one per authenticated connection).
func (s *Server) Logins() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.logins
}

// config is the server configuration for a new connection: the keys of now.
func (s *Server) config() *ssh.ServerConfig {
	s.mu.Lock()
	host := s.hostSigner
	s.mu.Unlock()
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: func(_ ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.authorized != nil && bytes.Equal(key.Marshal(), s.authorized.Marshal()) {
				s.logins++
				return nil, nil
			}
			return nil, errors.New("unknown key")
		},
	}
	cfg.AddHostKey(host)
	return cfg
}

func (s *Server) serve(nc net.Conn) {
	_, chans, reqs, err := ssh.NewServerConn(nc, s.config())
	if err != nil {
		_ = nc.Close()
		return
	}
	go func() {
		for r := range reqs {
			if s.freeze.Load() {
				continue // never reply: the client must notice by itself
			}
			if r.WantReply {
				_ = r.Reply(false, nil) // like dropbear: unknown request, but a reply
			}
		}
	}()
	for nch := range chans {
		if nch.ChannelType() != "session" {
			_ = nch.Reject(ssh.UnknownChannelType, "no")
			continue
		}
		if s.reject.Load() {
			_ = nch.Reject(ssh.Prohibited, "this test guest runs nothing")
			continue
		}
		ch, creqs, err := nch.Accept()
		if err != nil {
			continue
		}
		go s.session(nc, ch, creqs)
	}
}

// session serves one session channel: its first exec request runs; other
// requests (env, pty-req, shell, signal) are refused.
func (s *Server) session(nc net.Conn, ch ssh.Channel, reqs <-chan *ssh.Request) {
	defer ch.Close()
	for r := range reqs {
		if r.Type != "exec" {
			if r.WantReply {
				_ = r.Reply(false, nil)
			}
			continue
		}
		var payload struct{ Command string }
		if err := ssh.Unmarshal(r.Payload, &payload); err != nil {
			_ = r.Reply(false, nil)
			return
		}
		s.mu.Lock()
		s.cmds = append(s.cmds, payload.Command)
		s.mu.Unlock()
		_ = r.Reply(true, nil)
		// Later requests are refused; the request channel closes when the
		// client closes the channel (or the connection ends).
		closed := make(chan struct{})
		go func() {
			for r := range reqs {
				if r.WantReply {
					_ = r.Reply(false, nil)
				}
			}
			close(closed)
		}()
		s.exec(nc, ch, payload.Command, closed)
		return
	}
}

// exec runs command like sshd and reports how it ended.
func (s *Server) exec(nc net.Conn, ch ssh.Channel, command string, closed <-chan struct{}) {
	s.mu.Lock()
	login := s.login
	prefix := s.prefix
	s.mu.Unlock()
	if len(login) == 0 {
		login = []string{"bash"}
	}
	cmd := exec.Command(login[0], append(login[1:], "-c", prefix+command)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	inR, inW, err := os.Pipe()
	if err != nil {
		return
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		_, _ = inR.Close(), inW.Close()
		return
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		_, _, _, _ = inR.Close(), inW.Close(), outR.Close(), outW.Close()
		return
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, errW
	err = cmd.Start()
	_, _, _ = inR.Close(), outW.Close(), errW.Close()
	// stdin: what the client sends until its EOF. The copy is not waited
	// for: a command need not read its input.
	go func() { _, _ = io.Copy(inW, ch); _ = inW.Close() }()
	var copies sync.WaitGroup
	copies.Add(2)
	go func() {
		defer copies.Done()
		_, _ = io.Copy(&dropWriter{w: ch, s: s, nc: nc}, outR)
		_ = outR.Close()
	}()
	go func() { defer copies.Done(); _, _ = io.Copy(ch.Stderr(), errR); _ = errR.Close() }()
	var status uint32
	if err != nil {
		// As sshd's child when it cannot run the login shell.
		fmt.Fprintf(ch.Stderr(), "%s: %v\n", login[0], err)
		status = 1
	} else {
		err = cmd.Wait()
		var ee *exec.ExitError
		switch {
		case errors.As(err, &ee):
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				_, _ = ch.SendRequest("exit-signal", false, ssh.Marshal(struct {
					Signal     string
					CoreDumped bool
					Msg, Lang  string
				}{Signal: signalName(ws.Signal()), CoreDumped: ws.CoreDump()}))
				s.finish(ch, &copies, closed)
				return
			}
			status = uint32(ee.ExitCode())
		case err != nil:
			status = 255
		}
	}
	b := make([]byte, 4)
	binary.BigEndian.PutUint32(b, status)
	_, _ = ch.SendRequest("exit-status", false, b)
	s.finish(ch, &copies, closed)
}

// finish ends a session after its exit status, as OpenSSH does: once the
// command's output has ended, EOF and close. With HoldOpen not before the
// client closes the channel or the test ends.
func (s *Server) finish(ch ssh.Channel, copies *sync.WaitGroup, closed <-chan struct{}) {
	copies.Wait()
	if s.holdOpen.Load() {
		select {
		case <-closed:
		case <-s.stopped:
		}
	}
	_ = ch.CloseWrite()
}

// dropWriter passes a command's stdout to the channel until the DropOn
// marker appears in it; then it closes the connection.
type dropWriter struct {
	w    io.Writer
	s    *Server
	nc   net.Conn
	tail []byte // the end of what was written, to find a marker cut in two
}

var errDropped = errors.New("sshtest: connection dropped on purpose")

func (d *dropWriter) Write(p []byte) (int, error) {
	d.s.mu.Lock()
	marker := d.s.dropOn
	d.s.mu.Unlock()
	if marker != "" {
		m, keep := []byte(marker), len(marker)-1
		edge := append(append([]byte(nil), d.tail...), p[:min(len(p), keep)]...)
		if i := bytes.Index(p, m); i >= 0 || bytes.Contains(edge, m) {
			// What came before the marker in this write goes out first:
			// a loaded host reads several of the command's writes at once.
			if i > 0 {
				_, _ = d.w.Write(p[:i])
			}
			_ = d.nc.Close()
			return 0, errDropped
		}
		last := append(append([]byte(nil), d.tail...), p[max(0, len(p)-keep):]...)
		d.tail = last[max(0, len(last)-keep):]
	}
	return d.w.Write(p)
}

// signalName is the name of sig as SSH's exit-signal carries it (RFC 4254
// 6.10: without "SIG"), or OpenSSH's form for others.
func signalName(sig syscall.Signal) string {
	names := map[syscall.Signal]string{
		syscall.SIGABRT: "ABRT", syscall.SIGALRM: "ALRM", syscall.SIGFPE: "FPE", syscall.SIGHUP: "HUP",
		syscall.SIGILL: "ILL", syscall.SIGINT: "INT", syscall.SIGKILL: "KILL", syscall.SIGPIPE: "PIPE",
		syscall.SIGQUIT: "QUIT", syscall.SIGSEGV: "SEGV", syscall.SIGTERM: "TERM", syscall.SIGUSR1: "USR1",
		syscall.SIGUSR2: "USR2",
	}
	if n, ok := names[sig]; ok {
		return n
	}
	return fmt.Sprintf("SIG%d@openssh.com", int(sig))
}
