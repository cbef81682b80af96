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
