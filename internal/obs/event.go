// Package obs is what the short-lived executables record for the admin:
// one durable event record per stage (and per sweep, reaper, retirement)
// in a bounded spool on the host that the service folds into its metrics
// (internal/metrics), and one structured log record per step (StepLog). It
// links neither libvirt nor the Prometheus client: the stages stay lean,
// and a stage never waits on the service.
package obs

import (
	"time"
	"unicode/utf8"
)

// Event kinds.
const (
	// KindStage is one stage of a job (config, prepare, a run stage,
	// cleanup) as it ended.
	KindStage = "stage"
	// KindReaped is a machine its reaper removed after the job's cleanup.
	KindReaped = "reaped"
	// KindSweep is one sweep that removed something (or nothing).
	KindSweep = "sweep"
	// KindRetired is a standby machine the pool service removed.
	KindRetired = "retired"
	// KindReconnect is a reconnection of the service to libvirt.
	KindReconnect = "reconnect"
	// KindInstance is one operation of a front end that manages its
	// instances itself (garm's provider): Stage is the operation (create,
	// delete), with Result and Reason as for a stage.
	KindInstance = "instance"
)

// Operations of a KindInstance record (its Stage).
const (
	OpCreate = "create"
	OpDelete = "delete"
)

// InstanceOps lists the operations of KindInstance records.
var InstanceOps = []string{OpCreate, OpDelete}

// Result classes of a stage.
const (
	ResultSuccess = "success"
	ResultBuild   = "build_failure"
	ResultSystem  = "system_failure"
)

// Prepare paths.
const (
	PathWarm = "warm"
	PathCold = "cold"
	// PathSnapshot: a job's machine restored from its image's memory
	// snapshot (issue #48).
	PathSnapshot = "snapshot"
)

// EventVersion is the record format; records of another version are
// counted as invalid, not guessed at.
const EventVersion = 1

// CacheUse is one copy of a project's host cache (Report.Cache).
type CacheUse struct {
	Op           string `json:"op"`
	Result       string `json:"result"`
	Bytes        int64  `json:"bytes,omitempty"`
	EvictedBytes int64  `json:"evicted_bytes,omitempty"`
}

// ServicesUse is what a prepare did to start a job's services and
// container (Report.Services): how many service containers it started, in
// how long, whether a container job's container was among what it
// started, and the result (ok or error).
type ServicesUse struct {
	Started   int     `json:"started"`
	Seconds   float64 `json:"s"`
	Container bool    `json:"container,omitempty"`
	Result    string  `json:"result"`
}

// Event is one record of the spool. Every string in it is bounded (Bound)
// and chosen by the program, except Job and Image, which are validated
// names, and nothing in it is a secret: it says what happened, never with
// which token or key.
type Event struct {
	V    int       `json:"v"`
	Time time.Time `json:"time"`
	Kind string    `json:"kind"`

	// Stage is the stage's name (KindStage).
	Stage string `json:"stage,omitempty"`
	// Job is the job's machine name: the key that ties a job's stages
	// together (config first, cleanup last).
	Job string `json:"job,omitempty"`
	// Image is the image the job's machine is of, when known.
	Image string `json:"image,omitempty"`
	// Result and Reason: how the stage ended (Result*; the reason a bounded
	// word, failure.Classify).
	Result string `json:"result,omitempty"`
	Reason string `json:"reason,omitempty"`
	// Seconds is the stage's (KindStage) wall time, or the time from the
	// cleanup's start until the machine was gone (KindReaped).
	Seconds float64 `json:"s,omitempty"`
	// Path is warm or cold for a successful prepare.
	Path string `json:"path,omitempty"`
	// Pool is hit or miss for a prepare of an image with a standby pool,
	// PoolReason why a miss missed.
	Pool       string `json:"pool,omitempty"`
	PoolReason string `json:"pool_reason,omitempty"`
	// OverheadSeconds is a run stage's wall time minus the script's own
	// time in the guest; Overhead says it was measured.
	Overhead        bool    `json:"overhead,omitempty"`
	OverheadSeconds float64 `json:"overhead_s,omitempty"`
	// DeadAfterSeconds is, for a stage that found its guest dead, how long
	// the guest had been silent when that was noticed.
	DeadAfterSeconds float64 `json:"dead_after_s,omitempty"`
	// Reconnects is how many times the executable reconnected to libvirt.
	Reconnects int `json:"reconnects,omitempty"`
	// Cache is what a run stage did with the host cache, if anything.
	Cache *CacheUse `json:"cache,omitempty"`
	// Services is what a prepare did with the job's services, if anything.
	Services *ServicesUse `json:"services,omitempty"`

	// Trigger (KindSweep) is what ran the sweep: gc or cleanup; Removed
	// counts what it removed by verdict.
	Trigger string         `json:"trigger,omitempty"`
	Removed map[string]int `json:"removed,omitempty"`
}

// maxField bounds every string of a record.
const maxField = 128

// Bound cuts s to at most 128 bytes on a UTF-8 boundary.
func Bound(s string) string {
	if len(s) <= maxField {
		return s
	}
	s = s[:maxField]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// bounded returns e with every string field bounded.
func (e Event) bounded() Event {
	for _, p := range []*string{&e.Kind, &e.Stage, &e.Job, &e.Image, &e.Result, &e.Reason, &e.Path, &e.Pool, &e.PoolReason, &e.Trigger} {
		*p = Bound(*p)
	}
	if len(e.Removed) > 16 {
		e.Removed = nil
	}
	r := make(map[string]int, len(e.Removed))
	for k, v := range e.Removed {
		r[Bound(k)] = v
	}
	if len(r) > 0 {
		e.Removed = r
	} else {
		e.Removed = nil
	}
	return e
}
