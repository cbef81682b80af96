package obs

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// The spool is a directory (0700) of segment files (0600), each a sequence
// of JSON lines named by a growing number. Writers append one line with one
// write(2) to the newest segment, holding a shared flock on it; when the
// newest is full they start the next. The service (Spool.Fold) reads from
// its cursor on, and removes a segment it has read to the end only once a
// newer one exists, under an exclusive flock (no writer is in it) and after
// it saved its cursor past it: a record is counted once, or, if the service
// died in between, found again from the saved cursor, never twice.
//
// Bounded: when the segments reach the spool's limit (the service has been
// down for long), a writer removes the oldest and adds the records it held
// that the service had not read to the lost count (LostFile), which the
// service folds in as lost.

// Files of the spool directory.
const (
	// FoldedFile is the service's saved state: its cursor and what it has
	// folded so far (Folded).
	FoldedFile = "folded.json"
	// LostFile counts the records writers dropped, as a decimal number.
	LostFile  = "lost"
	segSuffix = ".jsonl"
)

// Spool is the event spool in Dir.
type Spool struct {
	Dir string
	// SegmentBytes is when a segment is full (default 256 KiB); MaxBytes
	// bounds the whole spool (default 16 MiB).
	SegmentBytes int64
	MaxBytes     int64
}

// Cursor is a position in the spool: segment number and byte offset.
type Cursor struct {
	Seq uint64 `json:"seq"`
	Off int64  `json:"off"`
}

// Folded is the service's saved state: Cursor and what it made of the
// records before it (Totals, the metrics package's format), and the lost
// count it has folded in.
type Folded struct {
	Cursor Cursor          `json:"cursor"`
	Lost   int64           `json:"lost"`
	Totals json.RawMessage `json:"totals,omitempty"`
}

// maxLine bounds one record; a longer line is invalid.
const maxLine = 16 << 10

func (s Spool) segBytes() int64 {
	if s.SegmentBytes > 0 {
		return s.SegmentBytes
	}
	return 256 << 10
}

func (s Spool) maxSegments() int {
	limit := s.MaxBytes
	if limit <= 0 {
		limit = 16 << 20
	}
	return max(2, int(limit/s.segBytes()))
}

func segName(seq uint64) string { return fmt.Sprintf("%012d%s", seq, segSuffix) }

// segments lists the segment numbers, oldest first.
func (s Spool) segments() ([]uint64, error) {
	entries, err := os.ReadDir(s.Dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var seqs []uint64
	for _, e := range entries {
		n, ok := strings.CutSuffix(e.Name(), segSuffix)
		if !ok {
			continue
		}
		if seq, err := strconv.ParseUint(n, 10, 64); err == nil {
			seqs = append(seqs, seq)
		}
	}
	slices.Sort(seqs)
	return seqs, nil
}

// lockWait bounds how long a writer waits for a segment's lock (the
// service holds it only while it reads a segment's rest and saves); see
// lockOpen.
const lockWait = time.Second

// checkOwner refuses to write into a spool (or, before it exists, a state
// directory) that another user owns: a root admin command must not leave
// root-owned segments the runner's user cannot write.
func (s Spool) checkOwner() error {
	dir := s.Dir
	st, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		dir = filepath.Dir(dir)
		st, err = os.Stat(dir)
	}
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil // made below, by us
		}
		return err
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) != os.Geteuid() {
		return fmt.Errorf("%s belongs to uid %d, not to this process (uid %d): not writing there (run as the stages' user)", dir, sys.Uid, os.Geteuid())
	}
	return nil
}

// Append adds one record. It never waits for the service: a few file
// operations, one write.
func (s Spool) Append(e Event) error {
	e = e.bounded()
	e.V = EventVersion
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	line, err := json.Marshal(e)
	if err != nil {
		return err
	}
	line = append(line, '\n')
	if err := s.checkOwner(); err != nil {
		return fmt.Errorf("event spool: %w", err)
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return fmt.Errorf("event spool: %w", err)
	}
	for range 8 {
		seqs, err := s.segments()
		if err != nil {
			return fmt.Errorf("event spool: %w", err)
		}
		if len(seqs) == 0 {
			s.create(1)
			continue
		}
		newest := seqs[len(seqs)-1]
		written, full, err := s.appendTo(newest, line)
		if err != nil {
			return fmt.Errorf("event spool: %w", err)
		}
		if full {
			s.create(newest + 1)
			if len(seqs)+1 > s.maxSegments() {
				s.dropOldest(seqs[0])
			}
			continue
		}
		if written {
			return nil
		}
		// The segment went away between the listing and the lock: list
		// again.
	}
	return errors.New("event spool: no segment to write to after 8 attempts")
}

