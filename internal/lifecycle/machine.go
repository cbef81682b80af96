package lifecycle

// Machine is one machine of this installation, by name: the per-machine
// operations (Connect, Teardown, Keep, Start, Stop, PinAddress, the cache
// disks, the seed, Explain) are its methods, so that a new capability adds
// to this small handle, not to Manager. It holds nothing but the name: a
// Machine of a name that has no machine is valid, and its operations say
// so (or treat "not found" as done, as Teardown does).
type Machine struct {
	m    *Manager
	name string
}

// Machine is the handle of the machine called name.
func (m *Manager) Machine(name string) Machine { return Machine{m: m, name: name} }

// Name is the machine's name.
func (mc Machine) Name() string { return mc.name }

// Capacity is the host's capacity as admission counts it: what the
// machines hold (Reservations, Used), the admission lock (Hold), and
// whether a job waited for room lately (UnderPressure).
type Capacity struct{ m *Manager }

// Capacity is the handle of the host's capacity.
func (m *Manager) Capacity() Capacity { return Capacity{m: m} }

// KVM is what this installation knows of the host's KVM: the probe
// (Probe), its record (Record) and the domain type it decides
// (DomainType).
type KVM struct{ m *Manager }

// KVM is the handle of the host's KVM probe.
func (m *Manager) KVM() KVM { return KVM{m: m} }

// Volumes is the configured storage pool's volumes: all of them (List)
// and the base files this installation's volumes are backed by
// (BackingFiles).
type Volumes struct{ m *Manager }

// Volumes is the handle of the storage pool's volumes.
func (m *Manager) Volumes() Volumes { return Volumes{m: m} }
