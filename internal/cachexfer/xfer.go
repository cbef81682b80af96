package cachexfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Timeout bounds one copy (restore or save) of a project's cache, the
// connection's dial included.
const Timeout = 10 * time.Minute

// Dialer makes a connection to the job's machine (jobvm.Session); the
// caller closes the client.
type Dialer interface {
	Take(ctx context.Context) (*state.Machine, *sshexec.Client, error)
}

// Transfer moves one project's host cache to and from one machine.
type Transfer struct {
	name    string
	store   *hostcache.Store
	project string
	viaDisk bool
	diskMin int64
	disk    Disk
	dial    Dialer
	log     *slog.Logger
}

// Setup is what a Transfer is made of.
type Setup struct {
	Cache config.Cache  // the host's cache configuration
	Image *config.Image // the machine's image (cache_via)
	// Machine is the job's machine's name.
	Machine string
	// ServerURL, ProjectID and Protected name the project's cache: that of
	// its protected refs or of its other refs, as the job's, so that a job
	// of an unprotected branch never sees nor replaces what a protected
	// one extracts.
	ServerURL string
	ProjectID int64
	Protected bool
	// Disk hands the cache over on disks (nil: no disk; every copy goes
	// over the connection).
	Disk Disk
	// Dial makes the connection to the machine (nil: none, a copy fails).
	Dial Dialer
	Log  *slog.Logger
}

// On reports whether the host cache is on for img.
func On(c config.Cache, img *config.Image) bool { return c.For(img) }

// New is the transfer s describes, or an error saying why the project's
// cache cannot be named.
func New(s Setup) (*Transfer, error) {
	project, err := hostcache.ProjectID(s.ServerURL, s.ProjectID, s.Protected)
	if err != nil {
		return nil, err
	}
	log := s.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Transfer{
		name: s.Machine, store: hostcache.ForConfig(s.Cache), project: project,
		viaDisk: s.Image != nil && s.Image.CacheVia == config.CacheViaDisk && s.Disk != nil,
		diskMin: s.Cache.DiskMin(), disk: s.Disk, dial: s.Dial, log: log,
	}, nil
}

// Store is the host's store the transfer reads and writes.
func (t *Transfer) Store() *hostcache.Store { return t.store }

// Project is the key of the project's cache in the store.
func (t *Transfer) Project() string { return t.project }

// Restored is what a restore did.
type Restored struct {
	Files, Bytes int64
	// How says the way it went: "over SSH", "from a restore disk (...)".
	How string
	// NoneWanted: none of the archives named is cached; ProjectEmpty:
	// nothing at all is cached for the project (nothing copied).
	NoneWanted, ProjectEmpty bool
	// DialErr: no connection to the machine (nothing done).
	DialErr error
	// Err: the copy failed.
	Err error
	// Notes are what happened on the way (a disk the guest could not
	// have), for the job log, in order.
	Notes []string
	// Took is the copy's time, dial included.
	Took time.Duration
}

// Saved is what a save did.
type Saved struct {
	Result hostcache.SaveResult
	// How says the way it went: " over SSH", " from a scratch disk (...)".
	How string
	// DialErr: no connection to the machine (nothing done).
	DialErr error
	// StoreErr: the host did not keep it (OverLimit tells the project
	// limit); GuestErr: how the guest's side ended, when not well.
	StoreErr, GuestErr error
	Notes              []string
	Took               time.Duration
}

// OverLimit reports whether err is the project limit's refusal.
func OverLimit(err error) bool { return errors.Is(err, hostcache.ErrProjectLimit) }

// Result is the metrics' result label of a copy.
func Result(hit bool, err error) string {
	switch {
	case OverLimit(err):
		return "over_limit"
	case err != nil:
		return "error"
	case !hit:
		return "miss"
	}
	return "ok"
}

// notes collects a copy's notes.
type notes []string

func (n *notes) say(format string, args ...any) { *n = append(*n, fmt.Sprintf(format, args...)) }

// connect is the connection made during the script (early), else one of
// its own.
func (t *Transfer) connect(ctx context.Context, early *Early) (*sshexec.Client, error) {
	if c := early.connection(); c != nil {
		return c, nil
	}
	if t.dial == nil {
		return nil, errors.New("no way to reach the machine")
	}
	_, c, err := t.dial.Take(ctx)
	if err == nil && c == nil {
		err = errors.New("no connection")
	}
	return c, err
}

