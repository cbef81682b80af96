package sshexec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// OutputLimit is how much of a command's stdout Output keeps: the first
// 64 KiB. Output runs only the driver's own short commands (the group kill,
// StopStage, the guest tools check), whose answers are a few lines; a guest
// that answers with more (its login shell replaced, a ForceCommand, a
// compromised guest answering "cat /dev/zero") is hostile or broken, and
// what it sends beyond the limit is read and dropped, never kept.
const OutputLimit = 64 << 10

// stderrLimit is how much of a command's stderr Output keeps for the error
// of a non-zero exit (the first 4 KiB: an error message, not a log).
const stderrLimit = 4 << 10

// capped keeps the first limit bytes written to it and drops the rest,
// while accepting every write: the SSH channel is drained, so its window
// keeps moving and the guest's exit status still arrives after a flood.
//
// The copy from the channel writes to it on its own goroutine, which may
// still be running when Stream returns on its context's end: what was kept
// is read only through String or take, which also ends the keeping.
type capped struct {
	limit int
	mu    sync.Mutex
	taken bool
	b     []byte
}

func (w *capped) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if room := w.limit - len(w.b); room > 0 && !w.taken {
		w.b = append(w.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

// String returns a copy of what was kept so far (another goroutine may
// still be writing).
func (w *capped) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return string(w.b)
}

// take returns what was kept; whatever is written after it is dropped, so
// the bytes returned are the caller's alone.
func (w *capped) take() []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.taken = true
	return w.b
}

// Output runs a fixed command (never built from job input) and returns its
// stdout, at most OutputLimit bytes of it: the rest is read and dropped. A
// non-zero exit is returned as an error mentioning stderr (its first 4 KiB).
//
// Output returns when ctx ends, whatever the guest is still doing: the
// command's channel is closed and nothing the guest sends after that is
// kept. The error then wraps context.Cause(ctx). The connection stays
// usable.
func (c *Client) Output(ctx context.Context, cmd string) ([]byte, error) {
	out := &capped{limit: OutputLimit}
	err := c.Stream(ctx, cmd, strings.NewReader(""), out)
	b := out.take()
	if err != nil && b == nil {
		return nil, err
	}
	return b, err
}

// Stream runs a fixed command (never built from job input) with stdin as its
// input and its stdout copied to stdout, as it comes: the caller bounds what
// it takes (a writer that fails ends the copy, and the caller then ends ctx
// to stop the command). A non-zero exit is returned as an error mentioning
// stderr (its first 4 KiB). Stream returns when ctx ends, whatever the
// guest is still doing, as Output does; the connection stays usable.
func (c *Client) Stream(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error {
	if ctx.Err() != nil {
		return fmt.Errorf("command not started: %w", context.Cause(ctx))
	}
	errb := &capped{limit: stderrLimit}
	// Opening the channel and the exec request each wait for the guest's
	// answer, which a hostile guest may never give: they run aside, and a
	// session that comes after ctx ended is closed unused.
	type started struct {
		s   *session
		err error
	}
	ready := make(chan started, 1)
	go func() {
		s, err := c.start(cmd, stdin, stdout, errb)
		ready <- started{s, err}
	}()
	var s *session
	select {
	case r := <-ready:
		if r.err != nil {
			return r.err
		}
		s = r.s
	case <-ctx.Done():
		go func() {
			if r := <-ready; r.s != nil {
				r.s.close()
			}
		}()
		return fmt.Errorf("the guest did not start the command: %w", context.Cause(ctx))
	}
	defer s.close()
	var res exitResult
	select {
	case res = <-s.exited:
	case <-ctx.Done():
		return fmt.Errorf("the guest's command did not end: %w", context.Cause(ctx))
	}
	// The rest of the output may still be on its way (sshd sends the exit
	// status when the command ends, the output's end when its pipes do).
	select {
	case <-s.drained:
	case <-ctx.Done():
		return fmt.Errorf("the guest's command ended but its output did not: %w", context.Cause(ctx))
	}
	switch {
	case !res.ok:
		return c.lost(errors.New("the command ended without an exit status"))
	case res.signal != "":
		// The guest's stderr, quoted and cut (obs.GuestText): this error
		// reaches the host's logs.
		return fmt.Errorf("exit status %d: %s", 128+signalNumber(res.signal), obs.GuestText(strings.TrimSpace(string(errb.take()))))
	case res.status != 0:
		return fmt.Errorf("exit status %d: %s", res.status, obs.GuestText(strings.TrimSpace(string(errb.take()))))
	}
	return nil
}
