package hostcache

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/iotest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// clock is a settable Now.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Set(t time.Time) { c.mu.Lock(); defer c.mu.Unlock(); c.t = t }

var t0 = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

// newStore is a store whose limits count bytes: a directory and an empty
// file are charged one byte, not a block (newBlockStore).
func newStore(t *testing.T, projectLimit, totalLimit int64) (*Store, *clock) {
	t.Helper()
	s, c := newBlockStore(t, projectLimit, totalLimit)
	s.blockSize = 1
	return s, c
}

// newBlockStore is a store as configured: every file charged whole
// blocks, at least one, and each directory one.
func newBlockStore(t *testing.T, projectLimit, totalLimit int64) (*Store, *clock) {
	t.Helper()
	c := &clock{t: t0}
	return &Store{Dir: filepath.Join(t.TempDir(), "store"), ProjectLimit: projectLimit, TotalLimit: totalLimit, Now: c.Now}, c
}

func project(t *testing.T, id int64) string {
	t.Helper()
	p, err := ProjectID("https://gitlab.example.com", id, true)
	require.NoError(t, err)
	return p
}

type ent struct {
	name string
	typ  byte // 0: regular
	body string
	link string
}

func mkTar(t *testing.T, ents ...ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: 0o777, Linkname: e.link}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
			h.Size = int64(len(e.body))
		}
		require.NoError(t, tw.WriteHeader(h))
		_, err := tw.Write([]byte(e.body))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

func files(kv ...string) []ent {
	var out []ent
	for i := 0; i < len(kv); i += 2 {
		out = append(out, ent{name: kv[i], body: kv[i+1]})
	}
	return out
}

func save(t *testing.T, s *Store, p string, ents ...ent) SaveResult {
	t.Helper()
	res, err := s.Save(context.Background(), p, bytes.NewReader(mkTar(t, ents...)), All)
	require.NoError(t, err)
	return res
}

// restore returns the project's files as Restore streams them, and checks
// the stream holds nothing but directories and regular files.
func restore(t *testing.T, s *Store, p string) map[string]string {
	t.Helper()
	var buf bytes.Buffer
	res, err := s.Restore(context.Background(), p, &buf)
	require.NoError(t, err)
	got := readTar(t, buf.Bytes())
	assert.EqualValues(t, len(got), res.Files)
	return got
}

func readTar(t *testing.T, b []byte) map[string]string {
	t.Helper()
	got := map[string]string{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return got
		}
		require.NoError(t, err)
		require.False(t, strings.HasPrefix(h.Name, "/") || strings.Contains(h.Name, ".."), h.Name)
		if h.Typeflag == tar.TypeDir {
			continue
		}
		require.Equal(t, byte(tar.TypeReg), h.Typeflag, h.Name)
		body, err := io.ReadAll(tr)
		require.NoError(t, err)
		got[h.Name] = string(body)
	}
}

// stageEntries lists Dir/stage.
func stageEntries(t *testing.T, s *Store) []string {
	t.Helper()
	es, err := os.ReadDir(filepath.Join(s.Dir, stageDir))
	require.NoError(t, err)
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

func TestProjectID(t *testing.T) {
	for _, tc := range []struct {
		instance string
		id       int64
		want     string // "" for an error
	}{
		{"gitlab.com", 42, "-42"},
		{"../../etc\n\x00", 1, "-1"},
		{"gitlab.com", 9223372036854775807, "-9223372036854775807"},
		{"", 1, ""},
		{"gitlab.com", 0, ""},
		{"gitlab.com", -5, ""},
	} {
		for _, protected := range []bool{true, false} {
			p, err := ProjectID(tc.instance, tc.id, protected)
			if tc.want == "" {
				assert.Error(t, err, "%q %d", tc.instance, tc.id)
				continue
			}
			require.NoError(t, err)
			suffix := "-u"
			if protected {
				suffix = "-p"
			}
			assert.True(t, strings.HasSuffix(p, tc.want+suffix), p)
			assert.NoError(t, checkJobProject(p))
		}
	}
	a, _ := ProjectID("a", 1, true)
	b, _ := ProjectID("b", 1, true)
	assert.NotEqual(t, a, b)
	for _, bad := range []string{"", "..", "x", "0123456789abcdef-0", "0123456789abcdef-1/..", "0123456789ABCDEF-1", "0123456789abcdef-1-x", "0123456789abcdef-1-p/.."} {
		assert.Error(t, checkProject(bad), bad)
		_, err := (&Store{Dir: t.TempDir(), ProjectLimit: 1, TotalLimit: 1}).Save(context.Background(), bad, strings.NewReader(""), All)
		assert.Error(t, err, bad)
	}
}

// A project's protected and unprotected refs have caches of their own: a
// save of one is never seen by a restore of the other, and a save of the
// unprotected one (whatever names its stream carries, the protected key's
// archive included) leaves the protected one's archive as it was.
func TestProtectedApart(t *testing.T) {
	s, _ := newStore(t, 1<<20, 1<<20)
	ctx := context.Background()
	prot, err := ProjectID("https://gitlab.example.com", 7, true)
	require.NoError(t, err)
	unprot, err := ProjectID("https://gitlab.example.com", 7, false)
	require.NoError(t, err)
	require.NotEqual(t, prot, unprot)

	const key = "ns/p/deps-protected/cache.zip"
	_, err = s.Save(ctx, prot, bytes.NewReader(mkTar(t, ent{name: key, body: "protected bytes"})), Only([]string{key}))
	require.NoError(t, err)

	// The unprotected ref's job sends the protected key's name too.
	res, err := s.Save(ctx, unprot, bytes.NewReader(mkTar(t, ent{name: key, body: "poison"},
		ent{name: "ns/p/deps-non_protected/cache.zip", body: "mine"})), All)
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Files)

	require.Equal(t, map[string]string{key: "protected bytes"}, restore(t, s, prot))
	require.Equal(t, map[string]string{key: "poison", "ns/p/deps-non_protected/cache.zip": "mine"}, restore(t, s, unprot))
}

