package state

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
)

// addressFile, in a machine's directory, names the spare DHCP host entry
// (its address) the machine holds: the hold lasts while the directory
// does, which teardown removes last, after the domain.
const addressFile = "address"

// HoldAddress records that the machine holds the spare entry of ip. The
// machine's directory must exist (admission made it).
func (s Store) HoldAddress(name, ip string) error {
	if net.ParseIP(ip) == nil {
		return fmt.Errorf("hold address %q: not an IP address", ip)
	}
	if ok, err := s.Has(name); err != nil || !ok {
		return errors.Join(fmt.Errorf("hold address %s for %s: no state directory", ip, name), err)
	}
	return WriteFileAtomic(filepath.Join(s.MachineDir(name), addressFile), []byte(ip+"\n"))
}

// DropAddress ends the machine's hold, if any.
func (s Store) DropAddress(name string) error {
	err := os.Remove(filepath.Join(s.MachineDir(name), addressFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// AddressHolds maps every held address to the machine that holds it. An
// unreadable hold is an error: its address might be handed out twice.
func (s Store) AddressHolds() (map[string]string, error) {
	names, err := s.Names()
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(s.MachineDir(n), addressFile))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("address hold of %s: %w", n, err)
		}
		ip := net.ParseIP(strings.TrimSpace(string(b)))
		if ip == nil {
			return nil, fmt.Errorf("address hold of %s: %q is not an IP address", n, strings.TrimSpace(string(b)))
		}
		out[ip.String()] = n
	}
	return out, nil
}
