package ociimage

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/imagecheck"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Store is the content-addressed image store of one host:
//
//	DIR/images/sha256-HEX/    one image (HEX: its manifest's digest):
//	                          manifest.json, config.json and its files
//	DIR/refs/KEY.json         the image a source names now (Record)
//	DIR/tmp/                  pulls under way (removed when they end)
//	DIR/lock                  taken by a pull or a removal
//
// An image directory appears by a rename once every file in it was
// checked; a record is replaced by a rename. Readers need no lock.
type Store struct {
	Dir string
	// MaxFileBytes bounds each file of an image once uncompressed, and
	// its compressed layer (default 64 GiB).
	MaxFileBytes int64
	// MaxVirtualBytes bounds the virtual size of an image's disk
	// (imagecheck.Check; 0: its default).
	MaxVirtualBytes uint64
}

// CheckedFile is the file of an image directory that records the disk's
// check (Checked): a store written before the check, or by an older
// check, has its images checked again on their next use.
const CheckedFile = "checked.json"

// Checked records imagecheck's verdict on an image's disk.
type Checked struct {
	Version     int    `json:"version"`
	VirtualSize uint64 `json:"virtual_size"`
}

// CheckDisk checks the disk file at path as a stored image's disk must be
// (imagecheck.Check: a standalone qcow2 within MaxVirtualBytes): a
// refusal wraps ErrRefused and names the file, the field and the value.
func (s *Store) CheckDisk(path string) (Checked, error) {
	info, err := imagecheck.Check(path, "qcow2", s.MaxVirtualBytes)
	if err != nil {
		if errors.Is(err, imagecheck.ErrRefused) {
			return Checked{}, fmt.Errorf("%w: %w", ErrRefused, err)
		}
		return Checked{}, err
	}
	return Checked{Version: imagecheck.Version, VirtualSize: info.VirtualSize}, nil
}

// Verify says whether a stored image may be used: its record of the
// check is current and its virtual size within today's bound, or, where
// the record is missing or older (a store written before the check), the
// disk passes the check now (recorded when the store can be written).
func (s *Store) Verify(img Image) error {
	bound := s.MaxVirtualBytes
	if bound == 0 {
		bound = imagecheck.DefaultMaxVirtual
	}
	var rec Checked
	if b, err := os.ReadFile(filepath.Join(img.Dir, CheckedFile)); err == nil && json.Unmarshal(b, &rec) == nil &&
		rec.Version >= imagecheck.Version && rec.VirtualSize <= bound {
		return nil
	}
	disk := img.Path(DiskFile)
	if disk == "" {
		return fmt.Errorf("%s has no %s: %w", img.Digest, DiskFile, ErrRefused)
	}
	rec, err := s.CheckDisk(disk)
	if err != nil {
		return err
	}
	if b, err := json.Marshal(rec); err == nil {
		_ = state.WriteFileDurableMode(filepath.Join(img.Dir, CheckedFile), append(b, '\n'), 0o644) // best effort: checked again next time
	}
	return nil
}

// Record says which image a source names on this host.
type Record struct {
	Source string        `json:"source"`
	Digest digest.Digest `json:"digest"`
	// Pulled is when the digest was first stored for the source;
	// Checked when the registry last said the source still names it.
	Pulled  time.Time `json:"pulled"`
	Checked time.Time `json:"checked"`
}

// Image is a stored image.
type Image struct {
	Digest digest.Digest
	Dir    string
	Files  []FileInfo
	Bytes  int64 // on disk, all files
}

// Path is the stored file name of the image (DiskFile, KernelFile,
// InitrdFile), "" when the image has none.
func (i Image) Path(name string) string {
	for _, f := range i.Files {
		if f.Name == name {
			return filepath.Join(i.Dir, name)
		}
	}
	return ""
}

const defaultMaxFileBytes = 64 << 30

// MaxFile is MaxFileBytes or its default.
func (s *Store) MaxFile() int64 {
	if s.MaxFileBytes > 0 {
		return s.MaxFileBytes
	}
	return defaultMaxFileBytes
}

// ImageDir is where image d is (or would be) stored.
func (s *Store) ImageDir(d digest.Digest) string {
	return filepath.Join(s.Dir, "images", d.Algorithm().String()+"-"+d.Encoded())
}

func refKey(source string) string {
	sum := sha256.Sum256([]byte(source))
	return hex.EncodeToString(sum[:16])
}

// RecordPath is the file of source's record.
func (s *Store) RecordPath(source string) string {
	return filepath.Join(s.Dir, "refs", refKey(source)+".json")
}

// Current is the image src names on this host (ErrNotPulled when none).
func (s *Store) Current(src Source) (Record, Image, error) {
	b, err := os.ReadFile(s.RecordPath(src.String()))
	if errors.Is(err, fs.ErrNotExist) {
		return Record{}, Image{}, fmt.Errorf("image %s: %w", src, ErrNotPulled)
	}
	if err != nil {
		return Record{}, Image{}, err
	}
	var rec Record
	if err := json.Unmarshal(b, &rec); err != nil || rec.Source != src.String() || rec.Digest.Validate() != nil {
		return Record{}, Image{}, fmt.Errorf("image %s: the store's record %s is damaged: pull again", src, s.RecordPath(src.String()))
	}
	img, err := s.Image(rec.Digest)
	if err != nil {
		return Record{}, Image{}, fmt.Errorf("image %s: %w", src, err)
	}
	return rec, img, nil
}

