package transfer

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"
	"oras.land/oras-go/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// files writes an image's files (random content) and returns them.
func files(t *testing.T, sizes map[string]int) []PushFile {
	t.Helper()
	dir := t.TempDir()
	var out []PushFile
	for _, name := range ociimage.FileNames {
		n, ok := sizes[name]
		if !ok {
			continue
		}
		b := make([]byte, n)
		_, _ = rand.Read(b[:n/2]) // half random, half zeros: compressible as a disk is
		if name == ociimage.DiskFile {
			b = registrytest.Qcow2(1<<30, b) // a standalone disk as the pull checks it
		}
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, b, 0o644))
		out = append(out, PushFile{Name: name, Path: p})
	}
	return out
}

func remoteFor(reg *registrytest.Registry) Remote {
	return Remote{PlainHTTP: []string{reg.Host}, Timeout: 10 * time.Second}
}

func mustSource(t *testing.T, s string) ociimage.Source {
	t.Helper()
	src, err := ociimage.ParseSource(s)
	require.NoError(t, err)
	return src
}

func requireSameFile(t *testing.T, want, got string) {
	t.Helper()
	a, err := os.ReadFile(want)
	require.NoError(t, err)
	b, err := os.ReadFile(got)
	require.NoError(t, err)
	require.True(t, bytes.Equal(a, b), "%s differs from %s", got, want)
}

// requireNothingHalf: no image directory but the ones named, no pull left
// in tmp.
func requireNothingHalf(t *testing.T, s *ociimage.Store, want ...digest.Digest) {
	t.Helper()
	imgs, _, err := s.List()
	require.NoError(t, err)
	var got []digest.Digest
	for _, i := range imgs {
		got = append(got, i.Digest)
	}
	require.ElementsMatch(t, want, got)
	left, _ := os.ReadDir(filepath.Join(s.Dir, "tmp"))
	require.Empty(t, left, "nothing of a pull left in tmp")
}

