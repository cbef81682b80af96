package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// Folder folds the spool into its Totals and saves them with the cursor.
// One Folder per installation runs at a time (the service's lock).
type Folder struct {
	Spool  obs.Spool
	Images []string
	Log    *slog.Logger

	// failSave, if set (tests), fails saves.
	failSave func() error

	mu     sync.Mutex
	loaded bool
	t      *Totals
	cur    obs.Cursor
	lost   int64
}

// load reads the saved state once. Saved state that cannot be read (a
// power loss mid-write, a hand edit) is moved aside and the count starts
// again, so that one bad file does not stop the metrics for good.
func (f *Folder) load() error {
	if f.loaded {
		return nil
	}
	saved, err := f.Spool.LoadFolded()
	var t *Totals
	if err == nil {
		t, err = unmarshalTotals(saved.Totals)
	}
	if err != nil {
		aside, merr := f.Spool.SetFoldedAside()
		if merr != nil {
			return fmt.Errorf("saved metrics in %s: %w (moving it aside: %v)", f.Spool.Dir, err, merr)
		}
		f.Log.Error("saved metrics unreadable: moved aside, counting again from the records in the spool", "err", err, "moved_to", aside)
		saved, t = obs.Folded{}, newTotals()
	}
	f.t, f.cur, f.lost, f.loaded = t, saved.Cursor, saved.Lost, true
	return nil
}

// Fold folds the records written since the last fold, and the records
// writers dropped, and saves the result.
func (f *Folder) Fold(now time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.load(); err != nil {
		return err
	}
	fd := folder{t: f.t, images: f.Images}
	dirty := false
	if lost := f.Spool.Lost(); lost > f.lost {
		// Never lowered: a count read short must not count again.
		f.t.add(EventsTotal, float64(lost-f.lost), "lost")
		f.lost, dirty = lost, true
	}
	before := len(f.t.Pending)
	f.t.expire(now)
	dirty = dirty || len(f.t.Pending) != before
	save := func(c obs.Cursor) error {
		if f.failSave != nil {
			if err := f.failSave(); err != nil {
				return err
			}
		}
		b, err := f.t.marshal()
		if err != nil {
			return err
		}
		return f.Spool.SaveFolded(obs.Folded{Cursor: c, Lost: f.lost, Totals: b})
	}
	c, err := f.Spool.Fold(f.cur, obs.Reader{
		Apply:   fd.apply,
		Invalid: func() { f.t.add(EventsTotal, 1, "invalid") },
		Save: func(c obs.Cursor) error {
			dirty = false
			return save(c)
		},
	})
	f.cur = c
	if err == nil && dirty {
		err = save(c)
	}
	if err != nil {
		// What was applied in memory may not be saved: start again from
		// the saved state, so that nothing is counted twice.
		f.loaded = false
		return err
	}
	return nil
}

// Snapshot is a copy of the totals (for tests and the collector).
func (f *Folder) Snapshot() *Totals {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, _ := f.t.marshal()
	t, _ := unmarshalTotals(b)
	return t
}

// Backlog is the size of the records not folded yet.
func (f *Folder) Backlog() int64 {
	f.mu.Lock()
	c := f.cur
	f.mu.Unlock()
	return f.Spool.Backlog(c)
}

// Live is what the collector asks at each scrape; any of it may be nil.
type Live struct {
	// VMs counts this installation's machines by owner kind and state.
	VMs func(ctx context.Context) (map[[2]string]int, error)
	// Pools is each pooled image's standby machines and target.
	Pools func() ([]PoolGauge, error)
	// Capacity is what is in use, and the limits (0: none).
	Capacity func() (vms, memoryMiB, maxVMs, memoryBudgetMiB int, err error)
	// Orphans counts garm instances whose pool garm no longer names (nil:
	// no such gauge).
	Orphans func(ctx context.Context) (int, error)
	// Cache is the host cache's size (nil: [cache] is off).
	Cache func() (CacheGauge, error)
	// Images is each image with a source (oci://) now (nil: none).
	Images func() ([]ImageGauge, error)
}

// ImageGauge is one image with a source: the digest this host stores for
// it now ("" before its first pull), when the registry last confirmed it,
// and the pulls failed in a row since.
type ImageGauge struct {
	Image, Digest string
	LastCheck     time.Time
	Failures      int
}

