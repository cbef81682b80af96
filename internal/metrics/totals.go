// Package metrics is the service's Prometheus endpoint: it folds the event
// records the stages leave in the spool (internal/obs) into counters and
// histograms that it saves with its cursor, so that they keep counting
// across restarts (nothing twice, nothing lost), and adds live gauges of
// the machines, pools and capacity at each scrape.
package metrics

import (
	"encoding/json"
	"slices"
	"sort"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/failure"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// Metric names and their label names.
const (
	StagesTotal        = "libvirt_executor_stages_total"
	JobsTotal          = "libvirt_executor_jobs_total"
	PoolClaimsTotal    = "libvirt_executor_pool_claims_total"
	PoolRetiredTotal   = "libvirt_executor_pool_retired_total"
	SweepsTotal        = "libvirt_executor_sweeps_total"
	SweepRemovedTotal  = "libvirt_executor_sweep_removed_total"
	ReconnectsTotal    = "libvirt_executor_libvirt_reconnects_total"
	EventsTotal        = "libvirt_executor_events_total"
	PrepareSeconds     = "libvirt_executor_prepare_duration_seconds"
	RunOverheadSeconds = "libvirt_executor_run_overhead_seconds"
	CleanupSeconds     = "libvirt_executor_cleanup_duration_seconds"
	RemovalSeconds     = "libvirt_executor_vm_removal_seconds"
	DeadGuestSeconds   = "libvirt_executor_dead_guest_detection_seconds"
	GarmInstancesTotal = "libvirt_executor_garm_instances_total"
	CacheOpsTotal      = "libvirt_executor_cache_operations_total"
	CacheBytesTotal    = "libvirt_executor_cache_bytes_total"
	CacheEvictedTotal  = "libvirt_executor_cache_evicted_bytes_total"
	ServiceStartsTotal = "libvirt_executor_service_starts_total"
	ServicesStarted    = "libvirt_executor_service_containers_started_total"
	ServicesSeconds    = "libvirt_executor_service_start_seconds"
)

// ServiceKinds are the label values of a prepare's services start: a job
// with services only, or a container job (its container, and services if
// any); ServiceResults how it ended.
var (
	ServiceKinds   = []string{"services", "container_job"}
	ServiceResults = []string{"ok", "error"}
)

// CacheOps and CacheResults are the host cache's label values (obs.CacheUse).
var (
	CacheOps     = []string{"restore", "save"}
	CacheResults = []string{"ok", "miss", "over_limit", "error"}
)

// def is one folded metric: its help, label names and, for a histogram,
// its buckets.
type def struct {
	help    string
	labels  []string
	buckets []float64
}

var defs = map[string]def{
	StagesTotal: {help: "Stages that ended, by stage, result class (success, build_failure, system_failure) and reason.",
		labels: []string{"stage", "result", "reason"}},
	JobsTotal: {help: "Jobs whose cleanup ran, by the result and reason of the stage that decided them.",
		labels: []string{"result", "reason"}},
	PoolClaimsTotal: {help: "Prepares of an image with a standby pool: hit (a standby VM claimed) or miss (cold start), and why it missed.",
		labels: []string{"image", "result", "reason"}},
	PoolRetiredTotal: {help: "Standby VMs removed, by image and reason.", labels: []string{"image", "reason"}},
	SweepsTotal:      {help: "Sweeps run, by trigger (gc, cleanup).", labels: []string{"trigger"}},
	SweepRemovedTotal: {help: "Machines sweeps removed, by verdict (expired, orphan, ended: leaks; retired: standby VMs).",
		labels: []string{"verdict"}},
	GarmInstancesTotal: {help: "garm's instance operations (create, delete) that ended, by result class (success, system_failure) and reason.",
		labels: []string{"op", "result", "reason"}},
	CacheOpsTotal: {help: "Host cache copies by run stages, by op (restore, save) and result (ok; miss: nothing cached yet; over_limit: a save above cache.project_limit_mib, not kept; error).",
		labels: []string{"op", "result"}},
	CacheBytesTotal:   {help: "Bytes of host cache copied into VMs (restore) and kept from them (save).", labels: []string{"op"}},
	CacheEvictedTotal: {help: "Bytes of host cache removed to stay within the project and total limits."},
	ServiceStartsTotal: {help: "Prepares that started a job's services or container in its VM (podman), by kind (services, container_job) and result (ok, error).",
		labels: []string{"kind", "result"}},
	ServicesStarted: {help: "Service containers started in job VMs."},
	ServicesSeconds: {help: "Time a prepare took to start a job's services or container in its VM (pulls, start, waits), by kind.",
		labels: []string{"kind"}, buckets: []float64{.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300}},
	ReconnectsTotal: {help: "Reconnections to libvirt after a lost connection, by process (service, stage).",
		labels: []string{"process"}},
	EventsTotal: {help: "Event records of the spool: folded, invalid (unreadable, skipped), lost (dropped while the spool was full).",
		labels: []string{"outcome"}},
	PrepareSeconds: {help: "Successful prepare stages, by image and path (warm: a standby VM claimed; cold: booted for the job).",
		labels: []string{"image", "path"}, buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300}},
	RunOverheadSeconds: {help: "Run stages' wall time minus the script's own time in the guest, by image.",
		labels: []string{"image"}, buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5}},
	CleanupSeconds: {help: "Cleanup stages (they return once the VM can run nothing more).",
		buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}},
	RemovalSeconds: {help: "From cleanup stopping a VM until its reaper had removed it.",
		buckets: []float64{.1, .25, .5, 1, 2, 5, 10, 30, 60, 120}},
	DeadGuestSeconds: {help: "Dead guests a stage detected, by image: how long the guest had been silent when noticed.",
		labels: []string{"image"}, buckets: []float64{1, 2, 5, 7.5, 10, 15, 20, 30, 60, 120}},
}

