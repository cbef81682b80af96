package hostcache

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"syscall"
)

// RestoreResult says what a Restore wrote.
type RestoreResult struct {
	Files int64
	Bytes int64 // the files' bytes (not counting tar headers)
}

// Restore writes the project's cache to w as a tar stream for `tar -x`
// in the guest: directories (0755) and regular files (0644) with
// relative names, nothing else. A project without a cache gives an empty
// tar stream. It marks the project used now, and holds a shared lock on
// it while reading, so each file is whole, from before or after a
// concurrent Save.
func (s *Store) Restore(ctx context.Context, project string, w io.Writer) (RestoreResult, error) {
	var res RestoreResult
	if err := checkProject(project); err != nil {
		return res, err
	}
	root, err := s.open()
	if err != nil {
		return res, err
	}
	defer func() { _ = root.Close() }()
	tw := tar.NewWriter(w)
	lock, err := lockProject(ctx, root, project, syscall.LOCK_SH, false, false)
	if errors.Is(err, errNoProject) {
		return res, tw.Close()
	}
	if err != nil {
		return res, err
	}
	defer func() { _ = lock.Close() }()
	if err := s.touch(root, project); err != nil {
		return res, err
	}
	tree := projectPath(project, treeName)
	if _, err := root.Lstat(tree); errors.Is(err, fs.ErrNotExist) {
		return res, tw.Close()
	}
	err = fs.WalkDir(root.FS(), tree, func(path string, d fs.DirEntry, err error) error {
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
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: 0o755})
		}
		if !d.Type().IsRegular() {
			return nil // not ours: Save writes no other kind
		}
		f, err := root.Open(path)
		if err != nil {
			return err
		}
		defer func() { _ = f.Close() }()
		fi, err := f.Stat()
		if err != nil || !fi.Mode().IsRegular() {
			return err
		}
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: fi.Size(), ModTime: fi.ModTime()}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		// Save renames whole files into place and never writes one in
		// place, so the open file keeps its size.
		if _, err := io.CopyN(tw, f, fi.Size()); err != nil {
			return err
		}
		res.Files++
		res.Bytes += fi.Size()
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		return res, fmt.Errorf("hostcache: restoring %s: %w", project, err)
	}
	return res, nil
}
