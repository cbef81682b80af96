package sshexec

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
)

// testServer is a real SSH server on 127.0.0.1:0 that runs exec requests with
// the local bash in a new session (as sshd does), sends real exit statuses
// and signals, and can misbehave on demand.
type testServer struct {
	addr       string
	hostSigner ssh.Signer
	client     ssh.Signer
	// freeze makes the server stop answering keepalives (a frozen guest).
	freeze atomic.Bool
	// dropOn, when set, closes the TCP connection as soon as this text
	// appears in a command's stdout (a guest that vanishes mid-stream).
	dropOn atomic.Value
	// prefix is put in front of every command (to break the guest's shell).
	prefix atomic.Value
	// login is the guest account's login shell, which runs every exec
	// request (default bash; dash and busybox ash are what other guests
	// have).
	login atomic.Value
	// holdOpen keeps every session channel open after its exit status.
	holdOpen atomic.Bool
	stopped  chan struct{}
	mu       sync.Mutex
	conns    []net.Conn
	cmds     []string
}

func newSigner(t *testing.T) ssh.Signer {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	s, err := ssh.NewSignerFromKey(priv)
	require.NoError(t, err)
	return s
}

func startServer(t *testing.T) *testServer {
	t.Helper()
	ts := &testServer{hostSigner: newSigner(t), client: newSigner(t), stopped: make(chan struct{})}
	ts.dropOn.Store("")
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: func(_ ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
			if bytes.Equal(key.Marshal(), ts.client.PublicKey().Marshal()) {
				return nil, nil
			}
			return nil, errors.New("unknown key")
		},
	}
	cfg.AddHostKey(ts.hostSigner)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ts.addr = ln.Addr().String()
	t.Cleanup(func() {
		close(ts.stopped)
		_ = ln.Close()
		ts.mu.Lock()
		for _, c := range ts.conns {
			_ = c.Close()
		}
		ts.mu.Unlock()
	})
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			ts.mu.Lock()
			ts.conns = append(ts.conns, nc)
			ts.mu.Unlock()
			go ts.serve(nc, cfg)
		}
	}()
	return ts
}

func (ts *testServer) serve(nc net.Conn, cfg *ssh.ServerConfig) {
	_, chans, reqs, err := ssh.NewServerConn(nc, cfg)
	if err != nil {
		_ = nc.Close()
		return
	}
	go func() {
		for r := range reqs {
			if ts.freeze.Load() {
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
		ch, creqs, err := nch.Accept()
		if err != nil {
			continue
		}
		go ts.session(nc, ch, creqs)
	}
}

type dropWriter struct {
	w  io.Writer
	ts *testServer
	nc net.Conn
}

func (d dropWriter) Write(p []byte) (int, error) {
	if s := d.ts.dropOn.Load().(string); s != "" && bytes.Contains(p, []byte(s)) {
		_ = d.nc.Close()
		return 0, errors.New("dropped")
	}
	return d.w.Write(p)
}

func (ts *testServer) session(nc net.Conn, ch ssh.Channel, reqs <-chan *ssh.Request) {
	defer ch.Close()
	for r := range reqs {
		if r.Type != "exec" {
			if r.WantReply {
				_ = r.Reply(false, nil)
			}
			continue
		}
		var payload struct{ Cmd string }
		if err := ssh.Unmarshal(r.Payload, &payload); err != nil {
			_ = r.Reply(false, nil)
			return
		}
		ts.mu.Lock()
		ts.cmds = append(ts.cmds, payload.Cmd)
		ts.mu.Unlock()
		_ = r.Reply(true, nil)
		prefix, _ := ts.prefix.Load().(string)
		login, _ := ts.login.Load().([]string)
		if len(login) == 0 {
			login = []string{"bash"}
		}
		cmd := exec.Command(login[0], append(login[1:], "-c", prefix+payload.Cmd)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		cmd.Stdin = ch
		// Like OpenSSH: the command's output goes through pipes the server
		// reads until EOF, the exit status is sent as soon as the command
		// exits, and the channel closes only when its output has ended
		// (anything the command left holding the pipes keeps it open).
		outR, outW, err := os.Pipe()
		if err != nil {
			return
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			return
		}
		cmd.Stdout, cmd.Stderr = outW, errW
		err = cmd.Start()
		_ = outW.Close()
		_ = errW.Close()
		var copies sync.WaitGroup
		copies.Add(2)
		go func() { defer copies.Done(); _, _ = io.Copy(dropWriter{ch, ts, nc}, outR); _ = outR.Close() }()
		go func() { defer copies.Done(); _, _ = io.Copy(ch.Stderr(), errR); _ = errR.Close() }()
		if err == nil {
			err = cmd.Wait()
		}
		var status uint32
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				sig := map[syscall.Signal]string{syscall.SIGTERM: "TERM", syscall.SIGKILL: "KILL", syscall.SIGSEGV: "SEGV", syscall.SIGUSR1: "USR1"}[ws.Signal()]
				_, _ = ch.SendRequest("exit-signal", false, ssh.Marshal(struct {
					Signal     string
					CoreDumped bool
					Msg, Lang  string
				}{Signal: sig}))
				ts.finish(&copies)
				return
			}
			status = uint32(ee.ExitCode())
		} else if err != nil {
			status = 255
		}
		b := make([]byte, 4)
		binary.BigEndian.PutUint32(b, status)
		_, _ = ch.SendRequest("exit-status", false, b)
		ts.finish(&copies)
		return
	}
}

// finish ends a session after its exit status: normally when the command's
// output has ended; with holdOpen never (until the client closes it), as a
// server does whose command left a process holding its output.
func (ts *testServer) finish(copies *sync.WaitGroup) {
	if ts.holdOpen.Load() {
		<-ts.stopped
	}
	copies.Wait()
}

func (ts *testServer) commands() []string {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	return append([]string(nil), ts.cmds...)
}
