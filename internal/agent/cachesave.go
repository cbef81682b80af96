//go:build linux

package agent

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachelayout"
)

// CacheSave is `lve-agent cache-save DEVICE DIR`: the host cache's save in
// the guest (internal/cachexfer's armed save), in one process: it writes the
// regular files under DIR on the scratch disk DEVICE in the direct layout
// (cachelayout) with O_DIRECT, each file's bytes at its offset, then the
// manifest, then flushes the disk; the shell's way does the same with five
// processes (find, stat, dd, stat, sync), each of which costs a TCG guest
// tens of milliseconds. armed: it waits for a line cachelayout.Go on in
// first (the host sends it once the runner's archive is made; started
// before, the process's start, and sudo's where the job's user cannot
// write the disk, are paid while the runner zips); without it it says
// cachelayout.NotAsked. It says cachelayout.Written "0 direct agent" on
// its last line when the disk holds the layout, else
// cachelayout.NotDirect (why on errOut): the host then runs the shell's
// save, which writes a tar stream where the layout cannot carry the cache
// (more than cachelayout.MaxDirectFiles files, a name with a newline, a
// file whose size changed, no room on the disk). Symbolic links and other
// files that are not regular are not followed and not written (the
// shell's `find -type f` leaves them out alike). Nothing is written in
// DIR. The exit status is 0 in every one of these cases; 2 for bad
// arguments.
func CacheSave(args []string, in io.Reader, out, errOut io.Writer) int {
	armed := len(args) > 0 && args[0] == "--armed"
	if armed {
		args = args[1:]
	}
	if len(args) != 2 || args[0] == "" || args[1] == "" {
		fmt.Fprintln(errOut, "lve-agent cache-save: want [--armed] DEVICE DIR")
		return 2
	}
	dev, dir := args[0], args[1]
	if armed {
		line, err := bufio.NewReaderSize(in, 64).ReadString('\n')
		if err != nil || strings.TrimSuffix(line, "\n") != cachelayout.Go {
			fmt.Fprintln(out, cachelayout.NotAsked)
			return 0
		}
	}
	if err := writeDirectLayout(dev, dir); err != nil {
		fmt.Fprintln(errOut, "lve-agent cache-save:", err)
		fmt.Fprintln(out, cachelayout.NotDirect)
		return 0
	}
	fmt.Fprintln(out, cachelayout.Written+" 0 direct agent")
	return 0
}

// layoutFile is one file of the layout being written.
type layoutFile struct {
	name string // as the manifest says it: "./" and the path under DIR
	size int64
	off  int64
}

// copyChunk is how much of a file goes to the disk in one write.
const copyChunk = 1 << 20

// writeDirectLayout writes the regular files under dir on the device dev in
// the direct layout; an error means the disk does not hold it (a manifest
// is written only once every file is whole on the disk).
func writeDirectLayout(dev, dir string) error {
	files, end, err := listLayout(dir)
	if err != nil {
		return err
	}
	manifest := manifestOf(files)
	d, err := openDirect(dev)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	capacity, err := d.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("the size of %s: %w", dev, err)
	}
	if end > capacity {
		return fmt.Errorf("the files need %d bytes of the disk, which has %d", end, capacity)
	}
	bufs := newBuffers()
	for _, f := range files {
		if err := copyAt(d, bufs, dir, f); err != nil {
			return err
		}
	}
	head := alignedBuffer(roundUp(int64(len(manifest)), cachelayout.Align))
	copy(head, manifest)
	if _, err := d.WriteAt(head, 0); err != nil {
		return fmt.Errorf("writing the manifest on %s: %w", dev, err)
	}
	if err := d.Sync(); err != nil {
		// The shell's way writes next; a manifest of this try left on
		// the disk could describe bytes it rewrote.
		clear(head)
		_, _ = d.WriteAt(head, 0)
		return fmt.Errorf("flushing %s: %w", dev, err)
	}
	return nil
}