// Restore copies the project's archives among named (the archives the
// runner's script names; none: nothing) into the guest's cache_dir: on a
// restore disk (the image's cache_via = "disk", the cache at least
// cache.disk_min_mib), else, or when the guest cannot have the disk, over
// a connection. Nothing else of the project's cache reaches the guest.
func (t *Transfer) Restore(ctx context.Context, named []string) (r Restored) {
	t0 := time.Now()
	defer func() { r.Took = time.Since(t0) }()
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	client, err := t.connect(ctx, nil)
	if err != nil {
		r.DialErr = err
		return r
	}
	defer client.Close()
	want, size, all, err := wantedFiles(ctx, t.store, t.project, named)
	if err == nil && len(want) == 0 {
		r.NoneWanted, r.ProjectEmpty = true, all == 0
		return r
	}
	var n notes
	defer func() { r.Notes = n }()
	var res hostcache.RestoreResult
	done := false
	// Below cache.disk_min_mib the hot plug costs more than SSH's copy.
	if err == nil && t.viaDisk && size >= t.diskMin {
		var steps string
		res, done, steps, err = t.restoreByDisk(ctx, &n, want, client)
		r.How = "from a restore disk (" + steps + ")"
	}
	if !done && err == nil {
		r.How = "over SSH"
		res, err = restoreBySSH(ctx, t.store, t.project, want, client)
	}
	r.Files, r.Bytes, r.Err = res.Files, res.Bytes, err
	return r
}

// Save keeps the archives named in keep (those the runner's archive_cache
// script names) of the guest's cache_dir in the project's cache: written
// by the guest on a scratch disk (the image's cache_via = "disk"; early,
// if not nil, is the one attached during the script), else, or when the
// guest cannot use the disk, over a connection. Any other file in
// cache_dir is left out.
func (t *Transfer) Save(ctx context.Context, keep []string, early *Early) (s Saved) {
	t0 := time.Now()
	defer func() { s.Took = time.Since(t0) }()
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	client, err := t.connect(ctx, early)
	if err != nil {
		s.DialErr = err
		return s
	}
	defer client.Close()
	var n notes
	defer func() { s.Notes = n }()
	done := false
	if t.viaDisk {
		var steps string
		s.Result, done, steps, s.GuestErr, s.StoreErr = t.saveByDisk(ctx, &n, keep, client, early)
		s.How = " from a scratch disk (" + steps + ")"
	}
	if !done && s.StoreErr == nil {
		s.How = " over SSH"
		s.Result, s.GuestErr, s.StoreErr = saveBySSH(ctx, t.store, t.project, keep, client)
	}
	return s
}

// saveBySSH reads the guest's tar stream of its cache_dir over the
// client's connection into the store, keeping the files named in keep.
// gerr is how the guest's side ended.
func saveBySSH(ctx context.Context, store *hostcache.Store, project string, keep []string, client *sshexec.Client) (res hostcache.SaveResult, gerr, serr error) {
	pr, pw := io.Pipe()
	done := make(chan struct{})
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		defer close(done)
		res, serr = store.Save(sctx, project, pr, hostcache.Only(keep))
		// The guest's tar is not waited for once the host has what it
		// keeps, or refused it: what it still sends is dropped.
		_ = pr.CloseWithError(errors.New("the host stopped reading the guest's cache"))
		if serr != nil {
			stop()
		}
	}()
	gerr = client.Stream(sctx, saveCommand, bytes.NewReader(nil), pw)
	_ = pw.CloseWithError(gerr)
	<-done
	return res, gerr, serr
}

