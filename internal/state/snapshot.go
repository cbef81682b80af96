package state

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

// SnapshotsDir holds one record per image that has a memory snapshot
// (issue #48, docs/pool.md): which template machine holds it and what it
// was made of.
const SnapshotsDir = "snapshots"

// Snapshot is the record of an image's memory snapshot: the template
// machine whose frozen disk and save volume clones restore from, and the
// inputs it was made from (a clone is restored only when they are still
// what the job's machine would be made of).
type Snapshot struct {
	Image string `json:"image"`
	// Template is the template machine's name (its state directory, disk
	// and save volume).
	Template string `json:"template"`
	// Fingerprint is the inputs' digest (lifecycle's snapshot fingerprint).
	Fingerprint string    `json:"fingerprint"`
	DomainType  string    `json:"domain_type"`
	VCPUs       int       `json:"vcpus"`
	MemoryMiB   int       `json:"memory_mib"`
	DiskBytes   uint64    `json:"disk_bytes"`
	DiskPath    string    `json:"disk_path,omitempty"`
	Started     time.Time `json:"started"`
	// Saved is when the template was saved; zero while it is being built.
	Saved time.Time `json:"saved,omitzero"`
	// SaveBytes is the save volume's size, DiskUsed the frozen overlay's
	// (what the snapshot holds of the host's disk).
	SaveBytes uint64 `json:"save_bytes,omitempty"`
}

// Ready reports whether the snapshot was saved.
func (s Snapshot) Ready() bool { return !s.Saved.IsZero() }

// snapshotImage is the shape of an image name a record is kept under (the
// configuration's image names are checked before; this keeps the path
// safe whatever calls it).
var snapshotImage = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

func (s Store) snapshotPath(image string) (string, error) {
	if !snapshotImage.MatchString(image) {
		return "", fmt.Errorf("snapshot record of image %q: not an image name (letters, digits, '.', '_', '-', 1-64)", image)
	}
	return filepath.Join(s.Dir, SnapshotsDir, image+".json"), nil
}

// PutSnapshot writes the image's snapshot record (atomically, durably).
func (s Store) PutSnapshot(sn Snapshot) error {
	p, err := s.snapshotPath(sn.Image)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	b, err := json.Marshal(sn)
	if err != nil {
		return err
	}
	return WriteFileDurable(p, b)
}

// SnapshotOf returns the image's snapshot record; nil and no error when it
// has none.
func (s Store) SnapshotOf(image string) (*Snapshot, error) {
	p, err := s.snapshotPath(image)
	if err != nil {
		return nil, err
	}
	var sn Snapshot
	if err := readRecord(p, &sn); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, err
	}
	return &sn, nil
}

// Snapshots returns every snapshot record (an unreadable one is skipped).
func (s Store) Snapshots() ([]Snapshot, error) {
	images, err := s.namesIn(SnapshotsDir, ".json")
	if err != nil {
		return nil, err
	}
	var out []Snapshot
	for _, im := range images {
		if sn, err := s.SnapshotOf(im); err == nil && sn != nil {
			out = append(out, *sn)
		}
	}
	return out, nil
}

// ForgetSnapshot removes the image's snapshot record if it still names
// template ("" for whichever it names).
func (s Store) ForgetSnapshot(image, template string) error {
	p, err := s.snapshotPath(image)
	if err != nil {
		return err
	}
	if template != "" {
		sn, err := s.SnapshotOf(image)
		if err != nil || sn == nil || sn.Template != template {
			return err
		}
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// MarkSaved records that the machine holds none of the host's vCPUs and
// memory any more (a saved snapshot template: its state is on disk), so
// that admission does not count it.
func (s Store) MarkSaved(name string) error {
	b, err := json.Marshal(Reservation{Saved: true})
	if err != nil {
		return err
	}
	return WriteFileAtomic(filepath.Join(s.MachineDir(name), reservationFile), b)
}