// TestPushPullRetag: an image of disk, kernel and initrd goes to a real
// registry and comes back byte for byte; a second pull fetches nothing;
// a moved tag brings the new image and keeps the old until it is
// removed; a pinned digest pulls the old one again.
func TestPushPullRetag(t *testing.T) {
	reg := registrytest.Start(t)
	ctx := context.Background()
	r := remoteFor(reg)
	src := mustSource(t, "oci://"+reg.Host+"/vm/tiny:v1")
	v1 := files(t, map[string]int{ociimage.DiskFile: 3 << 20, ociimage.KernelFile: 200 << 10, ociimage.InitrdFile: 100 << 10})
	pushed, err := Push(ctx, r, src, v1, t.TempDir(), "2026-11-28T00:00:00Z")
	require.NoError(t, err)
	require.Len(t, pushed.Files, 3)
	require.Less(t, pushed.Compressed, int64(3<<20), "compressed")

	store := &ociimage.Store{Dir: filepath.Join(t.TempDir(), "oci")}
	_, _, err = store.Current(src)
	require.ErrorIs(t, err, ociimage.ErrNotPulled)
	// The service's umask (0077) makes nothing QEMU cannot read.
	mask := syscall.Umask(0o077)
	res, err := Pull(ctx, store, r, src)
	syscall.Umask(mask)
	require.NoError(t, err)
	for _, p := range []string{store.Dir, filepath.Dir(res.Image.Dir), res.Image.Dir} {
		st, err := os.Stat(p)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o755), st.Mode().Perm(), p)
	}
	require.True(t, res.Changed)
	require.Equal(t, pushed.Descriptor.Digest, res.Record.Digest)
	require.Positive(t, res.Fetched)
	for _, f := range v1 {
		requireSameFile(t, f.Path, res.Image.Path(f.Name))
	}
	st, err := os.Stat(res.Image.Path(ociimage.DiskFile))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o644), st.Mode().Perm(), "readable by libvirt's QEMU user")
	_, cur, err := store.Current(src)
	require.NoError(t, err)
	require.Equal(t, res.Image.Dir, cur.Dir)

	again, err := Pull(ctx, store, r, src)
	require.NoError(t, err)
	require.False(t, again.Changed)
	require.Zero(t, again.Fetched, "an image stored already is not fetched again")
	require.Equal(t, res.Record.Pulled, again.Record.Pulled)

	// The tag moves to a disk-only image.
	v2 := files(t, map[string]int{ociimage.DiskFile: 1 << 20})
	pushed2, err := Push(ctx, r, src, v2, t.TempDir(), "")
	require.NoError(t, err)
	moved, err := Pull(ctx, store, r, src)
	require.NoError(t, err)
	require.True(t, moved.Changed)
	require.Equal(t, pushed2.Descriptor.Digest, moved.Record.Digest)
	require.Empty(t, moved.Image.Path(ociimage.KernelFile))
	requireSameFile(t, v2[0].Path, moved.Image.Path(ociimage.DiskFile))
	requireNothingHalf(t, store, pushed.Descriptor.Digest, pushed2.Descriptor.Digest)

	// The old image by its digest: stored already, nothing fetched.
	pinned := mustSource(t, "oci://"+reg.Host+"/vm/tiny@"+pushed.Descriptor.Digest.String())
	old, err := Pull(ctx, store, r, pinned)
	require.NoError(t, err)
	require.Zero(t, old.Fetched)
	require.Equal(t, res.Image.Dir, old.Image.Dir)

	// Removal keeps what a VM's disk still uses, then removes it.
	keepNamed := func(inUse ...string) func(ociimage.Image, []ociimage.Record) bool {
		return func(img ociimage.Image, recs []ociimage.Record) bool {
			for _, rec := range recs {
				if rec.Source == src.String() {
					return true
				}
			}
			return img.InUse(inUse)
		}
	}
	removed, err := Remove(ctx, store, keepNamed(old.Image.Path(ociimage.DiskFile), "/var/lib/libvirt/images/other.qcow2"))
	require.NoError(t, err)
	require.Empty(t, removed, "an image a VM uses stays")
	removed, err = Remove(ctx, store, keepNamed(old.Image.Dir+"-other/disk.qcow2"))
	require.NoError(t, err)
	require.Equal(t, []digest.Digest{pushed.Descriptor.Digest}, removed)
	_, _, err = store.Current(pinned)
	require.ErrorIs(t, err, ociimage.ErrNotPulled, "the record of a removed image goes with it")
	requireNothingHalf(t, store, pushed2.Descriptor.Digest)

	// A digest the registry does not have.
	missing := mustSource(t, "oci://"+reg.Host+"/vm/tiny@sha256:"+strings.Repeat("0", 64))
	_, err = Pull(ctx, store, r, missing)
	require.Error(t, err)
	require.Contains(t, err.Error(), "not found")

	// The registry gone: the pull fails, not as a refusal of what a
	// registry sent; the last verified image stays; a pinned digest that
	// is stored does not need the registry.
	reg.Stop()
	_, err = Pull(ctx, store, r, src)
	require.Error(t, err)
	require.False(t, errors.Is(err, ociimage.ErrRefused), "a transport error is not a refusal: %v", err)
	pinned2 := mustSource(t, "oci://"+reg.Host+"/vm/tiny@"+pushed2.Descriptor.Digest.String())
	still, err := Pull(ctx, store, r, pinned2)
	require.NoError(t, err, "stored: the registry is not asked")
	require.Equal(t, moved.Image.Dir, still.Image.Dir)
	_, cur, err = store.Current(src)
	require.NoError(t, err)
	require.Equal(t, moved.Image.Dir, cur.Dir)
}

