package jobvm

import (
	"context"
	"errors"
	"fmt"
	"io"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
)

// AttachCache hands the project's cache in store to the running machine
// name on a read-only disk hot-plugged into it (lifecycle.Manager.AttachData):
// one tar stream, taken under the project's shared lock, so each file is
// whole: the files named in want (none: nothing, and no disk). A project
// with nothing cached gets no disk (Files 0). DropDisks deletes the disk's volume once
// the guest has read it.
func (h *Host) AttachCache(ctx context.Context, store *hostcache.Store, name, project string, want []string) (hostcache.RestoreResult, error) {
	if err := h.m.Machine(name).CheckOurName(); err != nil {
		return hostcache.RestoreResult{}, err
	}
	sn, err := store.OpenOnly(ctx, project, hostcache.Only(want))
	if err != nil {
		return hostcache.RestoreResult{}, err
	}
	defer func() { _ = sn.Close() }()
	res := sn.Files()
	if res.Files == 0 {
		return res, nil
	}
	pr, pw := io.Pipe()
	written := make(chan struct{})
	go func() {
		defer close(written)
		_, werr := sn.WriteTo(pw)
		_ = pw.CloseWithError(werr)
	}()
	err = h.m.Machine(name).AttachData(ctx, pr, sn.Size())
	_ = pr.CloseWithError(errors.New("the restore disk is written"))
	<-written
	if err != nil {
		return hostcache.RestoreResult{}, err
	}
	return res, nil
}

// ScratchCapacity is the scratch disk's size for a save of the host cache:
// the project limit, and room for the tar headers of the most files a
// save may carry (hostcache.MaxFiles, each with a long name's PAX records).
// What a guest can put on the host's disk through it is bounded by it.
func ScratchCapacity(projectLimit int64) int64 {
	return projectLimit + int64(hostcache.MaxFiles)*4096 + 1<<20
}

// AttachScratch gives the running machine name an empty writable disk of
// capacity bytes for a save of the host cache (lifecycle.Manager's), and
// first reserves that much in the configured host cache
// (hostcache.Store.Reserve): the volume takes room on the host's disk,
// as the store does, until DropDisks deletes it, so it counts against
// total_limit_mib, and projects go to make room for it. A reservation
// the store refuses (larger than the total limit) is an error: no disk,
// and the stage saves over SSH. With the host cache off, nothing is
// reserved.
func (h *Host) AttachScratch(ctx context.Context, name string, capacity int64) error {
	if err := h.m.Machine(name).CheckOurName(); err != nil {
		return err
	}
	store := h.cacheStore()
	if store != nil {
		if _, err := store.Reserve(ctx, name, capacity); err != nil {
			return err
		}
	}
	err := h.m.Machine(name).AttachScratch(ctx, capacity)
	if err != nil && store != nil {
		_ = store.Unreserve(name)
	}
	return err
}

// DropDisks deletes the volumes of machine name's cache disks
// (lifecycle.Manager's), then the scratch disk's reservation
// (AttachScratch). A reservation left by a machine torn down with its
// disk, without this, stops counting after hours (hostcache).
func (h *Host) DropDisks(ctx context.Context, name string) error {
	if err := h.m.Machine(name).DropDisks(ctx); err != nil {
		return err
	}
	if store := h.cacheStore(); store != nil {
		return store.Unreserve(name)
	}
	return nil
}

// cacheStore is the configured host cache, nil when it is off.
func (h *Host) cacheStore() *hostcache.Store {
	if h.m.Cfg == nil || !h.m.Cfg.Cache.Enabled() {
		return nil
	}
	return hostcache.ForConfig(h.m.Cfg.Cache)
}

// errSaved ends the scratch disk's read once Save has what it keeps.
var errSaved = errors.New("the host cache has read the archive")

