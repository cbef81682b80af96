package state

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
)

// OwnerError is the refusal to write into a state directory that another
// user owns: a root admin command (gc, rm, serve) would leave root-owned
// files there (controller-id, locks/, the guest tools lock, last-sweep)
// that the stages' user cannot write, and every later job would fail.
type OwnerError struct {
	Dir string
	// UID is the directory's owner, Owner its name (the uid if unknown).
	UID   int
	Owner string
	// EUID is this process's effective uid.
	EUID int
}

func (e *OwnerError) Error() string {
	return fmt.Sprintf("state dir %s belongs to %s (uid %d), not to this process (uid %d): refusing to create files there that %s could not change; "+
		"run as %s: sudo -u %s libvirt-executor ... (or, if the stages really run as uid %d: chown -R %d %s)",
		e.Dir, e.Owner, e.UID, e.EUID, e.Owner, e.Owner, e.Owner, e.EUID, e.EUID, e.Dir)
}

// CheckOwner refuses (an *OwnerError) when the state directory exists and
// belongs to another user than this process's effective one. A directory
// that does not exist yet is made by whoever comes first, as before. It is
// the one owner check: ControllerID, which every opener calls first, makes
// it.
func (s Store) CheckOwner() error {
	st, err := os.Stat(s.Dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || int(sys.Uid) == os.Geteuid() {
		return nil
	}
	e := &OwnerError{Dir: s.Dir, UID: int(sys.Uid), Owner: strconv.Itoa(int(sys.Uid)), EUID: os.Geteuid()}
	if u, err := user.LookupId(e.Owner); err == nil {
		e.Owner = u.Username
	}
	return e
}

// ExistingControllerID reads the installation's identity and creates
// nothing: for a look that changes nothing (list) by another user than
// the state directory's (root). An error wrapping os.ErrNotExist means
// there is none yet.
func (s Store) ExistingControllerID() (string, error) {
	return readID(filepath.Join(s.Dir, ctrlFile))
}