// Only the files the filter names are kept; the others are left out,
// counted and named in the result, and never reach the store. A filter
// that names none keeps nothing, and the project's earlier cache stays.
func TestSaveKeepsOnlyNamed(t *testing.T) {
	s, _ := newStore(t, 1<<20, 1<<20)
	ctx := context.Background()
	p := project(t, 1)
	const key = "ns/p/k-protected/cache.zip"
	_, err := s.Save(ctx, p, bytes.NewReader(mkTar(t, ent{name: key, body: "v1"})), All)
	require.NoError(t, err)

	stream := mkTar(t, ent{name: "./" + key, body: "v2"}, ent{name: "ns/p/other-protected/cache.zip", body: "planted"},
		ent{name: "k-protected/cache.zip", body: "a suffix of the named one"}, ent{name: "junk", body: "x"})
	res, err := s.Save(ctx, p, bytes.NewReader(stream), Only([]string{key}))
	require.NoError(t, err)
	require.EqualValues(t, 1, res.Files)
	require.EqualValues(t, 3, res.SkipCount)
	require.Len(t, res.Skipped, 3)
	for _, sk := range res.Skipped {
		require.Contains(t, sk, NotNamed)
	}
	require.Equal(t, map[string]string{key: "v2"}, restore(t, s, p))

	res, err = s.Save(ctx, p, bytes.NewReader(mkTar(t, ent{name: key, body: "v3"})), Only(nil))
	require.NoError(t, err)
	require.EqualValues(t, 0, res.Files)
	require.EqualValues(t, 1, res.SkipCount)
	require.Equal(t, map[string]string{key: "v2"}, restore(t, s, p), "a save that names nothing leaves the cache as it was")

	_, err = s.Save(ctx, p, bytes.NewReader(mkTar(t, ent{name: key, body: "v4"})), nil)
	require.ErrorContains(t, err, "no filter")
	require.Equal(t, map[string]string{key: "v2"}, restore(t, s, p))
}

// A cache of a release that kept protected and unprotected refs together
// (a name without -p or -u) is never restored into a job nor saved to;
// List sees it, and Remove and Prune remove it.
func TestLegacyProjectNotUsed(t *testing.T) {
	s, c := newStore(t, 1<<20, 1<<20)
	ctx := context.Background()
	p := project(t, 3)
	_, err := s.Save(ctx, p, bytes.NewReader(mkTar(t, ent{name: "ns/p/k/cache.zip", body: "old"})), All)
	require.NoError(t, err)
	legacy := strings.TrimSuffix(p, "-p")
	require.NoError(t, os.Rename(filepath.Join(s.Dir, "projects", p), filepath.Join(s.Dir, "projects", legacy)))

	_, err = s.Open(ctx, legacy)
	require.ErrorContains(t, err, "older release")
	_, err = s.Save(ctx, legacy, bytes.NewReader(mkTar(t, ent{name: "ns/p/k/cache.zip", body: "new"})), All)
	require.ErrorContains(t, err, "older release")
	us, err := s.List()
	require.NoError(t, err)
	require.Len(t, us, 1)
	require.Equal(t, legacy, us[0].Project)
	require.EqualValues(t, 1, us[0].Files)

	c.Set(t0.Add(48 * time.Hour))
	removed, err := s.Prune(ctx, time.Hour)
	require.NoError(t, err)
	require.Equal(t, []string{legacy}, removed)
	require.NoError(t, s.Remove(ctx, legacy), "removing one that is gone is no error")
}

