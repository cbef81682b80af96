package state

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// ErrBusy means another process holds the machine's lock.
var ErrBusy = errors.New("machine is busy in another process")

// Lock takes the machine's exclusive lock, waiting until ctx ends. Prepare
// and cleanup hold it while they work, so a sweep never removes a machine
// that is being built or torn down. The kernel drops the lock when the holder
// dies (even by SIGKILL).
func (s Store) Lock(ctx context.Context, name string) (unlock func(), err error) {
	for {
		unlock, err := s.TryLock(name)
		if !errors.Is(err, ErrBusy) {
			return unlock, err
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("lock %s: %w", name, context.Cause(ctx))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TryLock takes the machine's exclusive lock or returns ErrBusy at once.
func (s Store) TryLock(name string) (unlock func(), err error) {
	dir := filepath.Join(s.Dir, "locks")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, name+".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, ErrBusy
		}
		return nil, err
	}
	return func() { f.Close() }, nil
}

// RemoveLock deletes the machine's lock file; call it while holding the lock,
// after the machine is gone.
func (s Store) RemoveLock(name string) {
	_ = os.Remove(filepath.Join(s.Dir, "locks", name+".lock"))
}

// LockNames lists machines that have lock files (they may be stale).
func (s Store) LockNames() ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(s.Dir, "locks"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if n, ok := strings.CutSuffix(e.Name(), ".lock"); ok {
			out = append(out, n)
		}
	}
	return out, nil
}