// saveByDisk has the guest write its cache_dir as a tar stream on an empty
// disk hot-plugged into its VM, and keeps the files named in keep of what
// is on the disk (checked as any guest's stream is). done is false (with nil errors) when the guest
// could not use the disk: the job log says why, and the caller copies over
// SSH instead. The disk's volume is deleted once read. steps says how
// long the disk took to make, the guest to write it and the host to keep
// it.
func (t *Transfer) saveByDisk(ctx context.Context, n *notes, keep []string, client *sshexec.Client, early *Early) (res hostcache.SaveResult, done bool, steps string, gerr, serr error) {
	// A disk attached during the script is used whatever the size: its
	// hot plug is paid, and writing a small cache on it costs less than
	// asking the guest how small it is.
	if early == nil && smallSave(ctx, t.diskMin, client) {
		return res, false, "", nil, nil
	}
	disk := t.disk
	t0 := time.Now()
	var err error
	made := "made in "
	if early != nil {
		err = early.wait()
		made = fmt.Sprintf("made during the script in %s, waited for ", vm.Round(early.took))
	} else {
		err = disk.AttachScratch(ctx, t.name)
	}
	if err != nil {
		if ctx.Err() != nil {
			return res, false, "", nil, err
		}
		n.say("no scratch disk (%v); copying over SSH instead", err)
		return res, false, "", nil, nil
	}
	// The volumes are deleted by Keep; where that was not reached or
	// failed, here (or by Early.Drop, when the stage ends).
	dropped := false
	if early == nil {
		defer func() {
			if !dropped {
				t.dropDisks(ctx)
			}
		}()
	}
	attached := time.Since(t0)
	t1 := time.Now()
	way := "" // the direct layout, or said
	last, err := guestWrite(ctx, client, early.armedCommand())
	if err != nil {
		return res, false, "", nil, fmt.Errorf("writing the cache to the scratch disk: %w", err)
	}
	switch {
	case strings.HasPrefix(last, diskWritten+" "):
		status, how, _ := strings.Cut(strings.TrimPrefix(last, diskWritten+" "), " ")
		if status != "0" {
			gerr = fmt.Errorf("exit status %.8s", status)
		}
		switch how {
		case "tar":
			way = "as a tar stream, "
		case "direct agent":
			way = "agent " // "written by the guest agent in"
		}
	case last == diskMissing:
		n.say("the guest did not see the scratch disk within 10 s (does its kernel do PCI hot plug? cache_via = \"ssh\" avoids the wait); copying over SSH instead")
		return res, false, "", nil, nil
	case last == diskUnwritable:
		n.say("the guest's user cannot write the scratch disk (not root, no passwordless sudo; cache_via = \"ssh\" avoids the attempt); copying over SSH instead")
		return res, false, "", nil, nil
	default:
		return res, false, "", nil, errors.New("writing the cache to the scratch disk: the guest's tar did not finish")
	}
	written := time.Since(t1)
	t2 := time.Now()
	k := disk.Keep(ctx, t.name, t.project, keep)
	res, serr = k.Result, k.Err
	if dropped = k.DropErr == nil; dropped && early != nil {
		early.dropped = true
	}
	read := "read"
	if k.FromFile {
		read = "read from the volume's file"
	}
	return res, true, fmt.Sprintf("%s%s, written by the guest %sin %s, %s and deleted in %s", made, vm.Round(attached), way, vm.Round(written), read, vm.Round(time.Since(t2))), gerr, serr
}

// guestWrite has the guest write its cache_dir on the scratch disk: by the
// armed command a where it takes the go, else by a command of its own
// (diskSaveCommand); after the agent's diskNotDirect, the shell's way
// (diskSaveShell). last is the guest's last line.
func guestWrite(ctx context.Context, client *sshexec.Client, a *armedSave) (last string, err error) {
	out := &headBuffer{limit: 4096}
	fired := a != nil && a.fire(ctx)
	if fired {
		select {
		case <-a.done:
		case <-ctx.Done():
			return "", context.Cause(ctx)
		}
		if a.err != nil {
			return "", a.err
		}
		out = a.out
	} else if err := client.Stream(ctx, diskSaveCommand, bytes.NewReader(nil), out); err != nil {
		return "", err
	}
	last = lastLine(out.String())
	if last != diskNotDirect && (!fired || last != diskNotAsked) {
		return last, nil
	}
	// The agent's layout cannot carry this cache (the shell's way writes a
	// tar stream), or the armed agent took the go and died (its shell
	// found its stdin ended: not asked).
	out = &headBuffer{limit: 4096}
	if err := client.Stream(ctx, diskSaveShell, bytes.NewReader(nil), out); err != nil {
		return "", err
	}
	return lastLine(out.String()), nil
}

// duCommand says how many KiB the guest's cache_dir holds.
const duCommand = "du -sk " + GuestCacheDir + " 2>/dev/null"

// smallSave reports whether the guest says its cache_dir holds less than
// cache.disk_min_mib: cheaper over SSH than on a disk. A guest that does
// not say (or lies) only chooses the way its cache comes; both check what
// comes the same.
func smallSave(ctx context.Context, min int64, client *sshexec.Client) bool {
	if min == 0 {
		return false
	}
	out := &headBuffer{limit: 256}
	if err := client.Stream(ctx, duCommand, bytes.NewReader(nil), out); err != nil {
		return false
	}
	f := strings.Fields(out.String())
	if len(f) == 0 {
		return false
	}
	kib, err := strconv.ParseInt(f[0], 10, 64)
	return err == nil && kib >= 0 && kib<<10 < min
}