func TestRoundTrip(t *testing.T) {
	s, c := newStore(t, 1<<20, 1<<20)
	p := project(t, 1)
	assert.Empty(t, restore(t, s, p), "no cache: an empty tar")

	res := save(t, s, p, append(files(
		"./cache.zip", "zip",
		"a/b/c/deep.txt", "deep",
		"./a/b/other", "other",
		"empty", ""),
		ent{name: "a/", typ: tar.TypeDir})...)
	assert.EqualValues(t, 4, res.Files)
	assert.EqualValues(t, 3+4+5, res.Bytes)
	assert.Zero(t, res.SkipCount, res.Skipped)
	want := map[string]string{"cache.zip": "zip", "a/b/c/deep.txt": "deep", "a/b/other": "other", "empty": ""}
	assert.Equal(t, want, restore(t, s, p))

	fi, err := os.Stat(filepath.Join(s.Dir, projectsDir, p, treeName, "a/b/c/deep.txt"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	fi, err = os.Stat(s.Dir)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm())

	// Same content again: unchanged; a changed file replaced; files the
	// stream lacks kept.
	c.Set(t0.Add(time.Hour))
	res = save(t, s, p, files("cache.zip", "zip", "a/b/other", "OTHER!")...)
	assert.EqualValues(t, 1, res.Files)
	assert.EqualValues(t, 1, res.Unchanged)
	want["a/b/other"] = "OTHER!"
	assert.Equal(t, want, restore(t, s, p))
	fi, err = os.Stat(filepath.Join(s.Dir, projectsDir, p, treeName, "cache.zip"))
	require.NoError(t, err)
	assert.Equal(t, t0.Add(time.Hour), fi.ModTime().UTC(), "an unchanged file counts as written now")

	// Later duplicates win; a file where a directory was replaces it.
	res = save(t, s, p, files("dup", "1", "dup", "2", "a/b", "now a file")...)
	assert.EqualValues(t, 2, res.Files)
	got := restore(t, s, p)
	assert.Equal(t, "2", got["dup"])
	assert.Equal(t, "now a file", got["a/b"])
	assert.NotContains(t, got, "a/b/other")
	assert.Empty(t, stageEntries(t, s))
}

func TestHostileEntries(t *testing.T) {
	deep := strings.Repeat("d/", 19) + "f"
	for _, tc := range []struct {
		name string
		ent  ent
		why  string
	}{
		{"symlink", ent{name: "ln", typ: tar.TypeSymlink, link: "/etc/passwd"}, "symlink"},
		{"hardlink", ent{name: "hl", typ: tar.TypeLink, link: "/etc/passwd"}, "hardlink"},
		{"fifo", ent{name: "fifo", typ: tar.TypeFifo}, "fifo"},
		{"char device", ent{name: "null", typ: tar.TypeChar}, "character device"},
		{"block device", ent{name: "sda", typ: tar.TypeBlock}, "block device"},
		{"absolute", ent{name: "/etc/evil", body: "x"}, "absolute path"},
		{"dotdot", ent{name: "../evil", body: "x"}, `".." path component`},
		{"dotdot inside", ent{name: "a/../../b", body: "x"}, `".." path component`},
		{"dot", ent{name: "a/./b", body: "x"}, `"." path component`},
		{"empty component", ent{name: "a//b", body: "x"}, "empty path component"},
		{"newline", ent{name: "a\nb", body: "x"}, "control character"},
		{"too deep", ent{name: deep, body: "x"}, "deeper than 16"},
		{"long component", ent{name: strings.Repeat("n", 256), body: "x"}, "over 255 bytes"},
		{"below a file", ent{name: "ok/under", body: "x"}, "below an earlier file"},
		{"over a dir", ent{name: "dir", body: "x"}, "a directory of an earlier file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newStore(t, 1<<20, 1<<20)
			p := project(t, 1)
			res := save(t, s, p, ent{name: "ok", body: "fine"}, ent{name: "dir/f", body: "f"}, tc.ent, ent{name: "after", body: "a"})
			assert.EqualValues(t, 1, res.SkipCount)
			require.Len(t, res.Skipped, 1)
			assert.Contains(t, res.Skipped[0], tc.why)
			assert.NotContains(t, res.Skipped[0], "\n")
			assert.Equal(t, map[string]string{"ok": "fine", "dir/f": "f", "after": "a"}, restore(t, s, p))
			assertOnlyTree(t, s)
		})
	}
	t.Run("at most 16 deep is fine", func(t *testing.T) {
		s, _ := newStore(t, 1<<20, 1<<20)
		name := strings.Repeat("d/", 15) + "f"
		save(t, s, project(t, 1), ent{name: name, body: "x"})
		assert.Equal(t, map[string]string{name: "x"}, restore(t, s, project(t, 1)))
	})
	t.Run("skipped names are a bounded list", func(t *testing.T) {
		s, _ := newStore(t, 1<<20, 1<<20)
		var ents []ent
		for i := range 50 {
			ents = append(ents, ent{name: fmt.Sprintf("l%d\n%s", i, strings.Repeat("x", 500)), typ: tar.TypeSymlink, link: "/"})
		}
		res := save(t, s, project(t, 1), ents...)
		assert.EqualValues(t, 50, res.SkipCount)
		assert.Len(t, res.Skipped, maxSkipNames)
		for _, sk := range res.Skipped {
			assert.Less(t, len(sk), 200)
		}
	})
	t.Run("10001 files refused, nothing kept", func(t *testing.T) {
		s, _ := newStore(t, 1<<20, 1<<20)
		p := project(t, 1)
		save(t, s, p, ent{name: "old", body: "old"})
		ents := make([]ent, MaxFiles+1)
		for i := range ents {
			ents[i] = ent{name: fmt.Sprintf("f/%d", i), body: "x"}
		}
		_, err := s.Save(context.Background(), p, bytes.NewReader(mkTar(t, ents...)), All)
		require.ErrorIs(t, err, ErrTooManyFiles)
		assert.Equal(t, map[string]string{"old": "old"}, restore(t, s, p))
		assert.Empty(t, stageEntries(t, s))
		// 10000 are fine.
		res := save(t, s, p, ents[:MaxFiles]...)
		assert.EqualValues(t, MaxFiles, res.Files)
	})
}

