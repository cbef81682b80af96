package sshtest_test

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

func dial(t *testing.T, s *sshtest.Server, client ssh.Signer) (*ssh.Client, error) {
	t.Helper()
	c, err := ssh.Dial("tcp", s.Addr(), &ssh.ClientConfig{
		User: "root", Auth: []ssh.AuthMethod{ssh.PublicKeys(client)},
		HostKeyCallback: ssh.FixedHostKey(s.HostKey()), Timeout: 10 * time.Second,
	})
	if err == nil {
		t.Cleanup(func() { _ = c.Close() })
	}
	return c, err
}

func mustDial(t *testing.T, s *sshtest.Server) *ssh.Client {
	t.Helper()
	c, err := dial(t, s, s.ClientSigner())
	require.NoError(t, err)
	return c
}

// output runs cmd in a session with stdin and returns stdout and the
// session's end.
func output(t *testing.T, c *ssh.Client, cmd, stdin string) (string, error) {
	t.Helper()
	sess, err := c.NewSession()
	require.NoError(t, err)
	defer sess.Close()
	var out bytes.Buffer
	sess.Stdout, sess.Stdin = &out, strings.NewReader(stdin)
	err = sess.Run(cmd)
	return out.String(), err
}

func TestExitStatusSignalStdinAndCommands(t *testing.T) {
	s := sshtest.Start(t)
	c := mustDial(t, s)
	out, err := output(t, c, "cat; echo done", "from stdin\n")
	require.NoError(t, err)
	require.Equal(t, "from stdin\ndone\n", out)

	_, err = output(t, c, "exit 3", "")
	var ee *ssh.ExitError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, 3, ee.ExitStatus())
	require.Empty(t, ee.Signal())

	_, err = output(t, c, "kill -TERM $$", "")
	require.ErrorAs(t, err, &ee)
	require.Equal(t, "TERM", ee.Signal())

	require.Equal(t, []string{"cat; echo done", "exit 3", "kill -TERM $$"}, s.Commands())
}

// Like sshd: the command runs with the login shell, in a session of its
// own, with the prefix in front.
func TestLoginShellNewSessionAndPrefix(t *testing.T) {
	s := sshtest.Start(t)
	c := mustDial(t, s)
	out, err := output(t, c, `set -- $(cat /proc/$$/stat); [ "$6" = "$$" ] && echo session-leader; echo "$0"`, "")
	require.NoError(t, err)
	require.Equal(t, "session-leader\nbash\n", out)

	s.SetLogin("sh")
	s.SetPrefix("X=prefixed; ")
	out, err = output(t, c, `echo "$0 $X"`, "")
	require.NoError(t, err)
	require.Equal(t, "sh prefixed\n", out)
	require.Equal(t, `echo "$0 $X"`, s.Commands()[1], "the prefix is not part of the recorded command")
}

// events records the order of what a client sees on a session channel.
type events struct {
	mu   sync.Mutex
	seen []string
}

func (e *events) add(s string) { e.mu.Lock(); e.seen = append(e.seen, s); e.mu.Unlock() }
func (e *events) list() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.seen...)
}

// exec runs cmd on a raw channel and records, in order, the exit status
// and the end of the output.
func exec(t *testing.T, c *ssh.Client, cmd string) (ssh.Channel, *events, <-chan string) {
	t.Helper()
	ch, reqs, err := c.OpenChannel("session", nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ch.Close() })
	ev := &events{}
	go func() {
		for r := range reqs {
			if r.Type == "exit-status" {
				ev.add("exit-status")
			}
			if r.WantReply {
				_ = r.Reply(false, nil)
			}
		}
	}()
	ok, err := ch.SendRequest("exec", true, ssh.Marshal(struct{ Command string }{cmd}))
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, ch.CloseWrite())
	out := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(ch)
		ev.add("output-ended")
		out <- string(b)
	}()
	return ch, ev, out
}

// As OpenSSH: the exit status is sent when the command exits; the channel
// ends only when its output has, here after a process the command left
// behind wrote its last line.
func TestChannelEndsWhenOutputEnds(t *testing.T) {
	s := sshtest.Start(t)
	c := mustDial(t, s)
	_, ev, out := exec(t, c, "(sleep 2; echo late) & echo early")
	select {
	case got := <-out:
		require.Equal(t, "early\nlate\n", got)
	case <-time.After(20 * time.Second):
		t.Fatal("the output never ended")
	}
	require.Equal(t, []string{"exit-status", "output-ended"}, ev.list())
}