// RunStages are the run stage names counted by their own name; any other
// is "other".
var RunStages = []string{"prepare_script", "get_sources", "clear_worktree", "restore_cache", "download_artifacts",
	"step_script", "build_script", "after_script", "archive_cache", "archive_cache_on_failure",
	"upload_artifacts_on_success", "upload_artifacts_on_failure", "cleanup_file_variables"}

// Hist is a histogram's state: observations per bucket (not cumulative;
// the last one is +Inf), their count and sum.
type Hist struct {
	Buckets []uint64 `json:"b"`
	Count   uint64   `json:"n"`
	Sum     float64  `json:"s"`
}

// pending is a job whose cleanup has not run yet: the result that decides
// it so far.
type pending struct {
	Result string    `json:"result,omitempty"`
	Reason string    `json:"reason,omitempty"`
	Seen   time.Time `json:"seen"`
	// Ran says a run stage of the job was seen.
	Ran bool `json:"ran,omitempty"`
	// Ended is when a cleanup followed a failed prepare before any run
	// stage: the runner cleans up after each failed prepare attempt and
	// may try again (config, prepare) under the same job key. The job is
	// counted when no attempt followed within retryGrace.
	Ended time.Time `json:"ended,omitzero"`
}

// pendingMax bounds the jobs waiting for their cleanup; pendingAge is when
// one is forgotten (its cleanup never came; the sweep handles the VM).
const (
	pendingMax = 10000
	pendingAge = 72 * time.Hour
	retryGrace = 5 * time.Minute
)

// Totals is everything folded so far; it is saved with the cursor.
type Totals struct {
	// Counters maps a metric to its series (label values joined by
	// sep) and their values.
	Counters map[string]map[string]float64 `json:"counters"`
	Hists    map[string]map[string]*Hist   `json:"hists"`
	Pending  map[string]*pending           `json:"pending"`
}

const sep = "\x1f"

