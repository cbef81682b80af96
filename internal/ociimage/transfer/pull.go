package transfer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/gofrs/flock"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
)

// lock takes the store's lock (a pull or a removal at a time).
func lock(ctx context.Context, s *ociimage.Store) (func(), error) {
	if err := os.MkdirAll(s.Dir, 0o755); err != nil { //nolint:gosec // G301: libvirt's QEMU user reads the stored images (no secret: as a base file)
		return nil, err
	}
	l := flock.New(filepath.Join(s.Dir, "lock"))
	ok, err := l.TryLockContext(ctx, 100*time.Millisecond)
	if err != nil {
		return nil, fmt.Errorf("image store %s: lock: %w", s.Dir, err)
	}
	if !ok {
		return nil, fmt.Errorf("image store %s: lock not taken", s.Dir)
	}
	return func() { _ = l.Unlock() }, nil
}

// PullResult says what a pull did.
type PullResult struct {
	Record  ociimage.Record
	Image   ociimage.Image
	Changed bool  // the source names another image than before (or none was stored)
	Fetched int64 // compressed bytes received (0: the image was stored already)
}

// Pull asks the registry which image src names, stores it unless it is
// stored already, and records it as src's image. Nothing of a refused or
// interrupted pull is visible: the image directory appears by a rename
// once every file was checked, and the record changes after that.
func Pull(ctx context.Context, s *ociimage.Store, r Remote, src ociimage.Source) (PullResult, error) {
	repo, err := r.repository(src)
	if err != nil {
		return PullResult{}, err
	}
	desc, err := repo.Resolve(ctx, src.Ref.Reference)
	if err != nil {
		return PullResult{}, fmt.Errorf("image %s: %w", src, err)
	}
	if want, err := src.Ref.Digest(); err == nil && desc.Digest != want {
		return PullResult{}, refused("image %s: the registry answered with %s", src, desc.Digest)
	}
	if desc.MediaType != ocispec.MediaTypeImageManifest {
		return PullResult{}, refused("image %s: a %s, not an image of libvirt-executor (an OCI image manifest of type %s)", src, desc.MediaType, ociimage.ArtifactType)
	}
	if desc.Size > ociimage.MaxManifestBytes || desc.Digest.Algorithm() != digest.SHA256 {
		return PullResult{}, refused("image %s: manifest of %d bytes (%s): at most %d bytes, sha256", src, desc.Size, desc.Digest, ociimage.MaxManifestBytes)
	}
	unlock, err := lock(ctx, s)
	if err != nil {
		return PullResult{}, err
	}
	defer unlock()
	res := PullResult{}
	old, _, oldErr := s.Current(src)
	img, err := s.Image(desc.Digest)
	if errors.Is(err, ociimage.ErrNotPulled) {
		res.Fetched, err = fetch(ctx, s, repo, src, desc)
		if err == nil {
			img, err = s.Image(desc.Digest)
		}
	}
	if err != nil {
		return PullResult{}, err
	}
	now := time.Now().UTC()
	rec := ociimage.Record{Source: src.String(), Digest: desc.Digest, Pulled: now, Checked: now}
	if oldErr == nil && old.Digest == desc.Digest {
		rec.Pulled = old.Pulled
	} else {
		res.Changed = true
	}
	if err := s.WriteRecord(rec); err != nil {
		return PullResult{}, err
	}
	res.Record, res.Image = rec, img
	return res, nil
}

// fetcher is the part of a repository a pull reads from.
type fetcher interface {
	Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error)
}