// create makes segment seq unless it exists.
func (s Spool) create(seq uint64) {
	f, err := os.OpenFile(filepath.Join(s.Dir, segName(seq)), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err == nil {
		_ = f.Close()
	}
}

// appendTo writes line to segment seq under a shared lock, unless the
// segment is full (full) or gone (neither written nor full).
func (s Spool) appendTo(seq uint64, line []byte) (written, full bool, err error) {
	f, err := os.OpenFile(filepath.Join(s.Dir, segName(seq)), os.O_WRONLY|os.O_APPEND, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false, false, nil
	}
	if err != nil {
		return false, false, err
	}
	defer f.Close()
	lock, gone, err := lockOpen(f, true)
	if err != nil || gone {
		return false, false, err
	}
	defer func() { _ = lock.Close() }()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return false, false, err
	}
	if st.Nlink == 0 {
		return false, false, nil // removed by the service or a writer dropping it
	}
	if st.Size >= s.segBytes() {
		return false, true, nil
	}
	if _, err := f.Write(line); err != nil {
		return false, false, err
	}
	return true, false, nil
}

// dropOldest removes segment seq when the spool is over its bound and adds
// the records the service had not read to LostFile.
func (s Spool) dropOldest(seq uint64) {
	path := filepath.Join(s.Dir, segName(seq))
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	lock, gone, err := lockOpen(f, false)
	if err != nil || gone {
		return
	}
	defer func() { _ = lock.Close() }()
	var st syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &st) != nil || st.Nlink == 0 {
		return
	}
	var from int64
	var folded Folded
	if b, err := os.ReadFile(filepath.Join(s.Dir, FoldedFile)); err == nil && json.Unmarshal(b, &folded) == nil {
		switch {
		case folded.Cursor.Seq > seq:
			from = st.Size // read already
		case folded.Cursor.Seq == seq:
			from = folded.Cursor.Off
		}
	}
	lost := int64(0)
	if _, err := f.Seek(from, io.SeekStart); err == nil {
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), maxLine*4)
		for sc.Scan() {
			lost++
		}
	}
	if os.Remove(path) == nil && lost > 0 {
		_ = s.addLost(lost)
	}
}

