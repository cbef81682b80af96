package hostcache

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// disk lays out a scratch disk: the manifest text at 0, then data at
// each offset.
func disk(manifest string, data map[int64]string, size int64) []byte {
	b := make([]byte, size)
	copy(b, manifest)
	for off, d := range data {
		copy(b[off:], d)
	}
	return b
}

func readAllTar(t *testing.T, r io.Reader) (map[string]string, error) {
	t.Helper()
	got := map[string]string{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return got, nil
		}
		if err != nil {
			return got, err
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return got, err
		}
		got[h.Name] = string(b)
	}
}

func TestFromDiskDirect(t *testing.T) {
	const M = DirectManifestMax
	man := DirectMagic + "\n" +
		"1048576 5 ./a/cache.zip\n" +
		"1052672 0 ./empty\n" +
		"1052672 11 ./name with spaces\n" +
		"end\n"
	b := disk(man, map[int64]string{M: "hello", M + 4096: "hello world"}, 2*M)
	r, err := FromDisk(bytes.NewReader(b), 100)
	require.NoError(t, err)
	got, err := readAllTar(t, r)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"./a/cache.zip": "hello", "./empty": "", "./name with spaces": "hello world"}, got)
	require.NoError(t, r.Close())
}

func TestFromDiskTar(t *testing.T) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "./k", Typeflag: tar.TypeReg, Size: 2, Mode: 0o644}))
	_, err := tw.Write([]byte("hi"))
	require.NoError(t, err)
	require.NoError(t, tw.Close())
	b := append(buf.Bytes(), make([]byte, 4096)...) // the disk goes on
	r, err := FromDisk(bytes.NewReader(b), 100)
	require.NoError(t, err)
	got, err := readAllTar(t, r)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"./k": "hi"}, got)
}

// A hostile or unfinished manifest is refused with what is wrong; a disk
// cut short ends the stream in an error, never in a shorter file.
func TestFromDiskHostile(t *testing.T) {
	const M = DirectManifestMax
	for _, tc := range []struct {
		name, man string
		want      string
		limit     bool
	}{
		{"no end line", DirectMagic + "\n1048576 5 ./a\n", `no "end" line`, false},
		{"offset in the manifest", DirectMagic + "\n4096 5 ./a\nend\n", "from 1048576", false},
		{"unaligned offset", DirectMagic + "\n1048577 5 ./a\nend\n", "multiple of 4096", false},
		{"overlapping files", DirectMagic + "\n1048576 5000 ./a\n1052672 5 ./b\nend\n", "from 1056768", false},
		{"going back", DirectMagic + "\n1056768 5 ./a\n1048576 5 ./b\nend\n", "increasing order", false},
		{"negative size", DirectMagic + "\n1048576 -5 ./a\nend\n", "decimal numbers", false},
		{"no name", DirectMagic + "\n1048576 5\nend\n", "<offset> <size> <name>", false},
		{"over the limit", DirectMagic + "\n1048576 6000 ./a\n1056768 6000 ./b\nend\n", "more than the bytes allowed", true},
		{"offset past the disk", DirectMagic + "\n9223372036854771712 5 ./a\nend\n", "to 1062672", false},
		{"NUL in a name", DirectMagic + "\n1048576 5 ./a\x00b\nend\n", "NUL", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := FromDisk(bytes.NewReader(disk(tc.man, nil, 2*M)), 10000)
			require.ErrorContains(t, err, tc.want)
			require.Equal(t, tc.limit, errors.Is(err, ErrProjectLimit), "%v", err)
		})
	}
	t.Run("disk cut short", func(t *testing.T) {
		man := DirectMagic + "\n1048576 5 ./a\n1052672 5000 ./b\nend\n"
		r, err := FromDisk(bytes.NewReader(disk(man, map[int64]string{M: "hello"}, M+4096+100)), 1<<20)
		require.NoError(t, err)
		_, err = readAllTar(t, r)
		require.ErrorContains(t, err, `ends within "./b"`)
	})
	t.Run("manifest cut short", func(t *testing.T) {
		_, err := FromDisk(strings.NewReader(DirectMagic+"\n1048576 5 ./a\nend\n"), 100)
		require.ErrorContains(t, err, "manifest")
	})
}

// A kept file carries its sha256 in sumXattr; the next save of the same
// bytes compares with it (the file is not read again), and a sum that
// differs makes the file count as changed.
func TestKeptSumXattr(t *testing.T) {
	s, _ := newStore(t, 1<<20, 1<<20)
	p := project(t, 1)
	require.EqualValues(t, 1, save(t, s, p, files("k/cache.zip", "archive")...).Files)
	kept := filepath.Join(s.Dir, projectsDir, p, treeName, "k", "cache.zip")
	v := make([]byte, sha256.Size+8)
	n, err := unix.Getxattr(kept, sumXattr, v)
	require.NoError(t, err, "the file system of the test's temporary directory keeps user xattrs")
	require.Equal(t, sha256.Size+8, n)
	want := sha256.Sum256([]byte("archive"))
	require.Equal(t, want[:], v[:sha256.Size])

	res := save(t, s, p, files("k/cache.zip", "archive")...)
	require.EqualValues(t, 1, res.Unchanged)

	// A wrong sum (the mtime still the file's) decides: the bytes are
	// not read.
	_, err = unix.Getxattr(kept, sumXattr, v)
	require.NoError(t, err)
	clear(v[:sha256.Size])
	require.NoError(t, unix.Setxattr(kept, sumXattr, v, 0))
	res = save(t, s, p, files("k/cache.zip", "archive")...)
	require.EqualValues(t, 0, res.Unchanged, "the kept sum, not the bytes, decided")
	require.EqualValues(t, 1, res.Files)

	// Rewritten in place since (the xattr stays, the mtime moves): the
	// bytes are read.
	require.NoError(t, os.WriteFile(kept, []byte("ARCHIVE"), 0o600))
	res = save(t, s, p, files("k/cache.zip", "archive")...)
	require.EqualValues(t, 1, res.Files, "same size, other bytes: not unchanged")

	require.NoError(t, unix.Removexattr(kept, sumXattr))
	res = save(t, s, p, files("k/cache.zip", "archive")...)
	require.EqualValues(t, 1, res.Unchanged, "without the xattr the bytes are read")
}
