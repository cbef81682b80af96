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

// afterOpen, if set, runs in TryLock between opening the lock file and
// locking it. Tests force the race with RemoveLock through it; it is nil in
// production.
var afterOpen func()

// lockAttempts bounds how often TryLock retries when the lock file is
// replaced under it.
const lockAttempts = 10

// TryLock takes the machine's exclusive lock or returns ErrBusy at once.
//
// RemoveLock unlinks the file while its holder still has it locked, so a
// process that opened the old file just before can lock it once the holder
// lets go, an inode no longer at the path, while another process locks a new
// file there: two holders. After locking, TryLock therefore checks that its
// open file is still the one at the path, and otherwise starts over.
func (s Store) TryLock(name string) (unlock func(), err error) {
	dir := filepath.Join(s.Dir, "locks")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, name+".lock")
	for range lockAttempts {
		f, err := lockFile(path)
		if err != nil {
			return nil, err
		}
		if f != nil {
			return func() { f.Close() }, nil
		}
	}
	return nil, fmt.Errorf("%w: lock file %s replaced %d times while locking it", ErrBusy, path, lockAttempts)
}

// lockFile opens and locks path. It returns a nil file and no error when the
// locked file is no longer the one at path (it was removed or replaced
// meanwhile): the caller tries again.
func lockFile(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if afterOpen != nil {
		afterOpen()
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, ErrBusy
		}
		return nil, err
	}
	same, err := isFileAt(f, path)
	if err != nil || !same {
		f.Close()
		return nil, err
	}
	return f, nil
}

// isFileAt reports whether the open file f is the file now at path (same
// device and inode).
func isFileAt(f *os.File, path string) (bool, error) {
	open, err := f.Stat()
	if err != nil {
		return false, err
	}
	now, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return os.SameFile(open, now), nil
}

// RemoveLock deletes the machine's lock file; call it while holding the lock,
// after the machine is gone. A process that opened the file before it was
// removed notices when it gets the lock, and retries on a new file (TryLock).
func (s Store) RemoveLock(name string) {
	_ = os.Remove(filepath.Join(s.Dir, "locks", name+".lock"))
}

// LockNames lists machines that have lock files (they may be stale).
func (s Store) LockNames() ([]string, error) { return s.namesIn("locks", ".lock") }

// namesIn lists the names of the files in the store's directory dir that
// end in suffix, without it; hidden files (a write in progress) are left
// out. A missing directory holds none.
func (s Store) namesIn(dir, suffix string) ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(s.Dir, dir))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if n, ok := strings.CutSuffix(e.Name(), suffix); ok && !strings.HasPrefix(n, ".") {
			out = append(out, n)
		}
	}
	return out, nil
}

// Held reports whether a process holds name's lock, without creating
// anything: no lock file (or no lock directory) means nobody holds it. For
// looking from another user (an administrator's doctor as root), where
// TryLock would leave files that user owns.
func (s Store) Held(name string) (bool, error) {
	f, err := os.Open(filepath.Join(s.Dir, "locks", name+".lock"))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return false, nil
}
