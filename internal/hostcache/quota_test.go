package hostcache

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// inodes counts the files and directories under dir (dir's own not).
func inodes(t *testing.T, dir string) int {
	t.Helper()
	n := -1
	require.NoError(t, filepath.WalkDir(dir, func(_ string, _ fs.DirEntry, err error) error {
		n++
		return err
	}))
	return n
}

// emptyFiles is a tar stream of n empty files, spread over 100 chains of
// 12 directories each under top.
func emptyFiles(t *testing.T, top string, n int) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := range n {
		name := fmt.Sprintf("%s/%02d/b/c/d/e/f/g/h/i/j/k/l/f%05d", top, i%100, i)
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644}))
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

// Three saves of 10,000 empty files in deep directories, each under other
// names: the project's tree holds at most the entry limit's files and
// directories (the older saves' files go, with the directories they
// leave empty), and `cache list` (List) shows them charged a block each
// (#42 item 3).
func TestManyEmptyFilesBounded(t *testing.T) {
	s, c := newBlockStore(t, 256<<20, 1<<30)
	p := project(t, 1)
	var last Usage
	for i := range 3 {
		c.Set(t0.Add(time.Duration(i) * time.Minute))
		res, err := s.Save(context.Background(), p, bytes.NewReader(emptyFiles(t, fmt.Sprintf("save%d", i), MaxFiles)), All)
		require.NoError(t, err, "save %d", i)
		assert.EqualValues(t, MaxFiles, res.Files)
		n := inodes(t, s.Dir)
		// The tree, and the store's own: projects/, stage/, the project's
		// directory, lock, last-use and tree/.
		assert.LessOrEqual(t, n, DefaultEntryLimit+6, "save %d: %d inodes under the store", i, n)
		us, err := s.List()
		require.NoError(t, err)
		require.Len(t, us, 1)
		last = us[0]
		assert.LessOrEqual(t, last.Entries(), int64(DefaultEntryLimit))
		assert.Equal(t, (last.Files+last.Dirs)*Block, last.Bytes, "save %d: every file and directory charged a block", i)
		assert.Equal(t, n-6, int(last.Entries()), "save %d: List counts every inode of the tree", i)
	}
	// The last save whole, and what is left of the one before it.
	got := restore(t, s, p)
	assert.EqualValues(t, last.Files, len(got))
	var lastSave int
	for name := range got {
		if strings.HasPrefix(name, "save2/") {
			lastSave++
		}
	}
	assert.Equal(t, MaxFiles, lastSave)
	assert.Zero(t, last.Data)
	entries, err := os.ReadDir(filepath.Join(s.Dir, projectsDir, p, treeName))
	require.NoError(t, err)
	var tops []string
	for _, e := range entries {
		tops = append(tops, e.Name())
	}
	assert.Equal(t, []string{"save1", "save2"}, tops, "save0/ is gone with its files")
}

// Every file is charged whole blocks, at least one, and each directory
// one: the project limit counts them, and a save that needs more than it
// is refused whole.
func TestChargePerEntry(t *testing.T) {
	s, _ := newBlockStore(t, 8*Block, 64*Block)
	p := project(t, 1)
	save(t, s, p, files("empty", "", "d/e/f", string(make([]byte, Block+1)))...)
	us, err := s.List()
	require.NoError(t, err)
	require.Len(t, us, 1)
	// empty: 1 block; f: 2; d/ and d/e/: 1 each.
	us[0].LastUse = us[0].LastUse.UTC()
	assert.Equal(t, Usage{Project: p, Bytes: 5 * Block, Data: Block + 1, Files: 2, Dirs: 2, LastUse: t0}, us[0])

	// Nine empty files need nine blocks: over the limit of eight, though
	// they hold no byte; the cache stays as it was.
	var many []ent
	for i := range 9 {
		many = append(many, ent{name: fmt.Sprintf("x%d", i)})
	}
	_, err = s.Save(context.Background(), p, bytes.NewReader(mkTar(t, many...)), All)
	require.ErrorIs(t, err, ErrProjectLimit)
	assert.ErrorContains(t, err, "each file charged whole 4096-byte blocks")
	assert.Len(t, restore(t, s, p), 2)
	assert.Empty(t, stageEntries(t, s))
	// So are eight empty files in a directory (nine blocks).
	_, err = s.Save(context.Background(), p, bytes.NewReader(mkTar(t, func() []ent {
		var es []ent
		for i := range 8 {
			es = append(es, ent{name: fmt.Sprintf("dir/x%d", i)})
		}
		return es
	}()...)), All)
	require.ErrorIs(t, err, ErrProjectLimit)
}

// The entry limit bounds a save (refused whole) and the project's tree
// (its least recently written files go, and the directories they leave
// empty).
func TestEntryLimit(t *testing.T) {
	s, c := newBlockStore(t, 1<<20, 1<<30)
	s.EntryLimit = 10
	p := project(t, 1)
	var eleven []ent
	for i := range 11 {
		eleven = append(eleven, ent{name: fmt.Sprintf("f%02d", i)})
	}
	_, err := s.Save(context.Background(), p, bytes.NewReader(mkTar(t, eleven...)), All)
	require.ErrorIs(t, err, ErrTooManyFiles)
	assert.ErrorContains(t, err, "more than 10 files and directories")
	// Ten files, or nine in a directory, fit.
	save(t, s, p, eleven[:10]...)
	c.Set(t0.Add(time.Minute))
	// Four files in two directories (six entries): the six oldest files go.
	save(t, s, p, files("a/x", "1", "a/y", "2", "b/x", "3", "b/y", "4")...)
	got := restore(t, s, p)
	assert.Len(t, got, 8)
	for _, k := range []string{"a/x", "a/y", "b/x", "b/y", "f06", "f07", "f08", "f09"} {
		assert.Contains(t, got, k)
	}
	us, err := s.List()
	require.NoError(t, err)
	assert.EqualValues(t, 10, us[0].Entries())
	// A newer save of files in a new directory: a/ and b/, emptied, go.
	c.Set(t0.Add(2 * time.Minute))
	save(t, s, p, files("c/1", "", "c/2", "", "c/3", "", "c/4", "", "c/5", "", "c/6", "", "c/7", "", "c/8", "")...)
	got = restore(t, s, p)
	assert.Len(t, got, 8, "c/'s eight, nothing older: %v", got)
	assert.NoDirExists(t, filepath.Join(s.Dir, projectsDir, p, treeName, "a"))
	assert.NoDirExists(t, filepath.Join(s.Dir, projectsDir, p, treeName, "b"))
}