// TestPullRefuses: what a registry sends that is not an image of ours, or
// not what it claims, is refused, and nothing of it is stored.
func TestPullRefuses(t *testing.T) {
	reg := registrytest.Start(t)
	ctx := context.Background()
	r := remoteFor(reg)
	repo, err := r.repository(mustSource(t, "oci://"+reg.Host+"/vm/bad:x"))
	require.NoError(t, err)
	repo.MaxMetadataBytes = 4 << 20 // the pusher of hostile content has no bound of ours

	// pushImage pushes a hand-made artifact: config cfg, layers of data
	// (compressed as given), the manifest's artifact type at, tag tag.
	pushImage := func(t *testing.T, tag, at string, cfg any, layers map[string][]byte, annotations map[string]string) ocispec.Descriptor {
		t.Helper()
		cb, err := json.Marshal(cfg)
		require.NoError(t, err)
		cfgDesc, err := oras.PushBytes(ctx, repo, ociimage.MediaTypeConfig, cb)
		require.NoError(t, err)
		var descs []ocispec.Descriptor
		for _, name := range ociimage.FileNames {
			b, ok := layers[name]
			if !ok {
				continue
			}
			d, err := oras.PushBytes(ctx, repo, mediaTypeOf(name), b)
			require.NoError(t, err)
			descs = append(descs, d)
		}
		man, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, at,
			oras.PackManifestOptions{Layers: descs, ConfigDescriptor: &cfgDesc, ManifestAnnotations: annotations})
		require.NoError(t, err)
		require.NoError(t, repo.Tag(ctx, man, tag))
		return man
	}
	zst := func(b []byte) []byte {
		enc, err := zstd.NewWriter(nil)
		require.NoError(t, err)
		return enc.EncodeAll(b, nil)
	}
	sum := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	disk := bytes.Repeat([]byte("qcow"), 1024)
	good := ociimage.ImageConfig{Format: 1, Files: []ociimage.FileInfo{{Name: ociimage.DiskFile, Size: int64(len(disk)), SHA256: sum(disk)}}}

	for _, tc := range []struct {
		name, want string
		push       func(t *testing.T, tag string)
	}{
		{"another artifact type", "not a libvirt-executor image", func(t *testing.T, tag string) {
			b, _ := json.Marshal(map[string]string{"hello": "world"})
			cfgDesc, err := oras.PushBytes(ctx, repo, "application/vnd.example.config+json", b)
			require.NoError(t, err)
			man, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, "application/vnd.example.thing",
				oras.PackManifestOptions{ConfigDescriptor: &cfgDesc})
			require.NoError(t, err)
			require.NoError(t, repo.Tag(ctx, man, tag))
		}},
		{"a huge manifest", "at most 65536 bytes", func(t *testing.T, tag string) {
			pushImage(t, tag, ociimage.ArtifactType, good, map[string][]byte{ociimage.DiskFile: zst(disk)},
				map[string]string{"padding": strings.Repeat("x", 100<<10)})
		}},
		{"a file name of its own", "allowed once each", func(t *testing.T, tag string) {
			bad := ociimage.ImageConfig{Format: 1, Files: []ociimage.FileInfo{{Name: "../../etc/cron.d/x", Size: int64(len(disk)), SHA256: sum(disk)}}}
			pushImage(t, tag, ociimage.ArtifactType, bad, map[string][]byte{ociimage.DiskFile: zst(disk)}, nil)
		}},
		{"no disk", "no disk.qcow2", func(t *testing.T, tag string) {
			k := []byte("kernel")
			cfg := ociimage.ImageConfig{Format: 1, Files: []ociimage.FileInfo{{Name: ociimage.KernelFile, Size: int64(len(k)), SHA256: sum(k)}}}
			pushImage(t, tag, ociimage.ArtifactType, cfg, map[string][]byte{ociimage.KernelFile: zst(k)}, nil)
		}},
		{"a newer config format", "reads format 1", func(t *testing.T, tag string) {
			cfg := good
			cfg.Format = 2
			pushImage(t, tag, ociimage.ArtifactType, cfg, map[string][]byte{ociimage.DiskFile: zst(disk)}, nil)
		}},
		{"more bytes than the config says (a zstd bomb)", "the config says", func(t *testing.T, tag string) {
			cfg := ociimage.ImageConfig{Format: 1, Files: []ociimage.FileInfo{{Name: ociimage.DiskFile, Size: 100, SHA256: sum(disk[:100])}}}
			pushImage(t, tag, ociimage.ArtifactType, cfg, map[string][]byte{ociimage.DiskFile: zst(make([]byte, 50<<20))}, nil)
		}},
		{"other bytes than the config says", "the config says", func(t *testing.T, tag string) {
			other := bytes.Repeat([]byte("QCOW"), 1024)
			pushImage(t, tag, ociimage.ArtifactType, good, map[string][]byte{ociimage.DiskFile: zst(other)}, nil)
		}},
		{"a layer that is not zstd", "refused", func(t *testing.T, tag string) {
			pushImage(t, tag, ociimage.ArtifactType, good, map[string][]byte{ociimage.DiskFile: disk}, nil)
		}},
		{"a truncated layer", "refused", func(t *testing.T, tag string) {
			z := zst(disk)
			pushImage(t, tag, ociimage.ArtifactType, good, map[string][]byte{ociimage.DiskFile: z[:len(z)/2]}, nil)
		}},
		{"a corrupted blob in the registry", "refused", func(t *testing.T, tag string) {
			content := append([]byte("corrupt-me"), disk...)
			z := zst(content)
			cfg := ociimage.ImageConfig{Format: 1, Files: []ociimage.FileInfo{{Name: ociimage.DiskFile, Size: int64(len(content)), SHA256: sum(content)}}}
			pushImage(t, tag, ociimage.ArtifactType, cfg, map[string][]byte{ociimage.DiskFile: z}, nil)
			// The registry's stored bytes change behind its back (a
			// disk error, a tampered mirror): same length, other bytes.
			p := reg.BlobPath(digest.FromBytes(z).Encoded())
			b, err := os.ReadFile(p)
			require.NoError(t, err)
			b[len(b)-1] ^= 0xff
			require.NoError(t, os.WriteFile(p, b, 0o644))
		}},
		{"a blob that decompresses right but is not the one named", "Content-Length", func(t *testing.T, tag string) {
			content := append([]byte("recompressed"), disk...)
			z := zst(content)
			cfg := ociimage.ImageConfig{Format: 1, Files: []ociimage.FileInfo{{Name: ociimage.DiskFile, Size: int64(len(content)), SHA256: sum(content)}}}
			pushImage(t, tag, ociimage.ArtifactType, cfg, map[string][]byte{ociimage.DiskFile: z}, nil)
			// The same file compressed otherwise: the uncompressed
			// check alone would pass; the layer's digest does not.
			enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedBestCompression), zstd.WithEncoderCRC(false))
			require.NoError(t, err)
			other := enc.EncodeAll(content, nil)
			require.NotEqual(t, z, other)
			require.NoError(t, os.WriteFile(reg.BlobPath(digest.FromBytes(z).Encoded()), other, 0o644))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tag := strings.NewReplacer(" ", "-", "(", "", ")", "").Replace(tc.name)
			tc.push(t, tag)
			store := &ociimage.Store{Dir: filepath.Join(t.TempDir(), "oci")}
			src := mustSource(t, "oci://"+reg.Host+"/vm/bad:"+tag)
			_, err := Pull(ctx, store, r, src)
			require.Error(t, err)
			require.True(t, errors.Is(err, ociimage.ErrRefused), "refused, not a transport error: %v", err)
			require.Contains(t, err.Error(), tc.want)
			requireNothingHalf(t, store)
			_, _, err = store.Current(src)
			require.ErrorIs(t, err, ociimage.ErrNotPulled)
		})
	}
}

