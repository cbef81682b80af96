package transfer

import (
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/progress"

	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
)

// PushFile is one file of an image to push.
type PushFile struct {
	Name string // ociimage.DiskFile, KernelFile or InitrdFile
	Path string // on this host
}

// PushResult says what a push sent.
type PushResult struct {
	Descriptor ocispec.Descriptor // the manifest's
	Files      []ociimage.FileInfo
	Compressed int64 // bytes of all layers
}

// Push compresses files (zstd) into layers, pushes them with a config and
// a manifest of ociimage.ArtifactType, and tags it as dst's tag. The files are read
// twice: once to compress them into temporary files in tmpDir (a layer's
// digest must be known before its upload), once by the upload.
func Push(ctx context.Context, r Remote, dst ociimage.Source, files []PushFile, tmpDir string, created string) (PushResult, error) {
	if dst.Pinned() {
		return PushResult{}, fmt.Errorf("push to %s: name a tag, not a digest (the digest is the result)", dst)
	}
	seen := map[string]bool{}
	for _, f := range files {
		if _, ok := ociimage.MediaTypeOf(f.Name); !ok || seen[f.Name] {
			return PushResult{}, fmt.Errorf("push: file %q: allowed once each: %v", f.Name, ociimage.FileNames)
		}
		seen[f.Name] = true
	}
	if !seen[ociimage.DiskFile] {
		return PushResult{}, errors.New("push: an image needs its disk (" + ociimage.DiskFile + ")")
	}
	repo, err := r.repository(dst)
	if err != nil {
		return PushResult{}, err
	}
	var res PushResult
	var layers []ocispec.Descriptor
	pr := progress.From(ctx)
	defer pr.Done()
	for _, name := range ociimage.FileNames {
		if !seen[name] {
			continue
		}
		var path string
		for _, f := range files {
			if f.Name == name {
				path = f.Path
			}
		}
		info, desc, cleanup, err := compress(path, name, tmpDir, pr)
		if err != nil {
			return PushResult{}, err
		}
		err = pushBlob(ctx, repo, desc, cleanup.path, name, pr)
		cleanup.remove()
		if err != nil {
			return PushResult{}, fmt.Errorf("push %s: %w", path, err)
		}
		res.Files = append(res.Files, info)
		res.Compressed += desc.Size
		layers = append(layers, desc)
	}
	pr.Step("push the config and the manifest, tag "+dst.Ref.Reference, 0)
	cb, err := json.Marshal(ociimage.ImageConfig{Format: ociimage.ConfigFormat, Files: res.Files})
	if err != nil {
		return PushResult{}, err
	}
	cfgDesc, err := oras.PushBytes(ctx, repo, ociimage.MediaTypeConfig, cb)
	if err != nil {
		return PushResult{}, fmt.Errorf("push the config: %w", err)
	}
	opts := oras.PackManifestOptions{Layers: layers, ConfigDescriptor: &cfgDesc}
	if created != "" {
		opts.ManifestAnnotations = map[string]string{ocispec.AnnotationCreated: created}
	}
	man, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, ociimage.ArtifactType, opts)
	if err != nil {
		return PushResult{}, fmt.Errorf("push the manifest: %w", err)
	}
	if err := repo.Tag(ctx, man, dst.Ref.Reference); err != nil {
		return PushResult{}, fmt.Errorf("tag %s: %w", dst, err)
	}
	res.Descriptor = man
	return res, nil
}

type tempFile struct{ path string }

func (t tempFile) remove() { _ = os.Remove(t.path) }

// compress writes path zstd-compressed into a temporary file, returning
// the file's info (uncompressed) and the layer's descriptor; pr hears its
// step and bytes read.
func compress(path, name, tmpDir string, pr progress.Reporter) (ociimage.FileInfo, ocispec.Descriptor, tempFile, error) {
	in, err := os.Open(path)
	if err != nil {
		return ociimage.FileInfo{}, ocispec.Descriptor{}, tempFile{}, err
	}
	defer in.Close()
	var size int64
	if st, err := in.Stat(); err == nil {
		size = st.Size()
	}
	pr.Step("compress "+name, size)
	out, err := os.CreateTemp(tmpDir, "lve-push-*.zst")
	if err != nil {
		return ociimage.FileInfo{}, ocispec.Descriptor{}, tempFile{}, err
	}
	tf := tempFile{out.Name()}
	fail := func(err error) (ociimage.FileInfo, ocispec.Descriptor, tempFile, error) {
		_ = out.Close()
		tf.remove()
		return ociimage.FileInfo{}, ocispec.Descriptor{}, tempFile{}, fmt.Errorf("compress %s: %w", path, err)
	}
	raw, packed := sha256.New(), sha256.New()
	cw := &countingWriter{w: io.MultiWriter(out, packed)}
	zw, err := zstd.NewWriter(cw, zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithEncoderConcurrency(runtime.GOMAXPROCS(0)))
	if err != nil {
		return fail(err)
	}
	n, err := io.Copy(zw, io.TeeReader(progress.Reader{R: in, P: pr}, raw))
	if err != nil {
		return fail(err)
	}
	if err := zw.Close(); err != nil {
		return fail(err)
	}
	if err := out.Close(); err != nil {
		return fail(err)
	}
	mt, _ := ociimage.MediaTypeOf(name)
	info := ociimage.FileInfo{Name: name, Size: n, SHA256: hex.EncodeToString(raw.Sum(nil))}
	desc := ocispec.Descriptor{
		MediaType:   mt,
		Digest:      digest.NewDigestFromBytes(digest.SHA256, packed.Sum(nil)),
		Size:        cw.n,
		Annotations: map[string]string{ocispec.AnnotationTitle: name},
	}
	return info, desc, tf, nil
}

type pusher interface {
	Exists(ctx context.Context, desc ocispec.Descriptor) (bool, error)
	Push(ctx context.Context, desc ocispec.Descriptor, r io.Reader) error
}

// pushBlob uploads the compressed file unless the registry has it; pr
// hears its step (name's upload) and bytes sent.
func pushBlob(ctx context.Context, repo pusher, desc ocispec.Descriptor, path, name string, pr progress.Reporter) error {
	if ok, err := repo.Exists(ctx, desc); err == nil && ok {
		pr.Step("upload "+name+": the registry has it", 0)
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	pr.Step("upload "+name, desc.Size)
	return repo.Push(ctx, desc, progress.Reader{R: f, P: pr})
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
