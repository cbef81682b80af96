package jobvm

import (
	"context"
	"errors"
	"io"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
)

// AttachCache hands the project's cache in store to the running machine
// name on a read-only disk hot-plugged into it (lifecycle.Manager.AttachData):
// one tar stream, taken under the project's shared lock, so each file is
// whole. A project with nothing cached gets no disk (Files 0). DropData
// deletes the disk's volume once the guest has read it.
func (h *Host) AttachCache(ctx context.Context, store *hostcache.Store, name, project string) (hostcache.RestoreResult, error) {
	if err := h.CheckOurName(name); err != nil {
		return hostcache.RestoreResult{}, err
	}
	sn, err := store.Open(ctx, project)
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
	err = h.AttachData(ctx, name, pr, sn.Size())
	_ = pr.CloseWithError(errors.New("the restore disk is written"))
	<-written
	if err != nil {
		return hostcache.RestoreResult{}, err
	}
	return res, nil
}