func TestPushRefuses(t *testing.T) {
	ctx := context.Background()
	r := Remote{}
	f := files(t, map[string]int{ociimage.DiskFile: 10, ociimage.KernelFile: 10})
	_, err := Push(ctx, r, mustSource(t, "oci://r.example/x@sha256:"+strings.Repeat("a", 64)), f, t.TempDir(), "")
	require.ErrorContains(t, err, "name a tag")
	_, err = Push(ctx, r, mustSource(t, "oci://r.example/x:v1"), f[1:], t.TempDir(), "")
	require.ErrorContains(t, err, "needs its disk")
	_, err = Push(ctx, r, mustSource(t, "oci://r.example/x:v1"), append(f, PushFile{Name: "cmdline", Path: f[0].Path}), t.TempDir(), "")
	require.ErrorContains(t, err, "allowed once each")
}

func mediaTypeOf(name string) string {
	mt, _ := ociimage.MediaTypeOf(name)
	return mt
}

// TestPullAfterACrash: what a pull killed half-way left in tmp/ goes at
// the next pull; an image directory whose config.json did not reach the
// disk (a power loss) is set aside and fetched again, not an error forever.
func TestPullAfterACrash(t *testing.T) {
	reg := registrytest.Start(t)
	ctx := context.Background()
	r := remoteFor(reg)
	src := mustSource(t, "oci://"+reg.Host+"/vm/tiny:v1")
	pushed, err := Push(ctx, r, src, files(t, map[string]int{ociimage.DiskFile: 1 << 20}), t.TempDir(), "")
	require.NoError(t, err)
	store := &ociimage.Store{Dir: filepath.Join(t.TempDir(), "oci")}
	left := filepath.Join(store.Dir, "tmp", "pull-123")
	require.NoError(t, os.MkdirAll(left, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(left, ociimage.DiskFile), make([]byte, 1<<20), 0o644))
	res, err := Pull(ctx, store, r, src)
	require.NoError(t, err)
	requireNothingHalf(t, store, pushed.Descriptor.Digest)

	// The image's config.json empty, as after a power loss.
	require.NoError(t, os.WriteFile(filepath.Join(res.Image.Dir, "config.json"), nil, 0o644))
	_, err = store.Image(pushed.Descriptor.Digest)
	require.Error(t, err)
	again, err := Pull(ctx, store, r, src)
	require.NoError(t, err)
	require.Positive(t, again.Fetched, "fetched again")
	_, err = store.Image(pushed.Descriptor.Digest)
	require.NoError(t, err)
	_, err = Pull(ctx, store, r, src) // and the damaged copy set aside goes at the next lock
	require.NoError(t, err)
	requireNothingHalf(t, store, pushed.Descriptor.Digest)
}

