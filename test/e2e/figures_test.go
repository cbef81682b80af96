//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// figures are the fault suite's numbers: printed after every round of the
// suite (each -count iteration: `make soak`) and when the suite ends, and
// kept in a file (figuresPath) that is replaced after every test, so that
// an interrupted soak still reports.
var figures = &suiteFigures{}

// figuresEnv names the figures file; without it the file is
// e2e-figures.json next to the executables under test (LVE_E2E_BIN).
const figuresEnv = "LVE_E2E_FIGURES"

type suiteFigures struct {
	mu           sync.Mutex
	faulted      int
	leaks        int
	classRight   int
	classChecked int
	detection    []time.Duration

	// Rounds: a round is one pass over the selected tests (go test
	// -count=N makes N of them). A round begins when the first test of
	// the first round begins again.
	started    time.Time
	round      int          // the round now running (1, 2, ...); 0 before any test
	order      []string     // the top-level tests of round 1, in order
	lastTest   string       // the top-level test that began last
	topTests   []*testing.T // top-level tests seen (setup may run twice in one)
	roundsDone int          // rounds whose every test ended
	tests      int          // top-level tests ended, all rounds
	failures   []string     // "round N: TestName" of every failed top-level test
	done       bool         // the test binary finished its tests
}

func (f *suiteFigures) addLeaks(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leaks += n
}

// fault records one faulted job.
func (f *suiteFigures) fault() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faulted++
}

// class records whether a stage exited with the expected class.
func (f *suiteFigures) class(got, want int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.classChecked++
	if got == want {
		f.classRight++
	}
}

// detected records how long a dead guest took to notice.
func (f *suiteFigures) detected(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.detection = append(f.detection, d)
}

// begin is called by setup, first: it notes which test runs in which
// round, prints the cumulative figures when a round ended, and has the
// figures file rewritten when the test ends (after the leftover check that
// setup registers next, since cleanups run last registered first).
func (f *suiteFigures) begin(t *testing.T) {
	f.mu.Lock()
	defer f.mu.Unlock()
	root, _, sub := strings.Cut(t.Name(), "/")
	top := !sub
	if top && slices.Contains(f.topTests, t) || !top && root == f.lastTest {
		return // a test that is already under way
	}
	if f.started.IsZero() {
		f.started = time.Now()
	}
	switch {
	case f.round == 0:
		f.round = 1
	case root == f.first():
		// The first test again: the previous round is over.
		if f.roundsDone < f.round {
			f.roundsDone = f.round
			f.printLocked(fmt.Sprintf("fault suite figures after round %d (cumulative)", f.roundsDone))
		}
		f.round++
		f.topTests = nil
		f.saveLocked()
	}
	if f.round == 1 && !slices.Contains(f.order, root) {
		f.order = append(f.order, root)
	}
	f.lastTest = root
	if !top {
		return
	}
	f.topTests = append(f.topTests, t)
	round := f.round
	t.Cleanup(func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.tests++
		if t.Failed() {
			f.failures = append(f.failures, fmt.Sprintf("round %d: %s", round, t.Name()))
		}
		// From round 2 on the last test of a round is known (round 1's
		// last): its end is the round's end.
		if round > 1 && round == f.round && root == f.order[len(f.order)-1] && f.roundsDone < round {
			f.roundsDone = round
			f.printLocked(fmt.Sprintf("fault suite figures after round %d (cumulative)", round))
		}
		f.saveLocked()
	})
}

// progress prints the cumulative figures in the middle of a long test
// (the random faulted jobs of a soak) and writes the figures file.
func (f *suiteFigures) progress(title string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.printLocked(title)
	f.saveLocked()
}

func (f *suiteFigures) first() string {
	if len(f.order) == 0 {
		return ""
	}
	return f.order[0]
}

// end is called when the test binary has run its tests: it prints the
// final figures and writes the file a last time.
func (f *suiteFigures) end() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.done = true
	f.roundsDone = f.round
	f.printLocked("fault suite figures")
	f.saveLocked()
}

func (f *suiteFigures) printLocked(title string) {
	if f.faulted == 0 && f.classChecked == 0 {
		return
	}
	s := f.snapshotLocked()
	fmt.Printf("\n%s:\n", title)
	fmt.Printf("  faulted jobs run:        %d\n", s.Faulted)
	fmt.Printf("  leaks found:             %d (must be 0)\n", s.Leaks)
	fmt.Printf("  exit class correct:      %d/%d = %.1f%% (must be 100%%)\n", s.ClassRight, s.ClassChecked, s.ClassPercent)
	if s.Detection.Count > 0 {
		fmt.Printf("  dead-guest detection:    median %s, max %s over %d (target < 15s with the default keepalive 3s x 3)\n",
			s.Detection.median().Round(100*time.Millisecond), s.Detection.max().Round(100*time.Millisecond), s.Detection.Count)
	}
	if title != "fault suite figures" || s.Rounds > 1 {
		under := ""
		if !s.Done && s.Round > s.Rounds {
			under = fmt.Sprintf(" (round %d under way)", s.Round)
		}
		fmt.Printf("  rounds:                  %d%s, %d tests, %d failed, %s\n", s.Rounds, under, s.Tests, len(s.Failures), time.Duration(s.ElapsedMS)*time.Millisecond)
	}
	if p := figuresPath(); p != "" {
		fmt.Printf("  figures file:            %s\n", p)
	}
}

