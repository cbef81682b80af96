package guestinit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	diskfs "github.com/diskfs/go-diskfs"
	"github.com/diskfs/go-diskfs/disk"
	"github.com/diskfs/go-diskfs/filesystem"
	"github.com/diskfs/go-diskfs/filesystem/iso9660"
)

// The guest tools disk: a read-only ISO 9660 image (Rock Ridge names and
// modes) that carries host binaries into every machine without a copy per
// job. Image recipes mount it by its disk serial and put its bin directory's
// programs on PATH; see docs/images.md.
const (
	// ToolsDiskSerial is the tools disk's serial: the guest finds it as
	// /dev/disk/by-id/virtio-lve-tools (or by /sys/block/*/serial).
	ToolsDiskSerial = "lve-tools"
	// ToolsMountPoint is where the images mount it.
	ToolsMountPoint = "/opt/libvirt-executor"
	// ToolsLabel is the ISO volume identifier.
	ToolsLabel = "LVE_TOOLS"
	// ToolsLayout versions the disk's layout: a change of it makes a new
	// volume even for the same binaries.
	ToolsLayout = "2"
	// GuestRunnerPath is the gitlab-runner binary in the guest; the images
	// link /usr/local/bin/gitlab-runner to it.
	GuestRunnerPath = ToolsMountPoint + "/bin/gitlab-runner"
	// GuestStepRunnerPath is the step-runner binary in the guest; the
	// images link /usr/local/bin/step-runner to it.
	GuestStepRunnerPath = ToolsMountPoint + "/bin/step-runner"
	// GuestAgentPath is the guest agent (cmd/lve-agent) in the guest: the
	// job's connection holder starts it there, by this path (images need
	// only mount the disk).
	GuestAgentPath = ToolsMountPoint + "/bin/lve-agent"
)

// ToolsManifest is tools.json at the root of the tools disk: where its
// programs came from.
type ToolsManifest struct {
	// Programs maps a name under bin/ to its origin.
	Programs map[string]ToolOrigin `json:"programs"`
}

// ToolOrigin is one program's origin on the host.
type ToolOrigin struct {
	Source string `json:"source"`
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
}

// ToolsISO writes the tools disk image to out: bin/NAME for every entry of
// programs (name -> path of the host file, copied with mode 0755) and
// tools.json. workDir must be a private directory; the staging copy is
// removed before returning. The image is padded to a whole number of 2 KiB
// blocks.
func ToolsISO(out string, programs map[string]string, manifest ToolsManifest, workDir string) error {
	stage, err := os.MkdirTemp(workDir, "tools-stage-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(stage) }() // best effort: a private temp dir
	// The staging directory is the disk's root (Rock Ridge keeps modes):
	// every guest user must get in, not only root.
	if err := os.Chmod(stage, 0o755); err != nil { //nolint:gosec // G30x: the modes the guest sees (Rock Ridge); on the host it sits in the caller's private work dir
		return err
	}
	if err := os.Mkdir(filepath.Join(stage, "bin"), 0o755); err != nil { //nolint:gosec // G30x: the modes the guest sees (Rock Ridge); on the host it sits in the caller's private work dir
		return err
	}
	if err := os.Chmod(filepath.Join(stage, "bin"), 0o755); err != nil { //nolint:gosec // G30x: the modes the guest sees (Rock Ridge); on the host it sits in the caller's private work dir
		return err
	}
	var total int64
	for name, src := range programs {
		if name == "" || filepath.Base(name) != name || name[0] == '.' {
			return fmt.Errorf("tools disk: program name %q refused", name)
		}
		n, sum, err := copyFile(filepath.Join(stage, "bin", name), src, 0o755)
		if err != nil {
			return fmt.Errorf("tools disk: copy %s: %w", src, err)
		}
		// The copy must be what the disk is named after (the file may be
		// replaced between hashing and copying: an upgrade in progress).
		if want := manifest.Programs[name].SHA256; want != "" && want != sum {
			return fmt.Errorf("tools disk: %s changed while it was being copied (sha256 %s, expected %s): try again", src, sum, want)
		}
		total += n
	}
	mb, err := json.MarshalIndent(manifest, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(stage, "tools.json"), append(mb, '\n'), 0o644); err != nil { //nolint:gosec // G30x: the modes the guest sees (Rock Ridge); on the host it sits in the caller's private work dir
		return err
	}
	// Room for the data plus ISO 9660's descriptors, directories and
	// path tables (a few dozen KiB for a handful of files).
	size := (total + int64(len(mb)) + 1<<20 + 2047) / 2048 * 2048
	_ = os.Remove(out)
	d, err := diskfs.Create(out, size, diskfs.SectorSizeDefault)
	if err != nil {
		return fmt.Errorf("tools disk image: %w", err)
	}
	defer func() { _ = d.Close() }()
	d.LogicalBlocksize = 2048
	// The workspace is where Finalize reads the tree from (and removes
	// it afterwards): the staged files, with their modes, are the content.
	fs, err := d.CreateFilesystem(disk.FilesystemSpec{Partition: 0, FSType: filesystem.TypeISO9660, VolumeLabel: ToolsLabel, WorkDir: stage})
	if err != nil {
		return fmt.Errorf("tools disk filesystem: %w", err)
	}
	iso, ok := fs.(*iso9660.FileSystem)
	if !ok {
		return fmt.Errorf("tools disk filesystem is %T, not ISO 9660", fs)
	}
	if err := iso.Finalize(iso9660.FinalizeOptions{RockRidge: true, VolumeIdentifier: ToolsLabel}); err != nil {
		return fmt.Errorf("tools disk finalize: %w", err)
	}
	return nil
}

// copyFile copies src to a new file dst with mode and returns its size and
// the SHA-256 (hex) of what it copied.
func copyFile(dst, src string, mode os.FileMode) (int64, string, error) {
	in, err := os.Open(src)
	if err != nil {
		return 0, "", err
	}
	defer func() { _ = in.Close() }()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
	if err != nil {
		return 0, "", err
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(out, h), in)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(dst, mode) // the umask does not decide the guest's mode
	}
	return n, hex.EncodeToString(h.Sum(nil)), err
}
