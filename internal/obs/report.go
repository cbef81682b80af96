package obs

import (
	"sync"
	"time"
)

// Report is what a stage tells about itself as it goes (its machine, the
// path it took, each step with its time); the stage shell ends it with the
// outcome (Finish) and records it. The zero value works; a nil *Report
// ignores everything, so code that runs without one need not check.
type Report struct {
	mu sync.Mutex
	// Kind is the event's kind: KindStage when empty.
	Kind string
	// Stage is the stage's name.
	Stage                string
	jobID, instance, key string
	vm, image, path      string
	pool, poolReason     string
	span                 *time.Duration
	reconnects           int
	cache                *CacheUse
	services             *ServicesUse
	steps                []step
}

// Identify names the job: the front end's job id, its instance (GitLab's
// URL) and key, the name that ties the job's stages together.
func (r *Report) Identify(jobID, instance, key string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.jobID, r.instance, r.key = jobID, instance, key
}

// SetStage names the stage (a run stage learns its name from its
// arguments).
func (r *Report) SetStage(name string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.Stage = name
}

type step struct {
	name string
	took time.Duration
	err  error
	at   time.Time
}

// Machine names the stage's machine and its image.
func (r *Report) Machine(vm, image string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.vm, r.image = vm, image
}

// Path says whether a prepare took a standby machine (PathWarm) or booted
// one (PathCold).
func (r *Report) Path(path string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.path = path
}

// Pool says how a prepare of an image with a standby pool fared: "hit",
// or "miss" and why.
func (r *Report) Pool(result, reason string) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pool, r.poolReason = result, reason
}

// GuestSpan records how long a run stage's script ran in the guest; the
// rest of the stage's wall time is its overhead.
func (r *Report) GuestSpan(d time.Duration) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.span = &d
}

// Cache records what a run stage did with the host cache: op "restore" or
// "save", result ok, miss, over_limit or error, the bytes copied and the
// bytes evicted to make room.
func (r *Report) Cache(op, result string, bytes, evicted int64) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cache = &CacheUse{Op: op, Result: result, Bytes: bytes, EvictedBytes: evicted}
}

// Services records what a prepare did with the job's services: the service
// containers started, how long the start took, whether a container job's
// container was started too, and whether it failed.
func (r *Report) Services(started int, took time.Duration, container bool, err error) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	res := "ok"
	if err != nil {
		res = "error"
	}
	r.services = &ServicesUse{Started: started, Seconds: took.Seconds(), Container: container, Result: res}
}

// Reconnects records how often the stage reconnected to libvirt.
func (r *Report) Reconnects(n int) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reconnects = n
}

// Step records one step: its name, how long it took and its error.
func (r *Report) Step(name string, took time.Duration, err error) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.steps = append(r.steps, step{name: name, took: took, err: err, at: time.Now()})
}

// Outcome is how a stage ended, as the stage shell decided it.
type Outcome struct {
	Err       error
	Cancelled bool
	Took      time.Duration
	End       time.Time
	// Classify gives an error's result class (Result*) and reason
	// (failure.Classify).
	Classify func(err error, cancelled bool) (result, reason string)
	// DeadAfter is, when Err says the guest died, how long it had been
	// silent (sshexec.DeadAfter).
	DeadAfter time.Duration
}

// Finish ends the report: the stage's event record and its step records,
// the whole stage last (step "stage").
func (r *Report) Finish(o Outcome) (Event, []StepRecord) {
	r.mu.Lock()
	defer r.mu.Unlock()
	result, reason := o.Classify(o.Err, o.Cancelled)
	kind := r.Kind
	if kind == "" {
		kind = KindStage
	}
	ev := Event{
		Time: o.End, Kind: kind, Stage: r.Stage, Job: r.key, Image: r.image,
		Result: result, Reason: reason, Seconds: o.Took.Seconds(),
		Pool: r.pool, PoolReason: r.poolReason, Reconnects: r.reconnects, Cache: r.cache,
		Services: r.services,
	}
	if o.Err == nil {
		ev.Path = r.path
	}
	if r.span != nil && *r.span > 0 {
		ev.Overhead, ev.OverheadSeconds = true, max(0, (o.Took-*r.span).Seconds())
	}
	ev.DeadAfterSeconds = o.DeadAfter.Seconds()
	rec := func(name string, took time.Duration, err error, at time.Time, cancelled bool) StepRecord {
		res, why := o.Classify(err, cancelled)
		out := "ok"
		switch {
		case cancelled:
			out = "cancelled"
		case err != nil:
			out = "failed"
		}
		s := StepRecord{
			Time: at, Stage: r.Stage, Step: name, Job: r.jobID, Instance: r.instance, VM: r.vm,
			Image: r.image, Path: r.path, Duration: took, Outcome: out, Class: res,
		}
		if err != nil || cancelled {
			s.Reason = why
		}
		if err != nil {
			s.Error = err.Error()
		}
		return s
	}
	var recs []StepRecord
	for _, s := range r.steps {
		recs = append(recs, rec(s.name, s.took, s.err, s.at, false))
	}
	recs = append(recs, rec("stage", o.Took, o.Err, o.End, o.Cancelled))
	return ev, recs
}
