package lifecycle

import (
	"context"
	"log/slog"
	"path/filepath"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// EventsDir is the event spool's directory in the state directory
// (internal/obs.Spool): the stages' records for the service's metrics.
const EventsDir = "events"

// Sweep triggers (obs.Event.Trigger).
const (
	SweepByGC      = "gc"
	SweepByCleanup = "cleanup"
	// SweepByRoom is the sweep of a prepare that found the host full.
	SweepByRoom = "room"
)

// SweepTriggers lists the sweep triggers.
var SweepTriggers = []string{SweepByGC, SweepByCleanup, SweepByRoom}

// Events is the installation's event spool.
func (m *Manager) Events() obs.Spool { return EventSpool(m.Cfg) }

// EventSpool is the event spool of the installation cfg describes.
func EventSpool(cfg *config.Config) obs.Spool {
	return obs.Spool{Dir: filepath.Join(cfg.StateDir, EventsDir), MaxBytes: int64(cfg.Serve.EventSpoolMiB) << 20}
}

// RecordReport ends a stage's (or a front end's operation's) report and
// records it: the event for the service's metrics (the spool in the state
// directory) and the step records for the host's structured log
// (log.steps). Neither can fail what it reports on; a failure is logged at
// debug level (a stage's stderr is the job log).
func RecordReport(cfg *config.Config, log *slog.Logger, r *obs.Report, o obs.Outcome) {
	ev, steps := r.Finish(o)
	if aerr := EventSpool(cfg).Append(ev); aerr != nil {
		log.Debug("event record not written", "err", aerr)
	}
	path := ""
	if cfg.Log.Steps == "file" {
		path = cfg.Log.StepsFile
	}
	sl, oerr := obs.OpenStepLog(cfg.Log.Steps, path, int64(cfg.Log.StepsFileMiB)<<20)
	if oerr != nil {
		log.Debug("step log not opened", "err", oerr)
		return
	}
	defer func() { _ = sl.Close() }()
	for _, s := range steps {
		if lerr := sl.Log(s); lerr != nil {
			log.Debug("step record not written", "err", lerr)
			return
		}
	}
}

// Record appends e to the event spool; a failure is only logged (log may
// be nil): an event never fails what it reports on.
func (m *Manager) Record(log *slog.Logger, e obs.Event) {
	if err := m.Events().Append(e); err != nil && log != nil {
		log.Warn("event record not written", "kind", e.Kind, "err", err)
	}
}

// RecordSweep records a sweep (not a dry run) and what it removed, by
// verdict.
func (m *Manager) RecordSweep(log *slog.Logger, trigger string, rep *SweepReport) {
	if rep == nil {
		return
	}
	removed := map[string]int{}
	gone := map[string]bool{}
	for _, n := range rep.Removed {
		gone[n] = true
	}
	for _, it := range rep.Items {
		if gone[it.Name] {
			removed[it.Verdict]++
		}
	}
	m.Record(log, obs.Event{Kind: obs.KindSweep, Trigger: trigger, Removed: removed})
}

// Reconnects is how often the Manager's libvirt connection was made again.
func (m *Manager) Reconnects() int {
	if r, ok := m.hv.(*vm.Reconnecting); ok {
		return r.Reconnects()
	}
	return 0
}

// CountMachines counts this installation's domains by owner kind and state
// (running, paused, shutoff, other), for the metrics. kind names the kind
// of a domain's owner front end (vm.Owner.Frontend; "" for a domain
// without a readable ownership record): the callers know the front ends,
// this package does not.
func (m *Manager) CountMachines(ctx context.Context, kind func(frontend string) string) (map[[2]string]int, error) {
	items, err := m.Inventory(ctx, time.Now())
	if err != nil {
		return nil, err
	}
	out := map[[2]string]int{}
	for _, it := range items {
		if !it.Domain {
			continue
		}
		frontend := ""
		if it.Owner != nil {
			frontend = it.Owner.Frontend
		}
		owner := kind(frontend)
		st := "shutoff"
		if it.Active {
			st = "running"
			if ds, err := m.hv.State(ctx, it.Name); err == nil && !ds.Running {
				st = "other"
				if ds.Code == vm.StatePaused {
					st = "paused"
				}
			}
		}
		out[[2]string{owner, st}]++
	}
	return out, nil
}
