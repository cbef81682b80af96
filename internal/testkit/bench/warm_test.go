package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
)

func fp(v float64) *float64 { return &v }

// warmJob is a warm-round job that claimed vm: prepare wall, claim, job
// wall and refill in ms.
func warmJob(run int, prepare, claim, wall float64, refill *float64) JobSample {
	return JobSample{Run: run, OK: true, Warm: true, PrepareWallMs: prepare, WallMs: wall, CleanupMs: 700, BuildOverheadMs: fp(15),
		PeakRSS: map[string]int64{"prepare": 12 << 20},
		Claim:   &ClaimMs{VM: "lve-2de26526-sb-0000000" + string(rune('0'+run)), Claim: claim, Ready: claim + 5, Refill: refill}}
}

// warmImage is an image with cold jobs (prepare 4000, 5000, 6000 ms; job
// 9000 ms) and a warm round of: three warm jobs, one that started cold
// (fast, and must not count as warm), one that failed, one warm by its
// log alone (no record: prepare wall counts, claim figures do not).
func warmImage() ImageReport {
	cold := func(run int, prepare float64) JobSample {
		return JobSample{Run: run, OK: true, PrepareWallMs: prepare, WallMs: 9000, CleanupMs: 800}
	}
	return ImageReport{Image: "tiny", DomainType: "qemu", VCPUs: 1, MemoryMiB: 512, FloorSpec: "same",
		Jobs: []JobSample{cold(1, 4000), cold(2, 6000), cold(3, 5000)},
		Warm: &WarmRound{FirstIdleMs: 14200, Jobs: []JobSample{
			warmJob(1, 300, 20, 2500, fp(250)),
			warmJob(2, 500, 40, 3500, fp(900)),
			{Run: 3, OK: true, PrepareWallMs: 50, WallMs: 100, ColdStart: "no idle VM of image tiny in the pool"},
			{Run: 4, OK: false, Warm: true, PrepareWallMs: 1, WallMs: 1, Error: "job failed: system_failure: boom", Claim: &ClaimMs{Claim: 1, Refill: fp(1)}},
			warmJob(5, 400, 30, 3000, fp(1500)),
			{Run: 6, OK: true, Warm: true, PrepareWallMs: 450, WallMs: 3200, CleanupMs: 700},
		}},
	}
}

func TestWarmSummary(t *testing.T) {
	img := warmImage()
	sum := img.Summarize()
	w := sum.Warm
	require.NotNil(t, w)
	require.Equal(t, 6, w.Jobs)
	require.Equal(t, 4, w.WarmStarts)
	require.Equal(t, 1, w.ColdStarts, "a job that booted its own VM is counted apart")
	require.Equal(t, 1, w.Failures)
	require.Equal(t, Summary{N: 4, Median: 425, Min: 300, Max: 500}, w.PrepareWall, "neither the cold start nor the failure is mixed in")
	require.Equal(t, Summary{N: 3, Median: 30, Min: 20, Max: 40}, w.Claim, "a warm job without its record has no claim figures")
	require.Equal(t, Summary{N: 3, Median: 35, Min: 25, Max: 45}, w.Ready)
	require.Equal(t, Summary{N: 3, Median: 900, Min: 250, Max: 1500}, w.Refill)
	require.Equal(t, Summary{N: 4, Median: 3100, Min: 2500, Max: 3500}, w.JobWall)
	require.Equal(t, 3, w.Overhead.N)
	require.Equal(t, float64(12<<20), w.PeakRSS["prepare"].Max)
	require.False(t, w.PeakRSS["config"].Known())
	require.NotNil(t, w.ColdWarm)
	require.InDelta(t, 5000.0/425, *w.ColdWarm, 1e-9, "ratio of the medians: cold 5000 ms / warm 425 ms")
	// The cold figures are the cold jobs' alone.
	require.Equal(t, Summary{N: 3, Median: 5000, Min: 4000, Max: 6000}, sum.PrepareWall)
	require.Equal(t, 0, sum.JobFailures)

	none := ImageReport{Jobs: img.Jobs}
	require.Nil(t, none.Summarize().Warm, "no warm round, no warm summary")

	allCold := ImageReport{Jobs: img.Jobs, Warm: &WarmRound{Jobs: []JobSample{img.Warm.Jobs[2]}}}
	w2 := allCold.Summarize().Warm
	require.False(t, w2.PrepareWall.Known())
	require.Nil(t, w2.ColdWarm, "no warm median, no ratio")
	require.Equal(t, 1, w2.ColdStarts)
}

