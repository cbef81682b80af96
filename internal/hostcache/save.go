package hostcache

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// SaveResult says what a Save kept, skipped and evicted.
type SaveResult struct {
	Files     int64    // files written (new or changed)
	Bytes     int64    // their bytes
	Unchanged int64    // files the stream carried that the cache already held, same size and sha256
	Skipped   []string // the first maxSkipNames skipped entries, "name: reason", quoted and cut
	SkipCount int64    // all skipped entries (directory entries, which are implied, not counted)
	Evicted   EvictResult
}

const (
	maxSkipNames = 10
	maxShownName = 80
)

func (r *SaveResult) skip(name, why string) {
	r.SkipCount++
	if len(r.Skipped) < maxSkipNames {
		if len(name) > maxShownName {
			name = name[:maxShownName] + "..."
		}
		r.Skipped = append(r.Skipped, strconv.QuoteToASCII(name)+": "+why)
	}
}

type stagedFile struct {
	name string // clean, relative to the project's tree
	file string // in the root
	size int64
	sum  [sha256.Size]byte
}

// Save reads a tar stream of the guest's cache (hostile: see the package
// doc) and, if it is whole and within the limits, puts its regular files
// whose names keep accepts (Only: the archives the runner's script names;
// All) into the project's cache, then evicts down to the limits. Every
// other file is left out and counted in SkipCount (its bytes still count
// against the limits: the host reads no more for it). Files of the cache
// the stream does not carry are kept. On any error nothing of this save
// is kept (save that a failure while renaming staged files into place may
// leave some in place, each whole) and nothing stays staged. Cancelling
// ctx is noticed between reads from r. A nil keep is an error: a caller
// says what it keeps.
func (s *Store) Save(ctx context.Context, project string, r io.Reader, keep func(name string) bool) (SaveResult, error) {
	var res SaveResult
	if err := checkJobProject(project); err != nil {
		return res, err
	}
	if keep == nil {
		return res, errors.New("hostcache: a save names the files it keeps (no filter given)")
	}
	root, err := s.open()
	if err != nil {
		return res, err
	}
	defer func() { _ = root.Close() }()
	if err := s.cleanStaging(root); err != nil {
		return res, err
	}
	stage, stageLock, err := newStage(root)
	if err != nil {
		return res, err
	}
	defer func() {
		_ = root.RemoveAll(stage) // before the unlock: Save and Prune leave a held one alone
		stageLock.Close()
	}()

	staged, synced, err := s.readStream(ctx, root, stage, r, keep, &res)
	if err == nil && !synced {
		err = syncStage(root, stage)
	}
	if err != nil {
		return res, err
	}
	// The staged files take room already: other projects go first where
	// the store with them is over TotalLimit (evictTotal counts staging).
	ev, err := s.evictTotal(ctx, root, project)
	res.Evicted.add(ev)
	if err != nil {
		return res, err
	}
	lock, err := lockProject(ctx, root, project, syscall.LOCK_EX, true, false)
	if err != nil {
		return res, err
	}
	err = s.install(root, project, staged, &res)
	if err == nil {
		err = s.touch(root, project)
	}
	if err == nil {
		var ev EvictResult
		ev, err = s.trimProject(root, project)
		res.Evicted.add(ev)
	}
	lock.Close()
	if err != nil {
		return res, err
	}
	ev, err = s.evictTotal(ctx, root, project)
	res.Evicted.add(ev)
	return res, err
}

// newStage makes a staging directory and holds its lock file.
func newStage(root *os.Root) (string, *os.File, error) {
	for {
		dir := stageDir + "/" + randomName()
		err := root.Mkdir(dir, 0o700)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return "", nil, fmt.Errorf("hostcache: %w", err)
		}
		// Locked before it is named lock: cleanStaging, which would
		// take an unheld lock for a dead Save's, never sees it free.
		f, err := root.OpenFile(dir+"/"+lockName+".new", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err == nil {
			err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
			if err == nil {
				err = root.Rename(dir+"/"+lockName+".new", dir+"/"+lockName)
			}
			if err != nil {
				f.Close()
			}
		}
		if err != nil {
			_ = root.RemoveAll(dir)
			return "", nil, fmt.Errorf("hostcache: staging: %w", err)
		}
		return dir, f, nil
	}
}

// syncEach is how many staged files are made durable each by its own
// fdatasync, as it is written; a stream with more is made durable by one
// syncfs (syncStage) after the last. A cache is most often one archive
// or a few: syncfs would also write every other dirty page of the file
// system (on a host whose storage pool shares it, the scratch disk's
// 100 MiB the guest just wrote, deleted unwritten right after the save,
// and the running VMs' disks).
const syncEach = 16

// The syncs (variables: the tests count them).
var (
	syncFS   = unix.Syncfs
	dataSync = unix.Fdatasync
)

// syncStage makes the staged files durable before they are renamed into
// place, where more than syncEach were staged: one syncfs(2) of the
// store's file system rather than an fsync per file (a stream may carry
// 10000 small files).
func syncStage(root *os.Root, stage string) error {
	d, err := root.Open(stage)
	if err != nil {
		return fmt.Errorf("hostcache: %w", err)
	}
	defer func() { _ = d.Close() }()
	if err := syncFS(int(d.Fd())); err != nil {
		return fmt.Errorf("hostcache: syncfs %s: %w", d.Name(), err)
	}
	return nil
}

// capReader reads from r at most max bytes in all (max grows as entries
// are admitted) and stops once ctx is done.
type capReader struct {
	ctx    context.Context
	r      io.Reader
	n, max int64
	over   bool
}

var errOverBudget = errors.New("read budget spent")

func (c *capReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	if c.n >= c.max {
		c.over = true
		return 0, errOverBudget
	}
	if int64(len(p)) > c.max-c.n {
		p = p[:c.max-c.n]
	}
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// NotNamed is why Save left out a file that its filter does not keep.
const NotNamed = "not an archive the runner's script names"

// All is the filter that keeps every file (Save's tests and tools).
func All(string) bool { return true }

// readStream stages the stream's acceptable files (those keep accepts) and returns them sorted
// by name, and whether each was made durable as it was written (at most
// syncEach staged); it fails if the stream is cut, over a limit, or ctx
// is done.
func (s *Store) readStream(ctx context.Context, root *os.Root, stage string, r io.Reader, keep func(string) bool, res *SaveResult) ([]stagedFile, bool, error) {
	cr := &capReader{ctx: ctx, r: r, max: streamOverhead}
	fail := func(err error) error {
		switch {
		case ctx.Err() != nil:
			return fmt.Errorf("hostcache: saving: %w", ctx.Err())
		case cr.over:
			return fmt.Errorf("hostcache: %w: the stream ran past %d bytes (file data allowed %d bytes, the rest is a bound on tar headers and skipped entries)",
				ErrProjectLimit, cr.max, s.ProjectLimit)
		default:
			return fmt.Errorf("hostcache: reading the cache stream: %w", err)
		}
	}
	tr := tar.NewReader(cr)
	var (
		declared int64 // the sizes of all regular-file entries so far
		charged  int64 // what the kept ones cost in the tree (Usage.Bytes)
		staged   int   // files staged, duplicates' included
		files    []stagedFile
		byName   = map[string]int{} // index in files
		dirs     = map[string]bool{}
	)
	for entries := 1; ; entries++ {
		cr.max = streamOverhead + int64(entries)*entryOverhead + declared
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, false, fail(err)
		}
		if entries > maxEntries {
			return nil, false, fmt.Errorf("hostcache: %w: more than %d entries", ErrTooManyFiles, maxEntries)
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			continue // implied by the files
		case tar.TypeReg:
		default:
			res.skip(hdr.Name, typeName(hdr.Typeflag))
			continue // its data, if any, counts against the overhead budget
		}
		if hdr.Size > s.ProjectLimit-declared {
			return nil, false, fmt.Errorf("hostcache: %w: the stream's files need more than the %d bytes allowed",
				ErrProjectLimit, s.ProjectLimit)
		}
		declared += hdr.Size
		cr.max += hdr.Size
		name, why := cleanName(hdr.Name)
		if why == "" && !keep(name) {
			why = NotNamed
		}
		if why == "" {
			why = conflict(name, byName, dirs)
		}
		if why != "" {
			res.skip(hdr.Name, why)
			continue
		}
		prev, dup := byName[name]
		if !dup && len(files) == MaxFiles {
			return nil, false, fmt.Errorf("hostcache: %w: more than %d files", ErrTooManyFiles, MaxFiles)
		}
		// What the kept files will cost in the project's tree: each file
		// at least a block, each directory a block (Usage).
		var newDirs int64
		if dup {
			charged -= s.charge(files[prev].size)
		} else {
			for i := range len(name) {
				if name[i] == '/' && !dirs[name[:i]] {
					newDirs++
				}
			}
		}
		charged += s.charge(hdr.Size) + newDirs*s.block()
		if charged > s.ProjectLimit {
			return nil, false, fmt.Errorf("hostcache: %w: the stream's files need more than the %d bytes allowed (each file charged whole %d-byte blocks, at least one, and each directory one)",
				ErrProjectLimit, s.ProjectLimit, s.block())
		}
		if n := int64(len(files)+len(dirs)) + newDirs; !dup && n >= s.entryLimit() {
			return nil, false, fmt.Errorf("hostcache: %w: more than %d files and directories", ErrTooManyFiles, s.entryLimit())
		}
		sf := stagedFile{name: name, file: stage + "/" + strconv.Itoa(entries)}
		staged++
		if err := stageFile(root, tr, hdr.Size, staged <= syncEach, &sf); err != nil {
			return nil, false, fail(err)
		}
		if dup { // the later entry wins, as with tar -x
			_ = root.Remove(files[prev].file)
			files[prev] = sf
			continue
		}
		byName[name] = len(files)
		files = append(files, sf)
		for i := range len(name) {
			if name[i] == '/' {
				dirs[name[:i]] = true
			}
		}
	}
	sort.Slice(files, func(i, j int) bool { return files[i].name < files[j].name })
	return files, staged <= syncEach, nil
}

// stageFile writes the entry from r to the staged file sf and notes its
// size and sha256 (copyHashing); with sync, it makes the file's data
// durable (fdatasync) before it closes it.
func stageFile(root *os.Root, r io.Reader, size int64, sync bool, sf *stagedFile) error {
	f, err := root.OpenFile(sf.file, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	h := sha256.New()
	var n int64
	if size <= hashChunk {
		n, err = io.Copy(io.MultiWriter(f, h), r) // one chunk: nothing to overlap
	} else {
		n, err = copyHashing(f, h, r)
	}
	if err == nil && n != size {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		return err
	}
	sf.size = n
	copy(sf.sum[:], h.Sum(nil))
	if sync {
		if err := dataSync(int(f.Fd())); err != nil {
			return fmt.Errorf("hostcache: fdatasync %s: %w", sf.file, err)
		}
	}
	return f.Close()
}

// hashChunk is how much copyHashing reads at a time.
const hashChunk = 256 << 10

// copyHashing copies r to w until r's end and writes the same bytes to h:
// the hash and the write of one chunk run side by side, and beside the
// read of the next (two buffers), where one after the other they add up
// (100 MiB on the project's host: sha256 ~60 ms, the write into the page
// cache ~40 ms, the read out of a scratch disk's file ~30 ms). h's Write
// must not fail (a hash.Hash's does not).
func copyHashing(w, h io.Writer, r io.Reader) (int64, error) {
	bufs := [2][]byte{make([]byte, hashChunk), make([]byte, hashChunk)}
	toHash, toWrite := make(chan []byte), make(chan []byte)
	hashed, wrote := make(chan struct{}), make(chan error)
	go func() {
		for b := range toHash {
			_, _ = h.Write(b)
			hashed <- struct{}{}
		}
	}()
	go func() {
		for b := range toWrite {
			_, err := w.Write(b)
			wrote <- err
		}
	}()
	defer close(toWrite)
	defer close(toHash)
	var n int64
	var werr error
	busy := false
	wait := func() {
		if busy {
			<-hashed
			if err := <-wrote; err != nil && werr == nil {
				werr = err
			}
			busy = false
		}
	}
	for i := 0; ; i ^= 1 {
		m, rerr := readFull(r, bufs[i])
		wait() // the chunk before: bufs[i^1] is free again
		if werr != nil {
			return n, werr
		}
		if m > 0 {
			toHash <- bufs[i][:m]
			toWrite <- bufs[i][:m]
			busy = true
			n += int64(m)
		}
		if rerr != nil {
			wait()
			if rerr == io.EOF {
				rerr = nil
			}
			if werr != nil {
				rerr = werr
			}
			return n, rerr
		}
	}
}

// readFull reads from r until b is full or r ends (io.EOF, with what was
// read before it).
func readFull(r io.Reader, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := r.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// sumXattr is the extended attribute that holds a kept file's sha256 and
// the modification time the file had when the sum was recorded: the next
// save of the project compares with it instead of reading the kept file
// again (100 MiB: 0.1 s). A file written since (its mtime differs), or on
// a file system without user xattrs, is read.
const sumXattr = "user.lve-sha256"

// setKeptSum records sum in target's sumXattr, with target's mtime now.
func setKeptSum(root *os.Root, target string, sum [sha256.Size]byte) {
	f, err := root.Open(target)
	if err != nil {
		return
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return
	}
	var v [sha256.Size + 8]byte
	copy(v[:], sum[:])
	binary.LittleEndian.PutUint64(v[sha256.Size:], uint64(fi.ModTime().UnixNano()))
	_ = unix.Fsetxattr(int(f.Fd()), sumXattr, v[:], 0)
}

func typeName(t byte) string {
	switch t {
	case tar.TypeSymlink:
		return "symlink"
	case tar.TypeLink:
		return "hardlink"
	case tar.TypeChar:
		return "character device"
	case tar.TypeBlock:
		return "block device"
	case tar.TypeFifo:
		return "fifo"
	}
	return "entry type " + strconv.QuoteRuneToASCII(rune(t))
}

// cleanName returns the name a regular file's entry is stored under, or
// why it is refused. A leading "./" (tar -c -C /cache .) is dropped.
func cleanName(name string) (string, string) {
	n := strings.TrimPrefix(name, "./")
	switch {
	case n == "":
		return "", "empty name"
	case n[0] == '/':
		return "", "absolute path"
	}
	parts := strings.Split(n, "/")
	for _, p := range parts {
		switch {
		case p == "":
			return "", "empty path component"
		case p == "." || p == "..":
			return "", fmt.Sprintf("%q path component", p)
		case len(p) > MaxComponent:
			return "", fmt.Sprintf("path component over %d bytes", MaxComponent)
		case strings.ContainsFunc(p, func(r rune) bool { return r < 0x20 || r == 0x7f }):
			return "", "control character (NUL, newline, ...) in name"
		}
	}
	if len(parts) > MaxDepth {
		return "", fmt.Sprintf("deeper than %d components", MaxDepth)
	}
	return n, ""
}

// conflict says why name cannot be a file next to the earlier files, or "".
func conflict(name string, files map[string]int, dirs map[string]bool) string {
	if dirs[name] {
		return "a directory of an earlier file"
	}
	for i := range len(name) {
		if name[i] == '/' {
			if _, ok := files[name[:i]]; ok {
				return "below an earlier file " + strconv.QuoteToASCII(name[:i])
			}
		}
	}
	return ""
}

// install renames the staged files into the project's tree (under the
// project's exclusive lock), leaving identical files be.
func (s *Store) install(root *os.Root, project string, staged []stagedFile, res *SaveResult) error {
	tree := projectPath(project, treeName)
	if err := realDir(root, tree); err != nil {
		return err
	}
	now := s.now()
	known := map[string]bool{}
	for _, sf := range staged {
		target := tree + "/" + sf.name
		if sameContent(root, target, sf) {
			if err := root.Chtimes(target, now, now); err != nil {
				return fmt.Errorf("hostcache: %w", err)
			}
			setKeptSum(root, target, sf.sum)
			res.Unchanged++
			continue
		}
		if err := makeParents(root, tree, sf.name, known); err != nil {
			return err
		}
		if fi, err := root.Lstat(target); err == nil && fi.IsDir() {
			if err := root.RemoveAll(target); err != nil {
				return fmt.Errorf("hostcache: %w", err)
			}
		}
		if err := root.Chtimes(sf.file, now, now); err != nil {
			return fmt.Errorf("hostcache: %w", err)
		}
		if err := root.Rename(sf.file, target); err != nil {
			return fmt.Errorf("hostcache: %w", err)
		}
		setKeptSum(root, target, sf.sum)
		res.Files++
		res.Bytes += sf.size
	}
	return nil
}

// sameContent: target is a regular file with sf's size and sha256 (its
// sumXattr, or read).
func sameContent(root *os.Root, target string, sf stagedFile) bool {
	fi, err := root.Lstat(target)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() != sf.size {
		return false
	}
	f, err := root.Open(target)
	if err != nil {
		return false
	}
	defer func() { _ = f.Close() }()
	var kept [sha256.Size + 8]byte
	if n, err := unix.Fgetxattr(int(f.Fd()), sumXattr, kept[:]); err == nil && n == len(kept) &&
		binary.LittleEndian.Uint64(kept[sha256.Size:]) == uint64(fi.ModTime().UnixNano()) {
		return [sha256.Size]byte(kept[:sha256.Size]) == sf.sum
	}
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return false
	}
	return bytes.Equal(h.Sum(nil), sf.sum[:])
}

// makeParents makes name's parent directories under tree, replacing (not
// following) whatever non-directory (a symlink, a file) is in the way.
// known holds the directories this install has made or found already
// (under the project's lock they stay so): each is looked at once, not
// once per file in it (an Lstat through os.Root opens every component).
func makeParents(root *os.Root, tree, name string, known map[string]bool) error {
	for i := range len(name) {
		if name[i] != '/' {
			continue
		}
		if known[name[:i]] {
			continue
		}
		known[name[:i]] = true
		dir := tree + "/" + name[:i]
		fi, err := root.Lstat(dir)
		if err == nil && fi.IsDir() {
			continue
		}
		if err == nil {
			err = root.Remove(dir)
		} else if errors.Is(err, fs.ErrNotExist) {
			err = nil
		}
		if err == nil {
			err = root.Mkdir(dir, 0o700)
		}
		if err != nil {
			return fmt.Errorf("hostcache: %w", err)
		}
	}
	return nil
}
