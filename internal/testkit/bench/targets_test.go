package bench

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func s(median, lo, hi float64) Summary { return Summary{N: 3, Median: median, Min: lo, Max: hi} }

func verdicts(ts []Target) map[string]string {
	m := map[string]string{}
	for _, t := range ts {
		m[t.Name] = t.Verdict()
	}
	return m
}

func TestEvaluate(t *testing.T) {
	sum := ImageSummary{
		Ratio:    s(1.03, 1.0, 1.2), // at the limit: PASS
		Overhead: s(20.5, 3, 25),    // median over: MISS
		Cleanup:  s(300, 200, 5000), // at the limit; a slow outlier does not matter
		Overlay:  s(300<<10, 200<<10, 1<<20+1),
		PeakRSS: map[string]Summary{
			"config":  s(10<<20, 9<<20, 11<<20),
			"prepare": s(29<<20, 28<<20, 31<<20), // max over: MISS
			"run":     s(12<<20, 12<<20, 30<<20), // max at the limit: PASS
			// cleanup not measured: N/A
		},
	}
	ts := Evaluate(sum)
	require.Equal(t, map[string]string{
		"prepare / floor":                   "PASS",
		"run overhead per stage (no-op)":    "MISS",
		"cleanup":                           "PASS",
		"overlay allocated at start":        "MISS",
		"peak RSS libvirt-executor-config":  "PASS",
		"peak RSS libvirt-executor-prepare": "MISS",
		"peak RSS libvirt-executor-run":     "PASS",
		"peak RSS libvirt-executor-cleanup": "N/A",
	}, verdicts(ts))
	for _, tg := range ts {
		switch tg.Unit {
		case unitBytes:
			require.Equal(t, statMax, tg.Stat, tg.Name)
		default:
			require.Equal(t, statMedian, tg.Stat, tg.Name)
		}
	}
	require.Equal(t, 1.03, ts[0].Value)
	require.Equal(t, float64(1<<20+1), ts[3].Value)
	require.False(t, ts[7].Pass, "an unmeasured figure never passes")
}

func TestSummarizePairsRatiosAndSkipsFailures(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	u := func(v uint64) *uint64 { return &v }
	r := ImageReport{
		Jobs: []JobSample{
			{Run: 1, OK: true, PrepareWallMs: 1100, CleanupMs: 900, BuildOverheadMs: f(30), OverlayBytes: u(400 << 10),
				Prepare: &PrepareMs{Clone: 10, Define: 20, Start: 300}, PeakRSS: map[string]int64{"run": 20 << 20},
				Stages: []StageSample{{Name: "build_script", WallMs: 31}}},
			{Run: 2, OK: true, PrepareWallMs: 2400, CleanupMs: 1100, BuildOverheadMs: f(50),
				Prepare: &PrepareMs{Clone: 12, Define: 25, Start: 310}, PeakRSS: map[string]int64{"run": 22 << 20},
				Stages: []StageSample{{Name: "build_script", WallMs: 51}}},
			{Run: 3, OK: false, PrepareWallMs: 99999, CleanupMs: 99999}, // failed: left out
			{Run: 4, OK: true, PrepareWallMs: 1000, CleanupMs: 1000, // its floor failed: no paired ratio
				Timeline: &TimelineMs{StartToSSH: 800}},
		},
		Floors: []FloorSample{
			{Run: 1, OK: true, SSHMs: 1000},
			{Run: 2, OK: true, SSHMs: 2000},
			{Run: 3, OK: true, SSHMs: 1000},
			{Run: 4, OK: false, SSHMs: 500},
		},
	}
	sum := r.Summarize()
	require.Equal(t, Summary{N: 2, Median: 1.15, Min: 1.1, Max: 1.2}, roundSummary(sum.Ratio))
	require.Equal(t, Summary{N: 3, Median: 1000, Min: 900, Max: 1100}, sum.Cleanup)
	require.Equal(t, Summary{N: 2, Median: 40, Min: 30, Max: 50}, sum.Overhead)
	require.Equal(t, Summary{N: 2, Median: 327.5, Min: 320, Max: 335}, sum.DefineStart)
	require.Equal(t, 1, sum.Overlay.N, "a job without volume info is left out")
	require.Equal(t, Summary{N: 2, Median: 41, Min: 31, Max: 51}, sum.StageWall["build_script"])
	require.Equal(t, float64(22<<20), sum.PeakRSS["run"].Max)
	require.False(t, sum.PeakRSS["config"].Known())
	require.Equal(t, 1, sum.JobFailures)
	require.Equal(t, 1, sum.FloorFailures)
	require.Equal(t, Summary{N: 3, Median: 1000, Min: 1000, Max: 2000}, sum.Floor)
	require.Equal(t, Summary{N: 1, Median: 1.25, Min: 1.25, Max: 1.25}, sum.OwnBootRatio, "needs only the job's own timeline")
	require.Equal(t, Summary{N: 1, Median: 200, Min: 200, Max: 200}, sum.OutsideBoot)
}

func roundSummary(s Summary) Summary {
	r := func(v float64) float64 { return float64(int(v*1000+0.5)) / 1000 }
	return Summary{N: s.N, Median: r(s.Median), Min: r(s.Min), Max: r(s.Max)}
}

func TestWriteTable(t *testing.T) {
	img := ImageReport{Image: "tiny", DomainType: "qemu", VCPUs: 1, MemoryMiB: 512, FloorSpec: "same",
		Jobs:       []JobSample{{Run: 1, OK: true, PrepareWallMs: 1030, CleanupMs: 2000, Prepare: &PrepareMs{Clone: 12}}},
		Floors:     []FloorSample{{Run: 1, OK: true, SSHMs: 1000}},
		Concurrent: &ConcurrentSample{N: 2, WallMs: 1500, Failures: 1},
	}
	img.Summary = img.Summarize()
	img.Targets = Evaluate(img.Summary)
	rep := &Report{Started: time.Unix(0, 0).UTC(), Host: "h", Config: "c.toml", Runs: 1, Concurrency: 2, PollMs: 50,
		Images: []ImageReport{img}, Leftovers: []string{"domain lvb-x"}}
	var out bytes.Buffer
	require.NoError(t, rep.WriteTable(&out))
	text := out.String()
	for _, want := range []string{
		"== image tiny (qemu, 1 vCPU, 512 MiB)",
		"PREPARE / FLOOR (paired)",
		"1.030",
		"concurrent: 2 jobs at once",
		"1 failed",
		"LEFTOVERS after the benchmark: domain lvb-x",
	} {
		require.Contains(t, text, want)
	}
	line := func(prefix string) string {
		for _, l := range strings.Split(text, "\n") {
			if strings.HasPrefix(l, prefix) && (strings.HasPrefix(prefix, " ") || strings.Contains(l, "<=")) {
				return l
			}
		}
		return ""
	}
	require.Regexp(t, `PASS$`, line("prepare / floor "))
	require.Regexp(t, `MISS$`, line("cleanup "))
	require.Regexp(t, `N/A$`, line("overlay allocated at start"))
	require.Regexp(t, `12 ms\s+12 ms - 12 ms\s+1$`, line("  clone disk"))
}

func TestFormatting(t *testing.T) {
	require.Equal(t, "4.6 ms", fmtMs(4.6))
	require.Equal(t, "396 ms", fmtMs(396.4))
	require.Equal(t, "1.18 s", fmtMs(1180))
	require.Equal(t, "392 KiB", fmtBytes(392<<10))
	require.Equal(t, "29.6 MiB", fmtBytes(29.6*(1<<20)))
	require.Equal(t, "0.699", fmtRatio(0.6994))
}
