package sshexec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
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

// ciphers is the client's cipher preference: ChaCha20-Poly1305 first (as
// OpenSSH's own default order has it), then x/crypto's default order.
// Measured on the tiny guest under TCG (qemu64, no AES-NI): 100 MiB into
// the guest's tar in 10.6 s with it against 18.7 s with aes128-gcm, the
// library's first choice; with AES-NI (KVM) both cost the guest far less
// than its disk. x/crypto does strict key exchange (the Terrapin fix),
// which OpenSSH 9.2p1 of Debian 12's images does too.
var ciphers = []string{
	ssh.CipherChaCha20Poly1305, ssh.CipherAES128GCM, ssh.CipherAES256GCM,
	ssh.CipherAES128CTR, ssh.CipherAES192CTR, ssh.CipherAES256CTR,
}

// ErrHostKeyMismatch means the server presented a key other than the pinned one.
var ErrHostKeyMismatch = errors.New("host key mismatch: the server is not the expected guest")

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
		Config:          ssh.Config{Ciphers: slices.Clone(ciphers)},
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
	// ended is closed once the connection has ended, for whatever reason.
	ended chan struct{}

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
	c := &Client{c: ssh.NewClient(sc, chans, reqs), done: make(chan struct{}), ended: make(chan struct{})}
	go func() { _ = c.c.Wait(); close(c.ended) }()
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

// lost turns a transport failure into a system failure, naming the keepalive
// verdict when there is one.
func (c *Client) lost(err error) error {
	if d := c.Dead(); d != nil {
		return exitcodes.System(fmt.Errorf("%w: %w", ErrConnectionLost, d))
	}
	return exitcodes.System(fmt.Errorf("%w: %w", ErrConnectionLost, err))
}

// ErrConnectionLost marks a command that failed because the connection
// under it ended (a transport failure, not the script's).
var ErrConnectionLost = errors.New("connection to guest lost")

// Ended is closed once the connection has ended, for whatever reason.
func (c *Client) Ended() <-chan struct{} { return c.ended }

// Wait blocks until the connection has ended, for whatever reason.
func (c *Client) Wait() error { return c.c.Wait() }