// assertOnlyTree: the store holds nothing but its own layout: no link,
// device or fifo anywhere.
func assertOnlyTree(t *testing.T, s *Store) {
	t.Helper()
	require.NoError(t, filepath.Walk(s.Dir, func(path string, fi os.FileInfo, err error) error {
		require.NoError(t, err)
		assert.True(t, fi.IsDir() || fi.Mode().IsRegular(), "%s: %v", path, fi.Mode())
		return nil
	}))
}

func TestPlantedSymlinks(t *testing.T) {
	s, _ := newStore(t, 1<<20, 1<<20)
	p := project(t, 1)
	save(t, s, p, ent{name: "seed", body: "s"})
	outside := t.TempDir()
	outFile := filepath.Join(outside, "file")
	require.NoError(t, os.WriteFile(outFile, []byte("precious"), 0o600))
	tree := filepath.Join(s.Dir, projectsDir, p, treeName)
	require.NoError(t, os.Symlink(outside, filepath.Join(tree, "d")))        // a directory on the way
	require.NoError(t, os.Symlink("../../../..", filepath.Join(tree, "up"))) // relative, out of the store
	require.NoError(t, os.Symlink(outFile, filepath.Join(tree, "x")))        // the target itself
	require.NoError(t, os.Symlink(outFile, filepath.Join(tree, "leak")))     // one Restore must not follow
	require.NoError(t, os.Symlink(filepath.Join(s.Dir, projectsDir), filepath.Join(tree, "peer")))

	assert.Equal(t, map[string]string{"seed": "s"}, restore(t, s, p), "Restore follows no link")

	res := save(t, s, p, files("d/f", "in", "up/f", "up", "x", "new x", "peer/g", "g")...)
	assert.EqualValues(t, 4, res.Files)
	assert.Equal(t, map[string]string{"seed": "s", "d/f": "in", "up/f": "up", "x": "new x", "peer/g": "g"}, restore(t, s, p))

	got, err := os.ReadFile(outFile)
	require.NoError(t, err)
	assert.Equal(t, "precious", string(got))
	es, err := os.ReadDir(outside)
	require.NoError(t, err)
	assert.Len(t, es, 1, "nothing written outside")
	_, err = os.Lstat(filepath.Join(filepath.Dir(s.Dir), "f"))
	assert.ErrorIs(t, err, os.ErrNotExist)
	_, err = os.Lstat(filepath.Join(s.Dir, projectsDir, "g"))
	assert.ErrorIs(t, err, os.ErrNotExist)

	// A project directory that is a link: refused both ways.
	p2 := project(t, 2)
	require.NoError(t, os.Symlink(outside, filepath.Join(s.Dir, projectsDir, p2)))
	_, err = s.Save(context.Background(), p2, bytes.NewReader(mkTar(t, files("a", "b")...)), All)
	assert.Error(t, err)
	_, err = s.Restore(context.Background(), p2, io.Discard)
	assert.Error(t, err)
	es, err = os.ReadDir(outside)
	require.NoError(t, err)
	assert.Len(t, es, 1, "nothing written outside")
}

func TestStoreDir(t *testing.T) {
	base := t.TempDir()
	real := filepath.Join(base, "real")
	require.NoError(t, os.Mkdir(real, 0o700))
	link := filepath.Join(base, "link")
	require.NoError(t, os.Symlink(real, link))
	s := &Store{Dir: link, ProjectLimit: 10, TotalLimit: 10}
	_, err := s.List()
	assert.ErrorContains(t, err, "symlink")

	file := filepath.Join(base, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	_, err = (&Store{Dir: file, ProjectLimit: 10, TotalLimit: 10}).List()
	assert.ErrorContains(t, err, "not a directory")

	_, err = (&Store{Dir: real, ProjectLimit: 0, TotalLimit: 10}).List()
	assert.ErrorContains(t, err, "limits")

	if os.Getuid() != 0 {
		t.Skip("chown needs root")
	}
	other := filepath.Join(base, "other")
	require.NoError(t, os.Mkdir(other, 0o700))
	require.NoError(t, os.Chown(other, 65534, 65534))
	_, err = (&Store{Dir: other, ProjectLimit: 10, TotalLimit: 10}).List()
	assert.ErrorContains(t, err, "not owned by the current user")
}

func TestOverLimitKeepsOld(t *testing.T) {
	s, c := newStore(t, 100, 1000)
	p := project(t, 1)
	save(t, s, p, files("a", "old a", "b", "old b")...)
	c.Set(t0.Add(time.Minute))
	// 60 + 50 bytes: over 100 only with the second file.
	stream := mkTar(t, files("a", strings.Repeat("A", 60), "c", strings.Repeat("C", 50))...)
	_, err := s.Save(context.Background(), p, bytes.NewReader(stream), All)
	require.ErrorIs(t, err, ErrProjectLimit)
	assert.ErrorContains(t, err, "100 bytes allowed")
	assert.Equal(t, map[string]string{"a": "old a", "b": "old b"}, restore(t, s, p))
	assert.Empty(t, stageEntries(t, s))
	// Exactly at the limit is fine; over it with the old files, the oldest go.
	res := save(t, s, p, files("a", strings.Repeat("A", 60), "c", strings.Repeat("C", 40))...)
	assert.EqualValues(t, 2, res.Files)
	assert.EqualValues(t, 1, res.Evicted.Files)
	assert.Equal(t, map[string]string{"a": strings.Repeat("A", 60), "c": strings.Repeat("C", 40)}, restore(t, s, p))
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// header is the 512-byte tar header of a regular file of size bytes, its
// type flag then set to typ.
func header(t *testing.T, name string, size int64, typ byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Size: size, Mode: 0o600}))
	b := buf.Bytes()
	require.Len(t, b, 512)
	b[156] = typ
	copy(b[148:156], "        ")
	var sum int64
	for _, c := range b {
		sum += int64(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

// repeat is a reader of b over and over, forever.
type repeat struct {
	b []byte
	i int
}

func (r *repeat) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		c := copy(p[n:], r.b[r.i:])
		n += c
		r.i = (r.i + c) % len(r.b)
	}
	return n, nil
}

