package state

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Standby describes a machine booted ahead of any job for an image's
// standby pool: what a job must match to be given it.
type Standby struct {
	// Image is the configured image name.
	Image string `json:"image"`
	// VCPUs, MemoryMiB and DiskGiB are its size.
	VCPUs     int `json:"vcpus"`
	MemoryMiB int `json:"memory_mib"`
	DiskGiB   int `json:"disk_gib"`
	// Base identifies the base image file the machine was cloned from: a
	// job is never given a machine of an older file.
	Base FileVersion `json:"base"`
	// Spec fingerprints the rest of the configuration the machine was
	// built from, and the driver's version (lifecycle.SpecFingerprint).
	Spec string `json:"spec"`
}

// FileVersion identifies one version of a file: path, size and
// modification time.
type FileVersion struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	ModTime int64  `json:"mtime_ns"`
}

// VersionOf returns the version of the file at path now.
func VersionOf(path string) (FileVersion, error) {
	st, err := os.Stat(path)
	if err != nil {
		return FileVersion{}, err
	}
	return FileVersion{Path: path, Size: st.Size(), ModTime: st.ModTime().UnixNano()}, nil
}

// Claim says who took a standby machine. Its file is created exclusively:
// the first claim wins, and a claimed machine is never given to anyone else.
type Claim struct {
	// Job is the name the claiming job knows its machine by (its job
	// mapping's key); empty when the pool service retired the machine.
	Job string `json:"job,omitempty"`
	// Retire says the machine is to be removed unused (it was found dead,
	// too old, of an old base image, or its room is needed for a job).
	Retire bool `json:"retire,omitempty"`
	// Reason says why, for people.
	Reason string    `json:"reason,omitempty"`
	At     time.Time `json:"at"`
}

const claimFile = "claim.json"

// ErrClaimed means the standby machine has been claimed already.
var ErrClaimed = errors.New("already claimed")

// Claim records c on the machine, failing with ErrClaimed if a claim
// exists. Callers hold the machine's lock; the exclusive create makes the
// first claim win even so.
func (s Store) Claim(name string, c Claim) error {
	b, err := json.Marshal(c)
	if err != nil {
		return err
	}
	path := filepath.Join(s.MachineDir(name), claimFile)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if errors.Is(err, os.ErrExist) {
		return fmt.Errorf("%s: %w", name, ErrClaimed)
	}
	if err != nil {
		return err
	}
	_, werr := f.Write(b)
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		_ = os.Remove(path)
	}
	return werr
}

// ClaimOf returns the machine's claim, or nil if it has none. A claim file
// that cannot be read counts as a claim (by nobody known): the machine is
// never handed out again.
func (s Store) ClaimOf(name string) (*Claim, error) {
	var c Claim
	err := readRecord(filepath.Join(s.MachineDir(name), claimFile), &c)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, nil
	case errors.Is(err, errBadRecord):
		return &Claim{Retire: true, Reason: "unreadable claim record"}, nil
	case err != nil:
		return nil, err
	}
	return &c, nil
}

// Record reads only the machine record (no keys); ErrNoMachine if there is
// none yet (a machine still booting).
func (s Store) Record(name string) (*Machine, error) {
	var m Machine
	err := readRecord(filepath.Join(s.MachineDir(name), machineFile), &m)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w for %s in %s", ErrNoMachine, name, s.MachineDir(name))
	}
	if err != nil {
		return nil, err
	}
	return &m, nil
}

// JobMachine is a job's entry in the job -> machine mapping.
type JobMachine struct {
	// Machine is the name of the job's machine.
	Machine string `json:"machine"`
	// Warm says it came from a standby pool.
	Warm bool      `json:"warm"`
	At   time.Time `json:"at"`
	// Container is the container the job's scripts run in (a container
	// job's, #46), named by prepare when it acquires the machine; "" for
	// a job whose scripts run in the VM itself.
	Container string `json:"container,omitempty"`
}

func (s Store) jobPath(job string) (string, error) {
	if job == "" || strings.ContainsAny(job, "/\x00") || job == "." || job == ".." {
		return "", fmt.Errorf("refusing job mapping for %q", job)
	}
	return filepath.Join(s.Dir, "jobs", job+".json"), nil
}

// MapJob records which machine serves the job (0600, atomically).
func (s Store) MapJob(job string, jm JobMachine) error {
	path, err := s.jobPath(job)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	b, err := json.Marshal(jm)
	if err != nil {
		return err
	}
	return WriteFileAtomic(path, b)
}

// MachineOfJob returns the job's mapping entry, or nil when it has none
// (a job prepared cold by an older version: its machine has its name).
func (s Store) MachineOfJob(job string) (*JobMachine, error) {
	path, err := s.jobPath(job)
	if err != nil {
		return nil, err
	}
	var jm JobMachine
	err = readRecord(path, &jm)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &jm, nil
}

// UnmapJob removes the job's mapping entry; a missing one is success.
func (s Store) UnmapJob(job string) error {
	path, err := s.jobPath(job)
	if err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// MappedJobs lists the jobs that have mapping entries.
func (s Store) MappedJobs() ([]string, error) { return s.namesIn("jobs", ".json") }

// Touch sets the modification time of the store's file key to now
// (creating it); Age tells how long ago that was.
func (s Store) Touch(key string) error {
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return err
	}
	path := filepath.Join(s.Dir, key)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	f.Close()
	now := time.Now()
	return os.Chtimes(path, now, now)
}

// Age is how long ago key was last touched; false if never.
func (s Store) Age(key string) (time.Duration, bool) {
	st, err := os.Stat(filepath.Join(s.Dir, key))
	if err != nil {
		return 0, false
	}
	return time.Since(st.ModTime()), true
}

// demandDir holds one empty file per job that asked a standby pool for a
// machine: the pool service counts them as demand and removes them.
const demandDir = "pool-demand"

// NoteDemand records that a job asked image's pool for a machine now. The
// image name comes from the configuration (an allowlisted name), never
// from the job.
func (s Store) NoteDemand(image string) error {
	if image == "" || strings.ContainsAny(image, "/\x00") || strings.HasPrefix(image, ".") {
		return fmt.Errorf("refusing demand record for %q", image)
	}
	dir := filepath.Join(s.Dir, demandDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, image+".*")
	if err != nil {
		return err
	}
	return f.Close()
}

// Demand is one recorded ask of a pool.
type Demand struct {
	Image string
	At    time.Time
}

// TakeDemand returns the recorded asks and removes their files.
func (s Store) TakeDemand() ([]Demand, error) {
	dir := filepath.Join(s.Dir, demandDir)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []Demand
	for _, e := range entries {
		// image.<random>: image names may hold dots themselves.
		i := strings.LastIndex(e.Name(), ".")
		image, ok := e.Name()[:max(i, 0)], i > 0
		info, ierr := e.Info()
		if ok && ierr == nil {
			out = append(out, Demand{Image: image, At: info.ModTime()})
		}
		_ = os.Remove(filepath.Join(dir, e.Name()))
	}
	return out, nil
}
