package vm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"

	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/steps"
)

// DataDiskSerial is the serial of the data disk (AttachData): the guest
// finds it by /sys/block/*/serial (or /dev/disk/by-id/virtio-lve-data).
const DataDiskSerial = "lve-data"

// dataDiskTarget is the data disk's target name: libvirt wants one; the
// guest names its disks in the order they appear, whatever it says.
const dataDiskTarget = "vdz"

// AttachData hands size bytes of r to the running machine name as a
// read-only virtio disk (serial DataDiskSerial) hot-plugged into it, in a
// raw volume of its own (DataVolume) in pool. The host writes the volume
// and never reads it back: nothing the guest does reaches the host through
// it. The volume is in the machine's ownership record before it exists, so
// a teardown removes it whatever happens to the caller; a data disk
// volume of an earlier call is deleted first, but while its disk is still
// in the guest (DropData leaves it there) the target is taken and the
// attach fails. Nothing is left when it fails.
func (e *Engine) AttachData(ctx context.Context, name, pool string, r io.Reader, size int64) error {
	if err := CheckName(name); err != nil {
		return err
	}
	if size <= 0 {
		return fmt.Errorf("data for %s: %d bytes: want at least 1", name, size)
	}
	if err := e.DropData(ctx, name, pool); err != nil {
		return err
	}
	o, found, err := e.provenOwner(ctx, name)
	switch {
	case err != nil:
		return err
	case !found:
		return fmt.Errorf("%s: %w", name, ErrNotFound)
	}
	vol := DataVolume(name)
	var path string
	return steps.Runner{}.Run(ctx, []steps.Step{
		{Name: "record the data volume", Do: func(ctx context.Context) error {
			return e.setVolumes(ctx, name, &o, append(slices.Clone(o.Volumes), vol))
		}, Undo: func(ctx context.Context) error { return e.dropData(ctx, name, pool, o) }},
		{Name: "create the data volume", Do: func(ctx context.Context) error {
			v := &libvirtxml.StorageVolume{
				Name:     vol,
				Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64((size + 511) / 512 * 512)},
				Target: &libvirtxml.StorageVolumeTarget{
					Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "raw"},
					Permissions: &libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"},
				},
			}
			path, err = changeV(ctx, func(ctx context.Context) (string, error) { return e.HV.CreateVolume(ctx, pool, v) })
			return err
		}},
		{Name: "write the data volume", Do: func(ctx context.Context) error {
			return change(ctx, func(ctx context.Context) error { return e.HV.StreamToVolume(ctx, pool, vol, r, size) })
		}},
		{Name: "attach the data disk", Do: func(ctx context.Context) error {
			disk := &libvirtxml.DomainDisk{
				Device:   "disk",
				Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
				Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: path}},
				Target:   &libvirtxml.DomainDiskTarget{Dev: dataDiskTarget, Bus: "virtio"},
				ReadOnly: &libvirtxml.DomainDiskReadOnly{},
				Serial:   DataDiskSerial,
			}
			return change(ctx, func(ctx context.Context) error { return e.HV.AttachDisk(ctx, name, disk) })
		}},
	})
}

// DropData takes the data disk away from machine name: its volume is
// deleted (a guest that still has the disk open keeps reading what it had
// until it lets go; the space is the host's again once QEMU closes it) and
// the ownership record forgets it. The disk itself stays in the running
// guest: a hot unplug waits for the guest, and a disposable machine is
// gone soon anyway. A machine without a data volume is success.
func (e *Engine) DropData(ctx context.Context, name, pool string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	o, found, err := e.provenOwner(ctx, name)
	switch {
	case err != nil:
		return err
	case !found:
		return fmt.Errorf("%s: %w", name, ErrNotFound)
	}
	return e.dropData(ctx, name, pool, o)
}

// dropData is DropData for the machine's proven owner record o.
func (e *Engine) dropData(ctx context.Context, name, pool string, o Owner) error {
	vol := DataVolume(name)
	if err := ignoreNotFound(change(ctx, func(ctx context.Context) error { return e.HV.DeleteVolume(ctx, pool, vol) })); err != nil {
		return fmt.Errorf("delete the data volume of %s: %w", name, err)
	}
	if !slices.Contains(o.Volumes, vol) {
		return nil
	}
	if err := e.setVolumes(ctx, name, &o, slices.DeleteFunc(slices.Clone(o.Volumes), func(v string) bool { return v == vol })); err != nil {
		return fmt.Errorf("record that %s has no data volume: %w", name, err)
	}
	return nil
}

// setVolumes records vols as the machine's volumes in its ownership
// record o (and in o).
func (e *Engine) setVolumes(ctx context.Context, name string, o *Owner, vols []string) error {
	n := *o
	n.Volumes = vols
	x, err := MarshalOwner(n)
	if err != nil {
		return err
	}
	if err := change(ctx, func(ctx context.Context) error { return e.HV.SetOwner(ctx, name, x) }); err != nil {
		if errors.Is(err, ErrNotFound) {
			return fmt.Errorf("%s: %w", name, err)
		}
		return err
	}
	*o = n
	return nil
}