// addLost adds n to LostFile under an exclusive lock.
func (s Spool) addLost(n int64) error {
	f, err := os.OpenFile(filepath.Join(s.Dir, LostFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	lock, gone, err := lockOpen(f, false)
	if err != nil {
		return err
	}
	if gone {
		return fmt.Errorf("%s: removed or replaced while being locked", f.Name())
	}
	defer func() { _ = lock.Close() }()
	b, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	have, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err = f.WriteAt([]byte(strconv.FormatInt(have+n, 10)+"\n"), 0)
	return err
}

// Lost is the number of records writers have dropped so far (read under
// the lock that addLost writes it under).
func (s Spool) Lost() int64 {
	f, err := os.Open(filepath.Join(s.Dir, LostFile))
	if err != nil {
		return 0
	}
	defer f.Close()
	lock, gone, err := lockOpen(f, true)
	if err != nil || gone {
		return 0
	}
	defer func() { _ = lock.Close() }()
	b, err := io.ReadAll(f)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// Backlog is the size of the segments from c on: records not folded yet.
func (s Spool) Backlog(c Cursor) int64 {
	seqs, _ := s.segments()
	var n int64
	for _, seq := range seqs {
		if seq < c.Seq {
			continue
		}
		if st, err := os.Stat(filepath.Join(s.Dir, segName(seq))); err == nil {
			n += st.Size()
			if seq == c.Seq {
				n -= min(c.Off, st.Size())
			}
		}
	}
	return n
}

// LoadFolded reads the service's saved state (zero if there is none yet).
func (s Spool) LoadFolded() (Folded, error) {
	var f Folded
	b, err := os.ReadFile(filepath.Join(s.Dir, FoldedFile))
	if errors.Is(err, os.ErrNotExist) {
		return f, nil
	}
	if err != nil {
		return f, err
	}
	if err := json.Unmarshal(b, &f); err != nil {
		return f, fmt.Errorf("%s: %w", filepath.Join(s.Dir, FoldedFile), err)
	}
	return f, nil
}

// SaveFolded replaces the service's saved state.
func (s Spool) SaveFolded(f Folded) error {
	b, err := json.Marshal(f)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return err
	}
	return state.WriteFileDurable(filepath.Join(s.Dir, FoldedFile), b)
}

// SetFoldedAside renames an unreadable saved state out of the way and
// returns its new name.
func (s Spool) SetFoldedAside() (string, error) {
	aside := filepath.Join(s.Dir, fmt.Sprintf("%s.bad-%d", FoldedFile, time.Now().Unix()))
	return aside, os.Rename(filepath.Join(s.Dir, FoldedFile), aside)
}

// Reader folds the spool's records into something (the metrics): Apply
// takes each valid record, Invalid counts each unreadable one, and Save
// persists what was folded up to the cursor it is given (it must write
// FoldedFile through SaveFolded, or the like, before it returns).
type Reader struct {
	Apply   func(Event)
	Invalid func()
	Save    func(Cursor) error
}

// Fold reads every complete record after c, in order, and returns the new
// cursor. Segments read to the end that a newer one follows are removed,
// each after Save has stored a cursor past it.
func (s Spool) Fold(c Cursor, r Reader) (Cursor, error) {
	seqs, err := s.segments()
	if err != nil {
		return c, err
	}
	if len(seqs) > 0 && c.Seq < seqs[0] {
		// What the cursor pointed into was dropped (and counted lost).
		c = Cursor{Seq: seqs[0]}
	}
	if len(seqs) > 0 && (c.Seq > seqs[len(seqs)-1] || (c.Seq == seqs[len(seqs)-1] && c.Off > s.size(c.Seq))) {
		// Past the spool's end: its segments were removed by hand or
		// restored from elsewhere. Read what is there.
		c = Cursor{Seq: seqs[0]}
	}
	start := c
	for i, seq := range seqs {
		if seq < c.Seq {
			continue // read before; removal failed then
		}
		if seq > c.Seq {
			c = Cursor{Seq: seq}
		}
		if i == len(seqs)-1 {
			return s.readNewest(c, start, r)
		}
		next, err := s.finishSeg(seq, c, seqs[i+1], r)
		if err != nil {
			return c, err
		}
		c = next
	}
	return c, nil
}

// readNewest reads the newest segment from c on under a shared lock, which
// it holds until Save stored the new cursor: a writer that drops the
// segment meanwhile (the spool is full; it takes the exclusive lock) then
// finds the saved cursor where the reading stopped, and counts as lost
// exactly what was not folded. Writers append under shared locks too, so
// neither waits for the other.
func (s Spool) readNewest(c, start Cursor, r Reader) (Cursor, error) {
	f, err := os.Open(filepath.Join(s.Dir, segName(c.Seq)))
	if errors.Is(err, os.ErrNotExist) {
		return c, nil // dropped since the listing: the next fold goes on
	}
	if err != nil {
		return c, err
	}
	defer f.Close()
	lock, gone, err := lockOpen(f, true)
	if err != nil {
		return c, err
	}
	if lock != nil {
		defer func() { _ = lock.Close() }()
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return c, err
	}
	if !gone && st.Nlink > 0 {
		off, err := s.readFrom(f, c.Off, false, r)
		if err != nil {
			return c, err
		}
		c.Off = off
	}
	if c != start {
		if err := r.Save(c); err != nil {
			return c, err
		}
	}
	return c, nil
}

// finishSeg reads the rest of an older segment under its exclusive lock,
// saves the cursor at the next segment and removes it.
func (s Spool) finishSeg(seq uint64, c Cursor, next uint64, r Reader) (Cursor, error) {
	path := filepath.Join(s.Dir, segName(seq))
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return Cursor{Seq: next}, nil
	}
	if err != nil {
		return c, err
	}
	defer f.Close()
	lock, gone, err := lockOpen(f, false)
	if err != nil {
		return c, err
	}
	if gone {
		return Cursor{Seq: next}, nil // as below
	}
	defer func() { _ = lock.Close() }()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return c, err
	}
	if st.Nlink == 0 {
		// A writer dropped it meanwhile (the spool was full) and counted
		// what it held as lost.
		return Cursor{Seq: next}, nil
	}
	if _, err := s.readFrom(f, c.Off, true, r); err != nil {
		return c, err
	}
	nc := Cursor{Seq: next}
	if err := r.Save(nc); err != nil {
		return c, err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nc, err
	}
	return nc, nil
}

// size is segment seq's size (0 if it is gone).
func (s Spool) size(seq uint64) int64 {
	st, err := os.Stat(filepath.Join(s.Dir, segName(seq)))
	if err != nil {
		return 0
	}
	return st.Size()
}

// readFrom applies the complete lines of f from off on and returns the
// offset after the last one. With final, a trailing incomplete line (a
// writer died mid-write) is invalid; otherwise it is left for later.
func (s Spool) readFrom(f *os.File, off int64, final bool, r Reader) (int64, error) {
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return off, err
	}
	br := bufio.NewReaderSize(f, 64<<10)
	for {
		line, n, err := readLine(br)
		if err == io.EOF {
			if n > 0 && final {
				r.Invalid()
				off += n
			}
			return off, nil
		}
		if err != nil {
			return off, err
		}
		off += n
		var e Event
		if line == nil || json.Unmarshal(bytes.TrimSpace(line), &e) != nil || e.V != EventVersion {
			r.Invalid()
			continue
		}
		r.Apply(e)
	}
}

// readLine reads one line of at most maxLine bytes: the line (nil when it
// was longer), its length with the newline, and io.EOF when no newline
// came (n is then what there was of a line).
func readLine(br *bufio.Reader) (line []byte, n int64, err error) {
	var buf []byte
	for {
		part, err := br.ReadSlice('\n')
		n += int64(len(part))
		if len(buf)+len(part) <= maxLine {
			buf = append(buf, part...)
		}
		switch {
		case err == nil:
			if n > maxLine {
				return nil, n, nil
			}
			return buf, n, nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		default:
			return nil, n, err
		}
	}
}