func TestEndlessStreams(t *testing.T) {
	const limit = 1 << 20
	bound := int64(limit + streamOverhead + (maxEntries+1)*entryOverhead)
	for _, tc := range []struct {
		name   string
		stream func() io.Reader
		err    error
		most   int64 // bytes it may read
	}{
		{"huge regular file of zeros", func() io.Reader {
			return io.MultiReader(bytes.NewReader(header(t, "big", 8<<30-1, tar.TypeReg)), zeros{})
		}, ErrProjectLimit, 512},
		{"just over the limit", func() io.Reader {
			return io.MultiReader(bytes.NewReader(header(t, "big", limit+1, tar.TypeReg)), zeros{})
		}, ErrProjectLimit, 512},
		{"huge entry of an unknown type", func() io.Reader {
			return io.MultiReader(bytes.NewReader(header(t, "odd", 8<<30-1, 'Z')), zeros{})
		}, ErrProjectLimit, limit + streamOverhead + 2*entryOverhead},
		// A bad name's data is still file data: it counts against the
		// limit and is skipped within it; then zeros end the archive.
		{"huge file data under a bad name", func() io.Reader {
			return io.MultiReader(bytes.NewReader(header(t, "../x", limit, tar.TypeReg)), zeros{})
		}, nil, limit + 3*512},
		{"endless fifos", func() io.Reader {
			return &repeat{b: header(t, "fifo", 0, tar.TypeFifo)}
		}, ErrTooManyFiles, bound},
		{"endless empty files under the same name", func() io.Reader {
			return &repeat{b: header(t, "same", 0, tar.TypeReg)}
		}, ErrTooManyFiles, bound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newStore(t, limit, 10*limit)
			p := project(t, 1)
			save(t, s, p, ent{name: "old", body: "old"})
			cr := &countingReader{r: tc.stream()}
			_, err := s.Save(context.Background(), p, cr, All)
			if tc.err != nil {
				require.ErrorIs(t, err, tc.err)
			} else {
				require.NoError(t, err)
			}
			assert.LessOrEqual(t, cr.n, tc.most)
			assert.Equal(t, map[string]string{"old": "old"}, restore(t, s, p))
			assert.Empty(t, stageEntries(t, s))
		})
	}
}

func TestCutStream(t *testing.T) {
	s, _ := newStore(t, 1<<20, 1<<20)
	p := project(t, 1)
	save(t, s, p, ent{name: "old", body: "old"})
	stream := mkTar(t, files("a", "aaa", "b", strings.Repeat("b", 5000))...)
	_, err := s.Save(context.Background(), p, bytes.NewReader(stream[:2048]), All)
	require.Error(t, err)
	assert.Equal(t, map[string]string{"old": "old"}, restore(t, s, p))
	assert.Empty(t, stageEntries(t, s))
}

func TestConcurrentSaveRestore(t *testing.T) {
	s, _ := newStore(t, 1<<22, 1<<22)
	p := project(t, 1)
	contents := [2]map[string]string{
		{"x/y": strings.Repeat("a", 300_000), "z": strings.Repeat("1", 70_000)},
		{"x/y": strings.Repeat("b", 170_000), "z": strings.Repeat("2", 130_000)},
	}
	streams := [2][]byte{}
	for i, m := range contents {
		streams[i] = mkTar(t, files("x/y", m["x/y"], "z", m["z"])...)
	}
	_, err := s.Save(context.Background(), p, bytes.NewReader(streams[0]), All)
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer cancel()
		for i := range 40 {
			if _, err := s.Save(ctx, p, bytes.NewReader(streams[(i+1)%2]), All); err != nil {
				errs <- err
				return
			}
		}
	}()
	restores := 0
	var mu sync.Mutex
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				var buf bytes.Buffer
				if _, err := s.Restore(context.Background(), p, &buf); err != nil {
					errs <- err
					return
				}
				got := readTar(t, buf.Bytes())
				for name, body := range got {
					if body != contents[0][name] && body != contents[1][name] {
						errs <- fmt.Errorf("%s: a torn file of %d bytes", name, len(body))
						return
					}
				}
				if len(got) != 2 {
					errs <- fmt.Errorf("restored %d files", len(got))
					return
				}
				mu.Lock()
				restores++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	assert.Positive(t, restores)
}