// TestPullRefusesADiskNamingAHostFile: a disk whose qcow2 header names a
// backing file, an external data file, or a virtual size past the bound
// is refused by the pull, naming the field and the value; the store is
// left as it was (the image stored before still named, nothing half).
func TestPullRefusesADiskNamingAHostFile(t *testing.T) {
	reg := registrytest.Start(t)
	ctx := context.Background()
	r := remoteFor(reg)
	store := &ociimage.Store{Dir: filepath.Join(t.TempDir(), "oci"), MaxVirtualBytes: 8 << 30}
	src := mustSource(t, "oci://"+reg.Host+"/vm/tiny:v1")
	good, err := Push(ctx, r, src, files(t, map[string]int{ociimage.DiskFile: 1 << 20}), t.TempDir(), "")
	require.NoError(t, err)
	first, err := Pull(ctx, store, r, src)
	require.NoError(t, err)
	require.Equal(t, good.Descriptor.Digest, first.Record.Digest)

	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	require.NoError(t, os.WriteFile(secret, []byte("root only"), 0o600))
	for _, c := range []struct {
		name, want string
		args       []string
	}{
		{"backing", `backing file "` + secret + `"`, []string{"-b", secret, "-F", "raw", "1M"}},
		{"data", "data", []string{"-o", "data_file=" + secret + ".data", "1M"}},
		{"huge", "virtual size 1125899906842624 bytes", []string{"1P"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(dir, c.name+".qcow2")
			args := append([]string{"create", "-q", "-f", "qcow2"}, c.args[:len(c.args)-1]...)
			out, err := exec.Command("qemu-img", append(args, p, c.args[len(c.args)-1])...).CombinedOutput()
			require.NoError(t, err, "%s", out)
			_, err = Push(ctx, r, src, []PushFile{{Name: ociimage.DiskFile, Path: p}}, t.TempDir(), "")
			require.NoError(t, err)
			_, err = Pull(ctx, store, r, src)
			require.ErrorIs(t, err, ociimage.ErrRefused)
			require.ErrorContains(t, err, c.want)
			require.ErrorContains(t, err, "vm/tiny:v1")
			requireNothingHalf(t, store, good.Descriptor.Digest)
			rec, _, err := store.Current(src)
			require.NoError(t, err)
			require.Equal(t, good.Descriptor.Digest, rec.Digest, "the source still names the image stored before")
		})
	}
}
