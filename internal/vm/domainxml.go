package vm

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"

	"libvirt.org/go/libvirtxml"
)

// DomainXML builds the domain definition from typed structs; no value is ever
// pasted into XML text. diskPath and seedPath are the volumes' paths.
func DomainXML(s Spec, diskPath, seedPath string) (string, error) {
	if err := CheckName(s.Name); err != nil {
		return "", err
	}
	if s.DomainType != "kvm" && s.DomainType != "qemu" {
		return "", fmt.Errorf("domain type %q: want \"kvm\" or \"qemu\"", s.DomainType)
	}
	owner, err := MarshalOwner(s.Owner)
	if err != nil {
		return "", err
	}
	os := &libvirtxml.DomainOS{
		Type: &libvirtxml.DomainOSType{Arch: "x86_64", Machine: s.Machine, Type: "hvm"},
	}
	if s.Kernel != "" {
		os.Kernel, os.Initrd, os.Cmdline = s.Kernel, s.Initrd, s.Cmdline
	} else {
		os.BootDevices = []libvirtxml.DomainBootDevice{{Dev: "hd"}}
	}
	d := &libvirtxml.Domain{
		Type:       s.DomainType,
		Name:       s.Name,
		Metadata:   &libvirtxml.DomainMetadata{XML: owner},
		Memory:     &libvirtxml.DomainMemory{Value: uint(s.MemoryMiB), Unit: "MiB"},
		VCPU:       &libvirtxml.DomainVCPU{Value: uint(s.VCPUs)},
		OS:         os,
		OnPoweroff: "destroy",
		OnCrash:    "destroy",
		OnReboot:   "restart",
		Features:   &libvirtxml.DomainFeatureList{ACPI: &libvirtxml.DomainFeature{}, APIC: &libvirtxml.DomainFeatureAPIC{}},
		Devices:    &libvirtxml.DomainDeviceList{},
	}
	if s.DomainType == "kvm" {
		d.CPU = &libvirtxml.DomainCPU{Mode: "host-passthrough"}
	}
	if len(s.OEMStrings) > 0 {
		os.SMBios = &libvirtxml.DomainSMBios{Mode: "sysinfo"}
		d.SysInfo = []libvirtxml.DomainSysInfo{{SMBIOS: &libvirtxml.DomainSysInfoSMBIOS{
			OEMStrings: &libvirtxml.DomainSysInfoOEMStrings{Entry: s.OEMStrings},
		}}}
	}
	dev := d.Devices
	dev.Disks = append(dev.Disks, libvirtxml.DomainDisk{
		Device: "disk",
		Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "qcow2", Discard: "unmap"},
		Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: diskPath}},
		Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"},
	})
	if seedPath != "" {
		seed := libvirtxml.DomainDisk{
			Device:   "disk",
			Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
			Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: seedPath}},
			Target:   &libvirtxml.DomainDiskTarget{Dev: "vdb", Bus: "virtio"},
			ReadOnly: &libvirtxml.DomainDiskReadOnly{},
			Serial:   s.SeedSerial,
		}
		if s.SeedWritable {
			seed.ReadOnly = nil // the guest wipes it (Spec.SeedWritable)
		}
		dev.Disks = append(dev.Disks, seed)
	}
	for i, sd := range s.Shared {
		if i >= 20 {
			return "", fmt.Errorf("%d shared disks: at most 20", len(s.Shared))
		}
		dev.Disks = append(dev.Disks, libvirtxml.DomainDisk{
			Device:   "disk",
			Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
			Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: sd.Path}},
			Target:   &libvirtxml.DomainDiskTarget{Dev: fmt.Sprintf("vd%c", 'c'+i), Bus: "virtio"},
			ReadOnly: &libvirtxml.DomainDiskReadOnly{},
			Serial:   sd.Serial,
		})
	}
	if len(s.Dirs) > 0 {
		if err := addDirs(d, s.Dirs); err != nil {
			return "", err
		}
	}
	if len(s.Dirs) > 0 || s.SharedMemory {
		d.MemoryBacking = &libvirtxml.DomainMemoryBacking{
			MemorySource: &libvirtxml.DomainMemorySource{Type: "memfd"},
			MemoryAccess: &libvirtxml.DomainMemoryAccess{Mode: "shared"},
		}
	}
	if s.Template {
		if s.Seed != nil || len(s.OEMStrings) > 0 || len(s.Shared) > 0 || len(s.Dirs) > 0 || s.SharedMemory || s.GuestAgent {
			return "", fmt.Errorf("snapshot template %s: no seed, SMBIOS strings, shared disks or directories, shared memory or agent channel (a clone gets what is its own after its restore)", s.Name)
		}
		d.GenID = &libvirtxml.DomainGenID{}
	} else {
		nic, err := InterfaceDevice(s)
		if err != nil {
			return "", err
		}
		dev.Interfaces = []libvirtxml.DomainInterface{*nic}
	}
	serial := libvirtxml.DomainSerial{Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}}}
	if s.ConsoleLog != "" {
		// append="on": libvirt writes into the file the caller made, which
		// stays the caller's (with "off" it is recreated as root's, and an
		// unprivileged caller could no longer read the boot console).
		serial.Log = &libvirtxml.DomainChardevLog{File: s.ConsoleLog, Append: "on"}
	}
	dev.Serials = []libvirtxml.DomainSerial{serial}
	dev.RNGs = []libvirtxml.DomainRNG{{
		Model:   "virtio",
		Backend: &libvirtxml.DomainRNGBackend{Random: &libvirtxml.DomainRNGBackendRandom{Device: "/dev/urandom"}},
	}}
	dev.MemBalloon = &libvirtxml.DomainMemBalloon{Model: "none"}
	if s.GuestAgent {
		dev.Channels = []libvirtxml.DomainChannel{{
			Source: &libvirtxml.DomainChardevSource{UNIX: &libvirtxml.DomainChardevSourceUNIX{Mode: "bind"}},
			Target: &libvirtxml.DomainChannelTarget{VirtIO: &libvirtxml.DomainChannelTargetVirtIO{Name: "org.qemu.guest_agent.0"}},
		}}
	}
	return d.Marshal()
}

