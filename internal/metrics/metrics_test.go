package metrics

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/failure"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// stage is one stage record of job key.
func stage(key, name, result, reason string, secs float64) obs.Event {
	return obs.Event{Kind: obs.KindStage, Job: key, Stage: name, Image: "tiny", Result: result, Reason: reason, Seconds: secs}
}

func ok(key, name string, secs float64) obs.Event {
	return stage(key, name, obs.ResultSuccess, failure.ReasonNone, secs)
}

// job writes the records of one job: config, prepare (warm or cold), the
// run stages given, cleanup.
func job(t *testing.T, s obs.Spool, key, path string, runs ...obs.Event) {
	t.Helper()
	require.NoError(t, s.Append(ok(key, "config", 0.01)))
	p := ok(key, "prepare", 4.5)
	p.Path = path
	if path == obs.PathWarm {
		p.Seconds, p.Pool = 0.03, "hit"
	}
	require.NoError(t, s.Append(p))
	for _, r := range runs {
		r.Job = key
		require.NoError(t, s.Append(r))
	}
	require.NoError(t, s.Append(ok(key, "cleanup", 0.05)))
}

func run(name, result, reason string, wall, overhead float64) obs.Event {
	e := stage("", name, result, reason, wall)
	e.Overhead, e.OverheadSeconds = true, overhead
	return e
}

func newFolder(dir string) *Folder {
	return &Folder{Spool: obs.Spool{Dir: dir}, Images: []string{"tiny", "debian"}, Log: slog.New(slog.DiscardHandler)}
}

