package vm

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/steps"
	"libvirt.org/go/libvirtxml"
)

// Engine creates and removes machines through a Hypervisor. Its methods
// give up on the hypervisor when their ctx ends.
type Engine struct {
	HV Hypervisor
	// Controller is this installation's identity; Remove and Sweep touch only
	// domains whose ownership record carries it.
	Controller string
	// Progress, if set, receives human-readable progress lines.
	Progress func(format string, args ...any)
	// UndoTimeout bounds the undo of a failed Create.
	UndoTimeout time.Duration
	// PollInterval is how often WaitAddress asks for leases, at a fixed rate
	// (default 50ms, the rate of the benchmark's floor).
	PollInterval time.Duration
	// ScratchGroup, if set, replaces LibvirtGroupOfProcess: the group a
	// scratch volume is made readable to (AttachScratch).
	ScratchGroup func() (gid int, ok bool)
	// Network, if set, is the network whose static DHCP host entry named
	// after a machine Remove removes with it (Spec.StaticAddress).
	Network string
	// Addresses, if set (with NamePrefix), hands the network's spare static
	// DHCP host entries to machines (Spec.StaticAddress): an entry outlives
	// its machine, and Remove gives it back.
	Addresses AddressBook
	// NamePrefix is how every machine name of this installation starts
	// (lifecycle.MachinePrefix): network filter bindings owned by such a
	// name that does not run are stale and removed
	// (RemoveStaleFilterBindings). Empty: none is.
	NamePrefix string
}

func (e *Engine) progress(format string, args ...any) {
	if e.Progress != nil {
		e.Progress(format, args...)
	}
}

// ResolveDomainType turns "auto" into "kvm" or "qemu" by what libvirt
// offers, without asking whether KVM runs guests (lifecycle's
// Manager.DomainType does, with ProbeKVM).
func (e *Engine) ResolveDomainType(ctx context.Context, want string) (string, error) {
	if want != "auto" {
		return want, nil
	}
	kvm, err := e.HV.KVMAvailable(ctx)
	if err != nil {
		return "", fmt.Errorf("read host capabilities: %w", err)
	}
	if kvm {
		return "kvm", nil
	}
	return "qemu", nil
}

// Create makes the overlay disk (and seed volume), defines and starts the
// domain; the Machine it returns says how long each step took. If anything
// fails, or ctx is cancelled, what was made is removed again before Create
// returns.
func (e *Engine) Create(ctx context.Context, s Spec) (*Machine, error) {
	if err := CheckName(s.Name); err != nil {
		return nil, err
	}
	if s.Owner.Controller == "" || s.Owner.Controller != e.Controller {
		return nil, fmt.Errorf("spec owner controller %q does not match engine controller %q", s.Owner.Controller, e.Controller)
	}
	c := &creation{e: e, s: s, m: &Machine{Name: s.Name, MAC: s.MAC}, disk: DiskVolume(s.Name)}
	if s.Seed != nil {
		c.seed = SeedVolume(s.Name)
	}
	c.s.Owner.Volumes = []string{c.disk}
	if c.seed != "" {
		c.s.Owner.Volumes = append(c.s.Owner.Volumes, c.seed)
	}
	r := steps.Runner{
		UndoTimeout: e.UndoTimeout,
		OnDone: func(name string, took time.Duration) {
			c.m.Steps = append(c.m.Steps, StepTime{Name: name, Took: took})
			e.progress("%s done in %s", name, Round(took))
		},
		OnUndo: func(name string, err error) {
			if err != nil {
				e.progress("undo %s failed: %v", name, err)
			}
		},
	}
	if err := r.Run(ctx, c.steps()); err != nil {
		return nil, err
	}
	return c.m, nil
}

// creation is one Create in progress: its spec (with the volumes recorded
// in its owner), the machine it fills in, and the volumes' names and paths.
type creation struct {
	e *Engine
	s Spec
	m *Machine
	// disk and seed are the volumes' names; seed is "" without a seed.
	disk, seed string
	// took: the machine holds a spare entry of Engine.Addresses.
	took bool
	// seedPath is the seed volume's path once it is created.
	seedPath string
}

