package vm

import (
	"context"
	"fmt"
	"time"

	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
)

// CreateSharedVolume makes a raw volume in pool holding data, for a disk
// many machines attach read-only (SharedDisk), and returns its path. Its
// content is no secret (mode 0644). If the upload fails or ctx ends, the
// volume is deleted again. The caller proves the name is its own before
// (the volume must not exist).
func (e *Engine) CreateSharedVolume(ctx context.Context, pool, name string, data []byte) (string, error) {
	vol := &libvirtxml.StorageVolume{
		Name:     name,
		Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64(len(data))},
		Target: &libvirtxml.StorageVolumeTarget{
			Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "raw"},
			Permissions: &libvirtxml.StorageVolumeTargetPermissions{Mode: "0644"},
		},
	}
	path, err := changeV(ctx, func(ctx context.Context) (string, error) { return e.HV.CreateVolume(ctx, pool, vol) })
	if err != nil {
		return "", fmt.Errorf("create volume %s: %w", name, err)
	}
	if err := change(ctx, func(ctx context.Context) error { return e.HV.UploadVolume(ctx, pool, name, data) }); err != nil {
		uctx, cancel := detachctx.WithTimeout(ctx, e.undoTimeout())
		defer cancel()
		if derr := ignoreNotFound(e.HV.DeleteVolume(uctx, pool, name)); derr != nil {
			return "", fmt.Errorf("upload volume %s: %w (and deleting it failed: %v)", name, err, derr)
		}
		return "", fmt.Errorf("upload volume %s: %w", name, err)
	}
	return path, nil
}

func (e *Engine) undoTimeout() time.Duration {
	if e.UndoTimeout > 0 {
		return e.UndoTimeout
	}
	return time.Minute
}