// A day of jobs as the stages record them; every metric's count means
// what the docs say.
func TestFoldJobSequence(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir}
	// 1: cold, passes.
	job(t, s, "j1", obs.PathCold,
		run("prepare_script", obs.ResultSuccess, "none", 0.3, 0.02),
		run("step_script", obs.ResultSuccess, "none", 2, 0.03))
	// 2: warm, script fails (exit 1), after_script fails too: a build
	// failure by the script.
	job(t, s, "j2", obs.PathWarm,
		run("step_script", obs.ResultBuild, failure.ReasonScript, 1, 0.01),
		run("after_script", obs.ResultSystem, failure.ReasonOther, 1, 0.01),
		run("upload_artifacts_on_failure", obs.ResultSuccess, "none", 1, 0.01))
	// 3: cancelled during step_script.
	job(t, s, "j3", obs.PathCold, run("step_script", obs.ResultSystem, failure.ReasonCancelled, 5, 0.2))
	// 4: the guest dies: detected after 9 s of silence.
	dead := run("step_script", obs.ResultSystem, failure.ReasonDeadGuest, 12, 0.02)
	dead.DeadAfterSeconds = 9
	job(t, s, "j4", obs.PathCold, dead)
	// 5: prepare fails (boot timeout), the runner retries, the second
	// attempt works, the job passes.
	// The runner cleans up after each failed prepare attempt, then runs
	// config and prepare again.
	require.NoError(t, s.Append(ok("j5", "config", 0.01)))
	require.NoError(t, s.Append(stage("j5", "prepare", obs.ResultSystem, failure.ReasonBootTimeout, 300)))
	require.NoError(t, s.Append(ok("j5", "cleanup", 0.04)))
	require.NoError(t, s.Append(ok("j5", "config", 0.01)))
	p := ok("j5", "prepare", 5)
	p.Path, p.Pool, p.PoolReason = obs.PathCold, "miss", jobvm.MissEmpty
	require.NoError(t, s.Append(p))
	require.NoError(t, s.Append(ok("j5", "cleanup", 0.04)))
	// j7: every prepare attempt fails: counted once, as a system failure,
	// when no attempt followed for a while.
	for range 3 {
		require.NoError(t, s.Append(ok("j7", "config", 0.01)))
		require.NoError(t, s.Append(stage("j7", "prepare", obs.ResultSystem, failure.ReasonLibvirt, 1)))
		require.NoError(t, s.Append(ok("j7", "cleanup", 0.01)))
	}
	// Around them: a reaper, a sweep that found a leak, a retired standby,
	// a service reconnect, an unknown run stage and an unknown image.
	require.NoError(t, s.Append(obs.Event{Kind: obs.KindReaped, Job: "j1", Seconds: 1.7}))
	require.NoError(t, s.Append(obs.Event{Kind: obs.KindSweep, Trigger: "gc", Removed: map[string]int{"expired": 2, "orphan": 1}}))
	require.NoError(t, s.Append(obs.Event{Kind: obs.KindRetired, Image: "tiny", Reason: "dead"}))
	require.NoError(t, s.Append(obs.Event{Kind: obs.KindReconnect}))
	odd := run("step_foo", obs.ResultSuccess, "none", 1, 0.01)
	odd.Job, odd.Image = "j6", "nope"
	require.NoError(t, s.Append(odd))

	f := newFolder(dir)
	require.NoError(t, f.Fold(time.Now()))
	tt := f.Snapshot()
	jobs := func(res, why string) float64 { return tt.Counter(JobsTotal, res, why) }
	require.Equal(t, 2.0, jobs(obs.ResultSuccess, "none"), "j1 and j5 (its retried prepare worked)")
	require.Equal(t, 1.0, jobs(obs.ResultBuild, failure.ReasonScript), "j2: after_script's failure does not decide")
	require.Equal(t, 1.0, jobs(obs.ResultSystem, failure.ReasonCancelled))
	require.Equal(t, 1.0, jobs(obs.ResultSystem, failure.ReasonDeadGuest))
	require.Len(t, tt.Counters[JobsTotal], 4)
	require.Len(t, tt.Pending, 2, "j6 has no cleanup yet; j7 may still be retried")
	require.NotNil(t, tt.Pending["j6"])
	require.NotNil(t, tt.Pending["j7"])
	require.NoError(t, f.Fold(time.Now().Add(retryGrace+time.Minute)))
	tt = f.Snapshot()
	require.Equal(t, 1.0, tt.Counter(JobsTotal, obs.ResultSystem, failure.ReasonLibvirt), "j7, once")
	require.Equal(t, 2.0, tt.Counter(JobsTotal, obs.ResultSuccess, "none"))
	require.Len(t, tt.Pending, 1)

	st := func(stage, res, why string) float64 { return tt.Counter(StagesTotal, stage, res, why) }
	require.Equal(t, 9.0, st("config", obs.ResultSuccess, "none"))
	require.Equal(t, 5.0, st("prepare", obs.ResultSuccess, "none"))
	require.Equal(t, 3.0, st("prepare", obs.ResultSystem, failure.ReasonLibvirt))
	require.Equal(t, 1.0, st("prepare", obs.ResultSystem, failure.ReasonBootTimeout))
	require.Equal(t, 1.0, st("after_script", obs.ResultSystem, failure.ReasonOther))
	require.Equal(t, 1.0, st("other", obs.ResultSuccess, "none"), "unknown run stage names are bounded")

	warm := tt.Histogram(PrepareSeconds, "tiny", obs.PathWarm)
	cold := tt.Histogram(PrepareSeconds, "tiny", obs.PathCold)
	require.Equal(t, uint64(1), warm.Count)
	require.InDelta(t, 0.03, warm.Sum, 1e-9)
	require.Equal(t, uint64(4), cold.Count, "failed prepares are not in the histogram")
	require.InDelta(t, 4.5*3+5, cold.Sum, 1e-9)
	require.Equal(t, uint64(7), tt.Histogram(RunOverheadSeconds, "tiny").Count)
	require.Equal(t, uint64(1), tt.Histogram(RunOverheadSeconds, "other").Count, "unknown images are bounded")
	require.Equal(t, uint64(9), tt.Histogram(CleanupSeconds).Count)
	require.Equal(t, uint64(1), tt.Histogram(RemovalSeconds).Count)
	dg := tt.Histogram(DeadGuestSeconds, "tiny")
	require.Equal(t, uint64(1), dg.Count)
	require.Equal(t, 9.0, dg.Sum)

	require.Equal(t, 1.0, tt.Counter(PoolClaimsTotal, "tiny", "hit", "none"))
	require.Equal(t, 1.0, tt.Counter(PoolClaimsTotal, "tiny", "miss", jobvm.MissEmpty))
	require.Equal(t, 1.0, tt.Counter(SweepsTotal, "gc"))
	require.Equal(t, 2.0, tt.Counter(SweepRemovedTotal, "expired"))
	require.Equal(t, 1.0, tt.Counter(SweepRemovedTotal, "orphan"))
	require.Equal(t, 1.0, tt.Counter(PoolRetiredTotal, "tiny", "dead"))
	require.Equal(t, 1.0, tt.Counter(ReconnectsTotal, "service"))
	require.Equal(t, 39.0, tt.Counter(EventsTotal, "folded"), "5+6+4+4+6+9 stage records and 5 others (j6's unknown stage among them)")
}