// steps are the creation's steps in order, each with its undo: clone disk,
// create seed volume and upload seed (with a seed only), define, start.
func (c *creation) steps() []steps.Step {
	list := []steps.Step{{Name: "clone disk", Do: c.cloneDisk, Undo: c.deleteVolume(c.disk)}}
	if c.s.StaticAddress {
		list = append(list, steps.Step{Name: "reserve address", Do: c.reserveAddress, Undo: c.releaseAddress})
	}
	if c.seed != "" {
		list = append(list,
			steps.Step{Name: "create seed volume", Do: c.createSeedVolume, Undo: c.deleteVolume(c.seed)},
			steps.Step{Name: "upload seed", Do: c.uploadSeed},
		)
	}
	return append(list,
		steps.Step{Name: "define", Do: c.define, Undo: c.undefine},
		steps.Step{Name: "start", Do: c.start, Undo: c.destroy},
	)
}

// cloneDisk creates the job disk: a qcow2 overlay on the base image, at
// least as large as the base.
func (c *creation) cloneDisk(ctx context.Context) error {
	s := c.s
	baseSize, err := c.e.HV.VolumeCapacity(ctx, s.Base)
	if err != nil {
		return fmt.Errorf("base image %s: %w", s.Base, err)
	}
	vol := &libvirtxml.StorageVolume{
		Name:     c.disk,
		Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: max(s.DiskBytes, baseSize)},
		Target: &libvirtxml.StorageVolumeTarget{
			Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"},
			Permissions: &libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"},
		},
		BackingStore: &libvirtxml.StorageVolumeBackingStore{
			Path:   s.Base,
			Format: &libvirtxml.StorageVolumeTargetFormat{Type: s.BaseFormat},
		},
	}
	c.m.DiskPath, err = changeV(ctx, func(ctx context.Context) (string, error) { return c.e.HV.CreateVolume(ctx, s.Pool, vol) })
	return err
}

// createSeedVolume creates the raw volume the seed is uploaded to.
func (c *creation) createSeedVolume(ctx context.Context) error {
	vol := &libvirtxml.StorageVolume{
		Name:     c.seed,
		Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64(len(c.s.Seed))},
		Target: &libvirtxml.StorageVolumeTarget{
			Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "raw"},
			Permissions: &libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"},
		},
	}
	var err error
	c.seedPath, err = changeV(ctx, func(ctx context.Context) (string, error) { return c.e.HV.CreateVolume(ctx, c.s.Pool, vol) })
	return err
}

// uploadSeed writes the seed into its volume. Its undo is the volume's.
func (c *creation) uploadSeed(ctx context.Context) error {
	return change(ctx, func(ctx context.Context) error { return c.e.HV.UploadVolume(ctx, c.s.Pool, c.seed, c.s.Seed) })
}

// deleteVolume is the undo of a step that created the volume name.
func (c *creation) deleteVolume(name string) func(context.Context) error {
	return func(ctx context.Context) error {
		return ignoreNotFound(change(ctx, func(ctx context.Context) error { return c.e.HV.DeleteVolume(ctx, c.s.Pool, name) }))
	}
}

// define defines the domain on the volumes made before.
func (c *creation) define(ctx context.Context) error {
	s := c.s
	f, err := c.completeFilter(ctx)
	if err != nil {
		return err
	}
	s.Filter = f
	x, err := DomainXML(s, c.m.DiskPath, c.seedPath)
	if err != nil {
		return err
	}
	return change(ctx, func(ctx context.Context) error { return c.e.HV.Define(ctx, x) })
}

// undefine is define's undo. A start whose outcome is unknown (it outlived
// MutationGrace) may have happened: it destroys first, or the undefine
// would leave a running transient domain.
func (c *creation) undefine(ctx context.Context) error {
	if err := c.destroy(ctx); err != nil {
		return err
	}
	return ignoreNotFound(change(ctx, func(ctx context.Context) error { return c.e.HV.Undefine(ctx, c.s.Name) }))
}

// start starts the defined domain.
func (c *creation) start(ctx context.Context) error {
	err := change(ctx, func(ctx context.Context) error { return c.e.HV.Start(ctx, c.s.Name) })
	if err != nil {
		return c.startAgain(ctx, err)
	}
	return nil
}