// fetch stores image desc of src: manifest, config, files, each checked.
func fetch(ctx context.Context, s *ociimage.Store, repo fetcher, src ociimage.Source, desc ocispec.Descriptor) (int64, error) {
	mb, err := fetchSmall(ctx, repo, desc)
	if err != nil {
		return 0, fmt.Errorf("image %s: manifest: %w", src, err)
	}
	var man ocispec.Manifest
	if err := json.Unmarshal(mb, &man); err != nil {
		return 0, refused("image %s: manifest %s: %v", src, desc.Digest, err)
	}
	if man.MediaType != "" && man.MediaType != ocispec.MediaTypeImageManifest {
		return 0, refused("image %s: manifest says it is a %s", src, man.MediaType)
	}
	if man.ArtifactType != ociimage.ArtifactType && man.Config.MediaType != ociimage.MediaTypeConfig {
		return 0, refused("image %s: an artifact of type %q (config %s), not a libvirt-executor image (%s)", src, man.ArtifactType, man.Config.MediaType, ociimage.ArtifactType)
	}
	if man.Config.MediaType != ociimage.MediaTypeConfig || man.Config.Size > ociimage.MaxConfigBytes {
		return 0, refused("image %s: config of type %s and %d bytes: want %s, at most %d bytes", src, man.Config.MediaType, man.Config.Size, ociimage.MediaTypeConfig, ociimage.MaxConfigBytes)
	}
	cb, err := fetchSmall(ctx, repo, man.Config)
	if err != nil {
		return 0, fmt.Errorf("image %s: config: %w", src, err)
	}
	var cfg ociimage.ImageConfig
	if err := json.Unmarshal(cb, &cfg); err != nil {
		return 0, refused("image %s: config: %v", src, err)
	}
	if err := s.CheckLayout(cfg, man.Layers); err != nil {
		return 0, refused("image %s: %v", src, err)
	}

	tmpRoot := filepath.Join(s.Dir, "tmp")
	if err := os.MkdirAll(tmpRoot, 0o755); err != nil { //nolint:gosec // G301: libvirt's QEMU user reads the stored images (no secret: as a base file)
		return 0, err
	}
	tmp, err := os.MkdirTemp(tmpRoot, "pull-")
	if err != nil {
		return 0, err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	var fetched int64
	for i, layer := range man.Layers {
		n, err := fetchFile(ctx, repo, layer, cfg.Files[i], filepath.Join(tmp, cfg.Files[i].Name))
		fetched += n
		if err != nil {
			return fetched, fmt.Errorf("image %s: %s: %w", src, cfg.Files[i].Name, err)
		}
	}
	for name, b := range map[string][]byte{"manifest.json": mb, "config.json": cb} {
		if err := os.WriteFile(filepath.Join(tmp, name), b, 0o644); err != nil { //nolint:gosec // G306: libvirt's QEMU user reads the stored images (no secret: as a base file)
			return fetched, err
		}
	}
	if err := ociimage.SyncDir(tmp); err != nil {
		return fetched, err
	}
	if err := os.Chmod(tmp, 0o755); err != nil { //nolint:gosec // G302: libvirt's QEMU user reads the stored images (no secret: as a base file)
		return fetched, err
	}
	if err := os.MkdirAll(filepath.Join(s.Dir, "images"), 0o755); err != nil { //nolint:gosec // G301: libvirt's QEMU user reads the stored images (no secret: as a base file)
		return fetched, err
	}
	if err := os.Rename(tmp, s.ImageDir(desc.Digest)); err != nil {
		return fetched, err
	}
	return fetched, ociimage.SyncDir(filepath.Join(s.Dir, "images"))
}

// fetchFile streams one layer into path: its digest checked as it comes,
// uncompressed, size and sha256 checked against the config. It returns
// the compressed bytes received.
func fetchFile(ctx context.Context, repo fetcher, layer ocispec.Descriptor, info ociimage.FileInfo, path string) (int64, error) {
	rc, err := repo.Fetch(ctx, layer)
	if err != nil {
		return 0, fetchError(err)
	}
	defer rc.Close()
	counted := &countingReader{r: rc}
	vr := content.NewVerifyReader(counted, layer)
	zr, err := zstd.NewReader(vr, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(64<<20))
	if err != nil {
		return counted.n, err
	}
	defer zr.Close()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644) //nolint:gosec // G302: libvirt's QEMU user reads the stored images (no secret: as a base file)
	if err != nil {
		return counted.n, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), io.LimitReader(zr, info.Size+1))
	if err != nil {
		return counted.n, counted.classify(err)
	}
	if n != info.Size {
		return counted.n, refused("%d bytes uncompressed, the config says %d", n, info.Size)
	}
	// The rest of the layer (the zstd frame's end) must be there and
	// the digest right.
	if _, err := io.Copy(io.Discard, io.LimitReader(zr, 1)); err != nil {
		return counted.n, counted.classify(err)
	}
	if err := vr.Verify(); err != nil {
		return counted.n, refused("layer %s: %v", layer.Digest, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != info.SHA256 {
		return counted.n, refused("sha256 %s uncompressed, the config says %s", got, info.SHA256)
	}
	if err := f.Sync(); err != nil {
		return counted.n, err
	}
	return counted.n, f.Close()
}

// countingReader counts what the registry sent and keeps the error its
// connection failed with, if any.
type countingReader struct {
	r   io.Reader
	n   int64
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err != nil && err != io.EOF {
		c.err = err
	}
	return n, err
}

// classify marks an error of a layer's content (a digest mismatch, a
// broken or truncated zstd stream) as ociimage.ErrRefused; an error of the
// connection stays what it is.
func (c *countingReader) classify(err error) error {
	if c.err != nil && errors.Is(err, c.err) {
		return err
	}
	return refused("%v", err)
}

// fetchError marks a registry's answer of another size than the
// descriptor's (oras-go checks Content-Length before any byte is read,
// with no error value of its own to test) as ociimage.ErrRefused.
func fetchError(err error) error {
	if strings.Contains(err.Error(), "mismatch Content-Length") {
		return refused("%v", err)
	}
	return err
}

// fetchSmall reads a manifest or config, bounded and checked.
func fetchSmall(ctx context.Context, repo fetcher, desc ocispec.Descriptor) ([]byte, error) {
	rc, err := repo.Fetch(ctx, desc)
	if err != nil {
		return nil, fetchError(err)
	}
	defer rc.Close()
	b, err := content.ReadAll(rc, desc)
	if err != nil {
		return nil, refused("%v", err)
	}
	return b, nil
}

// Remove deletes stored images for which keep is false, and the records
// of sources that name them; it returns the digests removed.
func Remove(ctx context.Context, s *ociimage.Store, keep func(ociimage.Image, []ociimage.Record) bool) ([]digest.Digest, error) {
	unlock, err := lock(ctx, s)
	if err != nil {
		return nil, err
	}
	defer unlock()
	imgs, refs, err := s.List()
	if err != nil {
		return nil, err
	}
	var removed []digest.Digest
	for _, img := range imgs {
		if keep(img, refs[img.Digest]) {
			continue
		}
		for _, rec := range refs[img.Digest] {
			if err := os.Remove(s.RecordPath(rec.Source)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return removed, err
			}
		}
		// Renamed away first, so that no reader finds half an image.
		gone := filepath.Join(s.Dir, "tmp", "remove-"+img.Digest.Encoded())
		if err := os.MkdirAll(filepath.Join(s.Dir, "tmp"), 0o755); err != nil { //nolint:gosec // G301: libvirt's QEMU user reads the stored images (no secret: as a base file)
			return removed, err
		}
		if err := os.Rename(img.Dir, gone); err != nil {
			return removed, err
		}
		if err := os.RemoveAll(gone); err != nil {
			return removed, err
		}
		removed = append(removed, img.Digest)
	}
	return removed, nil
}

func refused(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ociimage.ErrRefused}, args...)...)
}
