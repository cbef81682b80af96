package state

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// hostFile names the libvirt whose machines the state directory keeps.
const hostFile = "libvirt-host"

// HostError is the refusal to use a state directory for the machines of
// another libvirt than the one it keeps: two hosts sharing one would count
// each other's machines against their capacity, and each one's sweep
// would take the other's machine records for leftovers.
type HostError struct {
	Dir string
	// Kept is the libvirt the directory keeps, Want the configuration's.
	Kept, Want string
}

func (e *HostError) Error() string {
	if e.Kept == legacyHost {
		return fmt.Sprintf("state dir %s keeps the machines of %s, and this configuration's libvirt_uri names %s, another host's: "+
			"give this configuration a state_dir of its own (one per garm provider entry)", e.Dir, e.Kept, e.Want)
	}
	return fmt.Sprintf("state dir %s keeps the machines of libvirt %s, and this configuration's libvirt_uri names %s, another one: "+
		"give each host's configuration a state_dir of its own (one per garm provider entry); "+
		"if both name the same libvirt, remove %s once no machine is left (libvirt-executor list)",
		e.Dir, e.Kept, e.Want, filepath.Join(e.Dir, hostFile))
}

// legacyHost is what a directory keeps whose machine records predate the
// record of its libvirt: before it, only this host's libvirt worked.
const legacyHost = "this host's libvirt (its machine records predate the record of the directory's libvirt)"

// BindHost ties the state directory to the libvirt of key (vm.HostKey of
// the configuration's libvirt_uri) on first use and refuses (*HostError)
// when it is tied to another. A directory not tied yet that holds machine
// records keeps this host's libvirt's machines: a remote key is refused
// there. Concurrent first calls agree on one value; readOnly creates
// nothing (a directory tied to none yet is no refusal).
func (s Store) BindHost(key string, remote, readOnly bool) error {
	path := filepath.Join(s.Dir, hostFile)
	kept, err := readHost(path)
	if errors.Is(err, os.ErrNotExist) {
		if remote {
			if entries, _ := os.ReadDir(filepath.Join(s.Dir, "machines")); len(entries) > 0 {
				return &HostError{Dir: s.Dir, Kept: legacyHost, Want: key}
			}
		}
		if readOnly {
			return nil
		}
		if kept, err = s.writeHost(path, key); err != nil {
			return fmt.Errorf("state dir: record its libvirt: %w", err)
		}
	} else if err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	if kept != key {
		return &HostError{Dir: s.Dir, Kept: kept, Want: key}
	}
	return nil
}

// writeHost records key unless another process recorded one first, and
// returns what is recorded.
func (s Store) writeHost(path, key string) (string, error) {
	tmp, err := os.CreateTemp(s.Dir, ".libvirt-host-*")
	if err != nil {
		return "", err
	}
	defer func() { _ = os.Remove(tmp.Name()) }() // gone already once linked
	if _, err := tmp.WriteString(key + "\n"); err != nil {
		_ = tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	// Link fails if another process won the race; then its value counts.
	if err := os.Link(tmp.Name(), path); err != nil && !errors.Is(err, os.ErrExist) {
		return "", err
	}
	return readHost(path)
}

// readHost reads the recorded key (one line, at most 4 KiB).
func readHost(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	buf := make([]byte, 4<<10)
	n, err := f.Read(buf)
	if err != nil && n == 0 {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	key := strings.TrimSpace(string(buf[:n]))
	if key == "" || strings.ContainsAny(key, "\n\r") {
		return "", fmt.Errorf("%s: not one libvirt host key", path)
	}
	return key, nil
}

// BoundHost is the libvirt the directory keeps the machines of ("" when
// it is not tied to one yet).
func (s Store) BoundHost() (string, error) {
	kept, err := readHost(filepath.Join(s.Dir, hostFile))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	return kept, err
}