// InterfaceDevice is the machine's network interface on s.Network with
// s.MAC, its port isolated with s.Isolated and filtered with s.Filter: in
// its definition for a boot, hot-plugged into a restored clone.
func InterfaceDevice(s Spec) (*libvirtxml.DomainInterface, error) {
	nic := &libvirtxml.DomainInterface{
		MAC:    &libvirtxml.DomainInterfaceMAC{Address: s.MAC},
		Source: &libvirtxml.DomainInterfaceSource{Network: &libvirtxml.DomainInterfaceSourceNetwork{Network: s.Network}},
		Model:  &libvirtxml.DomainInterfaceModel{Type: "virtio"},
		// No iPXE option ROM: the disk or kernel boots, never the network.
		ROM: &libvirtxml.DomainROM{Enabled: "no"},
	}
	if s.Isolated {
		nic.PortOptions = &libvirtxml.DomainInterfacePortOptions{Isolated: "yes"}
	}
	if s.Filter != nil {
		ref, err := filterRef(s.Filter)
		if err != nil {
			return nil, err
		}
		nic.FilterRef = ref
	}
	return nic, nil
}

// virtiofsTag is a virtiofs tag the guest mounts by.
var virtiofsTag = regexp.MustCompile(`^[a-z][a-z0-9-]{0,35}$`)

// addDirs adds the virtiofs shares (DomainXML gives the guest the shared
// memory they need).
func addDirs(d *libvirtxml.Domain, dirs []SharedDir) error {
	if len(dirs) > maxDirs {
		return fmt.Errorf("%d shared directories: at most %d", len(dirs), maxDirs)
	}
	seen := map[string]bool{}
	for _, sd := range dirs {
		if seen[sd.Tag] {
			return fmt.Errorf("shared directory tag %q: given twice", sd.Tag)
		}
		seen[sd.Tag] = true
		fs, err := dirDevice(sd)
		if err != nil {
			return err
		}
		d.Devices.Filesystems = append(d.Devices.Filesystems, *fs)
	}
	return nil
}

// maxDirs is how many shared directories a machine may have.
const maxDirs = 8

// dirDevice is the virtiofs device of sd, checked.
func dirDevice(sd SharedDir) (*libvirtxml.DomainFilesystem, error) {
	if !virtiofsTag.MatchString(sd.Tag) {
		return nil, fmt.Errorf("shared directory tag %q: want a name of 1 to 36 lower-case letters, digits and '-'", sd.Tag)
	}
	if !filepath.IsAbs(sd.Socket) || filepath.Clean(sd.Socket) != sd.Socket {
		return nil, fmt.Errorf("shared directory %s: socket %q is not a clean absolute path", sd.Tag, sd.Socket)
	}
	return &libvirtxml.DomainFilesystem{
		Driver: &libvirtxml.DomainFilesystemDriver{Type: "virtiofs", Queue: 1024},
		Source: &libvirtxml.DomainFilesystemSource{Mount: &libvirtxml.DomainFilesystemSourceMount{Socket: sd.Socket}},
		Target: &libvirtxml.DomainFilesystemTarget{Dir: sd.Tag},
	}, nil
}

// AttachDirs hot-plugs the virtiofs shares dirs into the running machine
// name, which must have been booted with shared memory (Spec.SharedMemory):
// a standby machine that a GitHub hook job claims gets the job's shares.
func (e *Engine) AttachDirs(ctx context.Context, name string, dirs []SharedDir) error {
	// All checked (as for a boot: addDirs) before the first is plugged.
	var d libvirtxml.Domain
	d.Devices = &libvirtxml.DomainDeviceList{}
	if err := addDirs(&d, dirs); err != nil {
		return err
	}
	for i := range d.Devices.Filesystems {
		fs := &d.Devices.Filesystems[i]
		if err := change(ctx, func(ctx context.Context) error { return e.HV.AttachFilesystem(ctx, name, fs) }); err != nil {
			return fmt.Errorf("attach the shared directory %s: %w", fs.Target.Dir, err)
		}
	}
	return nil
}