// The totals survive a restart of the service: what was folded is not
// counted again, what was written while it was down is counted once.
func TestFoldSurvivesRestart(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir, SegmentBytes: 600}
	job(t, s, "a", obs.PathCold, run("step_script", obs.ResultSuccess, "none", 1, 0.01))
	first := newFolder(dir)
	require.NoError(t, first.Fold(time.Now()))
	require.Equal(t, 1.0, first.Snapshot().Counter(JobsTotal, obs.ResultSuccess, "none"))

	// Down: a job starts, the service stops (SIGKILL: no goodbye), the
	// job ends.
	require.NoError(t, s.Append(ok("b", "config", 0.01)))
	require.NoError(t, s.Append(stage("b", "step_script", obs.ResultBuild, failure.ReasonScript, 1)))
	second := newFolder(dir)
	require.NoError(t, second.Fold(time.Now()))
	require.NoError(t, s.Append(ok("b", "cleanup", 0.05)))
	for range 20 {
		job(t, s, "c", obs.PathWarm)
	}
	third := newFolder(dir)
	require.NoError(t, third.Fold(time.Now()))
	require.NoError(t, third.Fold(time.Now()))
	tt := third.Snapshot()
	require.Equal(t, 21.0, tt.Counter(JobsTotal, obs.ResultSuccess, "none"))
	require.Equal(t, 1.0, tt.Counter(JobsTotal, obs.ResultBuild, failure.ReasonScript), "b's failure was remembered across the restart")
	require.Equal(t, uint64(20), tt.Histogram(PrepareSeconds, "tiny", obs.PathWarm).Count)
	require.Equal(t, uint64(1), tt.Histogram(PrepareSeconds, "tiny", obs.PathCold).Count)
	require.Empty(t, tt.Pending)
	require.Zero(t, third.Backlog())
}

// Records dropped while the spool was full come out as lost, once.
func TestFoldCountsLost(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir, SegmentBytes: 500, MaxBytes: 1500}
	for range 100 {
		require.NoError(t, s.Append(ok("x", "step_script", 1)))
	}
	f := newFolder(dir)
	require.NoError(t, f.Fold(time.Now()))
	require.NoError(t, f.Fold(time.Now()))
	tt := f.Snapshot()
	lost := tt.Counter(EventsTotal, "lost")
	require.Positive(t, lost)
	require.Equal(t, 100.0, lost+tt.Counter(EventsTotal, "folded"))
	g := newFolder(dir)
	require.NoError(t, g.Fold(time.Now()))
	require.Equal(t, lost, g.Snapshot().Counter(EventsTotal, "lost"), "not again after a restart")
}

