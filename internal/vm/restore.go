package vm

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/steps"
	"libvirt.org/go/libvirtxml"
)

// Snapshot is a snapshot template's saved state (issue #48, docs/pool.md),
// what Engine.Restore starts a clone from: the template machine's frozen
// disk overlay, which every clone's overlay is over, and its save volume
// (SaveVolume), its memory and device state.
type Snapshot struct {
	// Template is the template machine's name (its volumes are named after
	// it).
	Template string
	// DiskPath is the frozen overlay's path, DiskBytes its virtual size:
	// a clone's disk is that size (its guest knows no other).
	DiskPath  string
	DiskBytes uint64
	// PipeDir is a directory of the caller's in which the restore's named
	// pipe is made (libvirtd opens it by path).
	PipeDir string
}

// ErrRestore marks a restore libvirt refused (not a lost connection): the
// snapshot's fault, as far as its caller can tell.
var ErrRestore = errors.New("libvirt refused the restore")

// SaveMachine saves the running machine name's memory and device state
// into its save volume (SaveVolume) in pool: the machine stops (it stays
// defined). The volume is made first, so that libvirt writes a file of
// the pool; it is deleted again when the save fails.
func (e *Engine) SaveMachine(ctx context.Context, name, pool string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	vol := &libvirtxml.StorageVolume{
		Name:     SaveVolume(name),
		Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 0},
		Target: &libvirtxml.StorageVolumeTarget{
			Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "raw"},
			Permissions: &libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"},
		},
	}
	path, err := changeV(ctx, func(ctx context.Context) (string, error) { return e.HV.CreateVolume(ctx, pool, vol) })
	if err != nil {
		return fmt.Errorf("save volume of %s: %w", name, err)
	}
	if err := change(ctx, func(ctx context.Context) error { return e.HV.Save(ctx, name, path) }); err != nil {
		dctx, cancel := detachctx.WithTimeout(ctx, max(e.UndoTimeout, time.Minute))
		defer cancel()
		_ = ignoreNotFound(e.HV.DeleteVolume(dctx, pool, vol.Name))
		return fmt.Errorf("save %s: %w", name, err)
	}
	return nil
}

// Restore starts the machine of s as a clone of snap instead of booting it
// (Create's counterpart): its overlay over the frozen one, its seed volume
// (s.Seed: the clone's credentials disk), the restore under its own name,
// a fresh UUID and its ownership record, then by hot plug what a template
// has none of: s's shared disks, its network interface (s.MAC, filter,
// isolation; its static address as Create gives one), and last its seed
// disk, which the template's guest waits for. s.DiskBytes larger than the
// snapshot's disk is refused (the restored guest knows the template's
// size). If anything fails, or ctx ends, what was made is removed before
// Restore returns.
func (e *Engine) Restore(ctx context.Context, s Spec, snap Snapshot) (*Machine, error) {
	if err := CheckName(s.Name); err != nil {
		return nil, err
	}
	if s.Owner.Controller == "" || s.Owner.Controller != e.Controller {
		return nil, fmt.Errorf("spec owner controller %q does not match engine controller %q", s.Owner.Controller, e.Controller)
	}
	if s.Template || s.Seed == nil || len(s.Dirs) > 0 || s.SharedMemory || s.GuestAgent || len(s.OEMStrings) > 0 {
		return nil, fmt.Errorf("machine %s: a clone has a seed (its credentials disk) and no template mark, SMBIOS strings, shared directories, shared memory or agent channel", s.Name)
	}
	if s.DiskBytes > snap.DiskBytes {
		return nil, fmt.Errorf("machine %s: a disk of %d bytes asked; the snapshot's is %d", s.Name, s.DiskBytes, snap.DiskBytes)
	}
	c := &creation{e: e, s: s, m: &Machine{Name: s.Name, MAC: s.MAC}, disk: DiskVolume(s.Name), seed: SeedVolume(s.Name)}
	c.s.Owner.Volumes = []string{c.disk, c.seed}
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
	list := []steps.Step{{Name: "clone disk", Do: func(ctx context.Context) error { return c.cloneDiskOver(ctx, snap) }, Undo: c.deleteVolume(c.disk)}}
	if s.StaticAddress {
		list = append(list, steps.Step{Name: "reserve address", Do: c.reserveAddress, Undo: c.releaseAddress})
	}
	list = append(list,
		steps.Step{Name: "create seed volume", Do: c.createSeedVolume, Undo: c.deleteVolume(c.seed)},
		steps.Step{Name: "upload seed", Do: c.uploadSeed},
		steps.Step{Name: "restore", Do: func(ctx context.Context) error { return c.restore(ctx, snap) }, Undo: c.undefine},
		steps.Step{Name: "hot plug", Do: c.plugIdentity},
	)
	if err := r.Run(ctx, list); err != nil {
		return nil, err
	}
	return c.m, nil
}

// cloneDiskOver creates the clone's disk: a qcow2 overlay on the frozen
// overlay of the snapshot, of its size.
func (c *creation) cloneDiskOver(ctx context.Context, snap Snapshot) error {
	vol := &libvirtxml.StorageVolume{
		Name:     c.disk,
		Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: snap.DiskBytes},
		Target: &libvirtxml.StorageVolumeTarget{
			Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"},
			Permissions: &libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"},
		},
		BackingStore: &libvirtxml.StorageVolumeBackingStore{
			Path:   snap.DiskPath,
			Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"},
		},
	}
	var err error
	c.m.DiskPath, err = changeV(ctx, func(ctx context.Context) (string, error) { return c.e.HV.CreateVolume(ctx, c.s.Pool, vol) })
	return err
}

