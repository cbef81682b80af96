package state

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A process that opened the lock file just before its holder removed it (the
// holder is done with the machine) must not lock the unlinked file: a third
// process opens a new file at the path, and both would hold "the" lock.
func TestTryLockAfterRemoveLockRace(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	const name = "lve-a-1"
	release, err := s.TryLock(name)
	require.NoError(t, err)

	hookRuns := 0
	afterOpen = func() {
		hookRuns++
		if hookRuns == 1 {
			// The holder finishes between our open and our flock.
			s.RemoveLock(name)
			release()
		}
	}
	t.Cleanup(func() { afterOpen = nil })
	unlock, err := s.TryLock(name)
	require.NoError(t, err, "the lock is free once the holder released it")
	defer unlock()
	afterOpen = nil

	third, err := s.TryLock(name)
	if err == nil {
		third()
	}
	require.ErrorIs(t, err, ErrBusy, "a third process must not get the lock while we hold it")
	names, err := s.LockNames()
	require.NoError(t, err)
	require.Equal(t, []string{name}, names, "the lock we hold is the file at the path")
}