// The endpoint's exposition: the folded series with their labels and
// histogram buckets, the live gauges, no limit when unlimited.
func TestCollectorExposition(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir}
	job(t, s, "a", obs.PathWarm, run("step_script", obs.ResultBuild, failure.ReasonScript, 1, 0.004))
	c := &Collector{
		Folder: newFolder(dir),
		Live: Live{
			VMs: func(context.Context) (map[[2]string]int, error) {
				return map[[2]string]int{{"job", "running"}: 3, {"standby", "running"}: 2, {"standby", "paused"}: 1}, nil
			},
			Pools: func() ([]PoolGauge, error) {
				return []PoolGauge{{Image: "tiny", Idle: 2, Booting: 1, Target: 3}}, nil
			},
			Capacity: func() (int, int, int, int, error) { return 6, 3072, 8, 0, nil },
			Orphans:  func(context.Context) (int, error) { return 2, nil },
			Cache:    func() (CacheGauge, error) { return CacheGauge{Projects: 3, Bytes: 5 << 20, Limit: 10 << 30}, nil },
		},
	}
	expected := `
# HELP libvirt_executor_jobs_total Jobs whose cleanup ran, by the result and reason of the stage that decided them.
# TYPE libvirt_executor_jobs_total counter
libvirt_executor_jobs_total{reason="script",result="build_failure"} 1
# HELP libvirt_executor_run_overhead_seconds Run stages' wall time minus the script's own time in the guest, by image.
# TYPE libvirt_executor_run_overhead_seconds histogram
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.001"} 0
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.0025"} 0
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.005"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.01"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.025"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.05"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.1"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.25"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="0.5"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="1"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="2.5"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="5"} 1
libvirt_executor_run_overhead_seconds_bucket{image="tiny",le="+Inf"} 1
libvirt_executor_run_overhead_seconds_sum{image="tiny"} 0.004
libvirt_executor_run_overhead_seconds_count{image="tiny"} 1
# HELP libvirt_executor_capacity_used_vms Machines of this installation that hold host capacity, as admission counts them.
# TYPE libvirt_executor_capacity_used_vms gauge
libvirt_executor_capacity_used_vms 6
# HELP libvirt_executor_capacity_used_memory_bytes Memory reserved by this installation's machines, in bytes, as admission counts it.
# TYPE libvirt_executor_capacity_used_memory_bytes gauge
libvirt_executor_capacity_used_memory_bytes 3.221225472e+09
# HELP libvirt_executor_capacity_limit_vms The host's VM limit (capacity.max_vms); absent when unlimited.
# TYPE libvirt_executor_capacity_limit_vms gauge
libvirt_executor_capacity_limit_vms 8
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(expected),
		JobsTotal, RunOverheadSeconds, "libvirt_executor_capacity_used_vms", "libvirt_executor_capacity_used_memory_bytes",
		"libvirt_executor_capacity_limit_vms", "libvirt_executor_capacity_limit_memory_bytes"), "no memory limit: budget 0 is unlimited")
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			key := mf.GetName()
			for _, l := range m.GetLabel() {
				key += "," + l.GetName() + "=" + l.GetValue()
			}
			if m.GetGauge() != nil {
				got[key] = m.GetGauge().GetValue()
			}
		}
	}
	require.Equal(t, 3.0, got["libvirt_executor_vms,owner=job,state=running"])
	require.Equal(t, 1.0, got["libvirt_executor_vms,owner=standby,state=paused"])
	require.Equal(t, 0.0, got["libvirt_executor_vms,owner=garm,state=running"])
	require.Equal(t, 2.0, got["libvirt_executor_pool_vms,image=tiny,state=idle"])
	require.Equal(t, 1.0, got["libvirt_executor_pool_vms,image=tiny,state=booting"])
	require.Equal(t, 3.0, got["libvirt_executor_pool_target_vms,image=tiny"])
	require.Equal(t, 2.0, got["libvirt_executor_garm_orphans"])
	require.Equal(t, float64(5<<20), got["libvirt_executor_cache_size_bytes"])
	require.Equal(t, 3.0, got["libvirt_executor_cache_projects"])
	require.Equal(t, float64(10<<30), got["libvirt_executor_cache_limit_bytes"])
	_, noErrors := got["libvirt_executor_scrape_errors,part=orphans"]
	require.False(t, noErrors)

	// a failed count is a scrape error, not a zero
	c.Live.Orphans = func(context.Context) (int, error) { return 0, errors.New("libvirt gone") }
	c.Folder.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	mfs, err = reg.Gather()
	require.NoError(t, err)
	var sawErr, sawGauge bool
	for _, mf := range mfs {
		switch mf.GetName() {
		case "libvirt_executor_scrape_errors":
			for _, m := range mf.GetMetric() {
				sawErr = sawErr || m.GetLabel()[0].GetValue() == "orphans"
			}
		case "libvirt_executor_garm_orphans":
			sawGauge = true
		}
	}
	require.True(t, sawErr)
	require.False(t, sawGauge)
	require.Equal(t, 1.0, got["libvirt_executor_build_info,goversion="+runtime.Version()+",revision="+revision()+",version="+versionForTest()])
}

// The HTTP endpoint answers on /metrics with the exposition, and a busy
// address fails at once.
func TestServeEndpoint(t *testing.T) {
	c := &Collector{Folder: newFolder(filepath.Join(t.TempDir(), "events"))}
	h, err := Handler(c)
	require.NoError(t, err)
	log := slog.New(slog.DiscardHandler)
	stop, err := Serve(context.Background(), "127.0.0.1:0", h, log)
	require.NoError(t, err)
	defer stop()
	// The address is logged; find it by serving on a fixed free port
	// instead.
	ln := freePort(t)
	stop2, err := Serve(context.Background(), ln, h, log)
	require.NoError(t, err)
	defer stop2()
	resp, err := http.Get("http://" + ln + "/metrics")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(body), "libvirt_executor_build_info{goversion=")
	require.Contains(t, string(body), "process_start_time_seconds")
	_, err = Serve(context.Background(), ln, h, log)
	require.ErrorContains(t, err, "serve.metrics_listen")
}

func versionForTest() string { return buildinfo.Version }

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// A save that fails while the service runs on: what was applied in
// memory is dropped with it, so the next fold does not count it again.
func TestFoldSaveFailureDoesNotDoubleCount(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir, SegmentBytes: 600}
	for range 6 {
		require.NoError(t, s.Append(ok("x", "step_script", 1)))
	}
	f := newFolder(dir)
	f.failSave = func() error { return errors.New("disk full") }
	require.Error(t, f.Fold(time.Now()))
	require.Error(t, f.Fold(time.Now()))
	f.failSave = nil
	require.NoError(t, f.Fold(time.Now()))
	require.NoError(t, f.Fold(time.Now()))
	require.Equal(t, 6.0, f.Snapshot().Counter(StagesTotal, "step_script", obs.ResultSuccess, "none"))
}

// Unreadable saved state is moved aside and counting starts again from
// the spool, instead of failing every scrape.
func TestFoldUnreadableSavedStateMovedAside(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir}
	require.NoError(t, s.Append(ok("x", "step_script", 1)))
	require.NoError(t, os.WriteFile(filepath.Join(dir, obs.FoldedFile), nil, 0o600)) // empty after a power loss
	f := newFolder(dir)
	require.NoError(t, f.Fold(time.Now()))
	require.Equal(t, 1.0, f.Snapshot().Counter(StagesTotal, "step_script", obs.ResultSuccess, "none"))
	aside, _ := filepath.Glob(filepath.Join(dir, obs.FoldedFile+".bad-*"))
	require.Len(t, aside, 1)
}

// With Run, a scrape serves the latest look and never waits for libvirt.
func TestCollectorServesTheLatestLook(t *testing.T) {
	var mu sync.Mutex
	calls := 0
	c := &Collector{Folder: newFolder(filepath.Join(t.TempDir(), "events")), Live: Live{
		VMs: func(context.Context) (map[[2]string]int, error) {
			mu.Lock()
			defer mu.Unlock()
			calls++
			return map[[2]string]int{{"job", "running"}: calls}, nil
		},
	}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx, time.Hour) }()
	// The look is served once Run has stored it (not as soon as Live was
	// called: a scrape in between finds no look and makes its own).
	require.Eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.snap != nil }, 5*time.Second, 10*time.Millisecond)
	for range 3 {
		require.Equal(t, 1.0, testutil.ToFloat64(gaugeOf(t, c, "libvirt_executor_vms", "job", "running")))
	}
	mu.Lock()
	require.Equal(t, 1, calls, "scrapes did not look themselves")
	mu.Unlock()
	cancel()
	<-done
}

// gaugeOf is one gauge series of c's output as a collector of its own.
func gaugeOf(t *testing.T, c prometheus.Collector, name string, labels ...string) prometheus.Collector {
	t.Helper()
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var vals []string
			for _, l := range m.GetLabel() {
				vals = append(vals, l.GetValue())
			}
			if strings.Join(vals, ",") == strings.Join(labels, ",") {
				g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
				g.Set(m.GetGauge().GetValue())
				return g
			}
		}
	}
	t.Fatalf("no %s%v", name, labels)
	return nil
}

// Host cache copies recorded by run stages become the cache counters, with
// bounded labels.
func TestFoldCache(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir}
	withCache := func(name string, c *obs.CacheUse) obs.Event {
		e := run(name, obs.ResultSuccess, failure.ReasonNone, 1, 0.1)
		e.Cache = c
		return e
	}
	job(t, s, "c1", obs.PathCold,
		withCache("restore_cache", &obs.CacheUse{Op: "restore", Result: "miss"}),
		withCache("archive_cache", &obs.CacheUse{Op: "save", Result: "ok", Bytes: 1000, EvictedBytes: 300}))
	job(t, s, "c2", obs.PathWarm,
		withCache("restore_cache", &obs.CacheUse{Op: "restore", Result: "ok", Bytes: 1000}),
		withCache("archive_cache", &obs.CacheUse{Op: "save", Result: "over_limit"}),
		withCache("archive_cache", &obs.CacheUse{Op: "forged\nop", Result: "weird"}))
	f := newFolder(dir)
	require.NoError(t, f.Fold(time.Now()))
	tt := f.Snapshot()
	require.Equal(t, 1.0, tt.Counter(CacheOpsTotal, "restore", "miss"))
	require.Equal(t, 1.0, tt.Counter(CacheOpsTotal, "restore", "ok"))
	require.Equal(t, 1.0, tt.Counter(CacheOpsTotal, "save", "ok"))
	require.Equal(t, 1.0, tt.Counter(CacheOpsTotal, "save", "over_limit"))
	require.Equal(t, 1.0, tt.Counter(CacheOpsTotal, "other", "other"), "unknown values are bounded")
	require.Equal(t, 1000.0, tt.Counter(CacheBytesTotal, "restore"))
	require.Equal(t, 1000.0, tt.Counter(CacheBytesTotal, "save"))
	require.Equal(t, 300.0, tt.Counter(CacheEvictedTotal))
}

// A prepare's services start (obs.ServicesUse) becomes the services
// counters and histogram, by kind and result, with bounded labels.
func TestFoldServices(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "events")
	s := obs.Spool{Dir: dir}
	withServices := func(key string, u *obs.ServicesUse) {
		p := ok(key, "prepare", 9)
		p.Path, p.Services = obs.PathCold, u
		require.NoError(t, s.Append(p))
	}
	withServices("s1", &obs.ServicesUse{Started: 2, Seconds: 7, Result: "ok"})
	withServices("s2", &obs.ServicesUse{Started: 1, Seconds: 12, Container: true, Result: "ok"})
	withServices("s3", &obs.ServicesUse{Seconds: 3, Result: "error"})
	withServices("s4", &obs.ServicesUse{Started: 1 << 20, Seconds: 1, Result: "forged\nresult"})
	require.NoError(t, s.Append(ok("s5", "prepare", 4)))
	f := newFolder(dir)
	require.NoError(t, f.Fold(time.Now()))
	tt := f.Snapshot()
	require.Equal(t, 1.0, tt.Counter(ServiceStartsTotal, "services", "ok"))
	require.Equal(t, 1.0, tt.Counter(ServiceStartsTotal, "container_job", "ok"))
	require.Equal(t, 1.0, tt.Counter(ServiceStartsTotal, "services", "error"))
	require.Equal(t, 1.0, tt.Counter(ServiceStartsTotal, "services", "other"), "unknown values are bounded")
	require.Equal(t, 3.0+64, tt.Counter(ServicesStarted), "a forged count is capped")
	h := tt.Histogram(ServicesSeconds, "services")
	require.NotNil(t, h)
	require.Equal(t, uint64(3), h.Count, "the prepare without services is not observed")
	require.InDelta(t, 11.0, h.Sum, 1e-9)
	require.Equal(t, uint64(1), tt.Histogram(ServicesSeconds, "container_job").Count)
}
