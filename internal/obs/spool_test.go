package obs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// folder is a Reader that counts records by stage, saved as FoldedFile
// the way the service saves its totals.
type folder struct {
	s       Spool
	seen    map[string]int
	invalid int
	saveErr error
	cur     Cursor
}

func newFolder(s Spool) *folder {
	f := &folder{s: s, seen: map[string]int{}}
	saved, err := s.LoadFolded()
	if err == nil {
		f.cur = saved.Cursor
		if len(saved.Totals) > 0 {
			_ = jsonUnmarshal(saved.Totals, &f.seen)
		}
	}
	return f
}

func (f *folder) fold(t *testing.T) error {
	t.Helper()
	c, err := f.s.Fold(f.cur, Reader{
		Apply:   func(e Event) { f.seen[e.Stage]++ },
		Invalid: func() { f.invalid++ },
		Save: func(c Cursor) error {
			if f.saveErr != nil {
				return f.saveErr
			}
			return f.s.SaveFolded(Folded{Cursor: c, Totals: jsonMarshal(f.seen)})
		},
	})
	f.cur = c
	return err
}

func (f *folder) total() int {
	n := 0
	for _, v := range f.seen {
		n += v
	}
	return n
}

func TestSpoolAppendFoldOnce(t *testing.T) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events")}
	for i := range 5 {
		require.NoError(t, s.Append(Event{Kind: KindStage, Stage: fmt.Sprint("s", i%2)}))
	}
	st, err := os.Stat(s.Dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())
	f := newFolder(s)
	require.NoError(t, f.fold(t))
	require.Equal(t, map[string]int{"s0": 3, "s1": 2}, f.seen)
	require.NoError(t, f.fold(t))
	require.Equal(t, 5, f.total(), "a second fold counts nothing again")
	// A restarted service starts from the saved state.
	require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "s9"}))
	g := newFolder(s)
	require.NoError(t, g.fold(t))
	require.Equal(t, map[string]int{"s0": 3, "s1": 2, "s9": 1}, g.seen)
	require.Zero(t, g.invalid)
}

func TestSpoolRecordsAreOwnerOnlyAndBounded(t *testing.T) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events")}
	require.NoError(t, s.Append(Event{Kind: KindStage, Stage: strings.Repeat("é", 200), Job: "j"}))
	seqs, err := s.segments()
	require.NoError(t, err)
	require.Len(t, seqs, 1)
	st, err := os.Stat(filepath.Join(s.Dir, segName(seqs[0])))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	var got Event
	f := Spool{Dir: s.Dir}
	_, err = f.Fold(Cursor{}, Reader{Apply: func(e Event) { got = e }, Invalid: func() { t.Fatal("invalid") }, Save: func(Cursor) error { return nil }})
	require.NoError(t, err)
	require.LessOrEqual(t, len(got.Stage), 128)
	require.Equal(t, EventVersion, got.V)
	require.False(t, got.Time.IsZero())
}

func TestSpoolSaveFailureRefoldsFromSavedCursor(t *testing.T) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events"), SegmentBytes: 300}
	for range 6 {
		require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "a"}))
	}
	f := newFolder(s)
	f.saveErr = errors.New("disk full")
	require.Error(t, f.fold(t))
	// The service died before it could save: a new one counts them all,
	// exactly once.
	g := newFolder(s)
	require.NoError(t, g.fold(t))
	require.Equal(t, 6, g.seen["a"])
	h := newFolder(s)
	require.NoError(t, h.fold(t))
	require.Equal(t, 6, h.seen["a"])
}

func TestSpoolRotatesAndRemovesReadSegments(t *testing.T) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events"), SegmentBytes: 400, MaxBytes: 1 << 20}
	for range 40 {
		require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "a"}))
	}
	seqs, _ := s.segments()
	require.Greater(t, len(seqs), 3)
	f := newFolder(s)
	require.NoError(t, f.fold(t))
	require.Equal(t, 40, f.seen["a"])
	left, _ := s.segments()
	require.Len(t, left, 1, "read segments are removed, the newest stays")
	require.Zero(t, s.Backlog(f.cur))
	require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "a"}))
	require.Positive(t, s.Backlog(f.cur))
}

func TestSpoolBoundDropsOldestAndCountsLost(t *testing.T) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events"), SegmentBytes: 500, MaxBytes: 2000}
	f := newFolder(s)
	for range 3 {
		require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "a"}))
	}
	require.NoError(t, f.fold(t)) // 3 read; the service then goes down
	const n = 200
	for range n {
		require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "a"}))
	}
	var size int64
	seqs, _ := s.segments()
	for _, q := range seqs {
		st, err := os.Stat(filepath.Join(s.Dir, segName(q)))
		require.NoError(t, err)
		size += st.Size()
	}
	require.LessOrEqual(t, size, int64(2000+500), "the spool stays within its bound")
	lost := s.Lost()
	require.Positive(t, lost)
	g := newFolder(s)
	require.NoError(t, g.fold(t))
	require.Equal(t, int64(3+n), int64(g.seen["a"])+lost, "every record is folded or counted lost")
}

