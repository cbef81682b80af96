package sshexec

import (
	"errors"
	"fmt"
	"time"
)

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
