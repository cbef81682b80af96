// Package state keeps the driver's files on the host: the installation's
// controller identity and, per machine, a 0700 directory with the pinned host
// key, the address and the 0600 client key that later stages need, its
// capacity reservation, standby claim and ended mark; the job -> machine
// mappings, the tools records, small remembered answers, and the locks
// (one per machine, re-checked by inode). A machine's directory is removed
// at cleanup. Every record is read by one reader (readRecord).
package state

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"
)

// Store is rooted at the configured state_dir.
type Store struct {
	Dir string
}

// Machine is what prepare learned and run needs.
type Machine struct {
	Name      string    `json:"name"`
	Image     string    `json:"image"`
	Address   string    `json:"address"`
	Port      int       `json:"port"`
	User      string    `json:"user"`
	Shell     string    `json:"shell"`
	HostKey   string    `json:"host_key"`
	MAC       string    `json:"mac"`
	Created   time.Time `json:"created"`
	BuildsDir string    `json:"builds_dir"`
	CacheDir  string    `json:"cache_dir"`
	// Standby is set on a machine booted for a standby pool: it waits,
	// idle, for a job to claim it.
	Standby *Standby `json:"standby,omitempty"`
	// Tools is the guest tools disk the machine was booted with; nil for
	// none.
	Tools *Tools `json:"tools,omitempty"`
	// Container is the container a container job's scripts run in
	// (#46 item 2). The job's mapping (JobMachine.Container) is where this
	// version reads it; it is written here too, for a run stage of the
	// previous version (which reads only this), and read here for a job
	// that version prepared (an upgrade between its stages).
	Container string `json:"container,omitempty"`
}

// Tools is a machine's guest tools disk: its volume and the host binary
// it carries.
type Tools struct {
	Volume string `json:"volume"`
	// Source and SHA256 are the gitlab-runner's ("" when the disk has none).
	Source string `json:"source"`
	SHA256 string `json:"sha256"`
	// StepRunner is the step-runner's (nil when the disk has none).
	StepRunner *ToolOrigin `json:"step_runner,omitempty"`
	// Agent is the guest agent's (lve-agent; nil when the disk has none):
	// the job's connection holder runs the stages through it.
	Agent *ToolOrigin `json:"agent,omitempty"`
}

// ToolOrigin is where a program of the tools disk came from on the host.
type ToolOrigin struct {
	Source string `json:"source"`
	SHA256 string `json:"sha256"`
}

const (
	machineFile = "machine.json"
	keyFile     = "id_ed25519"
	ctrlFile    = "controller-id"
)

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// ControllerID returns this installation's identity, creating it on first
// use. Concurrent first calls agree on one value. It refuses (CheckOwner:
// an *OwnerError) before it creates anything when the state directory
// belongs to another user: every opener calls it first.
func (s Store) ControllerID() (string, error) {
	if err := s.CheckOwner(); err != nil {
		return "", err
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return "", fmt.Errorf("state dir: %w", err)
	}
	path := filepath.Join(s.Dir, ctrlFile)
	if id, err := readID(path); err == nil {
		return id, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	id, err := newUUID()
	if err != nil {
		return "", err
	}
	tmp, err := os.CreateTemp(s.Dir, ".controller-id-*")
	if err != nil {
		return "", err
	}
	defer func() { _ = os.Remove(tmp.Name()) }() // gone already once linked
	if _, err := tmp.WriteString(id + "\n"); err != nil {
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	// Link fails if another process won the race; then use its value.
	if err := os.Link(tmp.Name(), path); err != nil && !errors.Is(err, os.ErrExist) {
		return "", err
	}
	return readID(path)
}

func readID(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	id := strings.TrimSpace(string(b))
	if !uuidRE.MatchString(id) {
		return "", fmt.Errorf("%s holds %q, not a controller id; remove it only if no VMs of this installation exist", path, id)
	}
	return id, nil
}

func newUUID() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// MachineDir is the private directory of one machine.
func (s Store) MachineDir(name string) string { return filepath.Join(s.Dir, "machines", name) }

// Has reports whether the machine has a state directory. Prepare makes it
// first, before any volume, and teardown removes it last: it is this
// installation's record that the machine's volumes are its own.
func (s Store) Has(name string) (bool, error) {
	st, err := os.Stat(s.MachineDir(name))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return st.IsDir(), nil
}

// Create makes the machine's private directory (0700), failing if it exists.
func (s Store) Create(name string) (string, error) {
	parent := filepath.Join(s.Dir, "machines")
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return "", err
	}
	dir := s.MachineDir(name)
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", fmt.Errorf("machine state: %w", err)
	}
	return dir, nil
}

