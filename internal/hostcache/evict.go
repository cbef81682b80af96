package hostcache

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"syscall"
	"time"
)

// EvictResult says what eviction removed.
type EvictResult struct {
	Projects []string // whole projects removed (over TotalLimit)
	Files    int64    // files removed, of those projects and of projects over ProjectLimit or the entry limit
	Dirs     int64    // directories removed with them (or found empty)
	Bytes    int64    // the charged size removed (Usage.Bytes): files' and directories'
}

func (e *EvictResult) add(o EvictResult) {
	e.Projects = append(e.Projects, o.Projects...)
	e.Files += o.Files
	e.Dirs += o.Dirs
	e.Bytes += o.Bytes
}

// Usage is one project's share of the store.
type Usage struct {
	Project string
	Bytes   int64 // charged: every file rounded up to whole blocks, at least one (Block), and one block per directory
	Data    int64 // the files' own bytes
	Files   int64
	Dirs    int64     // directories of its tree (the tree's own not counted)
	LastUse time.Time // zero if never marked
}

// Entries is the inodes the project's tree holds: files and directories.
func (u Usage) Entries() int64 { return u.Files + u.Dirs }

type treeFile struct {
	path   string // in the root
	size   int64
	charge int64
	mtime  time.Time
}

// treeInfo is a project's tree as walkTree found it.
type treeInfo struct {
	files []treeFile     // every non-directory (Save makes regular files only)
	dirs  map[string]int // each directory (the tree's own included) and how many entries it holds
	use   Usage          // Bytes, Data, Files, Dirs
}

// walkTree lists the project's tree: files, directories and their
// charged size.
func (s *Store) walkTree(root *os.Root, project string) (*treeInfo, error) {
	tree := projectPath(project, treeName)
	t := &treeInfo{dirs: map[string]int{}}
	err := fs.WalkDir(root.FS(), tree, func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // gone meanwhile (or no tree)
		}
		if err != nil {
			return err
		}
		if p == tree {
			t.dirs[p] += 0
			return nil
		}
		t.dirs[path.Dir(p)]++
		if d.IsDir() {
			t.dirs[p] += 0
			t.use.Dirs++
			t.use.Bytes += s.block()
			return nil
		}
		fi, err := d.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		f := treeFile{path: p, size: fi.Size(), charge: s.charge(fi.Size()), mtime: fi.ModTime()}
		t.files = append(t.files, f)
		t.use.Files++
		t.use.Data += f.size
		t.use.Bytes += f.charge
		return nil
	})
	return t, err
}

// Block is the least a stored file is charged, and what each directory
// is charged: a file's size is rounded up to whole blocks, and an empty
// one costs a block (its inode, and a block on most file systems).
const Block = 4096

// DefaultEntryLimit is how many files and directories one project's tree
// may hold (Store.EntryLimit zero): the most files of one save and as
// many directories.
const DefaultEntryLimit = 2 * MaxFiles

func (s *Store) block() int64 {
	if s.blockSize > 0 {
		return s.blockSize
	}
	return Block
}

// charge is what a file of size bytes is charged.
func (s *Store) charge(size int64) int64 {
	b := s.block()
	if size <= 0 {
		return b
	}
	return (size + b - 1) / b * b
}

func (s *Store) entryLimit() int64 {
	if s.EntryLimit > 0 {
		return s.EntryLimit
	}
	return DefaultEntryLimit
}

// trimProject removes the directories of the project's tree that hold
// nothing (a save that failed while renaming, an older release), then
// its least recently written files, and the directories they leave
// empty, until it is within ProjectLimit (charged) and the entry limit.
// Hold the project's exclusive lock.
func (s *Store) trimProject(root *os.Root, project string) (EvictResult, error) {
	var res EvictResult
	t, err := s.walkTree(root, project)
	if err != nil {
		return res, fmt.Errorf("hostcache: %w", err)
	}
	tree := projectPath(project, treeName)
	// prune removes d if it holds nothing, then its parents that are left
	// so; it stops at the first that will not go.
	prune := func(d string) {
		for d != tree && t.dirs[d] == 0 {
			if err := root.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return
			}
			delete(t.dirs, d)
			t.use.Dirs--
			t.use.Bytes -= s.block()
			res.Dirs++
			res.Bytes += s.block()
			d = path.Dir(d)
			t.dirs[d]--
		}
	}
	var empty []string
	for d, n := range t.dirs {
		if n == 0 && d != tree {
			empty = append(empty, d)
		}
	}
	sort.Strings(empty)
	for _, d := range empty {
		if n, ok := t.dirs[d]; ok && n == 0 {
			prune(d)
		}
	}
	files := t.files
	sort.Slice(files, func(i, j int) bool {
		if !files[i].mtime.Equal(files[j].mtime) {
			return files[i].mtime.Before(files[j].mtime)
		}
		return files[i].path < files[j].path
	})
	for _, f := range files {
		if t.use.Bytes <= s.ProjectLimit && t.use.Entries() <= s.entryLimit() {
			break
		}
		if err := root.Remove(f.path); err != nil {
			return res, fmt.Errorf("hostcache: %w", err)
		}
		t.use.Files--
		t.use.Bytes -= f.charge
		res.Files++
		res.Bytes += f.charge
		d := path.Dir(f.path)
		t.dirs[d]--
		prune(d) // and the directories it leaves empty
	}
	return res, nil
}

// lastUse is the mtime of the project's last-use marker, zero if none.
func lastUse(root *os.Root, project string) time.Time {
	fi, err := root.Lstat(projectPath(project, lastUseName))
	if err != nil {
		return time.Time{}
	}
	return fi.ModTime()
}

// list is the store's projects, least recently used first.
func (s *Store) list(root *os.Root) ([]Usage, error) {
	d, err := root.Open(projectsDir)
	if err != nil {
		return nil, fmt.Errorf("hostcache: %w", err)
	}
	entries, err := d.ReadDir(-1)
	d.Close()
	if err != nil {
		return nil, fmt.Errorf("hostcache: %w", err)
	}
	var out []Usage
	for _, e := range entries {
		if !e.IsDir() || !projectRE.MatchString(e.Name()) {
			continue
		}
		t, err := s.walkTree(root, e.Name())
		if err != nil {
			return nil, fmt.Errorf("hostcache: %w", err)
		}
		u := t.use
		u.Project, u.LastUse = e.Name(), lastUse(root, e.Name())
		out = append(out, u)
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].LastUse.Equal(out[j].LastUse) {
			return out[i].LastUse.Before(out[j].LastUse)
		}
		return out[i].Project < out[j].Project
	})
	return out, nil
}

// ListExisting is List for a reader that writes nothing, such as the
// service's gauge, whose sandbox may keep cache.dir read-only: a store that
// no job has made yet has no projects (List would make it).
func (s *Store) ListExisting() ([]Usage, error) {
	for _, d := range []string{projectsDir, stageDir} {
		if _, err := os.Lstat(filepath.Join(s.Dir, d)); errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
	}
	return s.List()
}

// List is the store's projects, least recently used first.
func (s *Store) List() ([]Usage, error) {
	root, err := s.open()
	if err != nil {
		return nil, err
	}
	defer func() { _ = root.Close() }()
	return s.list(root)
}

// removeProject removes the project under its exclusive lock. With try, a
// project in use is left alone (errBusy). With a non-zero usedBefore, so
// is one used since then. removed is false when it was left or missing.
func removeProject(ctx context.Context, root *os.Root, project string, try bool, usedBefore time.Time) (removed bool, err error) {
	lock, err := lockProject(ctx, root, project, syscall.LOCK_EX, false, try)
	if errors.Is(err, errNoProject) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer func() { _ = lock.Close() }()
	if !usedBefore.IsZero() && !lastUse(root, project).Before(usedBefore) {
		return false, nil
	}
	for _, name := range []string{projectPath(project, treeName), projectPath(project, lastUseName), projectPath(project, lockName), projectPath(project)} {
		if err := root.RemoveAll(name); err != nil {
			return false, fmt.Errorf("hostcache: removing %s: %w", project, err)
		}
	}
	return true, nil
}

// evictTotal removes whole projects, least recently used first, until the
// store, its staging included (stageUsage: saves in flight and the
// scratch disks reserved for them), is within TotalLimit; never protect
// unless it alone is over it. Projects in use are left alone.
func (s *Store) evictTotal(ctx context.Context, root *os.Root, protect string) (EvictResult, error) {
	var res EvictResult
	us, err := s.list(root)
	if err != nil {
		return res, err
	}
	total, err := s.stageUsage(root)
	if err != nil {
		return res, err
	}
	for _, u := range us {
		total += u.Bytes
	}
	var protected *Usage
	remove := func(u Usage) error {
		ok, err := removeProject(ctx, root, u.Project, true, time.Time{})
		if ok {
			total -= u.Bytes
			res.Projects = append(res.Projects, u.Project)
			res.Files += u.Files
			res.Dirs += u.Dirs
			res.Bytes += u.Bytes
		}
		if errors.Is(err, errBusy) {
			return nil
		}
		return err
	}
	for _, u := range us {
		if total <= s.TotalLimit {
			break
		}
		if u.Project == protect {
			protected = &u
			continue
		}
		if err := remove(u); err != nil {
			return res, err
		}
	}
	if total > s.TotalLimit && protected != nil && protected.Bytes > s.TotalLimit {
		if err := remove(*protected); err != nil {
			return res, err
		}
	}
	return res, nil
}

// Evict removes leftover staging, trims every project to ProjectLimit and
// the store to TotalLimit (see Save). Projects in use are left alone.
func (s *Store) Evict(ctx context.Context) (EvictResult, error) {
	var res EvictResult
	root, err := s.open()
	if err != nil {
		return res, err
	}
	defer func() { _ = root.Close() }()
	if err := s.cleanStaging(root); err != nil {
		return res, err
	}
	us, err := s.list(root)
	if err != nil {
		return res, err
	}
	for _, u := range us {
		if u.Bytes <= s.ProjectLimit && u.Entries() <= s.entryLimit() {
			continue
		}
		lock, err := lockProject(ctx, root, u.Project, syscall.LOCK_EX, false, true)
		if errors.Is(err, errBusy) || errors.Is(err, errNoProject) {
			continue
		}
		if err != nil {
			return res, err
		}
		ev, err := s.trimProject(root, u.Project)
		lock.Close()
		res.add(ev)
		if err != nil {
			return res, err
		}
	}
	ev, err := s.evictTotal(ctx, root, "")
	res.add(ev)
	return res, err
}

// Prune removes leftover staging and the projects not used for olderThan
// (Restore or Save); it returns their names. Projects in use are left
// alone.
func (s *Store) Prune(ctx context.Context, olderThan time.Duration) ([]string, error) {
	root, err := s.open()
	if err != nil {
		return nil, err
	}
	defer func() { _ = root.Close() }()
	if err := s.cleanStaging(root); err != nil {
		return nil, err
	}
	us, err := s.list(root)
	if err != nil {
		return nil, err
	}
	cutoff := s.now().Add(-olderThan)
	var removed []string
	for _, u := range us {
		if !u.LastUse.Before(cutoff) {
			continue
		}
		ok, err := removeProject(ctx, root, u.Project, true, cutoff)
		if errors.Is(err, errBusy) {
			continue
		}
		if err != nil {
			return removed, err
		}
		if ok {
			removed = append(removed, u.Project)
		}
	}
	return removed, nil
}

// Remove removes the project's cache, waiting for its users; a project
// without one is no error.
func (s *Store) Remove(ctx context.Context, project string) error {
	if err := checkProject(project); err != nil {
		return err
	}
	root, err := s.open()
	if err != nil {
		return err
	}
	defer func() { _ = root.Close() }()
	_, err = removeProject(ctx, root, project, false, time.Time{})
	return err
}