func TestProjectTrim(t *testing.T) {
	s, c := newStore(t, 1000, 10_000)
	p := project(t, 1)
	four := strings.Repeat("4", 400)
	save(t, s, p, files("b", four, "a", four)...)
	c.Set(t0.Add(time.Minute))
	res := save(t, s, p, files("c", four)...)
	// 1200 > 1000: the least recently written goes; a and b tie, a first.
	assert.EqualValues(t, 1, res.Evicted.Files)
	assert.EqualValues(t, 400, res.Evicted.Bytes)
	assert.Empty(t, res.Evicted.Projects)
	assert.Equal(t, map[string]string{"b": four, "c": four}, restore(t, s, p))

	// Confirming b (unchanged) makes it recent: c is the oldest now.
	c.Set(t0.Add(2 * time.Minute))
	res = save(t, s, p, files("b", four, "d/e", four)...)
	assert.EqualValues(t, 1, res.Unchanged)
	assert.Equal(t, map[string]string{"b": four, "d/e": four}, restore(t, s, p))
}

func TestEvictTotal(t *testing.T) {
	s, c := newStore(t, 2000, 1000)
	four := strings.Repeat("4", 400)
	p1, p2, p3, p4 := project(t, 1), project(t, 2), project(t, 3), project(t, 4)
	at := func(m int) { c.Set(t0.Add(time.Duration(m) * time.Minute)) }
	at(1)
	save(t, s, p1, files("f", four)...)
	at(2)
	save(t, s, p2, files("f", four)...)
	at(3)
	restore(t, s, p1) // p2 is the least recently used now
	at(4)
	res := save(t, s, p3, files("f", four)...)
	assert.Equal(t, []string{p2}, res.Evicted.Projects)
	assert.EqualValues(t, 400, res.Evicted.Bytes)

	us, err := s.List()
	require.NoError(t, err)
	require.Len(t, us, 2)
	assert.Equal(t, p1, us[0].Project)
	assert.Equal(t, t0.Add(3*time.Minute), us[0].LastUse.UTC())
	assert.Equal(t, p3, us[1].Project)
	assert.EqualValues(t, 400, us[1].Bytes)
	assert.EqualValues(t, 1, us[1].Files)

	// Within the project limit, over the total alone: everything goes,
	// itself last.
	at(5)
	res = save(t, s, p4, files("big", strings.Repeat("x", 1100))...)
	assert.Equal(t, []string{p1, p3, p4}, res.Evicted.Projects)
	us, err = s.List()
	require.NoError(t, err)
	assert.Empty(t, us)

	// Evict on its own; a project in use (locked) is left alone.
	at(6)
	save(t, s, p1, files("f", four)...)
	at(7)
	save(t, s, p2, files("f", four)...)
	s.TotalLimit = 500
	root, err := s.open()
	require.NoError(t, err)
	defer func() { _ = root.Close() }()
	held, err := lockProject(context.Background(), root, p1, syscall.LOCK_SH, false, false)
	require.NoError(t, err)
	ev, err := s.Evict(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{p2}, ev.Projects, "p1, older but in use, stays")
	held.Close()
	ev, err = s.Evict(context.Background())
	require.NoError(t, err)
	assert.Empty(t, ev.Projects, "within the limit now")
}

func TestPruneRemove(t *testing.T) {
	s, c := newStore(t, 1000, 10_000)
	p1, p2, p3 := project(t, 1), project(t, 2), project(t, 3)
	save(t, s, p1, files("f", "1")...)
	save(t, s, p2, files("f", "2")...)
	c.Set(t0.Add(10 * 24 * time.Hour))
	save(t, s, p3, files("f", "3")...)
	c.Set(t0.Add(11 * 24 * time.Hour))
	restore(t, s, p1)
	c.Set(t0.Add(20 * 24 * time.Hour))
	pruned, err := s.Prune(context.Background(), 14*24*time.Hour)
	require.NoError(t, err)
	assert.Equal(t, []string{p2}, pruned)
	us, err := s.List()
	require.NoError(t, err)
	require.Len(t, us, 2)
	assert.Equal(t, []string{p3, p1}, []string{us[0].Project, us[1].Project})
	assert.Empty(t, restore(t, s, p2))

	require.NoError(t, s.Remove(context.Background(), p3))
	require.NoError(t, s.Remove(context.Background(), p3), "gone already: no error")
	assert.Empty(t, restore(t, s, p3))
	_, err = os.Lstat(filepath.Join(s.Dir, projectsDir, p3))
	assert.ErrorIs(t, err, os.ErrNotExist)
	assert.Error(t, s.Remove(context.Background(), "../x"))
	// A Save after a Remove starts a fresh project.
	save(t, s, p3, files("g", "new")...)
	assert.Equal(t, map[string]string{"g": "new"}, restore(t, s, p3))
}

func TestRemoveWaitsForRestore(t *testing.T) {
	s, _ := newStore(t, 1000, 10_000)
	p := project(t, 1)
	save(t, s, p, files("f", "1")...)
	root, err := s.open()
	require.NoError(t, err)
	defer func() { _ = root.Close() }()
	held, err := lockProject(context.Background(), root, p, syscall.LOCK_SH, false, false)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, s.Remove(ctx, p), context.DeadlineExceeded)
	held.Close()
	require.NoError(t, s.Remove(context.Background(), p))
	assert.Empty(t, restore(t, s, p))
}