// figuresFile is the figures file's content (JSON).
type figuresFile struct {
	Updated      time.Time       `json:"updated"`
	ElapsedMS    int64           `json:"elapsed_ms"` // since the first test began
	Done         bool            `json:"done"`       // false while the suite runs (or after it was interrupted)
	Round        int             `json:"round"`      // the round running (or the last)
	Rounds       int             `json:"rounds_completed"`
	Tests        int             `json:"tests_completed"` // top-level tests ended, all rounds
	Failures     []string        `json:"failures"`        // "round N: TestName"
	Faulted      int             `json:"faulted_jobs"`
	Leaks        int             `json:"leaks"`
	ClassRight   int             `json:"exit_class_right"`
	ClassChecked int             `json:"exit_class_checked"`
	ClassPercent float64         `json:"exit_class_percent"`
	Detection    detectionFigure `json:"dead_guest_detection"`
}

type detectionFigure struct {
	Count    int     `json:"count"`
	MedianMS int64   `json:"median_ms"`
	MaxMS    int64   `json:"max_ms"`
	AllMS    []int64 `json:"all_ms"` // in the order measured
}

func (d detectionFigure) median() time.Duration { return time.Duration(d.MedianMS) * time.Millisecond }
func (d detectionFigure) max() time.Duration    { return time.Duration(d.MaxMS) * time.Millisecond }

func (f *suiteFigures) snapshotLocked() figuresFile {
	s := figuresFile{
		Updated: time.Now().UTC(), Done: f.done, Round: f.round, Rounds: f.roundsDone, Tests: f.tests,
		Failures: slices.Clone(f.failures), Faulted: f.faulted, Leaks: f.leaks,
		ClassRight: f.classRight, ClassChecked: f.classChecked, ClassPercent: 100,
	}
	if s.Failures == nil {
		s.Failures = []string{}
	}
	if !f.started.IsZero() {
		s.ElapsedMS = time.Since(f.started).Milliseconds()
	}
	if f.classChecked > 0 {
		s.ClassPercent = 100 * float64(f.classRight) / float64(f.classChecked)
	}
	s.Detection.AllMS = []int64{}
	for _, d := range f.detection {
		s.Detection.AllMS = append(s.Detection.AllMS, d.Milliseconds())
	}
	if n := len(f.detection); n > 0 {
		d := slices.Clone(f.detection)
		slices.Sort(d)
		s.Detection.Count, s.Detection.MedianMS, s.Detection.MaxMS = n, d[n/2].Milliseconds(), d[n-1].Milliseconds()
	}
	return s
}

// figuresPath is where the figures file goes: LVE_E2E_FIGURES, else
// e2e-figures.json in LVE_E2E_BIN; "" when neither is set.
func figuresPath() string {
	if p := os.Getenv(figuresEnv); p != "" {
		return p
	}
	if bin := os.Getenv("LVE_E2E_BIN"); bin != "" {
		return filepath.Join(bin, "e2e-figures.json")
	}
	return ""
}

// saveLocked replaces the figures file (a new file renamed over it: a
// reader sees the old figures or the new ones, never half of them). Only
// once there is something to report.
func (f *suiteFigures) saveLocked() {
	path := figuresPath()
	if path == "" || f.faulted == 0 && f.classChecked == 0 && f.leaks == 0 && len(f.failures) == 0 {
		return
	}
	b, err := json.MarshalIndent(f.snapshotLocked(), "", "  ")
	if err == nil {
		err = writeFileAtomic(path, append(b, '\n'))
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "fault suite figures: writing %s: %v\n", path, err)
	}
}

func writeFileAtomic(path string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(tmp.Name()) }() // after the rename: there is nothing at that name
	if _, err := tmp.Write(b); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

func TestMain(m *testing.M) {
	if addr := os.Getenv(helperListenEnv); addr != "" {
		helperListen(addr) // the test binary as a tiny TCP service, see metadataStandIn
		return
	}
	if op := os.Getenv(managerOpEnv); op != "" {
		os.Exit(managerOp(op)) // the test binary as the runner's user, see rig.managerAs
	}
	code := m.Run()
	endConfined()
	figures.end()
	os.Exit(code)
}
