package hostcache

import (
	"archive/tar"
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachelayout"
)

// The direct layout: what a guest writes on a scratch disk when it copies
// its cache's files with O_DIRECT (no copy through the guest's page cache,
// which is most of a tar's cost in a slow guest) instead of writing a tar
// stream. A manifest at the disk's start, DirectManifestMax bytes at most:
//
//	lve-cache-direct 1
//	<offset> <size> <name>      one line per file, in increasing offsets
//	end
//
// offset and size are decimal bytes; each offset is a multiple of
// DirectAlign, at least DirectManifestMax, and at or past the end of the
// file before (rounded up to DirectAlign); name is the rest of the line.
// Each file's bytes are at its offset. A disk that does not start with the
// first line is read as a tar stream (the guest's fallback).
const (
	DirectMagic       = cachelayout.Magic
	DirectEnd         = cachelayout.End
	DirectManifestMax = cachelayout.ManifestMax
	DirectAlign       = cachelayout.Align
	// maxDirectName bounds a manifest line's name (tar's limits and
	// cleanName's refuse far shorter ones).
	maxDirectName = MaxDepth * (MaxComponent + 1)
)

// errDirect is a malformed direct layout.
var errDirect = errors.New("hostcache: the scratch disk's manifest")

// FromDisk returns a tar stream of what a guest wrote on a scratch disk
// (read from r, from the disk's first byte): the files of a direct layout
// as tar entries, or, when the disk does not start with DirectMagic, the
// disk's bytes as they are (a tar stream the guest wrote). It reads the
// manifest (DirectManifestMax bytes at most) before it returns; the files'
// bytes are read as the stream is. The result is as hostile as r:
// Store.Save checks it. Names, sizes and offsets are checked only as far
// as the layout needs (sizes within maxSize, offsets increasing); a lying
// manifest can make entries of zeros or of another file's bytes, never
// make the read go backwards or past where r ends. Closing the result
// ends the goroutine that writes a direct layout's tar stream (once r's
// reads end too, when it is blocked in one).
func FromDisk(r io.Reader, maxSize int64) (io.ReadCloser, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	head, err := br.Peek(len(DirectMagic) + 1)
	if err != nil || string(head) != DirectMagic+"\n" {
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("hostcache: reading the scratch disk: %w", err)
		}
		return io.NopCloser(br), nil // a tar stream (or nothing Save will take)
	}
	man := make([]byte, DirectManifestMax)
	if _, err := io.ReadFull(br, man); err != nil {
		return nil, fmt.Errorf("hostcache: reading the scratch disk's manifest: %w", err)
	}
	files, err := parseManifest(man, maxSize)
	if err != nil {
		return nil, err
	}
	pr, pw := io.Pipe()
	go func() { _ = pw.CloseWithError(writeDirect(pw, br, files)) }()
	return pr, nil
}

type directFile struct {
	off, size int64
	name      string
}

// parseManifest reads the manifest in man (the disk's first
// DirectManifestMax bytes).
func parseManifest(man []byte, maxSize int64) ([]directFile, error) {
	end := bytes.Index(man, []byte("\n"+DirectEnd+"\n"))
	if end < 0 {
		return nil, fmt.Errorf("%w has no %q line within its %d bytes (the guest did not finish writing it)", errDirect, DirectEnd, DirectManifestMax)
	}
	body := man[len(DirectMagic)+1 : end+1]
	if bytes.Count(body, []byte("\n")) > MaxFiles {
		return nil, fmt.Errorf("%w: %w: more than %d files", errDirect, ErrTooManyFiles, MaxFiles)
	}
	lines := strings.Split(string(body), "\n")
	lines = lines[:len(lines)-1] // the empty string after the last "\n"
	// No file starts past where the files allowed, each aligned, would
	// end: the offsets' sums cannot overflow.
	last := int64(DirectManifestMax) + maxSize + int64(len(lines))*DirectAlign
	files := make([]directFile, 0, len(lines))
	next := int64(DirectManifestMax) // the first offset allowed
	var total int64
	for i, line := range lines {
		f, err := parseDirectLine(line, next, last, maxSize-total)
		if err != nil {
			return nil, fmt.Errorf("%w, line %d: %w", errDirect, i+2, err)
		}
		total += f.size
		next = f.off + (f.size+DirectAlign-1)/DirectAlign*DirectAlign
		files = append(files, f)
	}
	return files, nil
}

// parseDirectLine parses "<offset> <size> <name>": offset aligned, at
// least next and at most last, size at most room.
func parseDirectLine(line string, next, last, room int64) (directFile, error) {
	o, rest, ok1 := strings.Cut(line, " ")
	s, name, ok2 := strings.Cut(rest, " ")
	if !ok1 || !ok2 || name == "" {
		return directFile{}, errors.New(`want "<offset> <size> <name>"`)
	}
	off, err1 := strconv.ParseInt(o, 10, 64)
	size, err2 := strconv.ParseInt(s, 10, 64)
	switch {
	case err1 != nil || err2 != nil || off < 0 || size < 0:
		return directFile{}, fmt.Errorf("offset %.20q and size %.20q: want decimal numbers of bytes", o, s)
	case off%DirectAlign != 0 || off < next || off > last:
		return directFile{}, fmt.Errorf("offset %d: want a multiple of %d from %d to %d (the files in increasing order, within the disk)", off, DirectAlign, next, last)
	case size > room:
		return directFile{}, fmt.Errorf("%w: size %d: the files need more than the bytes allowed", ErrProjectLimit, size)
	case len(name) > maxDirectName || strings.ContainsRune(name, 0):
		return directFile{}, fmt.Errorf("name %.40q...: over %d bytes or with a NUL", name, maxDirectName)
	}
	return directFile{off: off, size: size, name: name}, nil
}

// writeDirect writes files, read from r (positioned at DirectManifestMax),
// to w as a tar stream.
func writeDirect(w io.Writer, r io.Reader, files []directFile) error {
	tw := tar.NewWriter(w)
	pos := int64(DirectManifestMax)
	for _, f := range files {
		if _, err := io.CopyN(io.Discard, r, f.off-pos); err != nil {
			return fmt.Errorf("hostcache: the scratch disk ends before %s's bytes: %w", strconv.QuoteToASCII(f.name), err)
		}
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: f.name, Size: f.size, Mode: 0o600, Format: tar.FormatPAX}
		if err := tw.WriteHeader(hdr); err != nil {
			return fmt.Errorf("hostcache: %s: %w", strconv.QuoteToASCII(f.name), err)
		}
		if _, err := io.CopyN(tw, r, f.size); err != nil {
			return fmt.Errorf("hostcache: the scratch disk ends within %s's bytes: %w", strconv.QuoteToASCII(f.name), err)
		}
		pos = f.off + f.size
	}
	return tw.Close()
}
