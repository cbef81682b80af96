package lifecycle

import (
	"context"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Hooks are what the kinds of machines built on this package add to one
// machine's life, without this package knowing them: the standby pool
// makes room for a job, the guest tools disk is attached and swept, a
// job's connection holder is stopped. Each is optional.
type Hooks struct {
	// MakeRoom, if set, is asked by a request that waits for room (not
	// NoWait) to free what the host lacks (short) by removing machines
	// that are cheaper to lose than the request's wait (idle standby
	// machines); it returns the name it removed, or "" for none.
	MakeRoom func(ctx context.Context, m *Manager, short Shortfall, reason string) string
	// Shared, if set, gives every machine that Provision boots (not
	// Launch) its read-only shared disks.
	Shared SharedDisks
	// Release run, under the machine's lock, when its user is done with
	// it: before a teardown, and when it is kept for debugging (Keep).
	// They must not fail: what they stop ends by itself too.
	Release []func(m *Manager, name string)
	// Sweepers run at the end of every Sweep, in order; their errors join
	// the sweep's.
	Sweepers []Sweeper
}

// Shortfall is what the host lacks for a machine: VMs (capacity.max_vms)
// and memory in MiB (capacity.memory_budget_mib) to free.
type Shortfall struct{ VMs, MemoryMiB int }

// SharedDisks provides the read-only disks shared between machines (the
// guest tools disk, internal/guesttools).
type SharedDisks interface {
	// Attach returns what a machine provisioned now gets: nil for none
	// (the job log says why), an error to fail the provisioning.
	Attach(ctx context.Context, m *Manager) (*Attached, error)
}

// Attached is the shared disks one machine gets.
type Attached struct {
	Disks []vm.SharedDisk
	// Record is what the machine's state keeps of them.
	Record *state.Tools
}

func (a *Attached) disks() []vm.SharedDisk {
	if a == nil {
		return nil
	}
	return a.Disks
}

func (a *Attached) record() *state.Tools {
	if a == nil {
		return nil
	}
	return a.Record
}

// Sweeper is an extra sweep (Hooks.Sweepers): rep is the sweep's report,
// dryRun says to report only.
type Sweeper func(ctx context.Context, m *Manager, rep *SweepReport, dryRun bool) error

// release runs the Release hooks.
func (m *Manager) release(name string) {
	for _, f := range m.hooks.Release {
		f(m, name)
	}
}

// Hypervisor is the Manager's hypervisor connection, for the packages
// that add to a machine's life (hooks).
func (m *Manager) Hypervisor() vm.Hypervisor { return m.hv }

// Engine is the VM engine over the Manager's hypervisor.
func (m *Manager) Engine() *vm.Engine { return m.engine() }

// Sayf writes a progress line for the person watching (Manager.Say).
func (m *Manager) Sayf(format string, args ...any) { m.say(format, args...) }

// PoolVolumes lists the volumes of the configured storage pool.
func (vh Volumes) List(ctx context.Context) ([]string, error) {
	m := vh.m
	return m.poolVolumes(ctx)
}