// SaveKey writes the client key (0600).
func (s Store) SaveKey(name string, pem []byte) error {
	return WriteFileAtomic(filepath.Join(s.MachineDir(name), keyFile), pem)
}

// Save writes the machine record (0600).
func (s Store) Save(m Machine) error {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return WriteFileAtomic(filepath.Join(s.MachineDir(m.Name), machineFile), b)
}

// ErrNoMachine means no prepared machine is recorded under that name.
var ErrNoMachine = errors.New("no prepared machine recorded")

// Load reads the machine record, the client key and the pinned host key.
func (s Store) Load(name string) (*Machine, ssh.Signer, ssh.PublicKey, error) {
	m, err := s.Record(name)
	if err != nil {
		return nil, nil, nil, err
	}
	pem, err := os.ReadFile(filepath.Join(s.MachineDir(name), keyFile))
	if err != nil {
		return nil, nil, nil, err
	}
	signer, err := ssh.ParsePrivateKey(pem)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("client key: %w", err)
	}
	var hostKey ssh.PublicKey
	if m.HostKey != "" {
		if hostKey, _, _, _, err = ssh.ParseAuthorizedKey([]byte(m.HostKey)); err != nil {
			return nil, nil, nil, fmt.Errorf("pinned host key: %w", err)
		}
	}
	return m, signer, hostKey, nil
}

// Remove deletes the machine's directory; a missing one is success.
func (s Store) Remove(name string) error {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return fmt.Errorf("refusing to remove state for %q", name)
	}
	return os.RemoveAll(s.MachineDir(name))
}

