package vm

import (
	"context"
	"errors"
	"io"
	"os"

	"libvirt.org/go/libvirtxml"
)

// ErrNotFound is returned by Hypervisor methods for a domain or volume that
// does not exist.
var ErrNotFound = errors.New("not found")

// HypervisorError is an error the hypervisor (libvirt) itself reported;
// its message is the hypervisor's. Metrics and logs class failures by it.
type HypervisorError struct{ Err error }

func (e *HypervisorError) Error() string { return e.Err.Error() }
func (e *HypervisorError) Unwrap() error { return e.Err }

// ErrNoOwner is returned by Hypervisor.Owner for a domain that carries no
// ownership record of ours.
var ErrNoOwner = errors.New("domain has no libvirt-executor ownership metadata")

// ErrAgentNotReady is returned by Hypervisor.Addresses with SourceAgent
// while the guest agent does not answer yet.
var ErrAgentNotReady = errors.New("guest agent not answering yet")

// Hypervisor holds only the libvirt operations the engine uses, so that the
// engine's logic is testable with a fake.
//
// Every method returns by the time its ctx ends, with an error that matches
// ctx.Err(), even when the operation underneath cannot be interrupted (see
// Guard, and internal/vm/libvirtvm, the libvirt implementation); what such
// an operation still does then is not waited for. An error that means the
// connection itself is gone matches ErrConnectionLost.
type Hypervisor interface {
	// KVMAvailable reports whether the host offers the kvm domain type.
	KVMAvailable(ctx context.Context) (bool, error)
	// Version reports libvirt's version and the hypervisor's (QEMU's),
	// each as major*1e6 + minor*1e3 + release (FormatVersion).
	Version(ctx context.Context) (libvirtVersion, hypervisor uint32, err error)
	// CreateVolume creates a volume in pool and returns its path.
	CreateVolume(ctx context.Context, pool string, vol *libvirtxml.StorageVolume) (string, error)
	// UploadVolume writes data at the start of an existing volume.
	UploadVolume(ctx context.Context, pool, name string, data []byte) error
	// StreamToVolume writes size bytes read from r at the start of an
	// existing volume. r is read once: unlike the other calls, a call cut
	// by a lost connection is not repeated on a new one.
	StreamToVolume(ctx context.Context, pool, name string, r io.Reader, size int64) error
	// StreamFromVolume copies a volume to w from its start, until its end
	// or until w fails (w's error is returned then).
	StreamFromVolume(ctx context.Context, pool, name string, w io.Writer) error
	// VolumeFile opens a volume's file for reading, where libvirt is this
	// host's and this process may read it (OpenVolumeFile); else nil (the
	// caller streams it: StreamFromVolume). ErrNotFound if absent.
	VolumeFile(ctx context.Context, pool, name string) (*os.File, error)
	// DeleteVolume removes a volume (ErrNotFound if absent).
	DeleteVolume(ctx context.Context, pool, name string) error
	// VolumePath returns the path of a volume in pool (ErrNotFound if
	// absent).
	VolumePath(ctx context.Context, pool, name string) (string, error)
	// VolumeNames lists the volumes in pool.
	VolumeNames(ctx context.Context, pool string) ([]string, error)
	// VolumeBacking returns the path of a volume's backing file ("" for
	// none; ErrNotFound if the volume is absent).
	VolumeBacking(ctx context.Context, pool, name string) (string, error)
	// VolumeCapacity returns the virtual size of the volume at path.
	VolumeCapacity(ctx context.Context, path string) (uint64, error)
	// Define defines a persistent domain from XML.
	Define(ctx context.Context, xml string) error
	// Start starts a defined domain.
	Start(ctx context.Context, name string) error
	// Destroy stops a domain at once (nil if it is not running, ErrNotFound
	// if it does not exist).
	Destroy(ctx context.Context, name string) error
	// Suspend pauses a running domain's vCPUs: the guest runs nothing
	// more, at once (nil if it is not running, ErrNotFound if it does not
	// exist).
	Suspend(ctx context.Context, name string) error
	// Undefine removes a domain's definition with its nvram, managed save
	// and snapshot metadata (ErrNotFound if absent).
	Undefine(ctx context.Context, name string) error
	// DetachDisk removes the disk whose source is the file source from the
	// domain's persistent definition and, if it runs, from the running
	// guest (a hot unplug the guest may complete late, or never). A disk
	// no longer there is success; ErrNotFound if the domain is absent.
	DetachDisk(ctx context.Context, name, source string) error
	// DACImageLabel returns the running domain's DAC image label, the
	// owner its QEMU opens disks as ("+UID:+GID"; DACImageLabelOf), or ""
	// where libvirt says none (no DAC security driver, a domain not
	// running). ErrNotFound if the domain is absent.
	DACImageLabel(ctx context.Context, name string) (string, error)
	// AttachDisk adds disk to the running domain, live only (a hot plug;
	// the domain's persistent definition does not get it). ErrNotFound if
	// the domain is absent.
	AttachDisk(ctx context.Context, name string, disk *libvirtxml.DomainDisk) error
	// AttachInterface adds iface to the running domain, live only (a hot
	// plug: a clone restored without a NIC gets its own). ErrNotFound if
	// the domain is absent.
	AttachInterface(ctx context.Context, name string, iface *libvirtxml.DomainInterface) error
	// AttachFilesystem adds fs (a virtiofs share) to the running domain,
	// live only; the domain needs shared memory. ErrNotFound if the
	// domain is absent.
	AttachFilesystem(ctx context.Context, name string, fs *libvirtxml.DomainFilesystem) error
	// Save writes the running domain's memory and device state to path
	// (virDomainSave: the domain stops, a persistent one stays defined).
	// ErrNotFound if the domain is absent.
	Save(ctx context.Context, name, path string) error
	// RestoreStream starts a running, transient domain from r, a whole
	// save file as libvirt writes one (a clone's head, SaveHead.WithXML,
	// then the template's migration stream), through a named pipe made in
	// pipeDir that libvirt reads: nothing is copied on disk. A call cut by
	// a lost connection is not repeated (the stream is read once). On an
	// error the domain its head names may run all the same (ctx ended
	// while libvirt finished the restore): the caller, who named it,
	// removes it by its name. Tried on libvirt 9.0, which opens the file
	// once; a libvirt that opens it twice (reads the header, then opens it
	// again) fails on the pipe (docs/pool.md).
	RestoreStream(ctx context.Context, r io.Reader, pipeDir string) error
	// Owner returns the domain's ownership metadata XML (ErrNotFound,
	// ErrNoOwner).
	Owner(ctx context.Context, name string) (string, error)
	// SetOwner replaces the domain's ownership metadata (persistent and, if
	// running, live).
	SetOwner(ctx context.Context, name, ownerXML string) error
	// DomainNames lists all domains, running or not.
	DomainNames(ctx context.Context) ([]string, error)
	// IsActive reports whether the domain runs.
	IsActive(ctx context.Context, name string) (bool, error)
	// State reports the domain's state and libvirt's reason for it.
	State(ctx context.Context, name string) (DomainState, error)
	// Addresses returns the addresses of the domain's interfaces from the
	// network's DHCP leases (SourceLease) or the guest agent (SourceAgent).
	Addresses(ctx context.Context, name string, source AddressSource) ([]Lease, error)
	// NetworkLeaseMACs returns the MACs holding leases on a network.
	NetworkLeaseMACs(ctx context.Context, network string) ([]string, error)
	// NetworkDHCP describes the network's IPv4 DHCP now: subnet, own
	// address, dynamic ranges, static host entries and leased addresses.
	NetworkDHCP(ctx context.Context, network string) (DHCPInfo, error)
	// AddDHCPHost adds a static DHCP host entry to the network, live and
	// persistent (ErrAddressTaken when one for its MAC, name or address
	// exists).
	AddDHCPHost(ctx context.Context, network string, h DHCPHost) error
	// DeleteDHCPHost removes the static DHCP host entry named name, live
	// and persistent (ErrNotFound when there is none).
	DeleteDHCPHost(ctx context.Context, network, name string) error
	// NetworkGateway returns the network's own IPv4 address (its DHCP
	// server and the guests' gateway), or "" for a network without one (a
	// bridge of the host's LAN).
	NetworkGateway(ctx context.Context, network string) (string, error)
	// EnsureNWFilters defines each filter of defs that libvirt does not
	// have (in order: one may refer to those before it). A filter of
	// requires that libvirt lacks is an error naming it; nothing is
	// defined then. A filter of defs that libvirt has must be that
	// definition (CheckFilter); one of that name with other rules is
	// refused, never used.
	EnsureNWFilters(ctx context.Context, requires []string, defs []NWFilter) error
	// PinFilterAddress gives the network filter on the running domain's
	// interface of MAC mac the address ip (vm.PinFilterIP), live only: the
	// next boot learns its address again. An interface without a filter,
	// or one pinned to ip already, is left alone; ErrNotFound if the domain
	// or the interface is absent.
	PinFilterAddress(ctx context.Context, name, mac, ip string) error
	// FilterBindings lists libvirt's network filter bindings: which filter
	// is applied on which tap device, for which domain.
	FilterBindings(ctx context.Context) ([]FilterBinding, error)
	// DeleteFilterBinding removes the filter binding of tap device portDev
	// (its firewall rules with it) when its owner is still the domain named
	// owner (read again just before: the tap name may have gone to another
	// domain since the binding was listed); ErrNotFound when there is no
	// such binding.
	DeleteFilterBinding(ctx context.Context, portDev, owner string) error
	// Close releases the connection. It does not wait for calls that were
	// abandoned when their ctx ended.
	Close() error
}

