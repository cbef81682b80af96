// Package guesttools owns the guest tools disk: a read-only ISO volume in
// the storage pool with this host's gitlab-runner, built once per binary
// (by content, under a lock, recorded so that only this installation's
// volumes are ever removed), attached to every machine provisioned
// (lifecycle.Hooks.Shared: Disk) and swept once no machine uses it
// (Sweep). The binary "auto" names is resolved once, by the process that
// builds the disk, and recorded: every later process (reaper, service,
// gc timer, with PATHs of their own) uses that record.
package guesttools

import (
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Tools is the guest tools disk every machine gets: a read-only ISO volume
// in the storage pool, built once per gitlab-runner binary (by content) and
// shared by all machines (guestinit.ToolsISO).
type Tools struct {
	// Volume is the volume's name: <prefix>-<controller>-tools-<sha256
	// prefix>.iso (ToolsVolumeName).
	Volume string
	// Path is the volume's path, attached to each machine.
	Path string
	// Source is the host binary it holds, SHA256 its content's hash.
	Source, SHA256 string
	// Built is how long building and uploading took; 0 when the volume
	// was there already.
	Built time.Duration
}

// Describe says, in a line of the job log, where the guest's gitlab-runner
// comes from.
func (t *Tools) Describe() string {
	if t == nil {
		return ""
	}
	return DescribeTools(t.record(), t.Built)
}

// DescribeTools says where a machine's gitlab-runner comes from (built: how
// long making its tools disk took, 0 if it was there).
func DescribeTools(t *state.Tools, built time.Duration) string {
	sha := t.SHA256
	if len(sha) > 12 {
		sha = sha[:12]
	}
	s := fmt.Sprintf("gitlab-runner for the guest: %s (sha256 %s), read-only at %s", t.Source, sha, guestinit.GuestRunnerPath)
	if built > 0 {
		s += fmt.Sprintf("; its tools disk was built in %s", vm.Round(built))
	}
	return s
}

// disks are the shared disks to attach (none for a nil Tools).
func (t *Tools) disks() []vm.SharedDisk {
	if t == nil {
		return nil
	}
	return []vm.SharedDisk{{Path: t.Path, Serial: guestinit.ToolsDiskSerial}}
}

// Disk is the guest tools disk as lifecycle.Hooks.Shared.
type Disk struct{}

// Attach finds (or builds, once per binary) the guest tools disk with
// this host's gitlab-runner. Without one the machine boots all the same
// and the job log says why; a binary the admin named that cannot be used
// fails the boot (artifacts and caches would silently not work), one found
// on PATH only warns.
func (Disk) Attach(ctx context.Context, m *lifecycle.Manager) (*lifecycle.Attached, error) {
	t, err := Get(ctx, m)
	switch {
	case err == nil:
		m.Sayf("%s", t.Describe())
		return &lifecycle.Attached{Disks: t.disks(), Record: t.record()}, nil
	case errors.Is(err, ErrNoTools):
		m.Sayf("Note: %v: the guest needs its own for caches and artifacts (see docs/images.md)", err)
		return nil, nil
	case ctx.Err() == nil && m.Cfg.GuestTools.GitLabRunner == config.GuestToolsAuto:
		m.Sayf("Warning: the gitlab-runner found on this host's PATH cannot go to the guest: %v", err)
		return nil, nil
	}
	return nil, fmt.Errorf("guest tools disk: %w", err)
}

// record is what the machine's state keeps of its tools disk (nil for
// none).
func (t *Tools) record() *state.Tools {
	if t == nil {
		return nil
	}
	return &state.Tools{Volume: t.Volume, Source: t.Source, SHA256: t.SHA256}
}

// VolumeOf is the tools volume a machine was booted with ("" for none).
func VolumeOf(rec *state.Machine) string {
	if rec.Tools == nil {
		return ""
	}
	return rec.Tools.Volume
}

// VolumeNow is the tools volume a machine booted now would get, by
// name, without libvirt ("" for none, when the binary is unusable or its
// volume was not made): a stat, the cached hash and its record, so cheap
// enough for every look at a standby machine.
func VolumeNow(m *lifecycle.Manager) string {
	src, ok, _ := knownSource(m)
	if !ok {
		return ""
	}
	sum, err := sourceHash(m, src)
	if err != nil {
		return ""
	}
	// Only a volume that is there: when building it failed, machines boot
	// without one (with a warning), and they are not outdated for that.
	vol := ToolsVolumeName(m.Cfg.NamePrefix, m.Controller, sum)
	var rec toolsRecord
	if !m.Store.GetTools(recordKey(m, vol), &rec) || !rec.Ready {
		return ""
	}
	return vol
}

// toolsSuffix ends every tools volume's name.
const toolsSuffix = ".iso"

// ToolsVolumeName names the tools disk of the binary with content hash
// sha (hex): the installation's machine prefix, "tools-", 16 hex digits of
// a hash over the disk's layout version and sha. It never has the shape of
// a machine's volume, so the sweep leaves it alone.
func ToolsVolumeName(prefix, controller, sha string) string {
	h := sha256.Sum256([]byte("libvirt-executor tools disk layout " + guestinit.ToolsLayout + "\n" + sha))
	return lifecycle.MachinePrefix(prefix, controller) + "tools-" + hex.EncodeToString(h[:8]) + toolsSuffix
}

// IsToolsVolume reports whether vol is a tools volume of this naming.
func IsToolsVolume(prefix, controller, vol string) bool {
	rest, ok := strings.CutPrefix(vol, lifecycle.MachinePrefix(prefix, controller)+"tools-")
	if !ok {
		return false
	}
	hexPart, ok := strings.CutSuffix(rest, toolsSuffix)
	if !ok || len(hexPart) != 16 {
		return false
	}
	_, err := hex.DecodeString(hexPart)
	return err == nil
}

// ErrNoTools says the configuration or the host gives the guests no
// gitlab-runner; the error says why. It is not a failure of the job:
// caches and artifacts then need a binary in the image.
var ErrNoTools = errors.New("no gitlab-runner for the guests")

// autoKey is the record (in the tools records) of the binary that
// guest_tools.gitlab_runner = "auto" resolved to.
const autoKey = "gitlab-runner-auto"

// autoRecord is what "auto" resolved to, and when.
type autoRecord struct {
	Path string    `json:"path"`
	At   time.Time `json:"at"`
}

// source is the host binary whose tools disk a machine provisioned now
// gets: toolsSource, except that "auto" is resolved from PATH once, by the
// process that builds the disk, and recorded; every later process (the
// stages, the reaper, the pool service and the gc timer, each with a PATH
// of its own) takes the recorded binary while it exists. Without that,
// the processes disagreed: a sweep under another PATH took the current
// volume for an old one and deleted it, and every standby machine the
// service booted was "outdated" for the stages.
func source(m *lifecycle.Manager) (string, error) {
	if !isAuto(m.Cfg) {
		return toolsSource(m.Cfg)
	}
	if p, ok := recordedAuto(m); ok {
		return p, nil
	}
	p, err := toolsSource(m.Cfg)
	if err != nil {
		return "", err
	}
	if err := m.Store.PutTools(autoKey, autoRecord{Path: p, At: time.Now().UTC()}); err != nil {
		return "", fmt.Errorf("record the gitlab-runner that \"auto\" found: %w", err)
	}
	return p, nil
}

// recordedAuto is the binary "auto" was resolved to, if that is recorded
// and is still a regular file.
func recordedAuto(m *lifecycle.Manager) (string, bool) {
	var rec autoRecord
	if !m.Store.GetTools(autoKey, &rec) || !filepath.IsAbs(rec.Path) {
		return "", false
	}
	st, err := os.Stat(rec.Path)
	if err != nil || !st.Mode().IsRegular() {
		return "", false
	}
	return rec.Path, true
}

// knownSource is the binary of the current tools disk for a process that
// must not resolve "auto" itself (VolumeNow, Sweep): the recorded one;
// false when "auto" was never resolved.
func knownSource(m *lifecycle.Manager) (string, bool, error) {
	if !isAuto(m.Cfg) {
		p, err := toolsSource(m.Cfg)
		return p, err == nil, err
	}
	p, ok := recordedAuto(m)
	return p, ok, nil
}

func isAuto(cfg *config.Config) bool {
	v := cfg.GuestTools.GitLabRunner
	return v == config.GuestToolsAuto || v == ""
}

// toolsSource is the host binary guest_tools.gitlab_runner names ("auto":
// found on this process's PATH), or ErrNoTools.
func toolsSource(cfg *config.Config) (string, error) {
	switch v := cfg.GuestTools.GitLabRunner; v {
	case config.GuestToolsNone:
		return "", fmt.Errorf("%w: guest_tools.gitlab_runner = \"none\"", ErrNoTools)
	case config.GuestToolsAuto, "":
		p, err := exec.LookPath("gitlab-runner")
		if err != nil {
			return "", fmt.Errorf("%w: no gitlab-runner on this host's PATH (guest_tools.gitlab_runner = \"auto\")", ErrNoTools)
		}
		return filepath.Abs(p)
	default:
		return v, nil
	}
}

// GuestToolsSource is the host binary guest_tools.gitlab_runner gives the
// guests, checked to be a linux/amd64 executable this user can read; an
// error matching ErrNoTools when the configuration or the host gives none.
func GuestToolsSource(cfg *config.Config) (string, error) {
	src, err := toolsSource(cfg)
	if err != nil {
		return "", err
	}
	if err := checkGuestBinary(src); err != nil {
		return "", fmt.Errorf("guest_tools.gitlab_runner %s: %w", src, err)
	}
	return src, nil
}

// toolsRecordKey names the record of a tools volume in the configured
// storage pool: one per pool (a configuration with another pool builds its
// own volume, and must not take the other pool's record for its own).
// Neither part can hold '@' (config and CheckName shapes).
func recordKey(m *lifecycle.Manager, vol string) string { return m.Cfg.StoragePool + "@" + vol }

// toolsLock serialises building a tools volume between processes. It has
// no machine's name, so the sweep never takes it for a machine's lock.
const toolsLock = "guest-tools"

// sourceStat identifies a file's version cheaply (no hash of 70 MB per
// job): a change of content changes at least its ctime.
type sourceStat struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	Inode   uint64 `json:"inode"`
	ModNs   int64  `json:"mtime_ns"`
	CtimeNs int64  `json:"ctime_ns"`
	SHA256  string `json:"sha256"`
}