func TestSpoolInvalidAndPartialLines(t *testing.T) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events")}
	require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "a"}))
	seqs, _ := s.segments()
	path := filepath.Join(s.Dir, segName(seqs[0]))
	fh, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = fh.WriteString("not json\n{\"v\":99,\"kind\":\"stage\"}\n" + strings.Repeat("x", maxLine+10) + "\n{\"v\":1,\"kind\":\"stage\",\"stage\":\"b\"")
	require.NoError(t, err)
	require.NoError(t, fh.Close())
	f := newFolder(s)
	require.NoError(t, f.fold(t))
	require.Equal(t, map[string]int{"a": 1}, f.seen)
	require.Equal(t, 3, f.invalid, "bad JSON, another version, an overlong line")
	// The partial line is completed by its writer later: read then.
	fh, err = os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = fh.WriteString("}\n")
	require.NoError(t, err)
	require.NoError(t, fh.Close())
	require.NoError(t, f.fold(t))
	require.Equal(t, map[string]int{"a": 1, "b": 1}, f.seen)
}

func TestSpoolConcurrentWritersAndFolder(t *testing.T) {
	for _, full := range []bool{false, true} {
		t.Run(fmt.Sprint("full=", full), func(t *testing.T) { concurrentWritersAndFolder(t, full) })
	}
}

// concurrentWritersAndFolder: 8 writers and a folding reader; with full,
// the spool is so small that writers drop segments as they go: every
// record is then folded or counted lost, never both, never neither.
func concurrentWritersAndFolder(t *testing.T, full bool) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events"), SegmentBytes: 1000, MaxBytes: 64 << 20}
	if full {
		s.MaxBytes = 3000
	}
	const writers, each = 8, 150
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				if err := s.Append(Event{Kind: KindStage, Stage: fmt.Sprint("w", w)}); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	f := newFolder(s)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for running := true; running; {
		select {
		case <-done:
			running = false
		case <-time.After(2 * time.Millisecond):
		}
		require.NoError(t, f.fold(t))
	}
	require.NoError(t, f.fold(t))
	require.Zero(t, f.invalid)
	if full {
		require.Positive(t, s.Lost())
		require.Equal(t, int64(writers*each), int64(f.total())+s.Lost())
		return
	}
	require.Equal(t, writers*each, f.total())
	for w := range writers {
		require.Equal(t, each, f.seen[fmt.Sprint("w", w)])
	}
	require.Zero(t, s.Lost())
}

// A cursor past the spool's end (segments removed by hand, a restore)
// reads what is there instead of skipping it for ever.
func TestSpoolCursorPastTheEnd(t *testing.T) {
	s := Spool{Dir: filepath.Join(t.TempDir(), "events")}
	for range 5 {
		require.NoError(t, s.Append(Event{Kind: KindStage, Stage: "a"}))
	}
	f := newFolder(s)
	f.cur = Cursor{Seq: 40}
	require.NoError(t, f.fold(t))
	require.Equal(t, 5, f.seen["a"])
	g := newFolder(s)
	g.cur, g.seen = Cursor{Seq: 1, Off: 1 << 20}, map[string]int{}
	require.NoError(t, g.fold(t))
	require.Equal(t, 5, g.seen["a"])
}

// A root admin command does not write into the stages' user's spool.
func TestSpoolRefusesAnotherUsersDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a directory of another user")
	}
	dir := filepath.Join(t.TempDir(), "events")
	require.NoError(t, os.Mkdir(dir, 0o700))
	require.NoError(t, os.Chown(dir, 65534, 65534))
	err := Spool{Dir: dir}.Append(Event{Kind: KindStage})
	require.ErrorContains(t, err, "belongs to uid 65534")
	entries, _ := os.ReadDir(dir)
	require.Empty(t, entries)
}

// BenchmarkSpoolAppend is what recording its event costs a stage.
func BenchmarkSpoolAppend(b *testing.B) {
	s := Spool{Dir: filepath.Join(b.TempDir(), "events")}
	e := Event{Kind: KindStage, Stage: "step_script", Job: "lve-0123abcd-89abcdef-123456", Image: "tiny", Result: ResultSuccess, Reason: "none", Seconds: 0.5, Overhead: true, OverheadSeconds: 0.01}
	for b.Loop() {
		if err := s.Append(e); err != nil {
			b.Fatal(err)
		}
	}
}
