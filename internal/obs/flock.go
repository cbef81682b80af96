package obs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/gofrs/flock"
)

// lockWithin takes a shared or exclusive flock on path (opened with flag,
// which must not create it), trying every poll for at most wait. It
// returns the held lock (Close releases it); an error wrapping
// os.ErrNotExist when there is no file at path; past wait, one that wraps
// syscall.EWOULDBLOCK; every error names the file.
func lockWithin(path string, flag int, shared bool, wait, poll time.Duration) (*flock.Flock, error) {
	fl := flock.New(path, flock.SetFlag(flag))
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	try := fl.TryLockContext
	if shared {
		try = fl.TryRLockContext
	}
	for {
		ok, err := try(ctx, poll)
		if errors.Is(err, syscall.EINTR) {
			continue // a signal during flock(2): try again
		}
		if errors.Is(err, context.DeadlineExceeded) {
			return nil, fmt.Errorf("%s: still locked after %s: %w", path, wait, syscall.EWOULDBLOCK)
		}
		var pe *os.PathError
		if errors.As(err, &pe) {
			return nil, err // the open's: names the file
		}
		if err != nil {
			return nil, &os.PathError{Op: "flock", Path: path, Err: err}
		}
		if !ok { // TryLockContext returns ok or an error; in case it did not
			return nil, fmt.Errorf("%s: not locked", path)
		}
		return fl, nil
	}
}

// lockOpen takes a shared or exclusive lock on the file f is open on, by
// its path, retrying every 5 ms for at most lockWait (the service holds a
// segment's lock only while it reads the segment's rest and saves). gone
// is true, and nothing locked, when the path no longer names f's file
// (removed, or replaced, since f was opened). Close the lock to release
// it.
func lockOpen(f *os.File, shared bool) (lock *flock.Flock, gone bool, err error) {
	lock, err = lockWithin(f.Name(), os.O_RDONLY, shared, lockWait, 5*time.Millisecond)
	if errors.Is(err, os.ErrNotExist) {
		return nil, true, nil
	}
	if err != nil {
		return nil, false, err
	}
	locked, lerr := lock.Stat()
	opened, oerr := f.Stat()
	if err := errors.Join(lerr, oerr); err != nil {
		_ = lock.Close()
		return nil, false, err
	}
	if !os.SameFile(locked, opened) {
		_ = lock.Close()
		return nil, true, nil
	}
	return lock, false, nil
}