// toolsRecord is the state record of a tools volume: it proves the volume
// of that name is this installation's, and says whether it is complete.
type toolsRecord struct {
	Volume string    `json:"volume"`
	Source string    `json:"source"`
	SHA256 string    `json:"sha256"`
	Ready  bool      `json:"ready"`
	At     time.Time `json:"at"`
}

// Get returns the tools disk for this host's gitlab-runner, building
// it (once per binary, under a lock) when there is none yet. It returns
// ErrNoTools (wrapped, saying why) when the configuration or the host gives
// no binary, and other errors when the binary the admin named is unusable
// or the volume cannot be made.
func Get(ctx context.Context, m *lifecycle.Manager) (*Tools, error) {
	src, err := source(m)
	if err != nil {
		return nil, err
	}
	sum, err := sourceHash(m, src)
	if err != nil {
		return nil, fmt.Errorf("guest_tools.gitlab_runner %s: %w", src, err)
	}
	t := &Tools{Volume: ToolsVolumeName(m.Cfg.NamePrefix, m.Controller, sum), Source: src, SHA256: sum}
	var rec toolsRecord
	if m.Store.GetTools(recordKey(m, t.Volume), &rec) && rec.Ready {
		path, err := m.Hypervisor().VolumePath(ctx, m.Cfg.StoragePool, t.Volume)
		if err == nil {
			t.Path = path
			return t, nil
		}
		if !errors.Is(err, vm.ErrNotFound) {
			return nil, fmt.Errorf("tools volume %s: %w", t.Volume, err)
		}
	}
	unlock, err := m.Store.Lock(ctx, toolsLock)
	if err != nil {
		return nil, err
	}
	defer unlock()
	start := time.Now()
	built, err := build(ctx, m, t)
	if err != nil {
		return nil, err
	}
	if built {
		t.Built = time.Since(start)
	}
	return t, nil
}

