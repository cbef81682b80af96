package vm

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// maxSeedWipe bounds the zeros DropSeed writes over a seed volume (a
// cloud-init seed is a few hundred KiB at most).
const maxSeedWipe = 64 << 20

// DropSeed takes the cloud-init seed (with whatever secrets its user-data
// holds) away from a running or stopped machine of this controller whose
// guest no longer needs it: the seed volume is overwritten with zeros
// first (a guest that never completes the hot unplug then reads zeros),
// its disk is detached from the domain (persistent definition and running
// guest) and the volume is deleted. A machine whose seed is gone already,
// or that never had one, is success; the ownership record then no longer
// lists the seed volume; a missing domain is ErrNotFound, one
// not ours ErrNotOurs. Remove treats the missing seed volume as removed.
func (e *Engine) DropSeed(ctx context.Context, name, pool string) error {
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
	seed := SeedVolume(name)
	if !slices.Contains(o.Volumes, seed) {
		return nil
	}
	// Once the seed is gone the ownership record stops listing it, so
	// that garm's next Get or List does not look at this machine again.
	forget := func() error {
		o.Volumes = slices.DeleteFunc(o.Volumes, func(v string) bool { return v == seed })
		x, err := MarshalOwner(o)
		if err != nil {
			return err
		}
		return change(ctx, func(ctx context.Context) error { return e.HV.SetOwner(ctx, name, x) })
	}
	path, err := e.HV.VolumePath(ctx, pool, seed)
	if errors.Is(err, ErrNotFound) {
		return forget() // dropped before (the detach comes before the delete)
	}
	if err != nil {
		return fmt.Errorf("seed volume of %s: %w", name, err)
	}
	size, err := e.HV.VolumeCapacity(ctx, path)
	if err != nil {
		return fmt.Errorf("size of the seed volume of %s: %w", name, err)
	}
	if size > maxSeedWipe {
		return fmt.Errorf("seed volume of %s: %d bytes, more than a seed (%d)", name, size, maxSeedWipe)
	}
	zeros := make([]byte, size)
	if err := change(ctx, func(ctx context.Context) error { return e.HV.UploadVolume(ctx, pool, seed, zeros) }); err != nil {
		return fmt.Errorf("wipe the seed volume of %s: %w", name, err)
	}
	if err := change(ctx, func(ctx context.Context) error { return e.HV.DetachDisk(ctx, name, path) }); err != nil {
		return fmt.Errorf("detach the seed of %s: %w", name, err)
	}
	if err := ignoreNotFound(change(ctx, func(ctx context.Context) error { return e.HV.DeleteVolume(ctx, pool, seed) })); err != nil {
		return fmt.Errorf("delete the seed volume of %s: %w", name, err)
	}
	if err := forget(); err != nil {
		return fmt.Errorf("record that %s has no seed: %w", name, err)
	}
	return nil
}
