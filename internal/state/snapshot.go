package state

import (
	"context"
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
	// SaveBytes is the save volume's size (what the snapshot holds of the
	// host's disk, with the frozen overlay's allocation).
	SaveBytes uint64 `json:"save_bytes,omitempty"`
	// Inputs are what it was made from, by name (lifecycle's
	// SnapshotInputs; Fingerprint is their digest).
	Inputs map[string]string `json:"inputs,omitempty"`
	// Previous is the template of the snapshot this one replaced.
	Previous string `json:"previous,omitempty"`
	// Failures counts the restores in a row that failed for the
	// snapshot's own sake (its file, libvirt refusing it); at
	// MaxSnapshotFailures it is no longer used.
	Failures int `json:"failures,omitempty"`
}

// MaxSnapshotFailures is how many restores in a row may fail for a
// snapshot's own sake before it is no longer used (and the pool service
// makes a new one).
const MaxSnapshotFailures = 3

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

// PutSnapshot writes the image's snapshot record (atomically, durably),
// under the record's lock.
func (s Store) PutSnapshot(ctx context.Context, sn Snapshot) error {
	unlock, err := s.lockSnapshot(ctx, sn.Image)
	if err != nil {
		return err
	}
	defer unlock()
	return s.putSnapshot(sn)
}

// lockSnapshot takes the lock of image's record ('_': no machine's).
func (s Store) lockSnapshot(ctx context.Context, image string) (func(), error) {
	if !snapshotImage.MatchString(image) {
		return nil, fmt.Errorf("snapshot record of image %q: not an image name (letters, digits, '.', '_', '-', 1-64)", image)
	}
	return s.Lock(ctx, "_snaprec-"+image)
}

func (s Store) putSnapshot(sn Snapshot) error {
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

// Snapshots returns every snapshot record; with an error, those it could
// read (a record cut short by a crash is an error: whoever removes what
// the records name must not take it for none).
func (s Store) Snapshots() ([]Snapshot, error) {
	images, err := s.namesIn(SnapshotsDir, ".json")
	if err != nil {
		return nil, err
	}
	var out []Snapshot
	var errs []error
	for _, im := range images {
		sn, err := s.SnapshotOf(im)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if sn != nil {
			out = append(out, *sn)
		}
	}
	return out, errors.Join(errs...)
}

// NoteSnapshotRestore counts a restore from template's snapshot of image:
// failed (for the snapshot's own sake) adds one to its failures in a row,
// a success clears them. A record that names another template is left
// alone.
func (s Store) NoteSnapshotRestore(ctx context.Context, image, template string, failed bool) error {
	unlock, err := s.lockSnapshot(ctx, image)
	if err != nil {
		return err
	}
	defer unlock()
	sn, err := s.SnapshotOf(image)
	if err != nil || sn == nil || sn.Template != template {
		return err
	}
	switch {
	case failed:
		sn.Failures++
	case sn.Failures == 0:
		return nil
	default:
		sn.Failures = 0
	}
	return s.putSnapshot(*sn)
}

// ForgetSnapshot removes the image's snapshot record if it still names
// template ("" for whichever it names).
func (s Store) ForgetSnapshot(ctx context.Context, image, template string) error {
	p, err := s.snapshotPath(image)
	if err != nil {
		return err
	}
	unlock, err := s.lockSnapshot(ctx, image)
	if err != nil {
		return err
	}
	defer unlock()
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
