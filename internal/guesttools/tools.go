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
// in the storage pool, built once per set of host programs (by content)
// and shared by all machines (guestinit.ToolsISO).
type Tools struct {
	// Volume is the volume's name: <prefix>-<controller>-tools-<sha256
	// prefix>.iso (ToolsVolumeName).
	Volume string
	// Path is the volume's path, attached to each machine.
	Path string
	// Source is the host gitlab-runner it holds, SHA256 its content's hash
	// (both "" when it holds none).
	Source, SHA256 string
	// StepRunner is the host step-runner it holds (nil: none).
	StepRunner *state.ToolOrigin
	// Agent is the guest agent it holds (nil: none).
	Agent *state.ToolOrigin
	// Built is how long building and uploading took; 0 when the volume
	// was there already.
	Built time.Duration
	// Notes say, a line of the job log each, which program the disk lacks
	// and why.
	Notes []string
}

// Describe says, in a line of the job log, where the guest's programs come
// from.
func (t *Tools) Describe() string {
	if t == nil {
		return ""
	}
	return DescribeTools(t.record(), t.Built)
}

// DescribeTools says where a machine's gitlab-runner and step-runner come
// from (built: how long making its tools disk took, 0 if it was there).
func DescribeTools(t *state.Tools, built time.Duration) string {
	short := func(sha string) string {
		if len(sha) > 12 {
			return sha[:12]
		}
		return sha
	}
	var parts []string
	if t.Source != "" {
		parts = append(parts, fmt.Sprintf("gitlab-runner for the guest: %s (sha256 %s), read-only at %s", t.Source, short(t.SHA256), guestinit.GuestRunnerPath))
	}
	if sr := t.StepRunner; sr != nil {
		parts = append(parts, fmt.Sprintf("step-runner for the guest (GitLab Steps): %s (sha256 %s), read-only at %s", sr.Source, short(sr.SHA256), guestinit.GuestStepRunnerPath))
	}
	if a := t.Agent; a != nil {
		parts = append(parts, fmt.Sprintf("guest agent (runs the stages): %s (sha256 %s), read-only at %s", a.Source, short(a.SHA256), guestinit.GuestAgentPath))
	}
	s := strings.Join(parts, "; ")
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

// Attach finds (or builds, once per set of binaries) the guest tools disk
// with this host's gitlab-runner and step-runner. Without one the machine
// boots all the same and the job log says why; a binary the admin named
// that cannot be used fails the boot (artifacts, caches or steps would
// silently not work), one found on PATH only warns.
func (Disk) Attach(ctx context.Context, m *lifecycle.Manager) (*lifecycle.Attached, error) {
	t, err := Get(ctx, m)
	switch {
	case err == nil:
		m.Sayf("%s", t.Describe())
		for _, n := range t.Notes {
			m.Sayf("%s", n)
		}
		return &lifecycle.Attached{Disks: t.disks(), Record: t.record()}, nil
	case errors.Is(err, ErrNoTools):
		var none *noToolsError
		if errors.As(err, &none) {
			for _, n := range none.notes {
				m.Sayf("%s", n)
			}
		}
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
	return &state.Tools{Volume: t.Volume, Source: t.Source, SHA256: t.SHA256, StepRunner: t.StepRunner, Agent: t.Agent}
}

// VolumeOf is the tools volume a machine was booted with ("" for none).
func VolumeOf(rec *state.Machine) string {
	if rec.Tools == nil {
		return ""
	}
	return rec.Tools.Volume
}

// VolumeNow is the tools volume a machine booted now would get, by
// name, without libvirt ("" for none, when a binary the admin named is
// unusable or the volume was not made): a stat, the cached hash and its
// record per program, so cheap enough for every look at a standby machine.
func VolumeNow(m *lifecycle.Manager) string {
	if t, _ := Now(m); t != nil {
		return t.Volume
	}
	return ""
}

// Now is the tools disk a machine booted now would get, as its record
// says it (nil for none), found as VolumeNow finds it. exact says a boot
// now would get just that: false when "auto" was never resolved, when an
// "auto" that found nothing would find a binary on this process's PATH
// now, when a binary the admin named cannot be used, or when the volume of
// the current binaries is not made yet (the boot would build it).
func Now(m *lifecycle.Manager) (t *state.Tools, exact bool) {
	exact = true
	var have []origin
	for _, p := range programs {
		src, known, _ := knownSource(m, p)
		if !known {
			return nil, false
		}
		if src == "" {
			if isAuto(m.Cfg, p) && !p.installed {
				if _, err := exec.LookPath(p.name); err == nil {
					exact = false // the next boot's Get takes it
				}
			}
			continue
		}
		sum, err := sourceHash(m, p, src)
		if err != nil {
			if isAuto(m.Cfg, p) {
				continue // Get leaves an unusable binary "auto" found out, with a warning
			}
			return nil, false
		}
		have = append(have, origin{program: p, Source: src, SHA256: sum})
	}
	if len(have) == 0 {
		return nil, exact
	}
	// Only a volume that is there: when building it failed, machines boot
	// without one (with a warning), and they are not outdated for that.
	t = recordOf(m, have)
	var rec toolsRecord
	if !m.Store.GetTools(recordKey(m, t.Volume), &rec) || !rec.Ready {
		return nil, false
	}
	return t, exact
}

// recordOf is the machine record of the tools disk holding have: its
// volume's name and where each program came from.
func recordOf(m *lifecycle.Manager, have []origin) *state.Tools {
	t := &state.Tools{Volume: ToolsVolumeName(m.Cfg.NamePrefix, m.Controller, contentKey(have))}
	for _, o := range have {
		switch o.name {
		case "gitlab-runner":
			t.Source, t.SHA256 = o.Source, o.SHA256
		case "step-runner":
			t.StepRunner = &state.ToolOrigin{Source: o.Source, SHA256: o.SHA256}
		case agentName:
			t.Agent = &state.ToolOrigin{Source: o.Source, SHA256: o.SHA256}
		}
	}
	return t
}

// program is a host program the tools disk can carry, at bin/<name>.
type program struct {
	name string
	// setting is its [guest_tools] key and value.
	key     string
	setting func(*config.GuestTools) string
	// autoKey is the tools record of what "auto" resolved to; hashKey the
	// state's cache of its hash.
	autoKey, hashKey string
	// missing says what a guest without it lacks.
	missing string
	// installed: "auto" is the program installed with the running
	// executables (installedAgent), never one on PATH, and so the same
	// for every process of one installation: not recorded.
	installed bool
}

// programs are the tools disk's programs, in the order of its content key.
var programs = []program{
	{
		name: "gitlab-runner", key: "guest_tools.gitlab_runner",
		setting: func(g *config.GuestTools) string { return g.GitLabRunner },
		autoKey: "gitlab-runner-auto", hashKey: "guest-tools-source",
		missing: "the guest needs its own for caches and artifacts (see docs/images.md)",
	},
	{
		name: "step-runner", key: "guest_tools.step_runner",
		setting: func(g *config.GuestTools) string { return g.StepRunner },
		autoKey: "step-runner-auto", hashKey: "guest-tools-source-step-runner",
		missing: "run: jobs (GitLab Steps) need one in the image (see docs/steps.md)",
	},
	{
		name: agentName, key: "guest_tools.agent",
		setting:   func(g *config.GuestTools) string { return g.Agent },
		hashKey:   "guest-tools-source-agent",
		missing:   "stages run through the wrapper (an SSH session and a few processes each, see docs/design.md)",
		installed: true,
	},
}

// agentName is the guest agent's program name (cmd/lve-agent), on the
// host and on the tools disk.
const agentName = "lve-agent"

// agentDirs are where "auto" looks for the guest agent, relative to the
// running executable's directory: beside it (make build's bin/), then
// ../lib/libvirt-executor (make install and the Debian package).
var agentDirs = []string{".", "../lib/libvirt-executor"}

// executable is the running executable's path (a test's stand-in).
var executable = os.Executable

// installedAgent is the guest agent installed with the running
// executables (agentDirs), or errNoProgram saying where it looked.
func installedAgent() (string, error) {
	self, err := executable()
	if err != nil {
		return "", &noProgram{fmt.Sprintf("no %s: this executable's path is unknown (%v)", agentName, err)}
	}
	var looked []string
	for _, d := range agentDirs {
		p := filepath.Clean(filepath.Join(filepath.Dir(self), d, agentName))
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
		looked = append(looked, p)
	}
	return "", &noProgram{fmt.Sprintf("no %s installed with these executables (looked for %s; guest_tools.agent = \"auto\")", agentName, strings.Join(looked, ", "))}
}

// origin is a program the disk holds, from Source with hash SHA256.
type origin struct {
	program
	Source, SHA256 string
}

// contentKey is what names a tools volume: the gitlab-runner's hash alone
// when the disk holds only that (the names of the disks made before
// step-runner was added stay the same), else every program's name and hash.
func contentKey(have []origin) string {
	if len(have) == 1 && have[0].name == "gitlab-runner" {
		return have[0].SHA256
	}
	var b strings.Builder
	for _, o := range have {
		fmt.Fprintf(&b, "%s %s\n", o.name, o.SHA256)
	}
	return b.String()
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

// ErrNoTools says the configuration or the host gives the guests none of
// the tools disk's programs; the error says why. It is not a failure of
// the job: caches and artifacts then need a binary in the image.
var ErrNoTools = errors.New("no gitlab-runner for the guests")

// errNoProgram says the configuration or the host gives the guests no
// such program (noProgram says which and why).
var errNoProgram = errors.New("no such program for the guests")

// noProgram is errNoProgram saying which program and why.
type noProgram struct{ msg string }

func (e *noProgram) Error() string { return e.msg }
func (e *noProgram) Unwrap() error { return errNoProgram }

// noToolsError is ErrNoTools with the notes for the job log.
type noToolsError struct{ notes []string }

func (e *noToolsError) Error() string { return strings.Join(e.notes, "; ") }
func (e *noToolsError) Unwrap() error { return ErrNoTools }

// autoRecord is what "auto" resolved to, and when; Path "" when this
// PATH had none.
type autoRecord struct {
	Path string    `json:"path"`
	At   time.Time `json:"at"`
}

// source is the host binary of p a machine provisioned now gets:
// toolsSource, except that "auto" is resolved from PATH by the process
// that builds the disk and recorded, and every later process (the stages,
// the reaper, the pool service and the gc timer, each with a PATH of its
// own) takes the recorded binary while it exists. Without that, the
// processes disagreed: a sweep under another PATH took the current volume
// for an old one and deleted it, and every standby machine the service
// booted was "outdated" for the stages. A recorded "none found" is looked
// for again (a binary installed later is taken; once found, it stays).
func source(m *lifecycle.Manager, p program) (string, error) {
	if !isAuto(m.Cfg, p) || p.installed {
		return toolsSource(m.Cfg, p)
	}
	if path, ok := recordedAuto(m, p); ok && path != "" {
		return path, nil
	}
	path, err := toolsSource(m.Cfg, p)
	if err != nil && !errors.Is(err, errNoProgram) {
		return "", err
	}
	// Written only when it changes: a path found, or a first "none found".
	// Never a recorded binary replaced by "none": a process whose PATH
	// lacks it (read the record as none just before another found it)
	// must not undo what the other recorded.
	var rec autoRecord
	had := m.Store.GetTools(p.autoKey, &rec)
	if (path != "" && rec.Path != path) || (path == "" && !had) {
		if rerr := m.Store.PutTools(p.autoKey, autoRecord{Path: path, At: time.Now().UTC()}); rerr != nil {
			return "", fmt.Errorf("record the %s that \"auto\" found: %w", p.name, rerr)
		}
	}
	return path, err
}

// recordedAuto is the binary "auto" was resolved to ("" for none found),
// if that is recorded and, for a binary, it is still a regular file.
func recordedAuto(m *lifecycle.Manager, p program) (string, bool) {
	var rec autoRecord
	if !m.Store.GetTools(p.autoKey, &rec) {
		return "", false
	}
	if rec.Path == "" {
		return "", true
	}
	if !filepath.IsAbs(rec.Path) {
		return "", false
	}
	st, err := os.Stat(rec.Path)
	if err != nil || !st.Mode().IsRegular() {
		return "", false
	}
	return rec.Path, true
}

// knownSource is the binary of p on the current tools disk for a process
// that must not resolve "auto" itself (VolumeNow, Sweep): the recorded one
// ("" for none); false when "auto" was never resolved.
func knownSource(m *lifecycle.Manager, p program) (string, bool, error) {
	if !isAuto(m.Cfg, p) || p.installed {
		path, err := toolsSource(m.Cfg, p)
		if errors.Is(err, errNoProgram) {
			return "", true, nil
		}
		return path, err == nil, err
	}
	path, ok := recordedAuto(m, p)
	return path, ok, nil
}

func isAuto(cfg *config.Config, p program) bool {
	v := p.setting(&cfg.GuestTools)
	return v == config.GuestToolsAuto || v == ""
}

// toolsSource is the host binary p's setting names ("auto": found on this
// process's PATH), or errNoProgram.
func toolsSource(cfg *config.Config, p program) (string, error) {
	switch v := p.setting(&cfg.GuestTools); v {
	case config.GuestToolsNone:
		return "", &noProgram{fmt.Sprintf("no %s for the guests: %s = \"none\"", p.name, p.key)}
	case config.GuestToolsAuto, "":
		if p.installed {
			return installedAgent()
		}
		path, err := exec.LookPath(p.name)
		if err != nil {
			return "", &noProgram{fmt.Sprintf("no %s on this host's PATH (%s = \"auto\")", p.name, p.key)}
		}
		return filepath.Abs(path)
	default:
		return v, nil
	}
}

// GuestToolsSource is the host binary guest_tools.gitlab_runner gives the
// guests, checked to be a linux/amd64 executable this user can read; an
// error matching ErrNoTools when the configuration or the host gives none.
func GuestToolsSource(cfg *config.Config) (string, error) {
	return guestSource(cfg, programs[0])
}

// GuestStepRunnerSource is GuestToolsSource for guest_tools.step_runner;
// an error matching ErrNoTools when the configuration or the host gives
// none.
func GuestStepRunnerSource(cfg *config.Config) (string, error) {
	return guestSource(cfg, programs[1])
}

// GuestAgentSource is GuestToolsSource for guest_tools.agent; an error
// matching ErrNoTools when the configuration or the installation gives
// none.
func GuestAgentSource(cfg *config.Config) (string, error) {
	return guestSource(cfg, programs[2])
}

func guestSource(cfg *config.Config, p program) (string, error) {
	src, err := toolsSource(cfg, p)
	if errors.Is(err, errNoProgram) {
		return "", &noToolsError{notes: []string{err.Error()}}
	}
	if err != nil {
		return "", err
	}
	if err := checkGuestBinary(src, p.name); err != nil {
		return "", fmt.Errorf("%s %s: %w", p.key, src, err)
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

// Get returns the tools disk for this host's gitlab-runner and
// step-runner, building it (once per set of binaries, under a lock) when
// there is none yet. It returns ErrNoTools (wrapped, saying why) when the
// configuration or the host gives neither, and other errors when a binary
// the admin named is unusable or the volume cannot be made. A binary
// "auto" found that cannot go to a guest is left out with a warning in
// Notes.
func Get(ctx context.Context, m *lifecycle.Manager) (*Tools, error) {
	t := &Tools{}
	var have []origin
	for _, p := range programs {
		src, err := source(m, p)
		if errors.Is(err, errNoProgram) {
			// step-runner matters to run: jobs only: prepare says what is
			// missing for those (a note on every job would be noise). An
			// agent the admin turned off needs no note either.
			if p.name != "step-runner" && (!p.installed || isAuto(m.Cfg, p)) {
				t.Notes = append(t.Notes, fmt.Sprintf("Note: %v: %s", err, p.missing))
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		sum, err := sourceHash(m, p, src)
		switch {
		case err != nil && isAuto(m.Cfg, p) && ctx.Err() == nil:
			where := "found on this host's PATH"
			if p.installed {
				where = "installed with these executables"
			}
			t.Notes = append(t.Notes, fmt.Sprintf("Warning: the %s %s cannot go to the guest: %v", p.name, where, err))
			continue
		case err != nil:
			return nil, fmt.Errorf("%s %s: %w", p.key, src, err)
		}
		have = append(have, origin{program: p, Source: src, SHA256: sum})
	}
	if len(have) == 0 {
		return nil, &noToolsError{notes: t.Notes}
	}
	rec0 := recordOf(m, have)
	t.Volume, t.Source, t.SHA256, t.StepRunner, t.Agent = rec0.Volume, rec0.Source, rec0.SHA256, rec0.StepRunner, rec0.Agent
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
	built, err := build(ctx, m, t, have)
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
func build(ctx context.Context, m *lifecycle.Manager, t *Tools, have []origin) (bool, error) {
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
	man := guestinit.ToolsManifest{Programs: map[string]guestinit.ToolOrigin{}}
	files := map[string]string{}
	for _, o := range have {
		st, err := os.Stat(o.Source)
		if err != nil {
			return false, err
		}
		man.Programs[o.name] = guestinit.ToolOrigin{Source: o.Source, SHA256: o.SHA256, Size: st.Size()}
		files[o.name] = o.Source
	}
	if err := guestinit.ToolsISO(iso, files, man, work); err != nil {
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
func sourceHash(m *lifecycle.Manager, p program, path string) (string, error) {
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
	if m.Store.Recall(p.hashKey, &cached) && cached.SHA256 != "" {
		sum := cached.SHA256
		cached.SHA256 = ""
		if cached == cur {
			return sum, nil
		}
	}
	if err := checkGuestBinary(path, p.name); err != nil {
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
	_ = m.Store.Remember(p.hashKey, cur) // a cache: the next job hashes again without it
	return cur.SHA256, nil
}

// checkGuestBinary refuses what cannot run in an x86_64 Linux guest.
func checkGuestBinary(path, name string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("not an ELF executable (%v); want a linux/amd64 %s binary", err, name)
	}
	defer func() { _ = f.Close() }()
	if f.Machine != elf.EM_X86_64 || f.Class != elf.ELFCLASS64 {
		return fmt.Errorf("built for %s, not x86_64; want a linux/amd64 %s binary", f.Machine, name)
	}
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("ELF type %s is not an executable", f.Type)
	}
	if name == agentName {
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				return fmt.Errorf("dynamically linked: the guest agent must be static to run on any guest (make build builds it with CGO_ENABLED=0)")
			}
		}
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
	for _, p := range programs {
		if _, known, _ := knownSource(m, p); !known && isAuto(m.Cfg, p) {
			// "auto" was never resolved by a process that builds the disk:
			// which volume is current is unknown here (this process's PATH
			// does not decide it), so none is removed.
			return nil
		}
	}
	vols, err := m.Volumes().List(ctx)
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
	unadmit, err := m.Capacity().Hold(ctx)
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
		if m.Machine(n).IsSnapshotTemplate() {
			continue // no tools disk (a clone gets the tools of its own prepare)
		}
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