func TestEvaluateWarm(t *testing.T) {
	byName := func(ts []Target, name string) Target {
		for _, tg := range ts {
			if tg.Name == name {
				return tg
			}
		}
		t.Fatalf("no target %q", name)
		return Target{}
	}
	const prep, ratio, refill = "warm prepare (standby VM)", "cold / warm prepare", "refill (claim -> replacement boot)"
	for _, tc := range []struct {
		name string
		w    WarmSummary
		want map[string]string
	}{
		{"all at their limits", WarmSummary{PrepareWall: s(500, 100, 9000), ColdWarm: fp(10), Refill: s(1000, 10, 5000)},
			map[string]string{prep: "PASS", ratio: "PASS", refill: "PASS"}},
		{"just over", WarmSummary{PrepareWall: s(500.5, 100, 600), ColdWarm: fp(9.99), Refill: s(1000.1, 10, 1001)},
			map[string]string{prep: "MISS", ratio: "MISS", refill: "MISS"}},
		{"a faster warm start is a larger ratio", WarmSummary{PrepareWall: s(120, 100, 130), ColdWarm: fp(40), Refill: s(300, 250, 400)},
			map[string]string{prep: "PASS", ratio: "PASS", refill: "PASS"}},
		{"nothing measured", WarmSummary{},
			map[string]string{prep: "N/A", ratio: "N/A", refill: "N/A"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := tc.w
			ts := Evaluate(ImageSummary{Warm: &w})
			got := verdicts(ts)
			for name, v := range tc.want {
				require.Equal(t, v, got[name], name)
			}
			require.True(t, byName(ts, ratio).AtLeast)
			require.Equal(t, ">=", byName(ts, ratio).Op())
			require.Equal(t, "<=", byName(ts, prep).Op())
			require.Equal(t, statMedian, byName(ts, prep).Stat)
			require.Equal(t, statMedian, byName(ts, refill).Stat)
			require.Equal(t, unitRatio, byName(ts, ratio).Unit)
		})
	}
	ts := Evaluate(ImageSummary{})
	require.Len(t, ts, 8, "without a warm round: the cold targets only")
	require.NotContains(t, verdicts(ts), prep)
	require.Equal(t, 500.5, byName(Evaluate(ImageSummary{Warm: &WarmSummary{PrepareWall: s(500.5, 1, 2)}}), prep).Value)
}

func TestWriteTableWarm(t *testing.T) {
	img := warmImage()
	img.Warm.Errors = []string{"after warm run 6: the pool did not come to rest\nmore"}
	img.Summary = img.Summarize()
	img.Targets = Evaluate(img.Summary)
	rep := &Report{Started: time.Unix(0, 0).UTC(), Host: "h", Config: "c.toml", Runs: 6, WarmRound: true, PollMs: 50,
		Images: []ImageReport{img}}
	var out bytes.Buffer
	require.NoError(t, rep.WriteTable(&out))
	text := out.String()
	line := func(prefix string) string {
		t.Helper()
		for _, l := range strings.Split(text, "\n") {
			if strings.HasPrefix(l, prefix) {
				return l
			}
		}
		t.Fatalf("no line %q in\n%s", prefix, text)
		return ""
	}
	require.Contains(t, line("6 run(s) per image"), "then a warm round")
	require.Regexp(t, `^warm round: 6 job\(s\)\s+4 warm\s+1 started cold\s+1 failed$`, line("warm round: "))
	require.Regexp(t, `14\.20 s`, line("  service start -> first standby VM idle"))
	require.Regexp(t, `425 ms\s+300 ms - 500 ms\s+4$`, line("  warm prepare wall (runner's view)"))
	require.Regexp(t, `30 ms\s+20 ms - 40 ms\s+3$`, line("    claim (driver's record)"))
	require.Regexp(t, `5\.00 s\s+4\.00 s - 6\.00 s\s+3$`, line("  cold prepare wall (runner's view)"))
	require.Regexp(t, `11\.765\s+5\.00 s / 425 ms`, line("COLD / WARM prepare (medians)"))
	require.Regexp(t, `3\.10 s\s+2\.50 s - 3\.50 s\s+4$`, line("  warm job wall (config..cleanup)"))
	require.Regexp(t, `9\.00 s\s+9\.00 s - 9\.00 s\s+3$`, line("  cold job wall (config..cleanup)"))
	require.Regexp(t, `900 ms\s+250 ms - 1\.50 s\s+3$`, line("refill: claim -> replacement's boot began"))
	require.Regexp(t, `^warm prepare \(standby VM\)\s+<= 500 ms\s+425 ms \(median\)\s+PASS$`, line("warm prepare (standby VM)"))
	require.Regexp(t, `^cold / warm prepare\s+>= 10\.000\s+11\.765 \(medians\)\s+PASS$`, line("cold / warm prepare "))
	require.Regexp(t, `^refill \(claim -> replacement boot\)\s+<= 1\.00 s\s+900 ms \(median\)\s+PASS$`, line("refill (claim -> replacement boot)"))
	require.Regexp(t, `^cleanup\s+<= 300 ms`, line("cleanup  "), "the cold targets keep their <=")
	require.Equal(t, "WARM ROUND ERROR: after warm run 6: the pool did not come to rest", line("WARM ROUND ERROR"))
	require.Equal(t, "warm run 3 started COLD (left out of the warm figures): no idle VM of image tiny in the pool", line("warm run 3 "))
	require.Equal(t, "warm run 4 FAILED: job failed: system_failure: boom", line("warm run 4 "))
	require.NotContains(t, text, "warm run 1 ")

	// Without a warm round: no warm rows, no warm targets.
	cold := warmImage()
	cold.Warm = nil
	cold.Summary = cold.Summarize()
	cold.Targets = Evaluate(cold.Summary)
	rep = &Report{Started: time.Unix(0, 0).UTC(), Runs: 3, Images: []ImageReport{cold}}
	out.Reset()
	require.NoError(t, rep.WriteTable(&out))
	require.Contains(t, out.String(), "no warm round")
	require.NotContains(t, strings.ReplaceAll(out.String(), "no warm round", ""), "warm")
	require.NotContains(t, out.String(), ">=")
}