func newTotals() *Totals {
	return &Totals{Counters: map[string]map[string]float64{}, Hists: map[string]map[string]*Hist{}, Pending: map[string]*pending{}}
}

func (t *Totals) add(name string, v float64, labels ...string) {
	m := t.Counters[name]
	if m == nil {
		m = map[string]float64{}
		t.Counters[name] = m
	}
	m[strings.Join(labels, sep)] += v
}

func (t *Totals) observe(name string, v float64, labels ...string) {
	m := t.Hists[name]
	if m == nil {
		m = map[string]*Hist{}
		t.Hists[name] = m
	}
	key := strings.Join(labels, sep)
	h := m[key]
	b := defs[name].buckets
	if h == nil || len(h.Buckets) != len(b)+1 {
		h = &Hist{Buckets: make([]uint64, len(b)+1)}
		m[key] = h
	}
	i := sort.SearchFloat64s(b, v) // first bucket whose bound >= v
	h.Buckets[i]++
	h.Count++
	h.Sum += v
}

// Counter is a counter's value for the label values (0 if never counted).
func (t *Totals) Counter(name string, labels ...string) float64 {
	return t.Counters[name][strings.Join(labels, sep)]
}

// Histogram is a histogram's state for the label values (nil if never
// observed).
func (t *Totals) Histogram(name string, labels ...string) *Hist {
	return t.Hists[name][strings.Join(labels, sep)]
}

// folder turns records into Totals; images are the configured image names
// (any other is "other").
type folder struct {
	t      *Totals
	images []string
}

func oneOf(v string, allowed []string) string {
	if slices.Contains(allowed, v) {
		return v
	}
	return "other"
}

var results = []string{obs.ResultSuccess, obs.ResultBuild, obs.ResultSystem}

func (f *folder) image(v string) string { return oneOf(v, f.images) }

func stageLabel(s string) string {
	switch s {
	case "config", "prepare", "cleanup":
		return s
	}
	return oneOf(s, RunStages)
}

// apply folds one record.
func (f *folder) apply(e obs.Event) {
	t := f.t
	t.add(EventsTotal, 1, "folded")
	switch e.Kind {
	case obs.KindStage:
		f.stage(e)
	case obs.KindReaped:
		t.observe(RemovalSeconds, e.Seconds)
	case obs.KindSweep:
		t.add(SweepsTotal, 1, oneOf(e.Trigger, lifecycle.SweepTriggers))
		for verdict, n := range e.Removed {
			t.add(SweepRemovedTotal, float64(n), oneOf(verdict, []string{lifecycle.VerdictExpired, lifecycle.VerdictOrphan, lifecycle.VerdictEnded, lifecycle.VerdictRetired}))
		}
	case obs.KindRetired:
		t.add(PoolRetiredTotal, 1, f.image(e.Image), oneOf(e.Reason, jobvm.RetireReasons))
	case obs.KindReconnect:
		t.add(ReconnectsTotal, 1, "service")
	case obs.KindInstance:
		t.add(GarmInstancesTotal, 1, oneOf(e.Stage, obs.InstanceOps), oneOf(e.Result, results), oneOf(e.Reason, failure.Reasons))
	}
}

