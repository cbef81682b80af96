package bench

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

var launch = time.Date(2026, 11, 21, 15, 0, 0, 0, time.UTC)

func at(ms float64) time.Time { return launch.Add(time.Duration(ms * float64(time.Millisecond))) }

// ready is a provisioned machine as lifecycle.Provision returns it: its
// durations unrounded, its moments on the wall clock.
func ready(machine string, clone time.Duration) *lifecycle.Ready {
	return &lifecycle.Ready{
		Machine: &state.Machine{Name: machine, Image: "tiny"},
		Timings: lifecycle.Timings{
			Create: []vm.StepTime{
				{Name: "clone disk", Took: clone},
				{Name: "create seed volume", Took: time.Millisecond},
				{Name: "upload seed", Took: 850 * time.Microsecond},
				{Name: "define", Took: 20 * time.Millisecond},
				{Name: "start", Took: 398400 * time.Microsecond},
			},
			Created: 434 * time.Millisecond, Address: 5730 * time.Millisecond,
			SSH: 700 * time.Millisecond, SSHAttempts: 3, Check: 250 * time.Millisecond, Ready: 7100 * time.Millisecond,
			Started: at(470), Addressed: at(6200), Connected: at(6900),
		},
	}
}

// writeRecords writes records the way the prepare stage does.
func writeRecords(t *testing.T, recs ...lifecycle.TimingRecord) string {
	path := filepath.Join(t.TempDir(), "timings.jsonl")
	for _, r := range recs {
		require.NoError(t, lifecycle.AppendTimings(path, r))
	}
	return path
}

// The benchmark reads what the driver writes: the figures, unrounded, of
// its machine's last record.
func TestReadTimingsOfTheDriver(t *testing.T) {
	const machine = "lve-2de26526-638947"
	earlier := lifecycle.NewTimingRecord(ready(machine, 999*time.Millisecond), at(-9000))
	other := lifecycle.NewTimingRecord(ready("lve-2de26526-1", time.Second), at(20))
	last := lifecycle.NewTimingRecord(ready(machine, 12345678*time.Nanosecond), at(25))
	path := writeRecords(t, earlier, last, other)

	rec, err := readTimings(path, machine)
	require.NoError(t, err)
	p, err := prepareMs(rec)
	require.NoError(t, err)
	require.Equal(t, &PrepareMs{
		Clone: 12.345678, Seed: 1.85, Define: 20, Start: 398.4, Created: 434,
		Address: 5730, SSH: 700, SSHAttempts: 3, Check: 250, Ready: 7100,
	}, p)
}

func TestReadTimingsErrors(t *testing.T) {
	dir := t.TempDir()
	_, err := readTimings(filepath.Join(dir, "none.jsonl"), "lve-a-1")
	require.ErrorContains(t, err, "no timings record of lve-a-1: prepare wrote none (LIBVIRT_EXECUTOR_TIMINGS)")

	path := writeRecords(t, lifecycle.NewTimingRecord(ready("lve-a-2", time.Millisecond), at(25)))
	_, err = readTimings(path, "lve-a-1")
	require.ErrorContains(t, err, "no timings record of lve-a-1 in")

	bad := filepath.Join(dir, "bad.jsonl")
	require.NoError(t, os.WriteFile(bad, []byte("{\"machine\":\"lve-a-1\"}\nclone disk done in 12ms\n"), 0o600))
	_, err = readTimings(bad, "lve-a-1")
	require.ErrorContains(t, err, "bad.jsonl:2")
}

// A create step the benchmark relies on that the record lacks is named, not
// read as zero.
func TestPrepareMsNamesMissingSteps(t *testing.T) {
	r := ready("lve-a-1", time.Millisecond)
	r.Timings.Create = r.Timings.Create[1:4] // no clone disk, no start
	_, err := prepareMs(lifecycle.NewTimingRecord(r, at(25)))
	require.ErrorContains(t, err, `timings record of lve-a-1: no create step "clone disk", "start"`)

	// An image without a seed has no seed steps: that is fine.
	r = ready("lve-a-1", time.Millisecond)
	r.Timings.Create = append(r.Timings.Create[:1], r.Timings.Create[3:]...)
	p, err := prepareMs(lifecycle.NewTimingRecord(r, at(25)))
	require.NoError(t, err)
	require.Zero(t, p.Seed)
}

func TestPrepareTimeline(t *testing.T) {
	rec := lifecycle.NewTimingRecord(ready("lve-a-1", time.Millisecond), at(25))
	tl, err := prepareTimeline(rec, launch, at(7200))
	require.NoError(t, err)
	require.Equal(t, Timeline{
		Launch:     25 * time.Millisecond,
		ToStart:    (470 - 25) * time.Millisecond,
		ToAddr:     (6200 - 470) * time.Millisecond,
		ToSSH:      700 * time.Millisecond,
		AfterSSH:   300 * time.Millisecond,
		StartCall:  398400 * time.Microsecond,
		StartToSSH: (6900-470)*time.Millisecond + 398400*time.Microsecond,
	}, tl)

	_, err = prepareTimeline(rec, launch, at(100))
	require.ErrorContains(t, err, "out of order", "a record of moments after the exit is not this stage's")
	_, err = prepareTimeline(rec, at(30), at(7200))
	require.ErrorContains(t, err, "out of order", "nor one of moments before the launch")
	delete(rec.CreateMs, "start")
	_, err = prepareTimeline(rec, launch, at(7200))
	require.ErrorContains(t, err, "no start step")
}
