package vm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"slices"
	"strconv"

	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/steps"
)

// The hot-plugged disks' serials: the guest finds them by
// /sys/block/*/serial (or /dev/disk/by-id/virtio-SERIAL).
const (
	// DataDiskSerial is the read-only data disk's (AttachData).
	DataDiskSerial = "lve-data"
	// ScratchDiskSerial is the writable scratch disk's (AttachScratch).
	ScratchDiskSerial = "lve-scratch"
)

// hotDisk is one kind of hot-plugged disk.
type hotDisk struct {
	volume   func(name string) string
	serial   string
	target   string // libvirt wants one; the guest names its disks in the order they appear
	readOnly bool
	// cache is the disk's cache mode in QEMU. The scratch disk's is
	// "unsafe": the guest's flush (the end of its write) is not a host
	// fsync of the volume, which the host reads right after from its page
	// cache and deletes; the guest's writes have all reached the volume
	// file when its flush returns either way. A host crash loses only a
	// save in progress, which is not kept then anyway.
	cache string
	// groupReadable: the volume is made readable to the attaching
	// process's group (scratchOwner), so that ReadScratch reads its file
	// (StreamFromVolume) instead of libvirt's stream.
	groupReadable bool
}

var (
	dataDisk    = hotDisk{volume: DataVolume, serial: DataDiskSerial, target: "vdz", readOnly: true}
	scratchDisk = hotDisk{volume: ScratchVolume, serial: ScratchDiskSerial, target: "vdy", cache: "unsafe", groupReadable: true}
)

// AttachData hands size bytes of r to the running machine name as a
// read-only virtio disk (serial DataDiskSerial) hot-plugged into it, in a
// raw volume of its own (DataVolume) in pool. The host writes the volume
// and never reads it back: nothing the guest does reaches the host through
// it. Nothing is left when it fails; see attach for the rest.
func (e *Engine) AttachData(ctx context.Context, name, pool string, r io.Reader, size int64) error {
	if size <= 0 {
		return fmt.Errorf("data for %s: %d bytes: want at least 1", name, size)
	}
	return e.attach(ctx, name, pool, dataDisk, size, func(ctx context.Context, vol string) error {
		return change(ctx, func(ctx context.Context) error { return e.HV.StreamToVolume(ctx, pool, vol, r, size) })
	})
}

// AttachScratch gives the running machine name an empty writable virtio
// disk of capacity bytes (serial ScratchDiskSerial; a sparse raw volume of
// its own, ScratchVolume, in pool) for the guest to write data the host
// then reads with ReadScratch. The capacity bounds what the guest can put
// on the host's disk through it. Nothing is left when it fails; see attach
// for the rest.
func (e *Engine) AttachScratch(ctx context.Context, name, pool string, capacity int64) error {
	if capacity <= 0 {
		return fmt.Errorf("scratch disk for %s: %d bytes: want at least 1", name, capacity)
	}
	return e.attach(ctx, name, pool, scratchDisk, capacity, nil)
}

// ReadScratch copies the scratch volume of machine name to w, from its
// start until its end or until w fails (w's error is returned): the bytes
// a guest wrote, to be treated as hostile, never probed as an image
// format. It reads the volume's file where this process may (made
// readable to its group: scratchOwner), else libvirt's stream; fromFile
// says which.
func (e *Engine) ReadScratch(ctx context.Context, name, pool string, w io.Writer) (fromFile bool, err error) {
	if err := e.proveOwned(ctx, name); err != nil {
		return false, err
	}
	f, err := e.HV.VolumeFile(ctx, pool, ScratchVolume(name))
	if err != nil {
		return false, err
	}
	if f != nil {
		defer func() { _ = f.Close() }()
		_, err := io.Copy(w, ContextReader(ctx, f))
		return true, err
	}
	return false, e.HV.StreamFromVolume(ctx, pool, ScratchVolume(name), w)
}

// DropData deletes the data disk's volume of machine name (DropDisks).
func (e *Engine) DropData(ctx context.Context, name, pool string) error {
	return e.drop(ctx, name, pool, dataDisk)
}

// DropScratch deletes the scratch disk's volume of machine name
// (DropDisks).
func (e *Engine) DropScratch(ctx context.Context, name, pool string) error {
	return e.drop(ctx, name, pool, scratchDisk)
}

