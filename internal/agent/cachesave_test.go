//go:build linux

package agent

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachelayout"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/cachetest"
)

// cacheDisk is a file standing in for the scratch disk, of size bytes.
func cacheDisk(t *testing.T, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk")
	require.NoError(t, os.WriteFile(p, nil, 0o600))
	require.NoError(t, os.Truncate(p, size))
	return p
}

// readDisk is what the host keeps of the disk, which must hold the direct
// layout.
func readDisk(t *testing.T, disk string) map[string][]byte {
	t.Helper()
	f, err := os.Open(disk)
	require.NoError(t, err)
	defer f.Close()
	head := make([]byte, len(cachelayout.Magic))
	_, err = io.ReadFull(f, head)
	require.NoError(t, err)
	require.Equal(t, cachelayout.Magic, string(head), "the disk holds the direct layout")
	return cachetest.Kept(t, disk, 1<<30)
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}

// The agent's save writes what the host reads back byte for byte: files
// of sizes around the alignment and the copy's chunk, an empty one, in
// directories; links and fifos are left out, nothing outside DIR is read
// through them, and DIR is left as it was.
func TestCacheSaveWritesTheDirectLayout(t *testing.T) {
	dir := t.TempDir()
	want := map[string][]byte{
		"./key/cache.zip":    randomBytes(t, 3*copyChunk+123),
		"./key/small":        randomBytes(t, 1),
		"./other/exact":      randomBytes(t, cachelayout.Align),
		"./other/chunk":      randomBytes(t, copyChunk),
		"./empty":            {},
		"./a b/name with sp": randomBytes(t, 5000),
	}
	for n, b := range want {
		p := filepath.Join(dir, n)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, b, 0o600))
	}
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte("not the cache's"), 0o600))
	require.NoError(t, os.Symlink(secret, filepath.Join(dir, "key", "link")))
	require.NoError(t, os.Symlink(filepath.Dir(secret), filepath.Join(dir, "dirlink")))
	require.NoError(t, syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o600))

	disk := cacheDisk(t, 64<<20)
	var out, errOut bytes.Buffer
	rc := CacheSave([]string{disk, dir}, strings.NewReader(""), &out, &errOut)
	require.Equal(t, 0, rc)
	require.Equal(t, cachelayout.Written+" 0 direct agent\n", out.String(), errOut.String())
	require.Equal(t, want, readDisk(t, disk))
	_, err := os.Lstat(filepath.Join(dir, "key", "link"))
	require.NoError(t, err, "DIR is left as it was")
}

// Armed, it writes nothing until go, and nothing at all without it.
func TestCacheSaveArmed(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o600))
	disk := cacheDisk(t, 4<<20)
	var out bytes.Buffer
	require.Equal(t, 0, CacheSave([]string{"--armed", disk, dir}, strings.NewReader("stop\n"), &out, io.Discard))
	require.Equal(t, cachelayout.NotAsked+"\n", out.String())
	b, err := os.ReadFile(disk)
	require.NoError(t, err)
	require.Equal(t, make([]byte, 4<<20), b, "nothing written")

	out.Reset()
	require.Equal(t, 0, CacheSave([]string{"--armed", disk, dir}, strings.NewReader(""), &out, io.Discard))
	require.Equal(t, cachelayout.NotAsked+"\n", out.String(), "stdin ended without go")

	out.Reset()
	require.Equal(t, 0, CacheSave([]string{"--armed", disk, dir}, strings.NewReader(cachelayout.Go+"\n"), &out, io.Discard))
	require.Equal(t, cachelayout.Written+" 0 direct agent\n", out.String())
	require.Equal(t, map[string][]byte{"./f": []byte("x")}, readDisk(t, disk))
}