// Directories that hold nothing (a save that failed while renaming, an
// older release) are removed by the next save: each costs an inode.
func TestEmptyDirsRemoved(t *testing.T) {
	s, c := newBlockStore(t, 1<<20, 1<<30)
	p := project(t, 1)
	save(t, s, p, files("k/cache.zip", "zip", "l/m/n", "x")...)
	tree := filepath.Join(s.Dir, projectsDir, p, treeName)
	require.NoError(t, os.MkdirAll(filepath.Join(tree, "empty/deep/chain"), 0o700))
	require.NoError(t, os.MkdirAll(filepath.Join(tree, "l/m/o/p"), 0o700))
	c.Set(t0.Add(time.Minute))
	save(t, s, p, files("k/cache.zip", "zip2")...)
	assert.NoDirExists(t, filepath.Join(tree, "empty"))
	assert.NoDirExists(t, filepath.Join(tree, "l/m/o"))
	assert.FileExists(t, filepath.Join(tree, "l/m/n"), "a file of another key stays")
	assert.Equal(t, map[string]string{"k/cache.zip": "zip2", "l/m/n": "x"}, restore(t, s, p))
	assert.Equal(t, 5, inodes(t, tree), "k/, k/cache.zip, l/, l/m/, l/m/n and nothing else")
}

// What saves in flight have staged, and the scratch disks reserved for
// them, count against the total limit: a save makes room for them, and
// Reserve does before the disk is attached.
func TestStagingCounted(t *testing.T) {
	s, c := newStore(t, 1000, 1000)
	p1, p2 := project(t, 1), project(t, 2)
	save(t, s, p1, files("f", strings.Repeat("1", 400))...)
	// Another save in flight: its staging directory, locked, holds 500
	// bytes (and its lock file and the directory, a byte each here).
	live := filepath.Join(s.Dir, stageDir, "live")
	require.NoError(t, os.Mkdir(live, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(live, "1"), make([]byte, 500), 0o600))
	lf, err := os.OpenFile(filepath.Join(live, lockName), os.O_RDWR|os.O_CREATE, 0o600)
	require.NoError(t, err)
	require.NoError(t, syscall.Flock(int(lf.Fd()), syscall.LOCK_EX))
	staged, err := s.Staged()
	require.NoError(t, err)
	assert.EqualValues(t, 502, staged)
	// 400 + 502 + 300 > 1000: p1, least recently used, goes.
	c.Set(t0.Add(time.Minute))
	res := save(t, s, p2, files("f", strings.Repeat("2", 300))...)
	assert.Equal(t, []string{p1}, res.Evicted.Projects)
	lf.Close()
	_, err = s.Evict(context.Background())
	require.NoError(t, err)
	staged, err = s.Staged()
	require.NoError(t, err)
	assert.Zero(t, staged, "the dead save's staging is gone")

	// A scratch disk of 800 bytes reserved: p2 (300) must go to make room.
	c.Set(t0.Add(2 * time.Minute))
	save(t, s, p1, files("f", strings.Repeat("1", 100))...)
	ev, err := s.Reserve(context.Background(), "lve-job-1", 800)
	require.NoError(t, err)
	assert.Equal(t, []string{p2}, ev.Projects)
	staged, err = s.Staged()
	require.NoError(t, err)
	assert.EqualValues(t, 800, staged)
	us, err := s.List()
	require.NoError(t, err)
	require.Len(t, us, 1)
	// A save while it stands: the total counts it.
	c.Set(t0.Add(3 * time.Minute))
	res = save(t, s, p2, files("f", strings.Repeat("2", 150))...)
	assert.Equal(t, []string{p1}, res.Evicted.Projects)
	require.NoError(t, s.Unreserve("lve-job-1"))
	require.NoError(t, s.Unreserve("lve-job-1"), "none: no error")
	staged, err = s.Staged()
	require.NoError(t, err)
	assert.Zero(t, staged)
	// Larger than the total on its own: refused; a bad name too.
	_, err = s.Reserve(context.Background(), "lve-job-2", 1001)
	assert.ErrorContains(t, err, "does not fit in the total limit")
	_, err = s.Reserve(context.Background(), "../x", 1)
	assert.Error(t, err)
	// A reservation whose VM went without a drop stops counting after
	// staleReservation: the next save's cleaning removes it.
	_, err = s.Reserve(context.Background(), "lve-job-3", 500)
	require.NoError(t, err)
	old := time.Now().Add(-staleReservation - time.Minute)
	require.NoError(t, os.Chtimes(filepath.Join(s.Dir, stageDir, reservePrefix+"lve-job-3"), old, old))
	save(t, s, p2, files("g", "g")...)
	staged, err = s.Staged()
	require.NoError(t, err)
	assert.Zero(t, staged)
}