func TestParseStart(t *testing.T) {
	vm, cold := parseStart("Using libvirt-executor\nWarm start: VM lve-2de26526-sb-0a1b2c3d (idle for 12s, booted with its own fresh keys) claimed in 31ms\r\nMachine ready in 40ms (warm)\n")
	require.Equal(t, "lve-2de26526-sb-0a1b2c3d", vm)
	require.Empty(t, cold)
	vm, cold = parseStart("Cold start: no idle VM of image tiny in the pool\r\nCreated lve-x in 1s\n")
	require.Empty(t, vm)
	require.Equal(t, "no idle VM of image tiny in the pool", cold)
	vm, cold = parseStart("Created lve-x in 1s\n")
	require.Empty(t, vm)
	require.Empty(t, cold)
}

// claimRecord is a warm prepare's record, as the driver writes it: its
// machine is the standby VM, not the job's.
func claimRecord(began time.Time) lifecycle.TimingRecord {
	const vm = "lve-2de26526-sb-0a1b2c3d"
	return jobvm.NewClaimRecord(&state.Machine{Name: vm, Image: "tiny"}, &jobvm.Claimed{Took: 31500 * time.Microsecond, At: began.Add(40 * time.Millisecond)}, began)
}

func TestReadWarm(t *testing.T) {
	const job, vm = "lve-2de26526-638947", "lve-2de26526-sb-0a1b2c3d"
	warmLog := "Warm start: VM " + vm + " (idle for 12s, ...) claimed in 32ms\n"

	t.Run("warm", func(t *testing.T) {
		path := writeRecords(t, claimRecord(at(20)))
		var j JobSample
		require.NoError(t, j.readWarm(path, warmLog, job, launch, at(300)))
		require.True(t, j.Warm)
		require.Empty(t, j.ColdStart)
		require.Nil(t, j.Prepare, "a warm start has no boot figures")
		require.NotNil(t, j.Claim)
		require.Equal(t, vm, j.Claim.VM)
		require.Equal(t, 31.5, j.Claim.Claim)
		require.Equal(t, 20.0, j.Claim.Launch)
		require.False(t, j.Claim.Claimed.IsZero())
		require.Positive(t, j.Claim.Ready)
	})
	t.Run("the log names another VM", func(t *testing.T) {
		path := writeRecords(t, claimRecord(at(20)))
		var j JobSample
		err := j.readWarm(path, "Warm start: VM lve-2de26526-sb-ffffffff (idle ...\n", job, launch, at(300))
		require.ErrorContains(t, err, "lve-2de26526-sb-ffffffff")
		require.True(t, j.Warm, "the record is the driver's word")
	})
	t.Run("no warm line", func(t *testing.T) {
		path := writeRecords(t, claimRecord(at(20)))
		var j JobSample
		require.ErrorContains(t, j.readWarm(path, "", job, launch, at(300)), `no "Warm start: VM" line`)
	})
	t.Run("cold start in the warm round", func(t *testing.T) {
		path := writeRecords(t, lifecycle.NewTimingRecord(ready(job, 12*time.Millisecond), at(25)))
		var j JobSample
		require.NoError(t, j.readWarm(path, "Cold start: no idle VM of image tiny in the pool\n", job, launch, at(7000)))
		require.False(t, j.Warm)
		require.Nil(t, j.Claim)
		require.Equal(t, "no idle VM of image tiny in the pool", j.ColdStart)
		require.NotNil(t, j.Prepare, "its boot figures, like a cold job's")
		require.Equal(t, 12.0, j.Prepare.Clone)
	})
	t.Run("cold record without the line", func(t *testing.T) {
		path := writeRecords(t, lifecycle.NewTimingRecord(ready(job, 12*time.Millisecond), at(25)))
		var j JobSample
		require.NoError(t, j.readWarm(path, "", job, launch, at(7000)))
		require.False(t, j.Warm)
		require.Contains(t, j.ColdStart, "cold start")
	})
	t.Run("no record", func(t *testing.T) {
		var j JobSample
		err := j.readWarm(filepath.Join(t.TempDir(), "none.jsonl"), warmLog, job, launch, at(300))
		require.ErrorContains(t, err, "prepare wrote none")
		require.True(t, j.Warm, "warm by its log")
		require.Nil(t, j.Claim)
	})
	t.Run("the last record counts", func(t *testing.T) {
		path := writeRecords(t, lifecycle.NewTimingRecord(ready(job, time.Millisecond), at(-9000)), claimRecord(at(20)))
		rec, err := lastTimings(path)
		require.NoError(t, err)
		require.Equal(t, vm, rec.Machine)
		require.True(t, rec.Warm)
		empty := filepath.Join(t.TempDir(), "empty.jsonl")
		require.NoError(t, os.WriteFile(empty, nil, 0o600))
		_, err = lastTimings(empty)
		require.ErrorContains(t, err, "no timings record in")
	})
}