// What the layout cannot carry is said (the host's shell save writes a tar
// stream then), and no manifest is written: more than MaxDirectFiles
// files, a name with a newline, a disk too small. A cache_dir that does
// not exist is an empty cache.
func TestCacheSaveNotDirect(t *testing.T) {
	cases := map[string]func(t *testing.T, dir string) int64{
		"too many files": func(t *testing.T, dir string) int64 {
			for i := range cachelayout.MaxDirectFiles + 1 {
				require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprint(i)), nil, 0o600))
			}
			return 4 << 20
		},
		"a newline in a name": func(t *testing.T, dir string) int64 {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "a\nb"), []byte("x"), 0o600))
			return 4 << 20
		},
		"no room": func(t *testing.T, dir string) int64 {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "big"), randomBytes(t, 2<<20), 0o600))
			return 2 << 20
		},
	}
	for name, setup := range cases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			disk := cacheDisk(t, setup(t, dir))
			var out, errOut bytes.Buffer
			require.Equal(t, 0, CacheSave([]string{disk, dir}, strings.NewReader(""), &out, &errOut))
			require.Equal(t, cachelayout.NotDirect+"\n", out.String())
			require.NotEmpty(t, errOut.String(), "why is said")
			head := make([]byte, len(cachelayout.Magic))
			f, err := os.Open(disk)
			require.NoError(t, err)
			defer f.Close()
			_, err = io.ReadFull(f, head)
			require.NoError(t, err)
			require.NotEqual(t, cachelayout.Magic, string(head), "no manifest")
		})
	}
	t.Run("no cache_dir", func(t *testing.T) {
		disk := cacheDisk(t, 2<<20)
		var out bytes.Buffer
		require.Equal(t, 0, CacheSave([]string{disk, filepath.Join(t.TempDir(), "none")}, strings.NewReader(""), &out, io.Discard))
		require.Equal(t, cachelayout.Written+" 0 direct agent\n", out.String())
		require.Empty(t, readDisk(t, disk))
	})
	t.Run("cache_dir a link to a directory", func(t *testing.T) {
		real := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(real, "f"), []byte("through the link"), 0o600))
		link := filepath.Join(t.TempDir(), "cache")
		require.NoError(t, os.Symlink(real, link))
		disk := cacheDisk(t, 4<<20)
		var out bytes.Buffer
		require.Equal(t, 0, CacheSave([]string{disk, link}, strings.NewReader(""), &out, io.Discard))
		require.Equal(t, cachelayout.Written+" 0 direct agent\n", out.String())
		require.Equal(t, map[string][]byte{"./f": []byte("through the link")}, readDisk(t, disk), "followed, as the shell's cd does")
	})
	t.Run("bad arguments", func(t *testing.T) {
		var errOut bytes.Buffer
		require.Equal(t, 2, CacheSave([]string{"only-one"}, strings.NewReader(""), io.Discard, &errOut))
		require.Contains(t, errOut.String(), "want [--armed] DEVICE DIR")
	})
}

// The built agent takes the subcommand (the host starts it so), and an
// agent given other arguments says what it takes.
func TestCacheSaveThroughTheBinary(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), []byte("bytes"), 0o600))
	disk := cacheDisk(t, 4<<20)
	cmd := exec.Command(agentBin, "cache-save", "--armed", disk, dir)
	cmd.Stdin = strings.NewReader(cachelayout.Go + "\n")
	out, err := cmd.Output()
	require.NoError(t, err)
	require.Equal(t, cachelayout.Written+" 0 direct agent\n", string(out))
	require.Equal(t, map[string][]byte{"./f": []byte("bytes")}, readDisk(t, disk))

	b, err := exec.Command(agentBin, "nonsense").CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(b), "cache-save [--armed] DEVICE DIR")
}

// A file whose size is not the listed one any more (the job's processes
// still writing it) fails the copy, grown or shrunk, so no manifest
// describes bytes that were not written.
func TestCacheSaveFileChanged(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "f"), randomBytes(t, 10000), 0o600))
	d, err := os.OpenFile(cacheDisk(t, 4<<20), os.O_RDWR, 0)
	require.NoError(t, err)
	defer d.Close()
	bufs := newBuffers()
	require.NoError(t, copyAt(d, bufs, dir, layoutFile{name: "./f", size: 10000, off: cachelayout.ManifestMax}))
	require.ErrorContains(t, copyAt(d, bufs, dir, layoutFile{name: "./f", size: 9000, off: cachelayout.ManifestMax}), "changed while it was copied")
	// Shrunk since it was listed: the mapping's pages past the file's end
	// fail the write (EFAULT), they do not fault the agent.
	require.ErrorContains(t, copyAt(d, bufs, dir, layoutFile{name: "./f", size: 20000, off: cachelayout.ManifestMax}), "bad address")
	// The same through reads (a file that cannot be mapped).
	src, err := os.Open(filepath.Join(dir, "f"))
	require.NoError(t, err)
	defer src.Close()
	require.ErrorContains(t, copyRead(d, bufs, src, layoutFile{name: "./f", size: 20000, off: cachelayout.ManifestMax}), "10000 of its 20000 bytes read")
	require.Len(t, bufs, inFlight, "every buffer back after a failed copy")
	// A write that fails (a disk opened read-only) fails the copy, both
	// ways.
	ro, err := os.Open(d.Name())
	require.NoError(t, err)
	defer ro.Close()
	require.ErrorContains(t, copyAt(ro, bufs, dir, layoutFile{name: "./f", size: 10000, off: cachelayout.ManifestMax}), "writing \"./f\" on the disk")
	_, err = src.Seek(0, io.SeekStart)
	require.NoError(t, err)
	require.ErrorContains(t, copyRead(ro, bufs, src, layoutFile{name: "./f", size: 10000, off: cachelayout.ManifestMax}), "writing \"./f\" on the disk")
	require.Len(t, bufs, inFlight)
	// Read, a file's bytes land as mapped ones do.
	_, err = src.Seek(0, io.SeekStart)
	require.NoError(t, err)
	require.NoError(t, copyRead(d, bufs, src, layoutFile{name: "./f", size: 10000, off: cachelayout.ManifestMax + 1<<20}))
	got := make([]byte, 10000)
	_, err = d.ReadAt(got, cachelayout.ManifestMax+1<<20)
	require.NoError(t, err)
	want, err := os.ReadFile(filepath.Join(dir, "f"))
	require.NoError(t, err)
	require.Equal(t, want, got)
}
