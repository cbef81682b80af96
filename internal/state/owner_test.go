package state

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A state directory of another user (the runner's, with a root admin
// command opening it) is refused before anything is made in it: no
// controller-id, no temporary file, no locks/ (issue #22, item 7). Its
// existing controller id can still be read, creating nothing.
func TestControllerIDRefusesAnotherUsersStateDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown the state dir to another user")
	}
	dir := filepath.Join(t.TempDir(), "state")
	require.NoError(t, os.Mkdir(dir, 0o700))
	require.NoError(t, os.Chown(dir, 65534, 65534))
	s := Store{Dir: dir}

	_, err := s.ControllerID()
	oe, ok := errors.AsType[*OwnerError](err)
	require.True(t, ok, "want an *OwnerError, got %v", err)
	require.Equal(t, 65534, oe.UID)
	require.Equal(t, 0, oe.EUID)
	require.Contains(t, err.Error(), "sudo -u "+oe.Owner+" libvirt-executor")
	require.Contains(t, err.Error(), "chown -R 0 "+dir)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "nothing created in another user's state dir")

	_, err = s.ExistingControllerID()
	require.ErrorIs(t, err, os.ErrNotExist)
	const id = "0f8e2c1a-5b7d-4e3f-9a1b-2c3d4e5f6a7b"
	require.NoError(t, os.WriteFile(filepath.Join(dir, ctrlFile), []byte(id+"\n"), 0o600))
	got, err := s.ExistingControllerID()
	require.NoError(t, err)
	require.Equal(t, id, got)
	_, err = s.ControllerID()
	require.ErrorAs(t, err, &oe, "an existing id does not make writing there right")

	// The owner itself, and a state dir not made yet, are as before.
	require.NoError(t, os.Chown(dir, 0, 0))
	got, err = s.ControllerID()
	require.NoError(t, err)
	require.Equal(t, id, got)
	fresh := Store{Dir: filepath.Join(t.TempDir(), "new", "state")}
	_, err = fresh.ControllerID()
	require.NoError(t, err)
}