// buildTools makes t's volume and sets t.Path, under the tools lock; it
// reports false when another process made it meanwhile.
func build(ctx context.Context, m *lifecycle.Manager, t *Tools) (bool, error) {
	pool := m.Cfg.StoragePool
	var rec toolsRecord
	had := m.Store.GetTools(recordKey(m, t.Volume), &rec)
	path, err := m.Hypervisor().VolumePath(ctx, pool, t.Volume)
	switch {
	case err == nil && had && rec.Ready:
		t.Path = path
		return false, nil
	case err == nil && !had:
		return false, fmt.Errorf("a volume %s is in storage pool %s but no record of this installation says it made it: left alone; remove it if it is not in use", t.Volume, pool)
	case err == nil:
		// A build that did not finish (its process was killed): ours, by
		// its record; made again.
		if err := m.Hypervisor().DeleteVolume(ctx, pool, t.Volume); err != nil && !errors.Is(err, vm.ErrNotFound) {
			return false, fmt.Errorf("delete the unfinished tools volume %s: %w", t.Volume, err)
		}
	case !errors.Is(err, vm.ErrNotFound):
		return false, fmt.Errorf("tools volume %s: %w", t.Volume, err)
	}
	rec = toolsRecord{Volume: t.Volume, Source: t.Source, SHA256: t.SHA256, At: time.Now().UTC()}
	if err := m.Store.PutTools(recordKey(m, t.Volume), rec); err != nil {
		return false, err
	}
	// Work directories of builds that were killed (a copy of the binary
	// and an image each); none is in use while the lock is ours.
	if old, err := filepath.Glob(filepath.Join(m.Store.Dir, toolsWorkPattern)); err == nil {
		for _, d := range old {
			_ = os.RemoveAll(d) // best effort: the next build tries again
		}
	}
	work, err := os.MkdirTemp(m.Store.Dir, toolsWorkPrefix)
	if err != nil {
		return false, err
	}
	defer func() { _ = os.RemoveAll(work) }() // best effort: a private temp dir
	iso := filepath.Join(work, "tools.iso")
	st, err := os.Stat(t.Source)
	if err != nil {
		return false, err
	}
	man := guestinit.ToolsManifest{Programs: map[string]guestinit.ToolOrigin{
		"gitlab-runner": {Source: t.Source, SHA256: t.SHA256, Size: st.Size()},
	}}
	if err := guestinit.ToolsISO(iso, map[string]string{"gitlab-runner": t.Source}, man, work); err != nil {
		return false, err
	}
	data, err := os.ReadFile(iso)
	if err != nil {
		return false, err
	}
	if t.Path, err = m.Engine().CreateSharedVolume(ctx, pool, t.Volume, data); err != nil {
		return false, err
	}
	rec.Ready, rec.At = true, time.Now().UTC()
	return true, m.Store.PutTools(recordKey(m, t.Volume), rec)
}