func TestHoldOpenKeepsTheChannelUntilTheClientClosesIt(t *testing.T) {
	s := sshtest.Start(t)
	s.HoldOpen(true)
	c := mustDial(t, s)
	ch, ev, out := exec(t, c, "echo hi")
	require.Eventually(t, func() bool { return len(ev.list()) > 0 }, 10*time.Second, 10*time.Millisecond)
	select {
	case <-out:
		t.Fatal("the output ended although the server holds the channel open")
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, ch.Close())
	select {
	case got := <-out:
		require.Equal(t, "hi\n", got)
	case <-time.After(10 * time.Second):
		t.Fatal("closing the channel did not end it")
	}
}

// What comes before the marker in the same write is sent (a loaded host
// reads several of the command's writes at once).
func TestDropOnSendsWhatPrecedesTheMarkerInOneWrite(t *testing.T) {
	s := sshtest.Start(t)
	s.DropOn("DROP-NOW")
	c := mustDial(t, s)
	out, err := output(t, c, `printf 'before\nDROP-NOW\nafter\n'; sleep 30`, "")
	require.Error(t, err, "out=%q", out)
	require.Equal(t, "before\n", out)
}

// The marker is found even when it arrives in two writes; the part before
// it was sent. The command outlives the marker by far: a command that
// exits at once may have its exit status sent before the copy of its
// output reaches the marker (as sshd sends it when the child exits), and a
// loaded host made that race visible. The sleeps keep "DRO" and "P-NOW"
// in two reads of the server's copy on a loaded host too.
func TestDropOnClosesTheConnection(t *testing.T) {
	s := sshtest.Start(t)
	s.DropOn("DROP-NOW")
	c := mustDial(t, s)
	out, err := output(t, c, "echo before; sleep 1; printf DRO; sleep 1; echo P-NOW; sleep 30; echo after", "")
	require.Error(t, err, "out=%q", out)
	var ee *ssh.ExitError
	require.False(t, errors.As(err, &ee), "no exit status after a drop: %v", err)
	require.Equal(t, "before\nDRO", out)
	// The connection is gone: the client sees its end (a new session on
	// it could race the client's read of the EOF).
	ended := make(chan error, 1)
	go func() { ended <- c.Wait() }()
	select {
	case werr := <-ended:
		t.Logf("the connection ended: %v", werr)
	case <-time.After(10 * time.Second):
		t.Fatal("the connection outlived the drop")
	}
	_, err = c.NewSession()
	require.Error(t, err, "no session on a connection that ended")
}

func TestFreezeStopsKeepaliveReplies(t *testing.T) {
	s := sshtest.Start(t)
	c := mustDial(t, s)
	ok, _, err := c.SendRequest("keepalive@openssh.com", true, nil)
	require.NoError(t, err)
	require.False(t, ok, "answered, like dropbear, with a failure")
	s.Freeze(true)
	replied := make(chan struct{})
	go func() { _, _, _ = c.SendRequest("keepalive@openssh.com", true, nil); close(replied) }()
	select {
	case <-replied:
		t.Fatal("a frozen server answered")
	case <-time.After(300 * time.Millisecond):
	}
}

// The keys can change while the server runs, as a guest installs those of
// its job at boot; logins are counted.
func TestKeysCanBeReplacedAndLoginsAreCounted(t *testing.T) {
	s := sshtest.Start(t)
	mustDial(t, s)
	require.Equal(t, 1, s.Logins())

	host, client := sshtest.NewSigner(t), sshtest.NewSigner(t)
	s.SetHostKey(host)
	s.SetAuthorizedKey(client.PublicKey())
	require.Equal(t, host.PublicKey().Marshal(), s.HostKey().Marshal())
	_, err := dial(t, s, s.ClientSigner())
	require.ErrorContains(t, err, "unable to authenticate")
	_, err = dial(t, s, client)
	require.NoError(t, err)
	require.Equal(t, 2, s.Logins())
}

func TestRejectSessions(t *testing.T) {
	s := sshtest.Start(t)
	s.RejectSessions(true)
	c := mustDial(t, s)
	_, err := c.NewSession()
	require.ErrorContains(t, err, "runs nothing")
	require.Empty(t, s.Commands())
}