// KeepCache reads what the guest of machine name wrote on its scratch disk
// (its cache_dir's files in hostcache's direct layout, or as a tar
// stream; hostcache.FromDisk) into the project's cache in store
// (hostcache.Store.Save: hostile input, checked and bounded there),
// keeping only the files named in keep (the archives the runner's
// archive_cache script names; none: nothing). The
// read stops where the stream ends. Then it deletes the machine's cache
// disks' volumes (DropDisks), whatever the save's outcome: dropErr is how
// that went (the caller drops them again where it failed). One call for
// both saves the run stage a second start of the admin tool and its
// libvirt connection (0.1-0.2 s on a TCG host).
func (h *Host) KeepCache(ctx context.Context, store *hostcache.Store, name, project string, keep []string) (k Kept) {
	if err := h.m.Machine(name).CheckOurName(); err != nil {
		return Kept{DropErr: err, Err: err}
	}
	defer func() { k.DropErr = h.DropDisks(ctx, name) }()
	pr, pw := io.Pipe()
	read := make(chan struct{})
	go func() {
		defer close(read)
		var err error
		k.FromFile, err = h.m.Machine(name).ReadScratch(ctx, pw)
		if err == nil {
			err = errors.New("the scratch disk ended before the archive did")
		}
		_ = pw.CloseWithError(err)
	}()
	// A failed read reaches Save as its stream's error; once Save returns,
	// the rest of the disk is not read.
	stream, err := hostcache.FromDisk(pr, store.ProjectLimit)
	if err == nil {
		k.Result, err = store.Save(ctx, project, stream, hostcache.Only(keep))
		_ = stream.Close()
	}
	_ = pr.CloseWithError(errSaved)
	<-read
	k.Err = err
	return k
}

// Kept is what KeepCache did: the save's result and error (Err), whether
// the scratch volume was read from its file (FromFile; else through
// libvirt's stream), and whether the disks' volumes were deleted after
// (DropErr nil).
type Kept struct {
	Result   hostcache.SaveResult
	FromFile bool
	DropErr  error
	Err      error
}

// KeepAnswer is what `cache-disk keep` prints: the save's result, or its
// error (OverLimit: hostcache.ErrProjectLimit), and whether the disks'
// volumes were deleted after it (Dropped; else why not, DropError). An
// admin tool from before the drop moved into keep says neither: the stage
// then deletes them itself.
type KeepAnswer struct {
	Result    hostcache.SaveResult `json:"result"`
	Error     string               `json:"error,omitempty"`
	OverLimit bool                 `json:"over_limit,omitempty"`
	Dropped   bool                 `json:"dropped,omitempty"`
	DropError string               `json:"drop_error,omitempty"`
	FromFile  bool                 `json:"from_file,omitempty"`
}

// NewKeepAnswer is the answer for KeepCache's k.
func NewKeepAnswer(k Kept) KeepAnswer {
	a := KeepAnswer{Result: k.Result, FromFile: k.FromFile}
	if k.Err != nil {
		a.Error, a.OverLimit = k.Err.Error(), errors.Is(k.Err, hostcache.ErrProjectLimit)
	}
	if k.DropErr != nil {
		a.DropError = k.DropErr.Error()
	} else {
		a.Dropped = true
	}
	return a
}

// Kept is the answer as KeepCache said it.
func (a KeepAnswer) Kept() Kept {
	return Kept{Result: a.Result, FromFile: a.FromFile, DropErr: a.DropErr(), Err: a.Err()}
}

// DropErr is nil when the answer says the volumes were deleted, else why
// not.
func (a KeepAnswer) DropErr() error {
	switch {
	case a.Dropped:
		return nil
	case a.DropError != "":
		return errors.New(a.DropError)
	}
	return errors.New("the admin tool did not say that it deleted the volumes")
}

// Err is the answer's error (wrapping hostcache.ErrProjectLimit where it
// was that), or nil.
func (a KeepAnswer) Err() error {
	switch {
	case a.Error == "":
		return nil
	case a.OverLimit:
		return fmt.Errorf("%w: %s", hostcache.ErrProjectLimit, a.Error)
	}
	return errors.New(a.Error)
}