// Names lists the machines that have state directories.
func (s Store) Names() ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(s.Dir, "machines"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// WriteFileAtomic replaces the file at path with data (mode 0600) by a
// rename, so that a reader sees the old content or the new, never a part.
func WriteFileAtomic(path string, data []byte) error { return writeFile(path, data, false, 0o600) }

// WriteFileDurable is WriteFileAtomic that also survives a power loss: the
// data and the rename reach the disk before it returns.
func WriteFileDurable(path string, data []byte) error { return writeFile(path, data, true, 0o600) }

// WriteFileDurableMode is WriteFileDurable with the file's mode (set
// whatever the umask): for a file others must read.
func WriteFileDurableMode(path string, data []byte, mode os.FileMode) error {
	return writeFile(path, data, true, mode)
}

func writeFile(path string, data []byte, durable bool, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(tmp.Name()) }() // gone already once renamed
	if err := tmp.Chmod(mode); err != nil {
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if durable {
		if err := tmp.Sync(); err != nil {
			tmp.Close()
			return err
		}
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil || !durable {
		return err
	}
	return SyncDir(filepath.Dir(path))
}

// SyncDir flushes a directory's entries (a rename into it) to disk.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Due reports whether at least every has passed since the last time Due
// returned true for key, and records now if so. Concurrent callers race
// harmlessly: at worst two of them both do the work.
func (s Store) Due(key string, every time.Duration) bool {
	if age, ok := s.Age(key); ok && age < every {
		return false
	}
	return s.Touch(key) == nil
}

// Reservation is what a machine holds of the host's capacity. It is written
// when the machine's directory is created, before anything else exists.
type Reservation struct {
	VCPUs     int `json:"vcpus"`
	MemoryMiB int `json:"memory_mib"`
	// Saved: the machine is a saved snapshot template, which holds disk
	// only (MarkSaved); admission does not count it.
	Saved bool `json:"saved,omitempty"`
}

const reservationFile = "reservation.json"

// Reserve creates the machine's directory (like Create) and records what it
// holds.
func (s Store) Reserve(name string, r Reservation) (string, error) {
	dir, err := s.Create(name)
	if err != nil {
		return "", err
	}
	b, err := json.Marshal(r)
	if err != nil {
		return "", err
	}
	if err := WriteFileAtomic(filepath.Join(dir, reservationFile), b); err != nil {
		_ = s.Remove(name)
		return "", err
	}
	return dir, nil
}

// Reservations returns the reservation of every machine directory but the
// saved snapshot templates'. A directory without one (older, or broken)
// counts with def.
func (s Store) Reservations(def Reservation) (map[string]Reservation, error) {
	names, err := s.Names()
	if err != nil {
		return nil, err
	}
	out := make(map[string]Reservation, len(names))
	for _, n := range names {
		r := def
		// Whatever went wrong (none, unreadable, a field of the wrong type),
		// r keeps def where the file did not say otherwise.
		_ = readRecord(filepath.Join(s.MachineDir(n), reservationFile), &r)
		if r.Saved {
			continue
		}
		out[n] = r
	}
	return out, nil
}

// Remember stores v as JSON under the store's cache directory, for facts
// that hold across jobs (such as what an image contains): safe to delete.
// Names are chosen by the caller from configuration, never from job input.
func (s Store) Remember(name string, v any) error { return s.writeJSON("cache", name, v) }

// Recall reads what Remember stored under name into v; false if there is
// nothing (or nothing readable).
func (s Store) Recall(name string, v any) bool { return s.readJSON("cache", name, v) }

// ToolsDir holds the records of the guest tools volumes (PutTools): not a
// cache, a record of what this installation made.
const ToolsDir = "tools"

// PutTools stores the record of a guest tools volume (by its name).
func (s Store) PutTools(volume string, v any) error { return s.writeJSON(ToolsDir, volume, v) }

// GetTools reads the record of a guest tools volume into v; false if there
// is none.
func (s Store) GetTools(volume string, v any) bool { return s.readJSON(ToolsDir, volume, v) }

// DropTools removes the record of a guest tools volume.
func (s Store) DropTools(volume string) error {
	err := os.Remove(filepath.Join(s.Dir, ToolsDir, volume+".json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

func (s Store) writeJSON(sub, name string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	dir := filepath.Join(s.Dir, sub)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return WriteFileAtomic(filepath.Join(dir, name+".json"), b)
}

func (s Store) readJSON(sub, name string, v any) bool {
	return readRecord(filepath.Join(s.Dir, sub, name+".json"), v) == nil
}

// errBadRecord means a record file was read but is not the JSON it should
// be (cut short by a crash, or written by hand).
var errBadRecord = errors.New("unreadable record")

// readRecord reads the JSON record at path into v. Every error names the
// file: one that wraps os.ErrNotExist when there is no such file,
// errBadRecord when its content does not decode into v (v may then hold
// part of it, as json.Unmarshal leaves it), else the read's own error.
func readRecord(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err // an *fs.PathError: it names path
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w: %w", path, errBadRecord, err)
	}
	return nil
}

// reapFile marks a machine whose job has ended: the machine is stopped and
// waits to be removed (by its reaper, or else by a sweep).
const reapFile = "ended.json"

// Ended is the mark of a machine whose job has ended.
type Ended struct {
	At     time.Time `json:"at"`
	Reason string    `json:"reason"`
}

// MarkEnded marks the machine as ended and deletes its client key: nothing
// of the job may connect to it any more. The record stays, as proof that
// what is left of the machine is this installation's.
func (s Store) MarkEnded(name string, e Ended) error {
	b, err := json.Marshal(e)
	if err != nil {
		return err
	}
	if err := WriteFileAtomic(filepath.Join(s.MachineDir(name), reapFile), b); err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(s.MachineDir(name), keyFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// EndedOf returns the machine's ended mark, or nil if it has none.
func (s Store) EndedOf(name string) (*Ended, error) {
	var e Ended
	err := readRecord(filepath.Join(s.MachineDir(name), reapFile), &e)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, nil
	case errors.Is(err, errBadRecord):
		// Cut short by a crash: the mark was being made, so it stands.
		return &Ended{Reason: "ended (unreadable mark)"}, nil
	case err != nil:
		return nil, err
	}
	return &e, nil
}