// attach creates the volume of disk kind d for machine name with capacity
// bytes, fills it (fill, if set), and hot-plugs it into the running
// guest. The volume is in the machine's ownership record before it
// exists, so a teardown removes it whatever happens to the caller. A
// volume of an earlier call is deleted first, but while its disk is still
// in the guest (drop leaves it there) the target is taken and the attach
// fails. Nothing is left when it fails.
func (e *Engine) attach(ctx context.Context, name, pool string, d hotDisk, capacity int64, fill func(ctx context.Context, vol string) error) error {
	if err := e.drop(ctx, name, pool, d); err != nil {
		return err
	}
	o, err := e.owned(ctx, name)
	if err != nil {
		return err
	}
	vol := d.volume(name)
	perms := libvirtxml.StorageVolumeTargetPermissions{Mode: "0600"}
	var seclabels []libvirtxml.DomainDeviceSecLabel
	if d.groupReadable {
		if p, ok := e.scratchOwner(ctx, name); ok {
			perms = p
			seclabels = []libvirtxml.DomainDeviceSecLabel{{Model: "dac", Relabel: "no"}}
		}
	}
	var path string
	list := []steps.Step{
		{Name: "record the volume", Do: func(ctx context.Context) error {
			return e.setVolumes(ctx, name, &o, append(slices.Clone(o.Volumes), vol))
		}, Undo: func(ctx context.Context) error { return e.dropVolume(ctx, name, pool, o, vol) }},
		{Name: "create the volume", Do: func(ctx context.Context) error {
			v := &libvirtxml.StorageVolume{
				Name:       vol,
				Capacity:   &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64((capacity + 511) / 512 * 512)}, //nolint:gosec // G115: capacity > 0, checked by AttachData and AttachScratch
				Allocation: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 0},
				Target: &libvirtxml.StorageVolumeTarget{
					Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "raw"},
					Permissions: &perms,
				},
			}
			var err error
			path, err = changeV(ctx, func(ctx context.Context) (string, error) { return e.HV.CreateVolume(ctx, pool, v) })
			return err
		}},
	}
	if fill != nil {
		list = append(list, steps.Step{Name: "write the volume", Do: func(ctx context.Context) error { return fill(ctx, vol) }})
	}
	list = append(list, steps.Step{Name: "attach the disk", Do: func(ctx context.Context) error {
		disk := &libvirtxml.DomainDisk{
			Device: "disk",
			Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw", Cache: d.cache},
			Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: path, SecLabel: seclabels}},
			Target: &libvirtxml.DomainDiskTarget{Dev: d.target, Bus: "virtio"},
			Serial: d.serial,
		}
		if d.readOnly {
			disk.ReadOnly = &libvirtxml.DomainDiskReadOnly{}
		}
		return change(ctx, func(ctx context.Context) error { return e.HV.AttachDisk(ctx, name, disk) })
	}})
	return steps.Runner{}.Run(ctx, list)
}

// scratchOwner is the permissions of a scratch volume its machine's QEMU
// writes and this process reads: owned by the user QEMU opens the
// machine's disks as (its DAC image label, so that libvirt need not
// relabel the file: the disk says relabel="no"), group the one this
// process reads it as (ScratchGroup: the libvirt group, whose members may
// read every volume through libvirt anyway), mode 0640. The host's read of
// the guest's save then opens the file (several GB/s from the page cache)
// instead of libvirt's stream (about 400 MB/s on a TCG host). ok is false
// where libvirt says no DAC label for the machine (no DAC security
// driver; a session libvirt; another host's libvirt) or there is no such
// group: the volume is made as the others, 0600.
func (e *Engine) scratchOwner(ctx context.Context, name string) (libvirtxml.StorageVolumeTargetPermissions, bool) {
	group := e.ScratchGroup
	if group == nil {
		group = LibvirtGroupOfProcess
	}
	gid, ok := group()
	if !ok {
		return libvirtxml.StorageVolumeTargetPermissions{}, false
	}
	label, err := e.HV.DACImageLabel(ctx, name)
	if err != nil {
		return libvirtxml.StorageVolumeTargetPermissions{}, false
	}
	uid, _, ok := ParseDACLabel(label)
	if !ok {
		return libvirtxml.StorageVolumeTargetPermissions{}, false
	}
	return libvirtxml.StorageVolumeTargetPermissions{Owner: strconv.Itoa(uid), Group: strconv.Itoa(gid), Mode: "0640"}, true
}

// LibvirtGroupOfProcess is the group this process may read a scratch
// volume as: root's (0) when it runs as root, else the group "libvirt"
// where the process is in it (the stages' user is: docs/install.md), else
// none (ok false). Never the user's primary group, which other users may
// share.
func LibvirtGroupOfProcess() (gid int, ok bool) {
	if os.Geteuid() == 0 {
		return 0, true
	}
	g, err := user.LookupGroup("libvirt")
	if err != nil {
		return 0, false
	}
	gid, err = strconv.Atoi(g.Gid)
	if err != nil {
		return 0, false
	}
	if os.Getegid() == gid {
		return gid, true
	}
	groups, err := os.Getgroups()
	return gid, err == nil && slices.Contains(groups, gid)
}

// drop deletes the volume of disk kind d of machine name, and the
// ownership record forgets it. The disk itself stays in the running guest
// (a guest that still has it open reads, or writes, the deleted file until
// it lets go; the space is the host's again once QEMU closes it): a hot
// unplug waits for the guest, and a disposable machine is gone soon anyway.
// A machine without such a volume is success.
func (e *Engine) drop(ctx context.Context, name, pool string, d hotDisk) error {
	o, err := e.owned(ctx, name)
	if err != nil {
		return err
	}
	return e.dropVolume(ctx, name, pool, o, d.volume(name))
}

// dropVolume is drop for the machine's proven owner record o.
func (e *Engine) dropVolume(ctx context.Context, name, pool string, o Owner, vol string) error {
	if err := ignoreNotFound(change(ctx, func(ctx context.Context) error { return e.HV.DeleteVolume(ctx, pool, vol) })); err != nil {
		return fmt.Errorf("delete volume %s: %w", vol, err)
	}
	if !slices.Contains(o.Volumes, vol) {
		return nil
	}
	if err := e.setVolumes(ctx, name, &o, slices.DeleteFunc(slices.Clone(o.Volumes), func(v string) bool { return v == vol })); err != nil {
		return fmt.Errorf("record that %s has no volume %s: %w", name, vol, err)
	}
	return nil
}

// owned is the ownership record of machine name, proven this controller's
// (ErrNotFound without a domain, ErrNotOurs for another's).
func (e *Engine) owned(ctx context.Context, name string) (Owner, error) {
	if err := CheckName(name); err != nil {
		return Owner{}, err
	}
	o, found, err := e.provenOwner(ctx, name)
	switch {
	case err != nil:
		return Owner{}, err
	case !found:
		return Owner{}, fmt.Errorf("%s: %w", name, ErrNotFound)
	}
	return o, nil
}

// proveOwned is owned without the record.
func (e *Engine) proveOwned(ctx context.Context, name string) error {
	_, err := e.owned(ctx, name)
	return err
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
