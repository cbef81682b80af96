package admin

import (
	"context"
	"errors"
	"os"
	"syscall"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// kvmProbeCheck is the domain type check where libvirt offers kvm (offered
// says how doctor knows): it boots a kernel under KVM (lifecycle's
// ProbeKVM), since on some nested hosts /dev/kvm opens and libvirt offers
// kvm, yet no guest runs. As the state directory's user it remembers the
// verdict, which domain_type = "auto" then follows.
func kvmProbeCheck(ctx context.Context, cfg *config.Config, hv vm.Hypervisor, offered string) Check {
	store := state.Store{Dir: cfg.StateDir}
	save := ownStateDir(cfg.StateDir)
	var ctrl string
	var err error
	if save {
		// The installation's identity, made now if need be: a probe's
		// guest that a killed doctor left is then the sweep's.
		ctrl, err = store.ControllerID()
	} else {
		ctrl, err = store.ExistingControllerID()
	}
	if err != nil {
		// Not this user's to make: the probe's guest is named apart, and
		// removed again before the check ends.
		ctrl = "doctor"
	}
	m := lifecycle.New(cfg, hv, ctrl, lifecycle.Options{})
	rec, err := m.KVM().Probe(ctx, save)
	c := Check{Name: "domain type"}
	switch {
	case err != nil:
		c.OK, c.Warn = true, true
		c.Info = offered + "; the KVM probe could not boot a guest: " + err.Error()
		c.Fix = "check the images' kernel files and libvirtd's log; domain_type = \"auto\" uses kvm"
	case rec.Works:
		c.OK, c.Info = true, offered+"; "+rec.Say()
	case cfg.DomainType == config.DomainKVM:
		c.Info = "domain_type = \"kvm\" but " + rec.Say()
		c.Fix = "set domain_type = \"qemu\" (or \"auto\", which chooses qemu here), or give this host a KVM that runs guests (nested virtualization)"
	default:
		c.OK, c.Warn = true, true
		c.Info = "auto: " + offered + ", but " + rec.Say() + "; jobs run under qemu (software emulation, much slower)"
		c.Fix = "set domain_type = \"qemu\" to say so, or give this host a KVM that runs guests (nested virtualization)"
	}
	if err == nil && !save {
		c.Info += " (not remembered: the state directory is not this user's; prepare probes once itself)"
	}
	return c
}

// ownStateDir reports whether dir exists and is this user's: only then
// does doctor write into it.
func ownStateDir(dir string) bool {
	st, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) || err != nil {
		return false
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	return ok && int(sys.Uid) == os.Geteuid()
}
