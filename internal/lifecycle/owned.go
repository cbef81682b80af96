package lifecycle

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Owned is a machine of this installation as a front end sees it: its
// ownership record and what libvirt says of it now.
type Owned struct {
	Name  string
	Owner vm.Owner
	State vm.DomainState
	// Address is its IPv4 address from the network's DHCP leases ("" when
	// it has none yet, or is stopped).
	Address string
}

// OwnedBy lists the domains of this installation whose ownership record
// names frontend and satisfies match (nil: all of them). Domains without a
// readable record, or of another controller, are never listed.
func (m *Manager) OwnedBy(ctx context.Context, frontend string, match func(vm.Owner) bool) ([]Owned, error) {
	names, err := m.hv.DomainNames(ctx)
	if err != nil {
		return nil, err
	}
	prefix := m.namePrefix()
	var out []Owned
	for _, name := range names {
		if !strings.HasPrefix(name, prefix) {
			continue
		}
		x, err := m.hv.Owner(ctx, name)
		if errors.Is(err, vm.ErrNotFound) || errors.Is(err, vm.ErrNoOwner) {
			continue // gone meanwhile, or not ours
		}
		if err != nil {
			return nil, err
		}
		o, err := vm.ParseOwner(x)
		if err != nil || o.Controller != m.Controller || o.Frontend != frontend || (match != nil && !match(o)) {
			continue
		}
		st, err := m.hv.State(ctx, name)
		if errors.Is(err, vm.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		it := Owned{Name: name, Owner: o, State: st}
		if st.Running {
			it.Address = m.leaseAddress(ctx, name)
		}
		out = append(out, it)
	}
	return out, nil
}

// leaseAddress is the machine's IPv4 address from the DHCP leases of its
// MAC (the state record's), or "".
func (m *Manager) leaseAddress(ctx context.Context, name string) string {
	mach, err := m.Store.Record(name)
	if err != nil {
		return ""
	}
	leases, err := m.hv.Addresses(ctx, name, vm.SourceLease)
	if err != nil {
		return ""
	}
	for _, l := range leases {
		if strings.EqualFold(l.MAC, mach.MAC) && l.IP.To4() != nil {
			return l.IP.String()
		}
	}
	return ""
}

// PinAddress gives the network filter of a running machine its address
// addr (vm.Hypervisor.PinFilterAddress), so that a libvirtd restart does
// not leave it able to send only DHCP until its lease is renewed. Machines
// that wait for their address at boot (jobs, standbys) are pinned then;
// detached ones (garm's) once the front end sees their address. Without
// l2_filter it does nothing.
func (mc Machine) PinAddress(ctx context.Context, addr string) error {
	m, name := mc.m, mc.name
	if m.Cfg.L2Filter != nil && !*m.Cfg.L2Filter {
		return nil
	}
	if err := m.checkOurName(name); err != nil {
		return err
	}
	mach, err := m.Store.Record(name)
	if err != nil {
		return err
	}
	if err := m.hv.PinFilterAddress(ctx, name, mach.MAC, addr); err != nil {
		return err
	}
	return m.markPinned(name, addr)
}

// markPinned records that the running machine's filter carries addr.
func (m *Manager) markPinned(name, addr string) error {
	return os.WriteFile(m.pinnedPath(name), []byte(addr+"\n"), 0o600)
}

// pinnedPath is the file in the machine's state directory that says the
// running domain's filter carries its address (PinAddress); StartMachine
// removes it, since a new boot learns the address again.
func (m *Manager) pinnedPath(name string) string {
	return filepath.Join(m.Store.MachineDir(name), "filter-address")
}

// Pinned reports whether PinAddress gave the running machine's filter its
// address since the machine last started (StartMachine).
func (mc Machine) Pinned() bool {
	m, name := mc.m, mc.name
	_, err := os.Stat(m.pinnedPath(name))
	return err == nil
}

// DropSeed takes the cloud-init seed away from a machine whose guest no
// longer needs it (vm.Engine.DropSeed: wiped, detached, deleted), under
// the machine's lock. A machine busy in another process (being torn down)
// is left for a later call (state.ErrBusy).
func (mc Machine) DropSeed(ctx context.Context) error {
	m, name := mc.m, mc.name
	if err := m.checkOurName(name); err != nil {
		return err
	}
	unlock, err := m.Store.TryLock(name)
	if err != nil {
		return err
	}
	defer unlock()
	err = m.engine().DropSeed(ctx, name, m.Cfg.StoragePool)
	if errors.Is(err, vm.ErrNotFound) {
		if has, herr := m.Store.Has(name); herr == nil && !has {
			m.Store.RemoveLock(name) // removed meanwhile: no lock file left behind
		}
	}
	return err
}

// AttachData hands size bytes of r to the running machine name on a
// read-only disk hot-plugged into it (vm.Engine.AttachData), under the
// machine's lock: a teardown runs before or after it, never in between, and
// removes the disk's volume either way.
func (mc Machine) AttachData(ctx context.Context, r io.Reader, size int64) error {
	m, name := mc.m, mc.name
	return m.withLock(ctx, name, func() error { return m.engine().AttachData(ctx, name, m.Cfg.StoragePool, r, size) })
}

// AttachDirs hot-plugs virtiofs shares into the running machine name
// (vm.Engine.AttachDirs), under the machine's lock; it needs the machine
// booted with shared memory (config.Image.SharedMemory).
func (mc Machine) AttachDirs(ctx context.Context, dirs []vm.SharedDir) error {
	m, name := mc.m, mc.name
	return m.withLock(ctx, name, func() error { return m.engine().AttachDirs(ctx, name, dirs) })
}

// AttachScratch gives the running machine name an empty writable disk of
// capacity bytes (vm.Engine.AttachScratch), under the machine's lock.
func (mc Machine) AttachScratch(ctx context.Context, capacity int64) error {
	m, name := mc.m, mc.name
	return m.withLock(ctx, name, func() error { return m.engine().AttachScratch(ctx, name, m.Cfg.StoragePool, capacity) })
}

// ReadScratch copies what the guest of machine name wrote on its scratch
// disk to w (vm.Engine.ReadScratch): hostile bytes. fromFile: read from
// the volume's file, not libvirt's stream.
func (mc Machine) ReadScratch(ctx context.Context, w io.Writer) (fromFile bool, err error) {
	m, name := mc.m, mc.name
	if err := m.checkOurName(name); err != nil {
		return false, err
	}
	return m.engine().ReadScratch(ctx, name, m.Cfg.StoragePool, w)
}

// DropDisks deletes the volumes of machine name's hot-plugged disks (data
// and scratch: vm.Engine.DropData, DropScratch), under the machine's lock.
// A machine gone meanwhile is success: its teardown removed them.
func (mc Machine) DropDisks(ctx context.Context) error {
	m, name := mc.m, mc.name
	return m.withLock(ctx, name, func() error {
		e := m.engine()
		for _, drop := range []func(context.Context, string, string) error{e.DropData, e.DropScratch} {
			if err := drop(ctx, name, m.Cfg.StoragePool); err != nil && !errors.Is(err, vm.ErrNotFound) {
				return err
			}
		}
		return nil
	})
}

// withLock runs fn for machine name of this installation under the
// machine's lock (waiting for it while ctx lets it).
func (m *Manager) withLock(ctx context.Context, name string, fn func() error) error {
	if err := m.checkOurName(name); err != nil {
		return err
	}
	unlock, err := m.Store.Lock(ctx, name)
	if err != nil {
		return err
	}
	defer unlock()
	return fn()
}

// StartMachine starts a stopped machine of this installation.
func (mc Machine) Start(ctx context.Context) error {
	m, name := mc.m, mc.name
	if err := m.checkOurName(name); err != nil {
		return err
	}
	if err := os.Remove(m.pinnedPath(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return m.hv.Start(ctx, name)
}

// StopMachine stops a machine of this installation at once (its disk and
// definition stay; StartMachine starts it again).
func (mc Machine) Stop(ctx context.Context) error {
	m, name := mc.m, mc.name
	if err := m.checkOurName(name); err != nil {
		return err
	}
	return m.hv.Destroy(ctx, name)
}