// destroy is start's undo (and the first half of define's): the domain
// stops at once; one already stopped or gone is fine.
func (c *creation) destroy(ctx context.Context) error {
	return ignoreNotFound(change(ctx, func(ctx context.Context) error { return c.e.HV.Destroy(ctx, c.s.Name) }))
}

// FreshMAC returns a MAC that holds no lease on network right now.
func (e *Engine) FreshMAC(ctx context.Context, network string) (string, error) {
	taken, err := e.HV.NetworkLeaseMACs(ctx, network)
	if err != nil {
		return "", err
	}
	for range 16 {
		mac, err := NewMAC()
		if err != nil {
			return "", err
		}
		if !slices.Contains(taken, mac) {
			return mac, nil
		}
	}
	return "", errors.New("could not find a MAC without a lease on the network")
}

// WaitAddress polls the domain's addresses (DHCP leases or the guest agent)
// until one for mac appears, the domain stops, or ctx ends. Only an address
// on this machine's own MAC counts. A poll starts every e.PollInterval
// (default 50ms), at a fixed rate: a slow poll is followed by the next at
// once, not an interval later.
func (e *Engine) WaitAddress(ctx context.Context, name, mac string, source AddressSource) (string, error) {
	interval := e.PollInterval
	if interval <= 0 {
		interval = 50 * time.Millisecond
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	mac = strings.ToLower(mac)
	for {
		leases, err := e.HV.Addresses(ctx, name, source)
		switch {
		case err != nil && ctx.Err() != nil:
			return "", fmt.Errorf("no address for %s (MAC %s, source %s): %w", name, mac, source, ctxError(ctx))
		case errors.Is(err, ErrNotFound):
			return "", fmt.Errorf("domain %s disappeared while waiting for its address", name)
		case errors.Is(err, ErrAgentNotReady):
			leases = nil // the agent starts late in the boot: keep polling
		case err != nil:
			return "", fmt.Errorf("read addresses of %s (%s): %w", name, source, err)
		}
		for _, l := range leases {
			if l.MAC == mac && l.IP.To4() != nil {
				return l.IP.String(), nil
			}
		}
		if active, err := e.HV.IsActive(ctx, name); err == nil && !active {
			return "", fmt.Errorf("domain %s stopped before it got an address", name)
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("no address for %s (MAC %s, source %s): %w", name, mac, source, context.Cause(ctx))
		case <-t.C:
		}
	}
}

// Extend moves the deadline of a machine of this controller (a sweep removes
// it after the deadline). Foreign domains are refused with ErrNotOurs.
func (e *Engine) Extend(ctx context.Context, name string, deadline time.Time) error {
	return e.UpdateOwner(ctx, name, func(o *Owner) { o.Deadline = deadline.UTC() })
}

// UpdateOwner changes the ownership record of a machine of this controller
// with update, in the persistent definition and, if it runs, the live one
// (a standby machine handed to a job gets the job's front end, job and
// deadline). Foreign domains are refused with ErrNotOurs; update cannot
// change the controller or the volumes.
func (e *Engine) UpdateOwner(ctx context.Context, name string, update func(*Owner)) error {
	x, err := e.HV.Owner(ctx, name)
	if err != nil {
		if errors.Is(err, ErrNoOwner) {
			return fmt.Errorf("%s: %w", name, ErrNotOurs)
		}
		return err
	}
	o, err := ParseOwner(x)
	if err != nil || o.Controller != e.Controller {
		return fmt.Errorf("%s: %w", name, ErrNotOurs)
	}
	ctrl, vols := o.Controller, o.Volumes
	update(&o)
	o.Controller, o.Volumes = ctrl, vols
	nx, err := MarshalOwner(o)
	if err != nil {
		return err
	}
	return change(ctx, func(ctx context.Context) error { return e.HV.SetOwner(ctx, name, nx) })
}

// ErrNotOurs is returned by Remove for a domain that exists but is not owned
// by this controller, or for volumes without a domain that the caller cannot
// prove are its own. Nothing of them is touched.
var ErrNotOurs = errors.New("not owned by this controller")

// Remove destroys and undefines the named machine and deletes its volumes.
// Missing pieces count as success; a domain without this controller's
// ownership record is left alone and reported with ErrNotOurs.
//
// With no domain, nothing on the host says whose the volumes of the
// machine's names are (a base image "debian-12.qcow2" has one). They are
// deleted only if orphanVolumesOurs: the caller holds a record of its own
// that they are (such as the machine's state directory). Otherwise any that
// exist are left alone and reported with ErrNotOurs.
func (e *Engine) Remove(ctx context.Context, name, pool string, orphanVolumesOurs bool) error {
	if err := CheckName(name); err != nil {
		return err
	}
	volumes := Volumes(name)
	o, found, err := e.provenOwner(ctx, name)
	switch {
	case err != nil:
		return err
	case !found:
		// No domain (a crash before define, or already removed): volumes of
		// the deterministic names may still be there.
		if !orphanVolumesOurs {
			return e.refuseUnprovenVolumes(ctx, name, pool, volumes)
		}
	default:
		for _, v := range o.Volumes {
			if !slices.Contains(volumes, v) {
				volumes = append(volumes, v)
			}
		}
		if err := ignoreNotFound(change(ctx, func(ctx context.Context) error { return e.HV.Destroy(ctx, name) })); err != nil {
			return fmt.Errorf("destroy %s: %w", name, err)
		}
		if err := ignoreNotFound(change(ctx, func(ctx context.Context) error { return e.HV.Undefine(ctx, name) })); err != nil {
			return fmt.Errorf("undefine %s: %w", name, err)
		}
	}
	var errs []error
	if err := e.removeOwnFilterBindings(ctx, name); err != nil {
		errs = append(errs, err)
	}
	if err := e.removeDHCPHost(ctx, e.Network, name); err != nil {
		errs = append(errs, err)
	}
	// The domain is gone (or never was): its spare entry is free again.
	if e.Addresses != nil {
		if err := e.Addresses.Give(name); err != nil {
			errs = append(errs, fmt.Errorf("give back the spare DHCP host entry of %s: %w", name, err))
		}
	}
	for _, v := range volumes {
		if !strings.HasPrefix(v, name) {
			continue // never delete a volume outside this machine's names
		}
		if err := ignoreNotFound(change(ctx, func(ctx context.Context) error { return e.HV.DeleteVolume(ctx, pool, v) })); err != nil {
			errs = append(errs, fmt.Errorf("delete volume %s: %w", v, err))
		}
	}
	return errors.Join(errs...)
}

// refuseUnprovenVolumes is Remove's answer for volumes without a domain that
// the caller cannot prove are its own: ErrNotOurs naming those of volumes
// that exist in pool, or nil when none does (nothing to do).
func (e *Engine) refuseUnprovenVolumes(ctx context.Context, name, pool string, volumes []string) error {
	all, err := e.HV.VolumeNames(ctx, pool)
	if err != nil {
		return fmt.Errorf("list volumes of pool %s: %w", pool, err)
	}
	var there []string
	for _, v := range volumes {
		if slices.Contains(all, v) {
			there = append(there, v)
		}
	}
	if len(there) == 0 {
		return nil
	}
	return fmt.Errorf("%s: %w: no domain and no state record of ours: volumes %s left alone",
		name, ErrNotOurs, strings.Join(there, ", "))
}

func ignoreNotFound(err error) error {
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}

// Round shortens a duration for humans: milliseconds below a second, else a
// tenth of a second.
func Round(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(100 * time.Millisecond)
}

// Explain says, in one sentence, what became of a machine whose guest stopped
// answering: gone, shut off, crashed, or paused by QEMU after a failed disk
// write (full storage). It is empty when the domain runs normally or its
// state cannot be read before ctx ends.
func (e *Engine) Explain(ctx context.Context, name, pool string) string {
	st, err := e.HV.State(ctx, name)
	switch {
	case errors.Is(err, ErrNotFound):
		return fmt.Sprintf("VM %s no longer exists", name)
	case err != nil, st.Running:
		return ""
	case st.IOError:
		return fmt.Sprintf("VM %s was paused by QEMU after a disk write failed: the filesystem under storage pool %s is probably full", name, pool)
	}
	return fmt.Sprintf("VM %s is %s", name, st.Summary)
}