// restore streams the template's save volume into libvirt's restore with
// the clone's XML in its head (CloneXML: name, fresh UUID, its overlay,
// console log and ownership record), then defines the running clone, so
// that its ownership record has a persistent home as a booted machine's
// has.
func (c *creation) restore(ctx context.Context, snap Snapshot) error {
	s := c.s
	owner, err := MarshalOwner(s.Owner)
	if err != nil {
		return err
	}
	uuid, err := newUUID()
	if err != nil {
		return err
	}
	save, err := OpenSave(ctx, c.e.HV, s.Pool, snap.Template)
	if err != nil {
		return err
	}
	defer save.Close()
	head := save.Head
	x, err := CloneXML(head.XML, CloneIdentity{
		Name: s.Name, UUID: uuid, Disks: map[string]string{snap.DiskPath: c.m.DiskPath},
		ConsoleLog: s.ConsoleLog, Owner: owner,
	})
	if err != nil {
		return err
	}
	clone, err := head.WithXML(x)
	if err != nil {
		return err
	}
	var hb bytes.Buffer
	if _, err := clone.WriteTo(&hb); err != nil {
		return err
	}
	// Not repeated on a lost connection: the stream is read once.
	err = c.e.HV.RestoreStream(ctx, io.MultiReader(&hb, save.Rest), snap.PipeDir)
	if err == nil {
		err = change(ctx, func(ctx context.Context) error { return c.e.HV.Define(ctx, x) })
		if err != nil {
			err = fmt.Errorf("define the restored clone: %w", err)
		}
	} else if !errors.Is(err, ErrConnectionLost) && ctx.Err() == nil {
		err = fmt.Errorf("restore from snapshot %s: %w: %w", snap.Template, ErrRestore, err)
	} else {
		err = fmt.Errorf("restore from snapshot %s: %w", snap.Template, err)
	}
	if err != nil {
		// The step's undo does not run for the step that failed: a clone
		// libvirt started all the same (the call cut, the define refused)
		// goes here.
		dctx, cancel := detachctx.WithTimeout(ctx, max(c.e.UndoTimeout, time.Minute))
		defer cancel()
		if uerr := c.undefine(dctx); uerr != nil {
			return fmt.Errorf("%w (and removing the clone: %v)", err, uerr)
		}
	}
	return err
}

// plugIdentity hot-plugs what is the clone's own: the shared disks, the
// network interface, then the seed (the credentials the guest waits for).
func (c *creation) plugIdentity(ctx context.Context) error {
	s := c.s
	for i, sd := range s.Shared {
		d := &libvirtxml.DomainDisk{
			Device:   "disk",
			Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
			Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: sd.Path}},
			Target:   &libvirtxml.DomainDiskTarget{Dev: fmt.Sprintf("vd%c", 'c'+i), Bus: "virtio"},
			ReadOnly: &libvirtxml.DomainDiskReadOnly{},
			Serial:   sd.Serial,
		}
		t0 := time.Now()
		if err := change(ctx, func(ctx context.Context) error { return c.e.HV.AttachDisk(ctx, s.Name, d) }); err != nil {
			return fmt.Errorf("attach the shared disk %s: %w", sd.Serial, err)
		}
		c.e.progress("shared disk %s plugged in %s", sd.Serial, Round(time.Since(t0)))
	}
	f, err := c.completeFilter(ctx)
	if err != nil {
		return err
	}
	ns := s
	ns.Filter = f
	nic, err := InterfaceDevice(ns)
	if err != nil {
		return err
	}
	t0 := time.Now()
	if err := change(ctx, func(ctx context.Context) error { return c.e.HV.AttachInterface(ctx, s.Name, nic) }); err != nil {
		return fmt.Errorf("attach the network interface: %w", err)
	}
	c.e.progress("network interface (MAC %s%s) plugged in %s", s.MAC, map[bool]string{true: ", network filter", false: ""}[f != nil], Round(time.Since(t0)))
	seed := &libvirtxml.DomainDisk{
		Device:   "disk",
		Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
		Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: c.seedPath}},
		Target:   &libvirtxml.DomainDiskTarget{Dev: "vdb", Bus: "virtio"},
		ReadOnly: &libvirtxml.DomainDiskReadOnly{},
		Serial:   s.SeedSerial,
	}
	t0 = time.Now()
	if err := change(ctx, func(ctx context.Context) error { return c.e.HV.AttachDisk(ctx, s.Name, seed) }); err != nil {
		return fmt.Errorf("attach the credentials disk: %w", err)
	}
	c.e.progress("credentials disk plugged in %s", Round(time.Since(t0)))
	return nil
}

// completeFilter is the spec's filter with the machine's static address
// and the network's gateway, its filters made sure of (nil without one).
func (c *creation) completeFilter(ctx context.Context) (*Filter, error) {
	s := c.s
	if s.Filter == nil {
		return nil, nil
	}
	f := *s.Filter
	if c.m.IP != "" {
		f.IP = c.m.IP
	}
	if f.Gateway == "" {
		gw, err := c.e.HV.NetworkGateway(ctx, s.Network)
		if err != nil {
			return nil, fmt.Errorf("network %s: its address, for the interface's filter: %w", s.Network, err)
		}
		f.Gateway = gw
	}
	if err := c.e.HV.EnsureNWFilters(ctx, []string{FilterBase}, Filters()); err != nil {
		return nil, fmt.Errorf("network filters (l2_filter): %w", err)
	}
	return &f, nil
}

// newUUID is a random (version 4) UUID.
func newUUID() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:]), nil
}
