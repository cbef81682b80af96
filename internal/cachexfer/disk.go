package cachexfer

import (
	"context"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// hot-plugged disks (jobvm.Jobs.AttachCache, AttachScratch, KeepCache,
// DropDisks).
type Disk interface {
	// Attach attaches the cache of project (the files in want; none:
	// nothing) to machine name on a read-only disk; nothing is attached
	// when nothing is cached (Files 0).
	Attach(ctx context.Context, name, project string, want []string) (hostcache.RestoreResult, error)
	// AttachScratch attaches an empty disk for the guest to write its
	// cache on.
	AttachScratch(ctx context.Context, name string) error
	// Keep saves the files named in keep of what the guest wrote on the
	// scratch disk into the project's cache (hostcache.Store.Save), then
	// deletes the disks' volumes as Drop does (jobvm.Kept says how each
	// went).
	Keep(ctx context.Context, name, project string, keep []string) jobvm.Kept
	// Drop deletes the disks' volumes of machine name.
	Drop(ctx context.Context, name string) error
}

// Disks is the engine's side of the cache disks: *jobvm.Jobs in a stage,
// *jobvm.Host in the admin tool.
type Disks interface {
	AttachCache(ctx context.Context, store *hostcache.Store, name, project string, want []string) (hostcache.RestoreResult, error)
	AttachScratch(ctx context.Context, name string, capacity int64) error
	KeepCache(ctx context.Context, store *hostcache.Store, name, project string, keep []string) jobvm.Kept
	DropDisks(ctx context.Context, name string) error
}

// LocalDisk is Disk in this process, over h, for the host cache c.
func LocalDisk(h Disks, c config.Cache) Disk { return StoreDisk(h, hostcache.ForConfig(c)) }

// StoreDisk is Disk in this process, over h, for store.
func StoreDisk(h Disks, store *hostcache.Store) Disk { return localCacheDisk{h: h, store: store} }

// localCacheDisk is Disk in this process.
type localCacheDisk struct {
	h     Disks
	store *hostcache.Store
}

func (l localCacheDisk) Attach(ctx context.Context, name, project string, want []string) (hostcache.RestoreResult, error) {
	return l.h.AttachCache(ctx, l.store, name, project, want)
}

func (l localCacheDisk) AttachScratch(ctx context.Context, name string) error {
	return l.h.AttachScratch(ctx, name, jobvm.ScratchCapacity(l.store.ProjectLimit))
}

func (l localCacheDisk) Keep(ctx context.Context, name, project string, keep []string) jobvm.Kept {
	return l.h.KeepCache(ctx, l.store, name, project, keep)
}

func (l localCacheDisk) Drop(ctx context.Context, name string) error { return l.h.DropDisks(ctx, name) }
