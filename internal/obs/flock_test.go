package obs

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// lockWithin: shared locks share, an exclusive one waits at most its
// bound, a missing file is not created, and it is taken once released.
func TestLockWithin(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	_, err := lockWithin(path, os.O_RDONLY, true, 50*time.Millisecond, time.Millisecond)
	require.ErrorIs(t, err, os.ErrNotExist)
	require.NoFileExists(t, path, "the lock makes no file")

	require.NoError(t, os.WriteFile(path, nil, 0o600))
	sh1, err := lockWithin(path, os.O_RDONLY, true, 50*time.Millisecond, time.Millisecond)
	require.NoError(t, err)
	sh2, err := lockWithin(path, os.O_RDONLY, true, 50*time.Millisecond, time.Millisecond)
	require.NoError(t, err, "shared locks share")

	start := time.Now()
	_, err = lockWithin(path, os.O_RDONLY, false, 50*time.Millisecond, time.Millisecond)
	require.ErrorIs(t, err, syscall.EWOULDBLOCK)
	require.ErrorContains(t, err, path)
	require.GreaterOrEqual(t, time.Since(start), 50*time.Millisecond)

	require.NoError(t, sh1.Close())
	go func() { time.Sleep(20 * time.Millisecond); _ = sh2.Close() }()
	ex, err := lockWithin(path, os.O_RDONLY, false, 5*time.Second, time.Millisecond)
	require.NoError(t, err, "taken once the shared ones are released")
	require.NoError(t, ex.Close())
}

// lockOpen locks the file f is open on, or says it is gone: removed, or
// another file at its path.
func TestLockOpenGone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "seg")
	require.NoError(t, os.WriteFile(path, nil, 0o600))
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()

	lock, gone, err := lockOpen(f, false)
	require.NoError(t, err)
	require.False(t, gone)
	require.NoError(t, lock.Close())

	require.NoError(t, os.Remove(path))
	lock, gone, err = lockOpen(f, false)
	require.NoError(t, err)
	require.True(t, gone, "removed")
	require.Nil(t, lock)

	require.NoError(t, os.WriteFile(path, nil, 0o600))
	lock, gone, err = lockOpen(f, true)
	require.NoError(t, err)
	require.True(t, gone, "replaced")
	require.Nil(t, lock)
}