func TestStagingLeftovers(t *testing.T) {
	s, _ := newStore(t, 1<<20, 1<<20)
	p := project(t, 1)
	save(t, s, p, ent{name: "f", body: "real"})
	stage := filepath.Join(s.Dir, stageDir)
	leftover := func(name string, lock bool) string {
		d := filepath.Join(stage, name)
		require.NoError(t, os.Mkdir(d, 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(d, "1"), []byte("half"), 0o600))
		if lock {
			require.NoError(t, os.WriteFile(filepath.Join(d, lockName), nil, 0o600))
		}
		return d
	}
	killed := leftover("killed", true) // its Save died: lock not held
	young := leftover("young", false)  // a Save between mkdir and lock
	old := leftover("old", false)      // the same, an hour later
	live := leftover("live", true)     // a Save running now
	require.NoError(t, os.Chtimes(old, time.Now().Add(-2*time.Hour), time.Now().Add(-2*time.Hour)))
	lf, err := os.OpenFile(filepath.Join(live, lockName), os.O_RDWR, 0)
	require.NoError(t, err)
	defer lf.Close()
	require.NoError(t, syscall.Flock(int(lf.Fd()), syscall.LOCK_EX))

	assert.Equal(t, map[string]string{"f": "real"}, restore(t, s, p), "staging is never restored")
	save(t, s, p, ent{name: "g", body: "g"})
	assert.ElementsMatch(t, []string{"young", "live"}, stageEntries(t, s))
	_, err = os.Stat(killed)
	assert.ErrorIs(t, err, os.ErrNotExist)
	_ = young

	leftover("killed2", true)
	lf.Close() // the live Save dies too
	_, err = s.Prune(context.Background(), time.Hour)
	require.NoError(t, err)
	assert.Equal(t, []string{"young"}, stageEntries(t, s))
	assert.Equal(t, map[string]string{"f": "real", "g": "g"}, restore(t, s, p))
}

// cancelAt cancels after n bytes and goes on giving data.
type cancelAt struct {
	r      io.Reader
	n      int64
	cancel func()
}

func (c *cancelAt) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n -= int64(n)
	if c.n <= 0 {
		c.cancel()
	}
	return n, err
}

func TestCancelMidSave(t *testing.T) {
	s, _ := newStore(t, 1<<22, 1<<22)
	p := project(t, 1)
	save(t, s, p, ent{name: "a", body: "old"})
	stream := mkTar(t, files("a", strings.Repeat("a", 100_000), "b", strings.Repeat("b", 100_000))...)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := s.Save(ctx, p, &cancelAt{r: bytes.NewReader(stream), n: 150_000, cancel: cancel}, All)
	require.ErrorIs(t, err, context.Canceled)
	assert.Empty(t, stageEntries(t, s))
	assert.Equal(t, map[string]string{"a": "old"}, restore(t, s, p))

	// Cancelled before it starts: no project made either.
	p2 := project(t, 2)
	_, err = s.Save(ctx, p2, bytes.NewReader(stream), All)
	require.True(t, errors.Is(err, context.Canceled), err)
	_, err = os.Lstat(filepath.Join(s.Dir, projectsDir, p2))
	assert.ErrorIs(t, err, os.ErrNotExist)
}

// A snapshot's Size is known before it is written (the restore disk is
// made to fit it) and is what WriteTo writes: long names (PAX records),
// sizes off tar's 512-byte blocks, empty files, nested directories.
func TestSnapshotSizeIsWhatIsWritten(t *testing.T) {
	s, _ := newStore(t, 1<<30, 1<<30)
	p := project(t, 5)
	long := strings.Repeat("d", 90) + "/" + strings.Repeat("f", 120)
	save(t, s, p,
		ent{name: "a/b/c.zip", body: strings.Repeat("x", 1000)},
		ent{name: "empty", body: ""},
		ent{name: "block", body: strings.Repeat("y", 512)},
		ent{name: long, body: "z"},
		ent{name: "ünïcode-name", body: "u"},
	)
	for _, proj := range []string{p, project(t, 6)} { // 6 has no cache
		sn, err := s.Open(context.Background(), proj)
		require.NoError(t, err)
		var buf bytes.Buffer
		n, err := sn.WriteTo(&buf)
		require.NoError(t, err)
		require.NoError(t, sn.Close())
		assert.EqualValues(t, buf.Len(), n)
		assert.EqualValues(t, buf.Len(), sn.Size(), "Size is the stream's length")
		assert.Zero(t, sn.Size()%512)
		got := readTar(t, buf.Bytes())
		assert.EqualValues(t, len(got), sn.Files().Files)
		if proj == p {
			assert.Equal(t, "z", got[long])
			assert.Len(t, got, 5)
		}
	}
}

