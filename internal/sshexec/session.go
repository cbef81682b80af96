package sshexec

import (
	"encoding/binary"
	"errors"
	"io"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"
)

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