// CacheGauge is the host cache now: projects with a cache, bytes of their
// files, and cache.total_limit_mib in bytes.
type CacheGauge struct {
	Projects     int
	Bytes, Limit int64
}

// PoolGauge is one image's standby pool now.
type PoolGauge struct {
	Image                                    string
	Idle, Booting, Claimed, Retiring, Target int
}

// Collector is the prometheus.Collector of the folded metrics and the live
// gauges. Each scrape folds first, so it sees every record written before
// it.
type Collector struct {
	Folder *Folder
	Live   Live
	// Wait bounds one look at the live gauges (default 5 s).
	Wait time.Duration

	mu   sync.Mutex
	snap *snapshot
}

// The live gauges. gauge registers each name for Kinds.
var (
	vmsDesc           = gauge("libvirt_executor_vms", "VMs of this installation by owner kind (job, standby, garm, other) and state (running, paused, shutoff, other).", "owner", "state")
	poolDesc          = gauge("libvirt_executor_pool_vms", "Standby VMs by image and state (idle, booting, claimed, retiring).", "image", "state")
	targetDesc        = gauge("libvirt_executor_pool_target_vms", "Idle standby VMs the service aims for now, by image.", "image")
	usedVMsDesc       = gauge("libvirt_executor_capacity_used_vms", "Machines of this installation that hold host capacity, as admission counts them.")
	usedMemDesc       = gauge("libvirt_executor_capacity_used_memory_bytes", "Memory reserved by this installation's machines, in bytes, as admission counts it.")
	limitVMsDesc      = gauge("libvirt_executor_capacity_limit_vms", "The host's VM limit (capacity.max_vms); absent when unlimited.")
	limitMemDesc      = gauge("libvirt_executor_capacity_limit_memory_bytes", "The host's memory budget (capacity.memory_budget_mib) in bytes; absent when unlimited.")
	backlogDesc       = gauge("libvirt_executor_event_spool_bytes", "Bytes of event records waiting in the spool to be folded.")
	buildDesc         = gauge("libvirt_executor_build_info", "The running service's build: version, git revision and Go version (value 1).", "version", "revision", "goversion")
	orphansDesc       = gauge("libvirt_executor_garm_orphans", "garm instances whose pool garm has not named for garm.orphan_after (a deleted pool, or a garm that is gone); they stay until garm.max_age.")
	cacheSizeDesc     = gauge("libvirt_executor_cache_size_bytes", "Bytes of files in the host cache ([cache] dir), all projects together.")
	cacheProjectsDesc = gauge("libvirt_executor_cache_projects", "Projects with a cache in the host cache.")
	cacheLimitDesc    = gauge("libvirt_executor_cache_limit_bytes", "The host cache's total limit (cache.total_limit_mib) in bytes.")
	imageInfoDesc     = gauge("libvirt_executor_image_info", "The image this host stores for each image with a source (oci://) now, by its manifest's digest (absent before the first pull).", "image", "digest")
	imageCheckDesc    = gauge("libvirt_executor_image_last_check_timestamp_seconds", "When the registry last confirmed what an image's source names (a successful pull or check), in seconds since the epoch.", "image")
	imageFailDesc     = gauge("libvirt_executor_image_pull_failures", "Pulls of an image's source failed in a row (0 once one succeeds): the last verified image keeps serving meanwhile.", "image")
	scrapeErrors      = gauge("libvirt_executor_scrape_errors", "Parts of this scrape that failed (fold, vms, pools, capacity, orphans, cache, images): 1 each.", "part")
)

// gaugeNames are the live gauges' names, in the order made.
var gaugeNames []string

func gauge(name, help string, labels ...string) *prometheus.Desc {
	gaugeNames = append(gaugeNames, name)
	return prometheus.NewDesc(name, help, labels, nil)
}

// Kinds is every metric the service exports itself (the Go and process
// collectors' aside), by name: counter, histogram or gauge. It is the
// specification the dashboard's and the alerts' tests check names against.
func Kinds() map[string]string {
	k := map[string]string{}
	for name, d := range defs {
		k[name] = "counter"
		if d.buckets != nil {
			k[name] = "histogram"
		}
	}
	for _, name := range gaugeNames {
		k[name] = "gauge"
	}
	return k
}

// revision is build_info's revision label: the commit, "unknown" without one.
func revision() string {
	if buildinfo.Commit == "" {
		return "unknown"
	}
	return buildinfo.Commit
}