// listLayout lists the regular files under dir with their offsets, and
// where the last one ends; a layout that cannot carry them is an error. A
// dir that does not exist is an empty cache; a dir that is a link (an
// image's /cache on another disk) is followed, as the shell's cd does, the
// links under it are not.
func listLayout(dir string) ([]layoutFile, int64, error) {
	var files []layoutFile
	off := int64(cachelayout.ManifestMax)
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	err := filepath.WalkDir(dir, func(path string, e fs.DirEntry, err error) error {
		switch {
		case err != nil:
			if path == dir && errors.Is(err, fs.ErrNotExist) {
				return fs.SkipAll
			}
			return err
		case !e.Type().IsRegular():
			return nil
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		if strings.ContainsAny(rel, "\n\x00") {
			return fmt.Errorf("the name %s has a newline", strconv.QuoteToASCII(rel))
		}
		info, err := e.Info()
		if err != nil {
			return err
		}
		if len(files) == cachelayout.MaxDirectFiles {
			return fmt.Errorf("more than %d files", cachelayout.MaxDirectFiles)
		}
		files = append(files, layoutFile{name: "./" + rel, size: info.Size(), off: off})
		off += roundUp(info.Size(), cachelayout.Align)
		return nil
	})
	if err != nil {
		return nil, 0, err
	}
	if n := len(manifestOf(files)); n > cachelayout.ManifestMax {
		return nil, 0, fmt.Errorf("the manifest takes %d bytes, over %d", n, cachelayout.ManifestMax)
	}
	return files, off, nil
}

// manifestOf is the layout's manifest for files.
func manifestOf(files []layoutFile) []byte {
	var b strings.Builder
	b.WriteString(cachelayout.Magic + "\n")
	for _, f := range files {
		fmt.Fprintf(&b, "%d %d %s\n", f.off, f.size, f.name)
	}
	b.WriteString(cachelayout.End + "\n")
	return []byte(b.String())
}

// inFlight is how many chunks a copy reads ahead of its writes: the
// guest's read of the next chunk (a copy out of its page cache, slow in a
// TCG guest) overlaps the disk's write of the one before (QEMU's, on the
// host), where one at a time adds them up.
const inFlight = 3

// buffers are a copy's chunk buffers, reused from file to file.
type buffers chan []byte

func newBuffers() buffers {
	b := make(buffers, inFlight)
	for range inFlight {
		b <- alignedBuffer(copyChunk)
	}
	return b
}

// chunk is a buffer read and waiting to be written at off (w bytes: n read,
// padded to cachelayout.Align).
type chunk struct {
	buf    []byte
	w, off int64
}

// copyAt copies the file f under dir to its offset on d, each write a
// multiple of cachelayout.Align (its last one padded with zeros, which the
// next file's offset leaves room for): from a mapping of the file
// (copyMapped), else read ahead of the writes (copyRead). A file that is
// not f.size bytes any more, or not a regular file, is an error.
func copyAt(d *os.File, bufs buffers, dir string, f layoutFile) error {
	src, err := os.OpenFile(filepath.Join(dir, f.name), os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return err
	}
	defer func() { _ = src.Close() }()
	mapped, err := copyMapped(d, src, f)
	if err != nil {
		return err
	}
	if !mapped {
		if err := copyRead(d, bufs, src, f); err != nil {
			return err
		}
	}
	info, err := src.Stat()
	switch {
	case err != nil:
		return err
	case !info.Mode().IsRegular() || info.Size() != f.size:
		return fmt.Errorf("%s changed while it was copied (%d bytes, was %d)", strconv.QuoteToASCII(f.name), info.Size(), f.size)
	}
	return nil
}

// mappedChunk is how much of a mapped file goes to the disk in one write.
const mappedChunk = 2 << 20

// copyMapped writes the file src to its offset on d from a mapping of the
// file (page aligned, as O_DIRECT wants): the disk's writes take the bytes
// from the guest's page cache, and nothing copies them in the guest (the
// read's copy is most of the cost in a TCG guest). The last write reaches
// past the file's end to the next multiple of cachelayout.Align: the
// mapping's last page holds zeros there. The process only hands the
// mapping to write(2), never reads it itself: a file cut short meanwhile
// fails the write, it cannot fault the agent. false where the file cannot
// be mapped (the caller reads it).
func copyMapped(d, src *os.File, f layoutFile) (bool, error) {
	if f.size == 0 {
		return true, nil
	}
	length := roundUp(f.size, int64(os.Getpagesize()))
	if length > math.MaxInt || length < roundUp(f.size, cachelayout.Align) {
		return false, nil
	}
	m, err := unix.Mmap(int(src.Fd()), 0, int(length), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return false, nil
	}
	defer func() { _ = unix.Munmap(m) }()
	for done := int64(0); done < f.size; done += mappedChunk {
		w := min(mappedChunk, roundUp(f.size-done, cachelayout.Align))
		if _, err := d.WriteAt(m[done:done+w], f.off+done); err != nil {
			return true, fmt.Errorf("writing %s on the disk: %w", strconv.QuoteToASCII(f.name), err)
		}
	}
	return true, nil
}

// copyRead is copyMapped for a file that cannot be mapped: read into bufs,
// up to inFlight chunks ahead of the disk's writes.
func copyRead(d *os.File, bufs buffers, src *os.File, f layoutFile) error {
	full := make(chan chunk, inFlight)
	written := make(chan error, 1)
	go func() {
		var werr error
		for c := range full {
			if werr == nil {
				if _, err := d.WriteAt(c.buf[:c.w], c.off); err != nil {
					werr = fmt.Errorf("writing %s on the disk: %w", strconv.QuoteToASCII(f.name), err)
				}
			}
			bufs <- c.buf
		}
		written <- werr
	}()
	var done int64
	var rerr error
	for done < f.size && rerr == nil {
		buf := <-bufs
		n, err := io.ReadFull(src, buf[:min(int64(len(buf)), f.size-done)])
		if err != nil {
			rerr = fmt.Errorf("%s: %d of its %d bytes read: %w", strconv.QuoteToASCII(f.name), done+int64(n), f.size, err)
			bufs <- buf
			break
		}
		w := roundUp(int64(n), cachelayout.Align)
		clear(buf[n:w])
		full <- chunk{buf: buf, w: w, off: f.off + done}
		done += int64(n)
	}
	close(full)
	if werr := <-written; rerr == nil {
		rerr = werr
	}
	return rerr
}

// openDirect opens the device for writes that bypass the guest's page
// cache; where the file system refuses O_DIRECT (a file on tmpfs: the
// tests), without it.
func openDirect(dev string) (*os.File, error) {
	d, err := os.OpenFile(dev, os.O_RDWR|unix.O_DIRECT, 0)
	if errors.Is(err, unix.EINVAL) {
		d, err = os.OpenFile(dev, os.O_RDWR, 0)
	}
	return d, err
}

// alignedBuffer is n bytes (a multiple of cachelayout.Align) starting at
// an address aligned for O_DIRECT: anonymous memory of its own, page
// aligned (the process ends after the save; it is not unmapped).
func alignedBuffer(n int64) []byte {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		// O_DIRECT may refuse an unaligned buffer (EINVAL): the write
		// fails and the host runs the shell's way.
		return make([]byte, n)
	}
	return b
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }
