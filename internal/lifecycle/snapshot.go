package lifecycle

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// The guest side of a snapshot template (issue #48, docs/pool.md): a guest
// booted with TemplateMarker on its kernel command line prints
// TemplateWaiting on its serial console and waits for its credentials disk
// (serial guestinit.CredentialDiskSerial); it is saved while it waits. A
// clone restored from it gets, by hot plug, the tools disk, its network
// interface, then its credentials disk, and goes on as a fresh boot:
// clock and entropy from the disk, DHCP, its own host key, sshd.
const (
	TemplateMarker  = "lve.snapshot=template"
	TemplateWaiting = "snapshot template: waiting for the credentials disk"
)

// snapshotTag is the machine-name shape of a snapshot template:
// MachinePrefix, "snap-", 8 random hex digits (SnapshotName).
const snapshotTag = "snap-"

// SnapshotName is a fresh name for a snapshot template machine.
func SnapshotName(prefix, controller string) (string, error) {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return MachinePrefix(prefix, controller) + snapshotTag + hex.EncodeToString(b), nil
}

// IsSnapshotTemplate reports whether the machine is a snapshot template of
// this installation.
func (mc Machine) IsSnapshotTemplate() bool {
	return strings.HasPrefix(mc.name, mc.m.namePrefix()+snapshotTag)
}

// Snapshots are this installation's memory snapshots of its images: one
// per image with snapshot = true, a saved template machine (its frozen
// disk and save volume, counted by admission while it boots, disk only
// once saved) and the record that names it (state.Snapshot).
type Snapshots struct{ m *Manager }

// SnapshotsOf is m's snapshots.
func SnapshotsOf(m *Manager) Snapshots { return Snapshots{m: m} }

// snapshotLeaseWait bounds a restored clone's wait for its address: a
// clone that takes none by then (its guest does not go on from its wait)
// is removed and the machine boots cold.
var snapshotLeaseWait = 30 * time.Second

// SnapshotInputs are what a snapshot of img is made from, by name: the
// image's machine spec (SpecFingerprint: the driver's version and the
// configuration that shapes a machine), the domain type, the size, the
// image's files as they are now (path, size, modification time; the
// manifest digest of a registry image), and host, the libvirt and QEMU
// versions that save and restore it. A snapshot is restored only where
// every input is what it was made from (SnapshotFingerprint); the record
// keeps them, so that a stale snapshot's reason names what changed.
func SnapshotInputs(cfg *config.Config, img *config.Image, domainType string, size config.Size, host string) map[string]string {
	in := map[string]string{
		"the driver's version or the image's machine configuration": SpecFingerprint(cfg, img),
		"the domain type":                    domainType,
		"the size":                           fmt.Sprintf("%d vCPU, %d MiB, %d GiB", size.VCPUs, size.MemoryMiB, size.DiskGiB),
		"the image's registry digest":        img.Digest,
		"the libvirt and QEMU versions":      host,
		"the template's kernel command line": TemplateMarker,
	}
	for what, p := range map[string]string{"base": img.Base, "kernel": img.Kernel, "initrd": img.Initrd} {
		stamp := p
		if st, err := os.Stat(p); err == nil && p != "" {
			stamp = fmt.Sprintf("%s %d %s", p, st.Size(), st.ModTime().UTC().Format(time.RFC3339Nano))
		}
		in["the image's "+what+" file"] = stamp
	}
	return in
}

// SnapshotFingerprint is the digest of inputs (SnapshotInputs).
func SnapshotFingerprint(inputs map[string]string) string {
	b, _ := json.Marshal(inputs) // keys sorted
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}

// changedInputs names the inputs of now that differ from was (sorted).
func changedInputs(was, now map[string]string) string {
	var out []string
	for k, v := range now {
		if was[k] != v {
			out = append(out, k)
		}
	}
	if len(out) == 0 {
		return "its inputs"
	}
	slices.Sort(out)
	return strings.Join(out, ", ")
}

// hostVersions is the libvirt and QEMU versions, for SnapshotInputs.
func (m *Manager) hostVersions(ctx context.Context) (string, error) {
	lv, hv, err := m.hv.Version(ctx)
	if err != nil {
		return "", fmt.Errorf("libvirt's version: %w", err)
	}
	return HostVersions(lv, hv), nil
}

// HostVersions is libvirt's and the hypervisor's versions as
// SnapshotInputs takes them (Hypervisor.Version's numbers).
func HostVersions(libvirt, hypervisor uint32) string {
	return fmt.Sprintf("libvirt %d, hypervisor %d", libvirt, hypervisor)
}

// Support says why img cannot have a memory snapshot (nil: it can).
func Support(img *config.Image) error {
	switch {
	case !img.Snapshot:
		return fmt.Errorf("image %s: snapshot is off; set [images.%s] snapshot = true", img.Name, img.Name)
	case img.Boot != config.BootKernel, img.KeyInjection != config.InjectSMBIOS, img.AddressSource != string(vm.SourceLease), img.SharedMemory:
		return fmt.Errorf("image %s: a snapshot needs boot = \"kernel\", key_injection = \"smbios\", address_source = \"lease\" and no shared_memory", img.Name)
	}
	return nil
}

// Build makes a fresh snapshot of img and records it as the image's, in
// place of the one it had (whose template the sweep removes once it is
// no longer needed: judgeTemplate). Only the replaced template gets the
// grace: one replaced twice within replacedGrace may go at once. The template boots
// at the image's default size with no network interface and no secret,
// and is saved when its guest says it waits for its credentials disk
// (within timeouts.boot). It is admitted as a machine while it boots
// (NoWait: a full host refuses it); once saved it holds no memory.
// Whatever fails, nothing of the new template is left.
func (s Snapshots) Build(ctx context.Context, img *config.Image) (*state.Snapshot, error) {
	m := s.m
	if err := Support(img); err != nil {
		return nil, err
	}
	if img.Source != "" && !img.Pulled() {
		return nil, fmt.Errorf("image %s (%s) is not on this host: libvirt-executor image pull %s", img.Name, img.Source, img.Name)
	}
	img = m.Cfg.ResolveFiles(img)
	if err := m.Cfg.CheckBase(img); err != nil {
		return nil, err
	}
	// One build per image at a time ('_': no machine name starts so).
	unlockImage, err := m.Store.Lock(ctx, "_snapbuild-"+img.Name)
	if err != nil {
		return nil, err
	}
	defer unlockImage()
	domainType, err := m.KVM().DomainType(ctx)
	if err != nil {
		return nil, err
	}
	size := m.Cfg.ImageSize(img)
	name, err := SnapshotName(m.Cfg.NamePrefix, m.Controller)
	if err != nil {
		return nil, err
	}
	// Held until the template is recorded: a sweep leaves it alone
	// meanwhile, and removes it if this process dies first.
	unlock, err := m.Store.Lock(ctx, name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	started := time.Now().UTC()
	req := request{Request: Request{Name: name, Image: img, VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB, DiskGiB: size.DiskGiB, NoWait: true}}
	if _, err := m.admit(ctx, req); err != nil {
		return nil, err
	}
	done := false
	defer func() {
		if !done {
			tctx, cancel := detachctx.WithTimeout(ctx, m.Cfg.Timeouts.Cleanup.D())
			defer cancel()
			if err := m.teardown(tctx, name); err != nil {
				m.say("Removing the unfinished snapshot template %s failed: %v", name, err)
			}
		}
	}()
	consoleLog := m.Machine(name).ConsoleLog()
	if err := touchPrivate(consoleLog); err != nil {
		return nil, err
	}
	spec := MachineSpec(m.Cfg, SpecInput{Request: req.Request, Controller: m.Controller, DomainType: domainType, Created: started, ConsoleLog: consoleLog})
	spec.Template = true
	spec.Seed, spec.SeedSerial, spec.OEMStrings, spec.Shared, spec.Filter = nil, "", nil, nil, nil
	spec.StaticAddress, spec.MAC = false, ""
	spec.Cmdline = strings.TrimSpace(spec.Cmdline + " " + TemplateMarker)
	// Its record, not a deadline, keeps it (judgeTemplate).
	spec.Owner.Deadline = started.AddDate(10, 0, 0)
	eng := m.engine()
	eng.Progress = func(format string, args ...any) { m.say("  "+format, args...) }
	if _, err := eng.Create(ctx, spec); err != nil {
		return nil, err
	}
	t0 := time.Now()
	bctx, cancel := context.WithTimeout(ctx, m.Cfg.Timeouts.Boot.D())
	err = m.waitConsole(bctx, name, consoleLog, TemplateWaiting)
	cancel()
	if err != nil {
		if t := tail(consoleLog, 25); len(t) > 0 {
			m.say("Last lines of the template's console:\n%s", t)
		}
		return nil, fmt.Errorf("snapshot template of image %s: %w", img.Name, err)
	}
	booted := time.Since(t0)
	t0 = time.Now()
	if err := eng.SaveMachine(ctx, name, m.Cfg.StoragePool); err != nil {
		return nil, err
	}
	saved := time.Since(t0)
	if err := m.Store.MarkSaved(name); err != nil {
		return nil, err
	}
	// The definition goes: nothing can start the template again and write
	// its disk, which every clone's is over. Its state directory and the
	// record (judgeTemplate) prove its volumes ours.
	if err := m.hv.Undefine(ctx, name); err != nil {
		return nil, fmt.Errorf("undefine the saved template %s: %w", name, err)
	}
	diskPath, err := m.hv.VolumePath(ctx, m.Cfg.StoragePool, vm.DiskVolume(name))
	if err != nil {
		return nil, err
	}
	diskBytes, err := m.hv.VolumeCapacity(ctx, diskPath)
	if err != nil {
		return nil, err
	}
	saveBytes, err := s.checkSave(ctx, name, diskPath)
	if err != nil {
		return nil, err
	}
	host, err := m.hostVersions(ctx)
	if err != nil {
		return nil, err
	}
	inputs := SnapshotInputs(m.Cfg, img, domainType, size, host)
	rec := state.Snapshot{
		Image: img.Name, Template: name, Fingerprint: SnapshotFingerprint(inputs), Inputs: inputs,
		DomainType: domainType, VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB, DiskBytes: diskBytes, DiskPath: diskPath,
		SaveBytes: saveBytes, Started: started, Saved: time.Now().UTC(),
	}
	old, _ := m.Store.SnapshotOf(img.Name)
	if old != nil && old.Template != name {
		// Kept a while by the sweep (judgeTemplate): a prepare that chose
		// it a moment ago still makes its clone's disk over it.
		rec.Previous = old.Template
	}
	if err := m.Store.PutSnapshot(ctx, rec); err != nil {
		return nil, err
	}
	done = true
	m.say("Snapshot of image %s made: template %s booted to its wait in %s, saved in %s (%d MiB)", img.Name, name, vm.Round(booted), vm.Round(saved), saveBytes>>20)
	return &rec, nil
}

// checkSave reads back the head of the template's save volume and makes
// a clone's XML of it, as a restore will: a save this code cannot restore
// (compressed by libvirt's save_image_format, another format version, a
// disk it does not name) is refused now, not at every job. It returns
// the volume's size.
func (s Snapshots) checkSave(ctx context.Context, name, diskPath string) (uint64, error) {
	m := s.m
	savePath, err := m.hv.VolumePath(ctx, m.Cfg.StoragePool, vm.SaveVolume(name))
	if err != nil {
		return 0, err
	}
	size, err := m.hv.VolumeCapacity(ctx, savePath)
	if err != nil {
		return 0, err
	}
	save, err := vm.OpenSave(ctx, m.hv, m.Cfg.StoragePool, name)
	if err != nil {
		return 0, fmt.Errorf("the saved template %s: %w", name, err)
	}
	save.Close()
	if _, err := vm.CloneXML(save.Head.XML, vm.CloneIdentity{Name: name, UUID: "00000000-0000-4000-8000-000000000000",
		Disks: map[string]string{diskPath: diskPath}}); err != nil {
		return 0, fmt.Errorf("the saved template %s: %w", name, err)
	}
	return size, nil
}

// Remove removes the image's snapshot: its record, then its template
// (unless a clone's disk is still over its frozen one: then a later sweep
// does).
func (s Snapshots) Remove(ctx context.Context, image string) (kept string, err error) {
	m := s.m
	rec, err := m.Store.SnapshotOf(image)
	if err != nil {
		return "", err
	}
	if rec == nil {
		return "", fmt.Errorf("image %s has no memory snapshot (libvirt-executor image snapshots lists them)", image)
	}
	if err := m.Store.ForgetSnapshot(ctx, image, rec.Template); err != nil {
		return "", err
	}
	return s.retire(ctx, rec.Template), nil
}

// List returns every snapshot record.
func (s Snapshots) List() ([]state.Snapshot, error) { return s.m.Store.Snapshots() }

// retire removes a template no record names any more, unless a clone's
// disk is over its frozen one (a sweep removes it once none is); it says
// why it kept it ("" when it removed it).
func (s Snapshots) retire(ctx context.Context, name string) (kept string) {
	m := s.m
	if inUse, err := s.frozenInUse(ctx, name); err != nil {
		return err.Error()
	} else if inUse {
		return "a clone's disk is still over its disk (a clone that runs, or one its reaper is removing)"
	}
	unlock, err := m.Store.TryLock(name)
	if err != nil {
		return err.Error()
	}
	defer unlock()
	if err := m.teardown(ctx, name); err != nil {
		return err.Error()
	}
	m.Store.RemoveLock(name)
	return ""
}

// frozenInUse reports whether a volume of the pool is over the template's
// frozen disk (a clone that runs, or was kept).
func (s Snapshots) frozenInUse(ctx context.Context, name string) (bool, error) {
	m := s.m
	path, err := m.hv.VolumePath(ctx, m.Cfg.StoragePool, vm.DiskVolume(name))
	if errors.Is(err, vm.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	backing, err := m.Volumes().BackingFiles(ctx)
	if err != nil {
		return false, err
	}
	for _, b := range backing {
		if b == path {
			return true, nil
		}
	}
	return false, nil
}

// judgeTemplate is the verdict on a snapshot template that the deadline
// rule kept: kept while its image's record names it or a clone's disk is
// over its frozen one; else (replaced, forgotten, or its build died)
// removed.
func (s Snapshots) judgeTemplate(ctx context.Context, it *Item, now time.Time) {
	recs, err := s.m.Store.Snapshots()
	if err != nil {
		// An unreadable record may be the one that names it: kept.
		it.Verdict, it.Reason = VerdictKeep, "a memory snapshot's template (a record is unreadable: "+err.Error()+")"
		return
	}
	for _, r := range recs {
		switch {
		case r.Template == it.Name && r.Ready():
			it.Verdict = VerdictKeep
			it.Reason = fmt.Sprintf("memory snapshot of image %s, saved %s ago", r.Image, now.Sub(r.Saved).Round(time.Second))
			return
		case r.Previous == it.Name && now.Sub(r.Saved) < replacedGrace:
			it.Verdict, it.Reason = VerdictKeep, fmt.Sprintf("the memory snapshot of image %s replaced %s ago", r.Image, now.Sub(r.Saved).Round(time.Second))
			return
		}
	}
	if inUse, err := s.frozenInUse(ctx, it.Name); err != nil || inUse {
		it.Verdict, it.Reason = VerdictKeep, "an old memory snapshot: clones still use its disk"
		return
	}
	it.Verdict, it.Reason = VerdictExpired, "a memory snapshot no record names (replaced, removed, or its build did not finish)"
}

// replacedGrace is how long a replaced template stays for the prepares
// that chose it just before (their clones' disks are over it once made).
const replacedGrace = 2 * time.Minute

// Current returns img's snapshot record when it is current (saved, made
// from what a machine of img would be made of now, its template and
// volumes there, not failed MaxSnapshotFailures restores in a row), else
// nil and why not.
func (s Snapshots) Current(ctx context.Context, img *config.Image) (*state.Snapshot, string) {
	m := s.m
	domainType, err := m.KVM().DomainType(ctx)
	if err != nil {
		return nil, err.Error()
	}
	return s.current(ctx, m.Cfg.ResolveFiles(img), domainType)
}

// current is Current for img's files resolved and the domain type known.
func (s Snapshots) current(ctx context.Context, img *config.Image, domainType string) (*state.Snapshot, string) {
	m := s.m
	rec, err := m.Store.SnapshotOf(img.Name)
	switch {
	case err != nil:
		return nil, err.Error()
	case rec == nil || !rec.Ready():
		return nil, fmt.Sprintf("none made yet (the pool service makes it, or libvirt-executor image snapshot %s)", img.Name)
	case rec.Failures >= state.MaxSnapshotFailures:
		return nil, fmt.Sprintf("its last %d restores failed (the pool service makes a new one, or libvirt-executor image snapshot %s)", rec.Failures, img.Name)
	}
	host, err := m.hostVersions(ctx)
	if err != nil {
		return nil, err.Error()
	}
	if now := SnapshotInputs(m.Cfg, img, domainType, m.Cfg.ImageSize(img), host); SnapshotFingerprint(now) != rec.Fingerprint {
		return nil, fmt.Sprintf("it is stale: %s changed since it was made %s ago (the pool service makes a new one where its configuration says the same, or libvirt-executor image snapshot %s)",
			changedInputs(rec.Inputs, now), time.Since(rec.Saved).Round(time.Second), img.Name)
	}
	if ok, err := m.Store.Has(rec.Template); err != nil || !ok {
		return nil, fmt.Sprintf("its template %s is gone", rec.Template)
	}
	// Its volumes, as libvirt has them: one removed by hand, or a save
	// that is not the size it was made with, is not restored.
	savePath, err := m.hv.VolumePath(ctx, m.Cfg.StoragePool, vm.SaveVolume(rec.Template))
	if err != nil {
		return nil, fmt.Sprintf("its save volume: %v", err)
	}
	if n, err := m.hv.VolumeCapacity(ctx, savePath); err != nil || n != rec.SaveBytes {
		return nil, fmt.Sprintf("its save volume %s is not the one it was made with (%d bytes, recorded %d; %v)", savePath, n, rec.SaveBytes, err)
	}
	if _, err := m.hv.VolumeCapacity(ctx, rec.DiskPath); err != nil {
		return nil, fmt.Sprintf("its disk %s: %v", rec.DiskPath, err)
	}
	return rec, ""
}

// usable returns the snapshot a job's machine of req starts from, or nil
// and why not ("" where a snapshot does not apply: the image has none,
// or the machine is not a job's).
func (s Snapshots) usable(ctx context.Context, req request, domainType string) (*vm.Snapshot, string) {
	img := req.Image
	if !img.Snapshot || req.detached || req.Standby != nil || req.Seed != nil || req.SeedWritable {
		return nil, ""
	}
	if len(req.Dirs) > 0 {
		return nil, "the job shares host directories (they need shared memory, which a template has not)"
	}
	rec, why := s.current(ctx, img, domainType)
	switch {
	case rec == nil:
		return nil, why
	case req.VCPUs != rec.VCPUs || req.MemoryMiB != rec.MemoryMiB:
		return nil, fmt.Sprintf("the job asks %d vCPUs and %d MiB; the snapshot has %d and %d", req.VCPUs, req.MemoryMiB, rec.VCPUs, rec.MemoryMiB)
	case uint64(max(req.DiskGiB, 0))<<30 > rec.DiskBytes: //nolint:gosec // G115: non-negative
		return nil, fmt.Sprintf("the job asks a %d GiB disk; the snapshot's is %d GiB", req.DiskGiB, rec.DiskBytes>>30)
	}
	return &vm.Snapshot{Template: rec.Template, DiskPath: rec.DiskPath, DiskBytes: rec.DiskBytes}, ""
}

// noteRestore counts a start from snap for img's snapshot: err is a
// failure for the snapshot's own sake (a save file refused, libvirt
// refusing the restore, a clone that did not go on or never answered
// SSH), nil a machine that became ready; a failure once ctx ended (the
// job's own) is not counted.
func (s Snapshots) noteRestore(ctx context.Context, img string, snap vm.Snapshot, err error) {
	m := s.m
	failed := err != nil
	if failed && ctx.Err() != nil {
		return
	}
	if nerr := m.Store.NoteSnapshotRestore(ctx, img, snap.Template, failed); nerr != nil {
		m.say("Note: the snapshot's restore count not recorded: %v", nerr)
	}
}

// waitConsole waits until the machine's console log (its last 64 KiB,
// read every 100 ms) holds line, the domain stops, or ctx ends.
func (m *Manager) waitConsole(ctx context.Context, name, path, line string) error {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	want := []byte(line)
	for {
		if b := lastBytes(path, 64<<10); bytes.Contains(b, want) {
			return nil
		}
		if active, err := m.hv.IsActive(ctx, name); err == nil && !active {
			return fmt.Errorf("the guest stopped before it said %q", line)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the guest did not say %q: %w", line, context.Cause(ctx))
		case <-t.C:
		}
	}
}

// lastBytes is up to n bytes at the end of the file at path (nil if it
// cannot be read).
func lastBytes(path string, n int64) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil
	}
	off := max(st.Size()-n, 0)
	b, err := io.ReadAll(io.NewSectionReader(f, off, n))
	if err != nil {
		return nil
	}
	return b
}