// dropDisks deletes the volumes of the machine's hot-plugged disks, on a
// deadline of its own.
func (t *Transfer) dropDisks(ctx context.Context) {
	dctx, cancel := detachctx.WithTimeout(ctx, dropWait)
	defer cancel()
	if err := t.disk.Drop(dctx, t.name); err != nil {
		t.log.Warn("a host cache disk's volume was not deleted; the VM's teardown deletes it", "vm", t.name, "err", err)
	}
}

// wantedFiles are the project's cached files among named (the archives
// the runner's script names: namedArchives), and their bytes (size), and
// the bytes of all the project's cached files (all).
func wantedFiles(ctx context.Context, store *hostcache.Store, project string, named []string) (want []string, size, all int64, err error) {
	sn, err := store.Open(ctx, project)
	if err != nil {
		return nil, 0, 0, err
	}
	defer func() { _ = sn.Close() }()
	for _, n := range sn.Names() {
		if slices.Contains(named, n) {
			want = append(want, n)
		}
	}
	return want, sn.Bytes(hostcache.Only(want)), sn.Bytes(nil), nil
}

// archiveFile is the file the runner keeps a cache key's archive in

// restoreBySSH streams the project's cache (the files in want; none:
// nothing) into the guest's tar.
func restoreBySSH(ctx context.Context, store *hostcache.Store, project string, want []string, client *sshexec.Client) (hostcache.RestoreResult, error) {
	sn, err := store.OpenOnly(ctx, project, hostcache.Only(want))
	if err != nil {
		return hostcache.RestoreResult{}, err
	}
	defer func() { _ = sn.Close() }()
	if sn.Files().Files == 0 {
		return sn.Files(), nil
	}
	pr, pw := io.Pipe()
	var serr error
	written := make(chan struct{})
	go func() {
		defer close(written)
		_, serr = sn.WriteTo(pw)
		_ = pw.CloseWithError(serr)
	}()
	gerr := client.Stream(ctx, restoreCommand, pr, io.Discard)
	_ = pr.CloseWithError(errors.New("the guest's tar ended"))
	<-written
	return sn.Files(), errors.Join(serr, gerr)
}

// CacheDisk moves a project's host cache to and from a job's machine on
// hot-plugged disks (jobvm.Jobs.AttachCache, AttachScratch, KeepCache,

// dropWait bounds deleting the restore disk's volume.
const dropWait = 30 * time.Second

// restoreByDisk hands the project's cache to the guest on a read-only disk
// hot-plugged into its VM, and has the guest extract it. done is false
// (with a nil error) when the guest could not have the disk: the job log
// says why, and the caller copies over SSH instead. The disk's volume is
// deleted once the guest is done with it.
//
// steps says how long the disk took to make and the guest to read it.
func (t *Transfer) restoreByDisk(ctx context.Context, n *notes, want []string, client *sshexec.Client) (res hostcache.RestoreResult, done bool, steps string, err error) {
	disk := t.disk
	t0 := time.Now()
	res, err = disk.Attach(ctx, t.name, t.project, want)
	switch {
	case err != nil && ctx.Err() == nil:
		n.say("no restore disk (%v); copying over SSH instead", err)
		return res, false, "", nil
	case err != nil:
		return res, false, "", err
	case res.Files == 0:
		return res, true, "", nil
	}
	attached := time.Since(t0)
	t1 := time.Now()
	defer t.dropDisks(ctx)
	out := &headBuffer{limit: 4096}
	if err := client.Stream(ctx, diskRestoreCommand, bytes.NewReader(nil), out); err != nil {
		return res, false, "", fmt.Errorf("extracting the restore disk: %w", err)
	}
	switch last := lastLine(out.String()); last {
	case diskOK:
		return res, true, fmt.Sprintf("written and attached in %s, read by the guest in %s", vm.Round(attached), vm.Round(time.Since(t1))), nil
	case diskMissing:
		n.say("the guest did not see the restore disk within 10 s (does its kernel do PCI hot plug? cache_via = \"ssh\" avoids the wait); copying over SSH instead")
	case diskUnreadable:
		n.say("the guest's user cannot read the restore disk (not root, no passwordless sudo; cache_via = \"ssh\" avoids the attempt); copying over SSH instead")
	default:
		return res, false, "", errors.New("extracting the restore disk: the guest's tar did not finish")
	}
	return res, false, "", nil
}

// headBuffer keeps the first limit bytes written to it and drops the rest
// (what a guest prints is bounded).
type headBuffer struct {
	b     []byte
	limit int
}

func (h *headBuffer) Write(p []byte) (int, error) {
	if room := h.limit - len(h.b); room > 0 {
		h.b = append(h.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (h *headBuffer) String() string { return string(h.b) }

// lastLine is s's last non-empty line.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}