// Describe implements prometheus.Collector (unchecked: the folded series
// are known only from the records).
func (c *Collector) Describe(chan<- *prometheus.Desc) {}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	failed := func(part string, err error) {
		c.Folder.Log.Warn("metrics: "+part+" failed", "err", err)
		ch <- prometheus.MustNewConstMetric(scrapeErrors, prometheus.GaugeValue, 1, part)
	}
	if err := c.Folder.Fold(time.Now()); err != nil {
		failed("fold", err)
	}
	c.collectTotals(ch)
	ch <- prometheus.MustNewConstMetric(backlogDesc, prometheus.GaugeValue, float64(c.Folder.Backlog()))
	ch <- prometheus.MustNewConstMetric(buildDesc, prometheus.GaugeValue, 1, buildinfo.Version, revision(), runtime.Version())
	snap := c.current()
	if snap.vmsErr != nil {
		failed("vms", snap.vmsErr)
	} else if snap.vms != nil {
		for _, owner := range []string{"job", "standby", "garm", "other"} {
			for _, st := range []string{"running", "paused", "shutoff", "other"} {
				ch <- prometheus.MustNewConstMetric(vmsDesc, prometheus.GaugeValue, float64(snap.vms[[2]string{owner, st}]), owner, st)
			}
		}
	}
	if snap.orphansErr != nil {
		failed("orphans", snap.orphansErr)
	} else if c.Live.Orphans != nil {
		ch <- prometheus.MustNewConstMetric(orphansDesc, prometheus.GaugeValue, float64(snap.orphans))
	}
	if snap.poolsErr != nil {
		failed("pools", snap.poolsErr)
	}
	for _, p := range snap.pools {
		for st, n := range map[string]int{"idle": p.Idle, "booting": p.Booting, "claimed": p.Claimed, "retiring": p.Retiring} {
			ch <- prometheus.MustNewConstMetric(poolDesc, prometheus.GaugeValue, float64(n), p.Image, st)
		}
		ch <- prometheus.MustNewConstMetric(targetDesc, prometheus.GaugeValue, float64(p.Target), p.Image)
	}
	if snap.cacheErr != nil {
		failed("cache", snap.cacheErr)
	} else if c.Live.Cache != nil {
		ch <- prometheus.MustNewConstMetric(cacheSizeDesc, prometheus.GaugeValue, float64(snap.cache.Bytes))
		ch <- prometheus.MustNewConstMetric(cacheProjectsDesc, prometheus.GaugeValue, float64(snap.cache.Projects))
		ch <- prometheus.MustNewConstMetric(cacheLimitDesc, prometheus.GaugeValue, float64(snap.cache.Limit))
	}
	if snap.imagesErr != nil {
		failed("images", snap.imagesErr)
	}
	for _, g := range snap.images {
		if g.Digest != "" {
			ch <- prometheus.MustNewConstMetric(imageInfoDesc, prometheus.GaugeValue, 1, g.Image, g.Digest)
			ch <- prometheus.MustNewConstMetric(imageCheckDesc, prometheus.GaugeValue, float64(g.LastCheck.UnixMilli())/1000, g.Image)
		}
		ch <- prometheus.MustNewConstMetric(imageFailDesc, prometheus.GaugeValue, float64(g.Failures), g.Image)
	}
	if snap.capErr != nil {
		failed("capacity", snap.capErr)
	} else if snap.hasCap {
		ch <- prometheus.MustNewConstMetric(usedVMsDesc, prometheus.GaugeValue, float64(snap.capVMs))
		ch <- prometheus.MustNewConstMetric(usedMemDesc, prometheus.GaugeValue, float64(snap.capMiB)*(1<<20))
		if snap.maxVMs > 0 {
			ch <- prometheus.MustNewConstMetric(limitVMsDesc, prometheus.GaugeValue, float64(snap.maxVMs))
		}
		if snap.budgetMiB > 0 {
			ch <- prometheus.MustNewConstMetric(limitMemDesc, prometheus.GaugeValue, float64(snap.budgetMiB)*(1<<20))
		}
	}
}

// snapshot is one look at the live gauges.
type snapshot struct {
	vms                               map[[2]string]int
	vmsErr                            error
	orphans                           int
	orphansErr                        error
	pools                             []PoolGauge
	poolsErr                          error
	hasCap                            bool
	capVMs, capMiB, maxVMs, budgetMiB int
	capErr                            error
	cache                             CacheGauge
	cacheErr                          error
	images                            []ImageGauge
	imagesErr                         error
}