func TestRefill(t *testing.T) {
	jobStart := at(0)
	claimed := at(400)
	began := map[string]time.Time{
		"sb-claimed":  at(-60000), // the VM the job claimed: in the pool before
		"sb-earlier":  at(-5000),  // an older boot (a previous job's) that is gone
		"sb-second":   at(1300),
		"sb-first":    at(650), // the replacement
		"sb-unstated": {},      // no reservation yet
	}
	name, d, ok := refill(claimed, jobStart, map[string]bool{"sb-claimed": true}, began)
	require.True(t, ok)
	require.Equal(t, "sb-first", name)
	require.Equal(t, 250.0, d)

	// Begun before the claim's moment (the record notes it at prepare's
	// end): negative, not hidden.
	_, d, ok = refill(claimed, jobStart, nil, map[string]time.Time{"sb-x": at(300)})
	require.True(t, ok)
	require.Equal(t, -100.0, d)

	_, _, ok = refill(claimed, jobStart, map[string]bool{"sb-claimed": true}, map[string]time.Time{"sb-claimed": at(-1), "sb-earlier": at(-5)})
	require.False(t, ok, "no boot began since the job started")
}

func TestAtRest(t *testing.T) {
	rec := func(img string) *state.Machine {
		return &state.Machine{Standby: &state.Standby{Image: img}}
	}
	idle := lifecycle.Standby{Name: "sb-a", Record: rec("tiny")}
	booting := lifecycle.Standby{Name: "sb-b"}
	claimed := lifecycle.Standby{Name: "sb-c", Record: rec("tiny"), Claim: &state.Claim{Job: "lve-x-1"}}
	retiring := lifecycle.Standby{Name: "sb-d", Record: rec("tiny"), Claim: &state.Claim{Retire: true, Reason: "SSH does not answer"}}
	name, ok := atRest([]lifecycle.Standby{idle}, "tiny", nil)
	require.True(t, ok)
	require.Equal(t, "sb-a", name)
	for _, all := range [][]lifecycle.Standby{nil, {booting}, {idle, booting}, {idle, claimed}, {retiring}, {claimed}} {
		_, ok := atRest(all, "tiny", nil)
		require.False(t, ok, poolsvc.Describe(all))
	}
	// With the holder on: only once the idle VM's holder has connected
	// (a directory without its record is a holder not ready).
	_, ok = atRest([]lifecycle.Standby{idle}, "tiny", func(string) string { return t.TempDir() })
	require.False(t, ok, "the idle VM's holder has not connected")
	_, ok = atRest([]lifecycle.Standby{idle}, "debian", nil)
	require.False(t, ok, "another image's VM")
	require.Equal(t, "sb-a idle (tiny), sb-b booting, sb-c claimed by lve-x-1, sb-d retiring (SSH does not answer)",
		poolsvc.Describe([]lifecycle.Standby{retiring, booting, claimed, idle}))
	require.Equal(t, "no standby VM", poolsvc.Describe(nil))
}