func (f *folder) stage(e obs.Event) {
	t := f.t
	stage := stageLabel(e.Stage)
	result := oneOf(e.Result, results)
	reason := oneOf(e.Reason, failure.Reasons)
	t.add(StagesTotal, 1, stage, result, reason)
	img := f.image(e.Image)
	if e.Reconnects > 0 {
		t.add(ReconnectsTotal, float64(e.Reconnects), "stage")
	}
	if c := e.Cache; c != nil {
		op := oneOf(c.Op, CacheOps)
		t.add(CacheOpsTotal, 1, op, oneOf(c.Result, CacheResults))
		if c.Bytes > 0 {
			t.add(CacheBytesTotal, float64(c.Bytes), op)
		}
		if c.EvictedBytes > 0 {
			t.add(CacheEvictedTotal, float64(c.EvictedBytes))
		}
	}
	if s := e.Services; s != nil {
		kind := ServiceKinds[0]
		if s.Container {
			kind = ServiceKinds[1]
		}
		t.add(ServiceStartsTotal, 1, kind, oneOf(s.Result, ServiceResults))
		if s.Started > 0 {
			t.add(ServicesStarted, float64(min(s.Started, 64)))
		}
		t.observe(ServicesSeconds, s.Seconds, kind)
	}
	if e.DeadAfterSeconds > 0 {
		t.observe(DeadGuestSeconds, e.DeadAfterSeconds, img)
	}
	p := t.Pending[e.Job]
	if p == nil && e.Job != "" && stage != "cleanup" && len(t.Pending) < pendingMax {
		p = &pending{}
		t.Pending[e.Job] = p
	}
	if p != nil {
		p.Seen = e.Time
		if !p.Ended.IsZero() && (stage == "config" || stage == "prepare") {
			// The runner tries the prepare again: the job goes on.
			p.Ended = time.Time{}
		}
	}
	failed := result != obs.ResultSuccess
	switch stage {
	case "config":
	case "prepare":
		if e.Pool != "" {
			pr := oneOf(e.PoolReason, []string{jobvm.MissNoPool, jobvm.MissSize, jobvm.MissServiceDown, jobvm.MissEmpty, jobvm.MissError})
			if e.Pool == "hit" {
				pr = failure.ReasonNone
			}
			t.add(PoolClaimsTotal, 1, img, oneOf(e.Pool, []string{"hit", "miss"}), pr)
		}
		if !failed {
			t.observe(PrepareSeconds, e.Seconds, img, oneOf(e.Path, []string{obs.PathWarm, obs.PathCold, obs.PathSnapshot}))
			if p != nil {
				// The runner retries a failed prepare: the attempt
				// that worked decides.
				p.Result, p.Reason = "", ""
			}
		}
	case "cleanup":
		t.observe(CleanupSeconds, e.Seconds)
		if p != nil && p.Result != "" && !p.Ran {
			// After a failed prepare: the runner may try again.
			p.Ended = e.Time
			return
		}
		t.countJob(p)
		delete(t.Pending, e.Job)
		return
	default:
		if p != nil {
			p.Ran = true
		}
		if e.Overhead {
			t.observe(RunOverheadSeconds, e.OverheadSeconds, img)
		}
		if stage == "after_script" {
			return // its failure does not fail the job
		}
	}
	if failed && p != nil && p.Result == "" {
		p.Result, p.Reason = result, reason
	}
}

// countJob counts a job with what decided it (success without).
func (t *Totals) countJob(p *pending) {
	res, why := obs.ResultSuccess, failure.ReasonNone
	if p != nil && p.Result != "" {
		res, why = p.Result, p.Reason
	}
	t.add(JobsTotal, 1, res, why)
}

// expire counts the jobs whose failed prepare no retry followed within
// retryGrace, and forgets jobs whose cleanup never came.
func (t *Totals) expire(now time.Time) {
	for k, p := range t.Pending {
		switch {
		case !p.Ended.IsZero() && now.Sub(p.Ended) > retryGrace:
			t.countJob(p)
			delete(t.Pending, k)
		case now.Sub(p.Seen) > pendingAge:
			delete(t.Pending, k)
		}
	}
}

func (t *Totals) marshal() (json.RawMessage, error) { return json.Marshal(t) }

func unmarshalTotals(b json.RawMessage) (*Totals, error) {
	t := newTotals()
	if len(b) == 0 {
		return t, nil
	}
	if err := json.Unmarshal(b, t); err != nil {
		return nil, err
	}
	if t.Counters == nil {
		t.Counters = map[string]map[string]float64{}
	}
	if t.Hists == nil {
		t.Hists = map[string]map[string]*Hist{}
	}
	if t.Pending == nil {
		t.Pending = map[string]*pending{}
	}
	return t, nil
}