// Image is the stored image d.
func (s *Store) Image(d digest.Digest) (Image, error) {
	if err := d.Validate(); err != nil {
		return Image{}, err
	}
	dir := s.ImageDir(d)
	b, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return Image{}, fmt.Errorf("%s is not in the store %s: %w", d, s.Dir, ErrNotPulled)
	}
	if err != nil {
		return Image{}, err
	}
	var cfg ImageConfig
	if err := json.Unmarshal(b, &cfg); err != nil {
		return Image{}, fmt.Errorf("%s in the store: config.json: %w", d, err)
	}
	img := Image{Digest: d, Dir: dir, Files: cfg.Files}
	for _, f := range cfg.Files {
		img.Bytes += f.Size
	}
	return img, nil
}

// List is every stored image, and the sources that name each.
func (s *Store) List() ([]Image, map[digest.Digest][]Record, error) {
	entries, err := os.ReadDir(filepath.Join(s.Dir, "images"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, nil, err
	}
	var imgs []Image
	for _, e := range entries {
		alg, enc, ok := strings.Cut(e.Name(), "-")
		if !ok || !e.IsDir() {
			continue
		}
		img, err := s.Image(digest.NewDigestFromEncoded(digest.Algorithm(alg), enc))
		if err != nil {
			continue
		}
		imgs = append(imgs, img)
	}
	sort.Slice(imgs, func(i, j int) bool { return imgs[i].Digest < imgs[j].Digest })
	refs, err := s.records()
	return imgs, refs, err
}

func (s *Store) records() (map[digest.Digest][]Record, error) {
	out := map[digest.Digest][]Record{}
	entries, err := os.ReadDir(filepath.Join(s.Dir, "refs"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.Dir, "refs", e.Name()))
		if err != nil {
			continue
		}
		var rec Record
		if json.Unmarshal(b, &rec) == nil && rec.Digest.Validate() == nil {
			out[rec.Digest] = append(out[rec.Digest], rec)
		}
	}
	return out, nil
}

// WriteRecord replaces the record of rec.Source.
func (s *Store) WriteRecord(rec Record) error {
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(s.RecordPath(rec.Source)), 0o755); err != nil { //nolint:gosec // G301: records name no secret
		return err
	}
	return state.WriteFileDurableMode(s.RecordPath(rec.Source), append(b, '\n'), 0o644)
}

// CheckLayout checks the config against the layers: one layer per file,
// in the config's order, each file known, at most once, the disk present,
// every size within bounds.
func (s *Store) CheckLayout(cfg ImageConfig, layers []ocispec.Descriptor) error {
	if cfg.Format < 1 || cfg.Format > ConfigFormat {
		return fmt.Errorf("config format %d: this version reads format %d (upgrade libvirt-executor)", cfg.Format, ConfigFormat)
	}
	if len(cfg.Files) != len(layers) || len(layers) == 0 || len(layers) > len(fileMediaTypes) {
		return fmt.Errorf("%d files in the config for %d layers (1 to %d)", len(cfg.Files), len(layers), len(fileMediaTypes))
	}
	seen := map[string]bool{}
	for i, f := range cfg.Files {
		mt, ok := fileMediaTypes[f.Name]
		if !ok || seen[f.Name] {
			return fmt.Errorf("file %q: allowed once each: %s", f.Name, strings.Join(FileNames, ", "))
		}
		seen[f.Name] = true
		if layers[i].MediaType != mt {
			return fmt.Errorf("file %s in a layer of type %s: want %s", f.Name, layers[i].MediaType, mt)
		}
		if f.Size < 0 || f.Size > s.MaxFile() || layers[i].Size < 0 || layers[i].Size > s.MaxFile() {
			return fmt.Errorf("file %s: %d bytes (%d compressed): at most %d", f.Name, f.Size, layers[i].Size, s.MaxFile())
		}
		if b, err := hex.DecodeString(f.SHA256); err != nil || len(b) != sha256.Size {
			return fmt.Errorf("file %s: sha256 %q is not 64 hex digits", f.Name, f.SHA256)
		}
		if layers[i].Digest.Validate() != nil || layers[i].Digest.Algorithm() != digest.SHA256 {
			return fmt.Errorf("file %s: layer digest %q: want sha256", f.Name, layers[i].Digest)
		}
	}
	if !seen[DiskFile] {
		return fmt.Errorf("no %s", DiskFile)
	}
	return nil
}

// InUse reports whether a stored image's files are named by any of the
// paths given (the backing files of the host's VMs).
func (i Image) InUse(paths []string) bool {
	return slices.ContainsFunc(paths, func(p string) bool { return strings.HasPrefix(p, i.Dir+string(filepath.Separator)) })
}