// DomainState is a domain's state with libvirt's reason for it.
type DomainState struct {
	// Code is the state, for comparing: StateRunning, StatePaused,
	// StateShutOff, ...
	Code StateCode
	// Running is true for a running (or blocked) guest: Code is
	// StateRunning.
	Running bool
	// Summary is the state with its reason, for people: it reads like
	// "running", "paused (I/O error)" or "shut off (destroyed)". Compare
	// Code, not Summary.
	Summary string
	// IOError: QEMU paused the guest because a disk write failed,
	// typically because the filesystem under the storage pool is full.
	IOError bool
}

// StateCode is a domain's state (libvirt's virDomainState) without its
// reason.
type StateCode int

// Domain states. The zero value is StateUnknown.
const (
	// StateUnknown: libvirt reports no state, or one this package does not
	// know.
	StateUnknown StateCode = iota
	// StateRunning: the guest runs (or is blocked on a resource).
	StateRunning
	// StatePaused: the guest is paused (by a user, or by QEMU after an I/O
	// error, a crash, a watchdog ...).
	StatePaused
	// StateShuttingDown: the guest is being shut down.
	StateShuttingDown
	// StateShutOff: the domain is defined but not running.
	StateShutOff
	// StateCrashed: the guest crashed (and libvirt did not restart it).
	StateCrashed
	// StateSuspended: the guest suspended itself (power management).
	StateSuspended
)

// String names the state as DomainState.Summary begins: "running",
// "paused", "shutting down", "shut off", "crashed", "suspended by the
// guest", or "unknown".
func (c StateCode) String() string {
	switch c {
	case StateRunning:
		return "running"
	case StatePaused:
		return "paused"
	case StateShuttingDown:
		return "shutting down"
	case StateShutOff:
		return "shut off"
	case StateCrashed:
		return "crashed"
	case StateSuspended:
		return "suspended by the guest"
	}
	return "unknown"
}