// A Save waits while a snapshot is open: the snapshot's files keep the
// sizes it listed until it is closed.
func TestSnapshotHoldsOffSave(t *testing.T) {
	s, _ := newStore(t, 1<<30, 1<<30)
	p := project(t, 7)
	save(t, s, p, ent{name: "k/cache.zip", body: "old"})
	sn, err := s.Open(context.Background(), p)
	require.NoError(t, err)
	saved := make(chan error, 1)
	go func() {
		_, err := s.Save(context.Background(), p, bytes.NewReader(mkTar(t, ent{name: "k/cache.zip", body: "newer and longer"})), All)
		saved <- err
	}()
	select {
	case err := <-saved:
		t.Fatalf("Save ended while a snapshot was open: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	var buf bytes.Buffer
	_, err = sn.WriteTo(&buf)
	require.NoError(t, err)
	require.NoError(t, sn.Close())
	assert.Equal(t, map[string]string{"k/cache.zip": "old"}, readTar(t, buf.Bytes()))
	require.NoError(t, <-saved)
	assert.Equal(t, "newer and longer", restore(t, s, p)["k/cache.zip"])
}

// OpenOnly streams the files it is asked for, and Size still fits.
func TestSnapshotOnly(t *testing.T) {
	s, _ := newStore(t, 1<<30, 1<<30)
	p := project(t, 8)
	save(t, s, p, ent{name: "ns/p/a/cache.zip", body: "aaa"}, ent{name: "ns/p/b/cache.zip", body: "bbbb"})
	sn, err := s.Open(context.Background(), p)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"ns/p/a/cache.zip", "ns/p/b/cache.zip"}, sn.Names())
	require.NoError(t, sn.Close())

	sn, err = s.OpenOnly(context.Background(), p, func(name string) bool { return name == "ns/p/b/cache.zip" })
	require.NoError(t, err)
	var buf bytes.Buffer
	_, err = sn.WriteTo(&buf)
	require.NoError(t, err)
	require.NoError(t, sn.Close())
	assert.EqualValues(t, buf.Len(), sn.Size())
	got := readTar(t, buf.Bytes())
	assert.Equal(t, "bbbb", got["ns/p/b/cache.zip"])
	assert.NotContains(t, got, "ns/p/a/cache.zip")
	assert.Equal(t, RestoreResult{Files: 1, Bytes: 4}, sn.Files())
}

// A save of a few files makes each durable by its own fdatasync (not a
// syncfs, which would write every dirty page of the file system); one of
// more than syncEach files ends with one syncfs. A failed sync keeps
// nothing.
func TestSaveSyncs(t *testing.T) {
	var fs, ds int
	was := []func(int) error{syncFS, dataSync}
	t.Cleanup(func() { syncFS, dataSync = was[0], was[1] })
	failFS := false
	syncFS = func(fd int) error {
		fs++
		if failFS {
			return errors.New("no sync")
		}
		return was[0](fd)
	}
	dataSync = func(fd int) error { ds++; return was[1](fd) }
	s, _ := newStore(t, 1<<20, 1<<20)
	p := project(t, 1)

	save(t, s, p, files("cache.zip", "zip", "other", "x")...)
	assert.Equal(t, []int{0, 2}, []int{fs, ds}, "syncfs, fdatasync calls")

	fs, ds = 0, 0
	var many []string
	for i := range syncEach + 1 {
		many = append(many, fmt.Sprintf("f%d", i), "x")
	}
	save(t, s, p, files(many...)...)
	assert.Equal(t, []int{1, syncEach}, []int{fs, ds}, "syncfs, fdatasync calls")

	failFS = true
	_, err := s.Save(context.Background(), p, bytes.NewReader(mkTar(t, files(append(many, "new", "y")...)...)), All)
	require.ErrorContains(t, err, "no sync")
	assert.NotContains(t, restore(t, s, p), "new", "nothing of a save whose sync failed is kept")
	dataSync = func(int) error { return errors.New("no data sync") }
	_, err = s.Save(context.Background(), p, bytes.NewReader(mkTar(t, files("new", "y")...)), All)
	require.ErrorContains(t, err, "no data sync")
	assert.NotContains(t, restore(t, s, p), "new", "nothing of a save whose fdatasync failed is kept")
	assert.Empty(t, stageEntries(t, s))
}

// copyHashing copies and hashes every byte, whatever the sizes against
// its chunk, and a write that fails fails the copy.
func TestCopyHashing(t *testing.T) {
	for _, size := range []int{0, 1, hashChunk - 1, hashChunk, hashChunk + 1, 3*hashChunk + 5} {
		in := bytes.Repeat([]byte("0123456789abcdef"), size/16+1)[:size]
		var out bytes.Buffer
		h := sha256.New()
		n, err := copyHashing(&out, h, iotest.OneByteReader(bytes.NewReader(in[:min(size, 3)])))
		require.NoError(t, err)
		require.EqualValues(t, min(size, 3), n)
		require.Equal(t, string(in[:min(size, 3)]), out.String())
		short := sha256.Sum256(in[:min(size, 3)])
		require.Equal(t, short[:], h.Sum(nil))
		out.Reset()
		h.Reset()
		n, err = copyHashing(&out, h, bytes.NewReader(in))
		require.NoError(t, err)
		require.EqualValues(t, size, n)
		require.Equal(t, string(in), out.String(), "size %d", size)
		want := sha256.Sum256(in)
		require.Equal(t, want[:], h.Sum(nil), "size %d", size)
	}
	_, err := copyHashing(failingWriter{}, sha256.New(), bytes.NewReader(make([]byte, 3*hashChunk)))
	require.ErrorContains(t, err, "disk full")
	_, err = copyHashing(io.Discard, sha256.New(), iotest.ErrReader(errors.New("cut short")))
	require.ErrorContains(t, err, "cut short")
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }
