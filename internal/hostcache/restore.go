package hostcache

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"
)

// RestoreResult says what a Restore wrote.
type RestoreResult struct {
	Files int64
	Bytes int64 // the files' bytes (not counting tar headers)
}

// Snapshot is a project's cache as one tar stream for `tar -x` in the
// guest, fixed while it is open: it holds a shared lock on the project, so
// each file is whole, from before or after a concurrent Save, and the
// stream's Size is known before it is written (a disk is made to fit it).
// The stream has directories (0755) and regular files (0644) with relative
// names, nothing else; a project without a cache gives an empty one.
type Snapshot struct {
	root    *os.Root
	lock    *os.File
	entries []entry
	want    func(name string) bool
	size    int64
	res     RestoreResult
}

// entry is one member of a Snapshot.
type entry struct {
	path, name string // path under the store's root; name in the stream
	dir        bool
	size       int64
	mtime      time.Time
}

// Open takes a snapshot of the project's cache and marks the project used
// now. Close releases it.
func (s *Store) Open(ctx context.Context, project string) (*Snapshot, error) {
	return s.OpenOnly(ctx, project, nil)
}

// OpenOnly is Open for the files whose names (relative to the project's
// cache, as Names lists them) want keeps; nil keeps all.
func (s *Store) OpenOnly(ctx context.Context, project string, want func(name string) bool) (*Snapshot, error) {
	if err := checkJobProject(project); err != nil {
		return nil, err
	}
	root, err := s.open()
	if err != nil {
		return nil, err
	}
	sn := &Snapshot{root: root, want: want}
	lock, err := lockProject(ctx, root, project, syscall.LOCK_SH, false, false)
	switch {
	case errors.Is(err, errNoProject):
		return sn, sn.measure()
	case err != nil:
		_ = root.Close()
		return nil, err
	}
	sn.lock = lock
	if err := sn.list(ctx, s, project); err != nil {
		_ = sn.Close()
		return nil, fmt.Errorf("hostcache: restoring %s: %w", project, err)
	}
	return sn, nil
}

// list fills the snapshot from the project's tree.
func (sn *Snapshot) list(ctx context.Context, s *Store, project string) error {
	if err := s.touch(sn.root, project); err != nil {
		return err
	}
	tree := projectPath(project, treeName)
	if _, err := sn.root.Lstat(tree); errors.Is(err, fs.ErrNotExist) {
		return sn.measure()
	}
	err := fs.WalkDir(sn.root.FS(), tree, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if path == tree {
			return nil
		}
		name := strings.TrimPrefix(path, tree+"/")
		if d.IsDir() {
			sn.entries = append(sn.entries, entry{path: path, name: name + "/", dir: true})
			return nil
		}
		if !d.Type().IsRegular() {
			return nil // not ours: Save writes no other kind
		}
		if sn.want != nil && !sn.want(name) {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		sn.entries = append(sn.entries, entry{path: path, name: name, size: fi.Size(), mtime: fi.ModTime()})
		sn.res.Files++
		sn.res.Bytes += fi.Size()
		return nil
	})
	if err != nil {
		return err
	}
	return sn.measure()
}

// measure computes the stream's size without reading a file: each
// member's header as archive/tar writes it (with its PAX records, for long
// names), its bytes padded to 512, and the two zero blocks at the end.
func (sn *Snapshot) measure() error {
	size := int64(2 * blockSize)
	for _, e := range sn.entries {
		var n countWriter
		if err := tar.NewWriter(&n).WriteHeader(e.header()); err != nil {
			return err
		}
		size += int64(n) + (e.size+blockSize-1)/blockSize*blockSize
	}
	sn.size = size
	return nil
}

// blockSize is tar's.
const blockSize = 512

// header is the entry's tar header.
func (e entry) header() *tar.Header {
	if e.dir {
		return &tar.Header{Typeflag: tar.TypeDir, Name: e.name, Mode: 0o755}
	}
	return &tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: e.size, ModTime: e.mtime}
}

// Names are the names of the files the stream holds.
func (sn *Snapshot) Names() []string {
	var out []string
	for _, e := range sn.entries {
		if !e.dir {
			out = append(out, e.name)
		}
	}
	return out
}

// Bytes is the bytes of the stream's files that want keeps (nil: all).
func (sn *Snapshot) Bytes(want func(name string) bool) int64 {
	var n int64
	for _, e := range sn.entries {
		if !e.dir && (want == nil || want(e.name)) {
			n += e.size
		}
	}
	return n
}

// Only is the filter for OpenOnly and Save that keeps exactly the files
// named in want: none when want is empty (never all).
func Only(want []string) func(name string) bool {
	return func(name string) bool { return slices.Contains(want, name) }
}

// Files says how many files the stream holds, and their bytes.
func (sn *Snapshot) Files() RestoreResult { return sn.res }

// Size is the stream's length in bytes (a multiple of 512).
func (sn *Snapshot) Size() int64 { return sn.size }

// WriteTo writes the stream to w: exactly Size bytes, or an error.
func (sn *Snapshot) WriteTo(w io.Writer) (int64, error) {
	var n countWriter
	tw := tar.NewWriter(io.MultiWriter(w, &n))
	err := func() error {
		for _, e := range sn.entries {
			if err := tw.WriteHeader(e.header()); err != nil {
				return err
			}
			if e.dir {
				continue
			}
			if err := sn.copyFile(tw, e); err != nil {
				return err
			}
		}
		return tw.Close()
	}()
	if err == nil && int64(n) != sn.size {
		err = fmt.Errorf("hostcache: the cache's stream came out %d bytes long, not %d", n, sn.size)
	}
	return int64(n), err
}

// copyFile copies e's bytes to w. Save renames whole files into place and
// never writes one in place, and the shared lock keeps a Save from
// replacing or removing one: the file still has the size listed.
func (sn *Snapshot) copyFile(w io.Writer, e entry) error {
	f, err := sn.root.Open(e.path)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	_, err = io.CopyN(w, f, e.size)
	return err
}

// Close releases the snapshot's lock.
func (sn *Snapshot) Close() error {
	var err error
	if sn.lock != nil {
		err = sn.lock.Close()
		sn.lock = nil
	}
	if sn.root != nil {
		err = errors.Join(err, sn.root.Close())
		sn.root = nil
	}
	return err
}

// Restore writes the project's cache to w as a tar stream (Snapshot) and
// marks the project used now.
func (s *Store) Restore(ctx context.Context, project string, w io.Writer) (RestoreResult, error) {
	sn, err := s.Open(ctx, project)
	if err != nil {
		return RestoreResult{}, err
	}
	defer func() { _ = sn.Close() }()
	if _, err := sn.WriteTo(w); err != nil {
		return RestoreResult{}, fmt.Errorf("hostcache: restoring %s: %w", project, err)
	}
	return sn.Files(), nil
}

type countWriter int64

func (c *countWriter) Write(p []byte) (int, error) { *c += countWriter(len(p)); return len(p), nil }