// The tools build's work directories in state_dir.
const (
	toolsWorkPrefix  = "tools-work-"
	toolsWorkPattern = toolsWorkPrefix + "*"
)

// sourceHash returns the SHA-256 of the binary at path, from the cache
// while the file is unchanged. The file must be a linux/amd64 executable.
func sourceHash(m *lifecycle.Manager, path string) (string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	if !st.Mode().IsRegular() {
		return "", fmt.Errorf("not a regular file")
	}
	cur := sourceStat{Path: path, Size: st.Size(), ModNs: st.ModTime().UnixNano()}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		cur.Inode, cur.CtimeNs = sys.Ino, sys.Ctim.Nano()
	}
	var cached sourceStat
	if m.Store.Recall("guest-tools-source", &cached) && cached.SHA256 != "" {
		sum := cached.SHA256
		cached.SHA256 = ""
		if cached == cur {
			return sum, nil
		}
	}
	if err := checkGuestBinary(path); err != nil {
		return "", err
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	cur.SHA256 = hex.EncodeToString(h.Sum(nil))
	_ = m.Store.Remember("guest-tools-source", cur) // a cache: the next job hashes again without it
	return cur.SHA256, nil
}

// checkGuestBinary refuses what cannot run in an x86_64 Linux guest.
func checkGuestBinary(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("not an ELF executable (%v); want a linux/amd64 gitlab-runner binary", err)
	}
	defer func() { _ = f.Close() }()
	if f.Machine != elf.EM_X86_64 || f.Class != elf.ELFCLASS64 {
		return fmt.Errorf("built for %s, not x86_64; want a linux/amd64 gitlab-runner binary", f.Machine)
	}
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("ELF type %s is not an executable", f.Type)
	}
	return nil
}

