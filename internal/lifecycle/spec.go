package lifecycle

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// SpecInput is what MachineSpec needs besides the configuration: the
// request and the per-machine values Provision makes or looks up before it
// creates the machine.
type SpecInput struct {
	// Request gives the name, image, sizes and the owner's front end, job
	// and lifetime (Check is not used).
	Request Request
	// Controller is this installation's id, recorded as the owner.
	Controller string
	// DomainType is "kvm" or "qemu" (Manager.DomainType).
	DomainType string
	// Keys are the machine's fresh keys; the comment on its authorized key
	// is the machine's name.
	Keys *guestinit.Keys
	// CloudInitSeed is the NoCloud seed image of an image whose keys travel
	// by cloud-init (CloudInitSeed makes it); other images ignore it.
	CloudInitSeed []byte
	// MAC is the interface's address (vm.Engine.FreshMAC).
	MAC string
	// Created is the creation time in the ownership record; the deadline is
	// Created + Request.Lifetime + timeouts.job_slack.
	Created time.Time
	// ConsoleLog is the file that receives the serial console.
	ConsoleLog string
	// Shared are the read-only disks shared between machines (the guest
	// tools disk: Tools.Disk).
	Shared []vm.SharedDisk
}

// MachineSpec is the machine that Provision creates for in: a pure function
// of cfg and in, so that whoever boots the same machine (the benchmark's
// floor) boots exactly what prepare boots.
func MachineSpec(cfg *config.Config, in SpecInput) vm.Spec {
	req, img := in.Request, in.Request.Image
	s := vm.Spec{
		Name: req.Name, DomainType: in.DomainType,
		VCPUs: req.VCPUs, MemoryMiB: req.MemoryMiB, DiskBytes: uint64(max(req.DiskGiB, 0)) << 30, //nolint:gosec // G115: non-negative and bounded by limits.max_disk_gib
		Base: img.Base, BaseFormat: img.Format, Machine: img.Machine,
		Pool: cfg.StoragePool, Network: cfg.Network, MAC: in.MAC,
		// nil only in a Config not made by config.Parse: the default, on.
		StaticAddress: cfg.StaticAddresses == nil || *cfg.StaticAddresses,
		GuestAgent:    img.AddressSource == string(vm.SourceAgent),
		// nil only in a Config not made by config.Parse: the default, on.
		Isolated:   cfg.IsolateGuests == nil || *cfg.IsolateGuests,
		ConsoleLog: in.ConsoleLog,
		Shared:     in.Shared,
		Dirs:       req.Dirs,
		// The image's (SpecFingerprint covers it): a standby of
		// github_hooks.vm_image can get a hook job's shares (Machine.AttachDirs).
		SharedMemory: img.SharedMemory,
		Owner: vm.Owner{
			Controller: in.Controller, Frontend: req.Frontend, Job: req.Job, Tags: req.Tags,
			Created: in.Created, Deadline: in.Created.Add(req.Lifetime + cfg.Timeouts.JobSlack.D()),
		},
	}
	s.Filter = MachineFilter(cfg, img, req.ReachServicePorts)
	if img.Boot == config.BootKernel {
		s.Kernel, s.Initrd, s.Cmdline = img.Kernel, img.Initrd, img.Cmdline
	}
	switch img.KeyInjection {
	case config.InjectCloudInit:
		s.Seed = in.CloudInitSeed
		if req.SeedWritable {
			s.SeedWritable, s.SeedSerial = true, guestinit.WritableSeedSerial
		}
	case config.InjectSMBIOS:
		if in.Keys == nil {
			break // a snapshot template: no keys
		}
		s.Seed, s.SeedSerial = in.Keys.CredentialDisk(), guestinit.CredentialDiskSerial
		s.OEMStrings = in.Keys.OEMStrings(req.Name)
	}
	return s
}

// MachineFilter is the network filter of a machine of img: nil with
// l2_filter off. A machine refuses the service ports of the network's
// address that the configuration keeps from job machines
// (Config.GarmPorts: the guard opens them for the whole network) unless
// reachServicePorts (Request.ReachServicePorts) says its guest is the one
// they serve.
func MachineFilter(cfg *config.Config, img *config.Image, reachServicePorts bool) *vm.Filter {
	if cfg.L2Filter != nil && !*cfg.L2Filter {
		return nil
	}
	f := &vm.Filter{}
	if !reachServicePorts {
		f.DenyHostPorts = cfg.GarmPorts()
	}
	if eg := img.Egress(); eg != nil {
		f.Egress = make([]vm.EgressRule, 0, len(eg))
		for _, e := range eg {
			f.Egress = append(f.Egress, vm.EgressRule{Net: e.Net, Port: e.Port})
		}
	}
	return f
}

// CloudInitSeed makes the NoCloud seed image that gives a cloud-init image
// the machine's keys, in dir (the machine's state directory); it is nil for
// an image whose keys travel otherwise.
func CloudInitSeed(name string, img *config.Image, keys *guestinit.Keys, dir string) ([]byte, error) {
	if img.KeyInjection != config.InjectCloudInit {
		return nil, nil
	}
	ci := guestinit.CloudInit{InstanceID: name, Hostname: name, User: img.User}
	return ci.SeedISO(keys, name, dir)
}

// SpecFingerprint identifies everything of cfg that goes into a machine of
// img besides its size and base file (which a standby record keeps on its
// own): the image's table without its pool, the network, storage pool,
// isolation, network filter, domain type and host key policy, and the
// driver's version. A
// standby machine built under another fingerprint is never handed out.
func SpecFingerprint(cfg *config.Config, img *config.Image) string {
	i := *img
	i.Pool, i.Snapshot = nil, false
	b, _ := json.Marshal(struct {
		Version, Network, StoragePool, DomainType, HostKeyPolicy, NamePrefix string
		Isolated                                                             bool
		Image                                                                config.Image
		Filter                                                               *vm.Filter
	}{buildinfo.Version, cfg.Network, cfg.StoragePool, cfg.DomainType, cfg.HostKeyPolicy, cfg.NamePrefix,
		cfg.IsolateGuests == nil || *cfg.IsolateGuests, i, MachineFilter(cfg, img, false)})
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}
