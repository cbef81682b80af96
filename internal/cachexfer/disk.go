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

// LocalDisk is Disk in the stage's own process, over jobs, for the host
// cache c.
func LocalDisk(jobs *jobvm.Jobs, c config.Cache) Disk {
	return localCacheDisk{h: jobs, store: hostcache.ForConfig(c)}
}

// localCacheDisk is Disk in the stage's own process.
type localCacheDisk struct {
	h     *jobvm.Jobs
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
