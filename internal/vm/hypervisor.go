package vm

import (
	"errors"

	"libvirt.org/go/libvirtxml"
)

// ErrNotFound is returned by Hypervisor methods for a domain or volume that
// does not exist.
var ErrNotFound = errors.New("not found")

// ErrNoOwner is returned by Hypervisor.Owner for a domain that carries no
// ownership record of ours.
var ErrNoOwner = errors.New("domain has no libvirt-executor ownership metadata")

// Hypervisor holds only the libvirt operations the engine uses, so that the
// engine's logic is testable with a fake.
type Hypervisor interface {
	// KVMAvailable reports whether the host offers the kvm domain type.
	KVMAvailable() (bool, error)
	// CreateVolume creates a volume in pool and returns its path.
	CreateVolume(pool string, vol *libvirtxml.StorageVolume) (string, error)
	// UploadVolume writes data at the start of an existing volume.
	UploadVolume(pool, name string, data []byte) error
	// DeleteVolume removes a volume (ErrNotFound if absent).
	DeleteVolume(pool, name string) error
	// VolumeNames lists the volumes in pool.
	VolumeNames(pool string) ([]string, error)
	// VolumeCapacity returns the virtual size of the volume at path.
	VolumeCapacity(path string) (uint64, error)
	// Define defines a persistent domain from XML.
	Define(xml string) error
	// Start starts a defined domain.
	Start(name string) error
	// Destroy stops a domain at once (nil if it is not running, ErrNotFound
	// if it does not exist).
	Destroy(name string) error
	// Undefine removes a domain's definition with its nvram, managed save
	// and snapshot metadata (ErrNotFound if absent).
	Undefine(name string) error
	// Owner returns the domain's ownership metadata XML (ErrNotFound,
	// ErrNoOwner).
	Owner(name string) (string, error)
	// SetOwner replaces the domain's ownership metadata (persistent and, if
	// running, live).
	SetOwner(name, ownerXML string) error
	// DomainNames lists all domains, running or not.
	DomainNames() ([]string, error)
	// IsActive reports whether the domain runs.
	IsActive(name string) (bool, error)
	// State reports the domain's state and libvirt's reason for it.
	State(name string) (DomainState, error)
	// Addresses returns the addresses of the domain's interfaces from the
	// network's DHCP leases (SourceLease) or the guest agent (SourceAgent).
	Addresses(name string, source AddressSource) ([]Lease, error)
	// NetworkLeaseMACs returns the MACs holding leases on a network.
	NetworkLeaseMACs(network string) ([]string, error)
	// Close releases the connection.
	Close() error
}

// DomainState is a domain's state with libvirt's reason for it.
type DomainState struct {
	// Running is true for a running (or blocked) guest.
	Running bool
	// Summary reads like "running", "paused (I/O error)" or "shut off
	// (destroyed)".
	Summary string
	// IOError: QEMU paused the guest because a disk write failed,
	// typically because the filesystem under the storage pool is full.
	IOError bool
}
