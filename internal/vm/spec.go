package vm

import (
	"crypto/rand"
	"fmt"
	"net"
	"time"
)

// Spec is everything needed to create one machine.
type Spec struct {
	// Name of the domain; see CheckName.
	Name string
	// DomainType is "kvm" or "qemu".
	DomainType string
	VCPUs      int
	MemoryMiB  int
	// DiskBytes is the overlay's virtual size; 0 or less than the base keeps
	// the base size.
	DiskBytes uint64
	// Base and BaseFormat describe the backing image of the linked clone.
	Base       string
	BaseFormat string
	// Machine is the QEMU machine type ("pc", "q35").
	Machine string
	// Kernel, Initrd and Cmdline select direct kernel boot when Kernel is set.
	Kernel, Initrd, Cmdline string
	// Pool is the storage pool for the overlay and seed volumes.
	Pool string
	// Network is the libvirt network to attach to.
	Network string
	// MAC is the interface's address; see NewMAC.
	MAC string
	// StaticAddress gives the machine a static DHCP host entry of its own
	// on Network before the domain is defined: a spare entry it takes over,
	// MAC and address, and gives back when removed (Engine.Addresses), or
	// else one added for it (MAC to a free address, named Name) and removed
	// with it (Engine.Remove). The filter carries the
	// address from the first packet, and a network without a dynamic
	// range gives the guest no second lease, whatever client identifier
	// it sends. A network without libvirt's DHCP is left as it is.
	StaticAddress bool
	// OEMStrings are SMBIOS type 11 strings (systemd credentials).
	OEMStrings []string
	// Seed, when not nil, is attached read-only as a second disk: a
	// cloud-init NoCloud image, or a credentials disk. It is a volume in the
	// pool, so its content never appears in the domain XML or on QEMU's
	// command line.
	Seed []byte
	// SeedSerial is the seed disk's serial number (the guest finds it as
	// /dev/disk/by-id/virtio-SERIAL); empty for none.
	SeedSerial string
	// SeedWritable attaches the seed writable instead: a guest that wipes
	// it itself once it has read it (garm's bootstrap overwrites it with
	// zeros, which reach the volume), so that its secrets do not wait for
	// the host to take the disk away.
	SeedWritable bool
	// Shared are read-only disks that many machines attach at once (such
	// as the guest tools disk). They are not the machine's: Remove never
	// deletes them.
	Shared []SharedDisk
	// Dirs are host directories shared into the guest with virtiofs,
	// each served by a virtiofsd the caller started (libvirt 9.0 runs its
	// own only as root, and supports no read-only virtiofs). They need the
	// guest's memory shared (memfd), which DomainXML then sets.
	Dirs []SharedDir `json:",omitempty"`
	// SharedMemory gives the guest shared memory (memfd) without a shared
	// directory yet, so that Engine.AttachDirs can add some later (a
	// standby machine that a GitHub hook job may claim).
	SharedMemory bool `json:",omitempty"`
	// Isolated sets the interface's bridge port isolated: isolated ports on
	// one bridge cannot talk to each other, only to the uplink (the host side
	// of the network: DHCP, DNS, NAT to the outside).
	Isolated bool
	// Filter, when not nil, puts the project's nwfilter on the interface
	// (see Filter): the machine can use only its own MAC and the address
	// DHCP gave it, and reaches only what the filter allows.
	Filter *Filter
	// GuestAgent adds the qemu-guest-agent channel.
	GuestAgent bool
	// ConsoleLog, when set, receives the serial console output, appended to
	// the file (create it first: it stays the creator's).
	ConsoleLog string
	// Owner is stored in the domain's metadata.
	Owner Owner
	// Template makes the machine a snapshot template (issue #48,
	// docs/pool.md): no network interface, no seed or SMBIOS strings, no
	// shared disks or directories (a clone gets its own by hot plug after
	// its restore), and a VM generation id, which libvirt renews on every
	// restore so that each clone's kernel reseeds its random generator.
	// The caller puts the guest's template marker on the kernel command
	// line.
	Template bool `json:",omitempty"`
}

// SharedDir is a host directory served into the guest by a virtiofsd the
// caller started.
type SharedDir struct {
	// Socket is the virtiofsd's vhost-user socket (QEMU's user must be
	// able to connect to it).
	Socket string
	// Tag is the name the guest mounts it by (mount -t virtiofs TAG DIR).
	Tag string
}

// SharedDisk is a read-only raw disk image shared between machines.
type SharedDisk struct {
	// Path of the image (a volume in the storage pool).
	Path string
	// Serial is the disk's serial number (/dev/disk/by-id/virtio-SERIAL).
	Serial string
}

// NewMAC returns a random locally administered unicast MAC in QEMU's
// 52:54:00 range.
func NewMAC() (string, error) {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return fmt.Sprintf("52:54:00:%02x:%02x:%02x", b[0], b[1], b[2]), nil
}

// Machine is a created machine.
type Machine struct {
	Name     string
	MAC      string
	DiskPath string
	// IP is the address of the machine's static DHCP host entry, "" when
	// it has none (Spec.StaticAddress off, or a network without libvirt's
	// DHCP).
	IP string
	// Steps is how long each of Create's steps took, in order, unrounded
	// (the progress lines print them rounded).
	Steps []StepTime
}

// StepTime is how long one named step took.
type StepTime struct {
	Name string
	Took time.Duration
}

// AddressSource is where a machine's address is learned.
type AddressSource string

const (
	// SourceLease reads the libvirt network's active DHCP leases.
	SourceLease AddressSource = "lease"
	// SourceAgent asks qemu-guest-agent in the guest (for networks whose DHCP
	// server is not libvirt's, such as a host bridge).
	SourceAgent AddressSource = "agent"
)

// Lease is one address reported for a domain interface.
type Lease struct {
	MAC string
	IP  net.IP
}
