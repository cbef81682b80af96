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
	"syscall"
	"time"

	"github.com/gofrs/flock"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/progress"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// lock takes the store's lock (a pull or a removal at a time).
func lock(ctx context.Context, s *ociimage.Store) (func(), error) {
	if err := os.MkdirAll(s.Dir, 0o755); err != nil { //nolint:gosec // G301: libvirt's QEMU user reads the stored images (no secret: as a base file)
		return nil, err
	}
	if err := os.Chmod(s.Dir, 0o755); err != nil { //nolint:gosec // G302: libvirt's QEMU user reads the stored images (no secret: as a base file)
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
	// Whatever is in tmp/ now was left by a pull or removal that died
	// holding the lock (SIGKILL, power loss): it goes.
	if left, err := os.ReadDir(filepath.Join(s.Dir, "tmp")); err == nil {
		for _, e := range left {
			_ = os.RemoveAll(filepath.Join(s.Dir, "tmp", e.Name()))
		}
	}
	return func() { _ = l.Unlock() }, nil
}

// mkdirs makes dir (and its parents) 0755 whatever the umask: the
// service runs with UMask=0077, and QEMU must reach the stored files.
func mkdirs(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil { //nolint:gosec // G301: libvirt's QEMU user reads the stored images (no secret: as a base file)
		return err
	}
	return os.Chmod(dir, 0o755) //nolint:gosec // G302: as above
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
	if want, err := src.Ref.Digest(); err == nil {
		// A pinned digest never moves: stored is stored.
		if img, err := s.Image(want); err == nil {
			if err := s.Verify(img); err != nil {
				return PullResult{}, fmt.Errorf("image %s: stored as %s: %w", src, want, err)
			}
			rec, _, cerr := s.Current(src)
			if cerr != nil || rec.Digest != want {
				now := time.Now().UTC()
				rec = ociimage.Record{Source: src.String(), Digest: want, Pulled: now, Checked: now}
				if err := s.WriteRecord(rec); err != nil {
					return PullResult{}, err
				}
			}
			return PullResult{Record: rec, Image: img, Changed: cerr != nil}, nil
		}
	}
	repo, err := r.repository(src)
	if err != nil {
		return PullResult{}, err
	}
	asked := time.Now().UTC()
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
	if oldErr == nil && old.Digest != desc.Digest && old.Checked.After(asked) {
		// Another pull asked the registry after this one and recorded its
		// answer meanwhile: the newer answer stands.
		img, err := s.Image(old.Digest)
		if err == nil {
			return PullResult{Record: old, Image: img}, nil
		}
	}
	img, err := s.Image(desc.Digest)
	if err != nil && !errors.Is(err, ociimage.ErrNotPulled) {
		// A damaged image directory (a power loss before its files
		// reached the disk): set aside, fetched again.
		if _, serr := os.Stat(s.ImageDir(desc.Digest)); serr == nil {
			if aside, terr := tempDir(s, "damaged-"); terr == nil {
				_ = os.Rename(s.ImageDir(desc.Digest), filepath.Join(aside, "image"))
			}
		}
		err = fmt.Errorf("%w (damaged)", ociimage.ErrNotPulled)
	}
	if errors.Is(err, ociimage.ErrNotPulled) {
		res.Fetched, err = fetch(ctx, s, repo, src, desc)
		if err == nil {
			img, err = s.Image(desc.Digest)
		}
	}
	if err != nil {
		return PullResult{}, err
	}
	if err := s.Verify(img); err != nil {
		// Stored by a version before the check: left as it is, not named.
		return PullResult{}, fmt.Errorf("image %s: stored as %s: %w", src, desc.Digest, err)
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

	var need uint64
	for _, f := range cfg.Files {
		need += uint64(f.Size) //nolint:gosec // G115: CheckLayout bounded each size to 0..MaxFile
	}
	if err := checkRoom(s.Dir, need); err != nil {
		return 0, fmt.Errorf("image %s: %w", src, err)
	}
	tmp, err := tempDir(s, "pull-")
	if err != nil {
		return 0, err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	var fetched int64
	pr := progress.From(ctx)
	defer pr.Done()
	for i, layer := range man.Layers {
		pr.Step("fetch "+cfg.Files[i].Name, layer.Size)
		n, err := fetchFile(ctx, repo, layer, cfg.Files[i], filepath.Join(tmp, cfg.Files[i].Name))
		fetched += n
		if err != nil {
			return fetched, fmt.Errorf("image %s: %s: %w", src, cfg.Files[i].Name, err)
		}
	}
	// The disk is input too: a header that names a host file (a backing
	// or data file) or claims a size past the limits is never stored.
	pr.Step("check "+ociimage.DiskFile+" and store the image", 0)
	checked, err := s.CheckDisk(filepath.Join(tmp, ociimage.DiskFile))
	if err != nil {
		return fetched, fmt.Errorf("image %s: %s: %w", src, ociimage.DiskFile, err)
	}
	ck, err := json.Marshal(checked)
	if err != nil {
		return fetched, err
	}
	for name, b := range map[string][]byte{"manifest.json": mb, "config.json": cb, ociimage.CheckedFile: append(ck, '\n')} {
		if err := writeSynced(filepath.Join(tmp, name), b); err != nil {
			return fetched, err
		}
	}
	if err := state.SyncDir(tmp); err != nil {
		return fetched, err
	}
	if err := os.Chmod(tmp, 0o755); err != nil { //nolint:gosec // G302: libvirt's QEMU user reads the stored images (no secret: as a base file)
		return fetched, err
	}
	if err := mkdirs(filepath.Join(s.Dir, "images")); err != nil {
		return fetched, err
	}
	if err := os.Rename(tmp, s.ImageDir(desc.Digest)); err != nil {
		return fetched, err
	}
	return fetched, state.SyncDir(filepath.Join(s.Dir, "images"))
}

// fetchFile streams one layer into path: its digest checked as it comes,
// uncompressed, size and sha256 checked against the config. It returns
// the compressed bytes received.
func fetchFile(ctx context.Context, repo fetcher, layer ocispec.Descriptor, info ociimage.FileInfo, path string) (int64, error) {
	// A registry that stops sending holds the store's lock: the transfer
	// ends once nothing came for IdleTimeout.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	idle := time.AfterFunc(IdleTimeout, func() { cancel(errIdle) })
	defer idle.Stop()
	n, err := fetchFileWatched(ctx, repo, layer, info, path, func() { idle.Reset(IdleTimeout) })
	if err != nil && errors.Is(context.Cause(ctx), errIdle) {
		return n, fmt.Errorf("the registry sent nothing for %s: %w", IdleTimeout, err)
	}
	return n, err
}

// IdleTimeout ends a layer's transfer that received nothing for so long.
var IdleTimeout = 60 * time.Second

var errIdle = errors.New("registry idle")

func fetchFileWatched(ctx context.Context, repo fetcher, layer ocispec.Descriptor, info ociimage.FileInfo, path string, progress func()) (int64, error) {
	rc, err := repo.Fetch(ctx, layer)
	if err != nil {
		return 0, fetchError(err)
	}
	defer rc.Close()
	counted := &countingReader{r: rc, progress: progress, bytes: progressOf(ctx)}
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
	if err := f.Chmod(0o644); err != nil { //nolint:gosec // G302: whatever the umask (the service's is 0077)
		return counted.n, err
	}
	h := sha256.New()
	w := &errWriter{w: f}
	n, err := io.Copy(io.MultiWriter(w, h), io.LimitReader(zr, info.Size+1))
	if err != nil {
		if w.err != nil || ctx.Err() != nil {
			return counted.n, err // the host's disk, or the caller gave up: not the registry's fault
		}
		return counted.n, counted.classify(err)
	}
	if n != info.Size {
		return counted.n, refused("%d bytes uncompressed, the config says %d", n, info.Size)
	}
	// The rest of the layer (the zstd frame's end) must be there and
	// the digest right.
	if _, err := io.Copy(io.Discard, io.LimitReader(zr, 1)); err != nil {
		if ctx.Err() != nil {
			return counted.n, err
		}
		return counted.n, counted.classify(err)
	}
	if err := vr.Verify(); err != nil {
		if counted.err != nil || ctx.Err() != nil {
			return counted.n, err
		}
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
	r        io.Reader
	n        int64
	err      error
	progress func() // called when bytes arrive (nil: nothing)
	bytes    progress.Reporter
}

// progressOf is ctx's progress reporter (progress.From).
func progressOf(ctx context.Context) progress.Reporter { return progress.From(ctx) }

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if n > 0 && c.progress != nil {
		c.progress()
	}
	if n > 0 && c.bytes != nil {
		c.bytes.Add(int64(n))
	}
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
	counted := &countingReader{r: rc}
	b, err := content.ReadAll(counted, desc)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		return nil, counted.classify(err)
	}
	return b, nil
}

// errWriter keeps the error its writer failed with (the host's disk).
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	n, err := e.w.Write(p)
	if err != nil {
		e.err = err
	}
	return n, err
}

// tempDir makes a directory of its own under the store's tmp/ (cleared
// when the lock is next taken).
func tempDir(s *ociimage.Store, prefix string) (string, error) {
	root := filepath.Join(s.Dir, "tmp")
	if err := mkdirs(root); err != nil {
		return "", err
	}
	return os.MkdirTemp(root, prefix)
}

// writeSynced writes a small file 0644, whatever the umask, and syncs it.
func writeSynced(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644) //nolint:gosec // G302: libvirt's QEMU user reads the stored images (no secret: as a base file)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Chmod(0o644); err != nil { //nolint:gosec // G302: as above
		return err
	}
	if _, err := f.Write(b); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}

// roomSlack is what a pull leaves free on the store's filesystem.
const roomSlack = 1 << 30

// checkRoom refuses a pull whose files (need bytes) would leave less than
// roomSlack free where the store is.
func checkRoom(dir string, need uint64) error {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return err
	}
	free := st.Bavail * uint64(st.Bsize) //nolint:gosec // G115: block sizes are positive
	if free < need+roomSlack {
		return fmt.Errorf("%.1f GiB free in %s, the image needs %.1f GiB and 1 GiB is kept free: remove old images (libvirt-executor image prune) or make room",
			float64(free)/(1<<30), dir, float64(need)/(1<<30))
	}
	return nil
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
		aside, err := tempDir(s, "remove-")
		if err != nil {
			return removed, err
		}
		gone := filepath.Join(aside, "image")
		if err := os.Rename(img.Dir, gone); err != nil {
			return removed, err
		}
		if err := os.RemoveAll(aside); err != nil {
			return removed, err
		}
		removed = append(removed, img.Digest)
	}
	return removed, nil
}

func refused(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ociimage.ErrRefused}, args...)...)
}
