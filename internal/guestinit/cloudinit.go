package guestinit

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	diskfs "github.com/diskfs/go-diskfs"
	"github.com/diskfs/go-diskfs/disk"
	"github.com/diskfs/go-diskfs/filesystem"
	"github.com/diskfs/go-diskfs/filesystem/iso9660"
)

// CloudInit describes a NoCloud seed.
type CloudInit struct {
	// InstanceID changes per job so cloud-init runs its per-instance modules.
	InstanceID string
	// Hostname of the guest.
	Hostname string
	// User receives the authorized key.
	User string
	// ExtraKeys are more authorized keys for User (a front end's own).
	ExtraKeys []string
	// Files are written before RunCmd runs (cloud-init write_files).
	Files []File
	// BootCmd are commands cloud-init runs early in every boot (its "init"
	// stage, before Files are written), each an argument vector (never a
	// shell string).
	BootCmd [][]string
	// Extra are files on the seed's own filesystem beside user-data and
	// meta-data (Path is the name at its root, Permissions unused):
	// cloud-init neither reads nor copies them, only a program in the guest
	// that reads the seed device itself does (garm's bootstrap: its
	// parameters, which thus never reach the guest's disk).
	Extra []File
}

// WritableSeedSerial is the serial of a seed attached writable
// (vm.Spec.SeedWritable): the guest finds the disk it may wipe by it.
const WritableSeedSerial = "lve-seed-rw"

// File is one file of the seed's write_files; Content travels base64
// encoded (no YAML quoting question).
type File struct {
	Path        string
	Content     []byte
	Permissions string // e.g. "0600"
}

// UserData renders #cloud-config. JSON is valid YAML, so every value is
// encoded by encoding/json: nothing is pasted into YAML text.
func (c CloudInit) UserData(k *Keys, comment string) ([]byte, error) {
	type user struct {
		Name              string   `json:"name"`
		Sudo              string   `json:"sudo,omitempty"`
		Shell             string   `json:"shell"`
		SSHAuthorizedKeys []string `json:"ssh_authorized_keys"`
		LockPasswd        bool     `json:"lock_passwd"`
	}
	u := user{Name: c.User, Shell: "/bin/bash", SSHAuthorizedKeys: append([]string{k.AuthorizedKey(comment)}, c.ExtraKeys...), LockPasswd: true}
	if c.User != "root" {
		u.Sudo = "ALL=(ALL) NOPASSWD:ALL"
	}
	// ssh_keys makes cloud-init's ssh module install this pair and generate
	// no host key of its own (it reads ssh_genkeytypes only without
	// ssh_keys); ssh_deletekeys removes the image's keys first. No
	// "ssh_genkeytypes: []": cloud-init's schema requires at least one item
	// and reports the whole user-data as invalid.
	// No "ssh_pwauth": its set-passwords module runs in the config stage,
	// after sshd has started, and restarts sshd when it changes the setting
	// (on every fresh clone of a stock image): a stage connecting during that
	// restart fails. The job user has no password (lock_passwd); password
	// logins are the image's setting.
	doc := map[string]any{
		"users":          []any{u},
		"disable_root":   c.User != "root",
		"ssh_deletekeys": true,
		"ssh_keys": map[string]string{
			"ed25519_private": string(k.HostPEM),
			"ed25519_public":  k.HostPublicLine(),
		},
	}
	if len(c.Files) > 0 {
		var files []map[string]string
		for _, f := range c.Files {
			files = append(files, map[string]string{
				"path": f.Path, "encoding": "b64", "content": base64.StdEncoding.EncodeToString(f.Content),
				"permissions": f.Permissions, "owner": "root:root",
			})
		}
		doc["write_files"] = files
	}
	if len(c.BootCmd) > 0 {
		doc["bootcmd"] = c.BootCmd
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return nil, err
	}
	return append([]byte("#cloud-config\n"), b...), nil
}

// MetaData renders meta-data.
func (c CloudInit) MetaData() ([]byte, error) {
	return json.Marshal(map[string]string{"instance-id": c.InstanceID, "local-hostname": c.Hostname})
}

// SeedISO builds the NoCloud seed: an ISO 9660 image with Rock Ridge names,
// volume label "cidata", holding user-data and meta-data. workDir must be a
// private directory; the staging files are removed before returning.
func (c CloudInit) SeedISO(k *Keys, comment, workDir string) ([]byte, error) {
	ud, err := c.UserData(k, comment)
	if err != nil {
		return nil, err
	}
	md, err := c.MetaData()
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(workDir, "seed-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(tmp) }() // best effort: a private temp dir
	img := filepath.Join(tmp, "seed.iso")
	d, err := diskfs.Create(img, 1<<20, diskfs.SectorSizeDefault)
	if err != nil {
		return nil, fmt.Errorf("seed image: %w", err)
	}
	d.LogicalBlocksize = 2048
	stage := filepath.Join(tmp, "stage")
	if err := os.Mkdir(stage, 0o700); err != nil {
		return nil, err
	}
	fs, err := d.CreateFilesystem(disk.FilesystemSpec{Partition: 0, FSType: filesystem.TypeISO9660, VolumeLabel: "cidata", WorkDir: stage})
	if err != nil {
		return nil, fmt.Errorf("seed filesystem: %w", err)
	}
	files := []File{{Path: "/user-data", Content: ud}, {Path: "/meta-data", Content: md}}
	for _, e := range c.Extra {
		if n := strings.TrimPrefix(e.Path, "/"); n == "" || strings.Contains(n, "/") || n == "user-data" || n == "meta-data" {
			return nil, fmt.Errorf("seed file %q: a name at the seed's root, not user-data or meta-data", e.Path)
		}
		files = append(files, File{Path: "/" + strings.TrimPrefix(e.Path, "/"), Content: e.Content})
	}
	for _, file := range files {
		name, data := file.Path, file.Content
		f, err := fs.OpenFile(name, os.O_CREATE|os.O_RDWR)
		if err != nil {
			return nil, err
		}
		if _, err := f.Write(data); err != nil {
			return nil, err
		}
		if err := f.Close(); err != nil {
			return nil, err
		}
	}
	iso, ok := fs.(*iso9660.FileSystem)
	if !ok {
		return nil, fmt.Errorf("seed filesystem is %T, not ISO 9660", fs)
	}
	if err := iso.Finalize(iso9660.FinalizeOptions{RockRidge: true, VolumeIdentifier: "cidata"}); err != nil {
		return nil, fmt.Errorf("seed finalize: %w", err)
	}
	return os.ReadFile(img)
}