// look asks Live once, bounded by Wait.
func (c *Collector) look() *snapshot {
	wait := c.Wait
	if wait <= 0 {
		wait = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	var s snapshot
	if c.Live.VMs != nil {
		s.vms, s.vmsErr = c.Live.VMs(ctx)
	}
	if c.Live.Orphans != nil {
		s.orphans, s.orphansErr = c.Live.Orphans(ctx)
	}
	if c.Live.Pools != nil {
		s.pools, s.poolsErr = c.Live.Pools()
	}
	if c.Live.Cache != nil {
		s.cache, s.cacheErr = c.Live.Cache()
	}
	if c.Live.Images != nil {
		s.images, s.imagesErr = c.Live.Images()
	}
	if c.Live.Capacity != nil {
		s.capVMs, s.capMiB, s.maxVMs, s.budgetMiB, s.capErr = c.Live.Capacity()
		s.hasCap = s.capErr == nil
	}
	return &s
}

// current is the latest look of Run, or, without Run, a look now.
func (c *Collector) current() *snapshot {
	c.mu.Lock()
	snap := c.snap
	c.mu.Unlock()
	if snap == nil {
		return c.look()
	}
	return snap
}

// Run looks at the live gauges every interval until ctx ends, so that a
// scrape answers at once, however slow libvirt is at the moment (a scrape
// that waited for it hit Prometheus' scrape timeout under load).
func (c *Collector) Run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		snap := c.look()
		c.mu.Lock()
		c.snap = snap
		c.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// collectTotals sends the folded counters and histograms, sorted.
func (c *Collector) collectTotals(ch chan<- prometheus.Metric) {
	t := c.Folder.Snapshot()
	names := make([]string, 0, len(defs))
	for n := range defs {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		d := defs[name]
		desc := prometheus.NewDesc(name, d.help, d.labels, nil)
		send := func(m prometheus.Metric, err error) {
			if err != nil {
				// A saved series that does not fit its metric (an older
				// format): skipped, the rest is served.
				c.Folder.Log.Warn("metrics: saved series skipped", "metric", name, "err", err)
				return
			}
			ch <- m
		}
		if d.buckets == nil {
			for _, v := range zeroSeries[name] {
				if _, ok := t.Counters[name][v]; !ok {
					send(prometheus.NewConstMetric(desc, prometheus.CounterValue, 0, v))
				}
			}
			for key, v := range t.Counters[name] {
				send(prometheus.NewConstMetric(desc, prometheus.CounterValue, v, labelValues(key, len(d.labels))...))
			}
			continue
		}
		for key, h := range t.Hists[name] {
			cum := map[float64]uint64{}
			var run uint64
			for i, b := range d.buckets {
				if i < len(h.Buckets) {
					run += h.Buckets[i]
				}
				cum[b] = run
			}
			send(prometheus.NewConstHistogram(desc, h.Count, h.Sum, cum, labelValues(key, len(d.labels))...))
		}
	}
}

// zeroSeries are the one-label counters shown as 0 before they first
// count, so that an alert's increase() sees their first step.
var zeroSeries = map[string][]string{
	EventsTotal:       {"folded", "invalid", "lost"},
	SweepsTotal:       {"gc", "cleanup", "room"},
	SweepRemovedTotal: {"expired", "orphan", "ended", "retired"},
	ReconnectsTotal:   {"service", "stage"},
}

func labelValues(key string, n int) []string {
	if n == 0 {
		return nil
	}
	return strings.SplitN(key, sep, n)
}

// Handler is the /metrics handler of a registry with the collector and the
// Go and process collectors.
func Handler(c *Collector) (http.Handler, error) {
	reg := prometheus.NewRegistry()
	for _, col := range []prometheus.Collector{c, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: nil, ErrorHandling: promhttp.ContinueOnError}), nil
}

// Serve serves /metrics on addr until ctx ends. The listener is made
// before Serve returns its first error, so a busy port fails the service
// at once.
func Serve(ctx context.Context, addr string, h http.Handler, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics endpoint (serve.metrics_listen %q): %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", h)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		_, _ = fmt.Fprintln(w, "libvirt-executor: metrics at /metrics")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, WriteTimeout: 30 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics endpoint failed", "err", err)
		}
	}()
	log.Info("serving metrics", "address", ln.Addr().String(), "path", "/metrics")
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
		<-done
	}, nil
}