// Sweep (a lifecycle.Hooks.Sweepers entry) removes the guest tools volumes of earlier binaries (each
// ~100 MB) once no machine can use them: a volume of this installation's
// naming with its record, other than the current binary's, while every
// machine of the state directory has a record (none is booting: a booting
// machine's record is not written yet) and none names it. It holds the tools
// lock (no build meanwhile) and removes the record after the volume.
func Sweep(ctx context.Context, m *lifecycle.Manager, rep *lifecycle.SweepReport, dryRun bool) error {
	unlock, err := m.Store.TryLock(toolsLock)
	if errors.Is(err, state.ErrBusy) {
		return nil // a build in progress: the next sweep
	}
	if err != nil {
		return err
	}
	defer unlock()
	if _, known, _ := knownSource(m); !known && isAuto(m.Cfg) {
		// "auto" was never resolved by a process that builds the disk:
		// which volume is current is unknown here (this process's PATH
		// does not decide it), so none is removed.
		return nil
	}
	vols, err := m.PoolVolumes(ctx)
	if err != nil {
		return err
	}
	current := VolumeNow(m)
	var old []string
	for _, v := range vols {
		var rec toolsRecord
		if IsToolsVolume(m.Cfg.NamePrefix, m.Controller, v) && v != current && m.Store.GetTools(recordKey(m, v), &rec) {
			old = append(old, v)
		}
	}
	if len(old) == 0 {
		return nil
	}
	// No machine is admitted while this sweep looks at the machines and
	// deletes: one admitted after that look would attach a volume this
	// sweep took for unused (one admitted before it has no record yet,
	// and keeps them all). Only a sweep with something to remove holds
	// admission up.
	unadmit, err := m.HoldAdmission(ctx)
	if err != nil {
		return err
	}
	defer unadmit()
	names, err := m.Store.Names()
	if err != nil {
		return err
	}
	inUse := map[string]bool{}
	for _, n := range names {
		rec, err := m.Store.Record(n)
		if err != nil || rec == nil {
			return nil // a machine still booting (or unreadable): keep them all
		}
		inUse[VolumeOf(rec)] = true
	}
	var errs []error
	for _, v := range old {
		if inUse[v] {
			continue
		}
		if dryRun {
			rep.SharedVolumes = append(rep.SharedVolumes, v)
			continue
		}
		if err := m.Hypervisor().DeleteVolume(ctx, m.Cfg.StoragePool, v); err != nil && !errors.Is(err, vm.ErrNotFound) {
			errs = append(errs, fmt.Errorf("delete tools volume %s: %w", v, err))
			continue
		}
		if err := m.Store.DropTools(recordKey(m, v)); err != nil {
			errs = append(errs, err)
			continue
		}
		rep.SharedVolumes = append(rep.SharedVolumes, v)
	}
	return errors.Join(errs...)
}
