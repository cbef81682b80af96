package jobvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detach"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// ReaperCommand is the first argument that makes the cleanup executable a
// reaper (StartReaper).
const ReaperCommand = "reap-machines"

// ReaperExecutable is the executable that serves as reaper: the cleanup
// stage's, found next to the running executable.
const ReaperExecutable = "libvirt-executor-cleanup"

// reaperLog is the reapers' log in the state directory (owner-only, cut
// back to its last part when it grows past reaperLogMax).
const (
	reaperLog    = "reaper.log"
	reaperLogMax = 1 << 20
)

// EndJob ends the job's machine (MachineOf; and the job's own name if a
// retried prepare left a machine under it too) as fast as that can be
// proven: under the machine's lock it stops its connection holder, marks
// the machine ended and deletes its client key (nothing of the job
// connects to it any more), and pauses the guest (Engine.Halt: it runs
// nothing from then on). What takes long, QEMU's exit, the undefine and the
// volumes, is left to Reap. It returns the names it marked ended, also
// with an error (the caller starts their reaper all the same: a machine that
// could not be paused is destroyed there), and removes the job's mapping. A
// machine without a state directory has nothing that proves its volumes
// ours to a later process: it is removed here, the slow way.
func (h *Host) EndJob(ctx context.Context, job string) (JobMachine, []string, error) {
	jm, err := h.MachineOf(job)
	if err != nil {
		return jm, nil, err
	}
	names := []string{jm.Name}
	if jm.Name != job {
		// A cold attempt of the same job (a retried prepare) may have left
		// its own machine too.
		names = append(names, job)
	}
	var ended []string
	var errs []error
	for _, name := range names {
		marked, err := h.end(ctx, name)
		if marked {
			ended = append(ended, name)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return jm, ended, errors.Join(errs...)
	}
	return jm, ended, h.m.Store.UnmapJob(job)
}

// end is EndJob for one machine: true once it is marked ended (it awaits
// Reap, also when an error follows), false if there was nothing to end or
// it was removed at once.
func (h *Host) end(ctx context.Context, name string) (bool, error) {
	if err := h.m.Machine(name).CheckOurName(); err != nil {
		return false, err
	}
	unlock, err := h.m.Store.Lock(ctx, name)
	if err != nil {
		return false, err
	}
	defer unlock()
	has, err := h.m.Store.Has(name)
	if err != nil {
		return false, fmt.Errorf("state of %s: %w", name, err)
	}
	if !has {
		if err := h.m.Machine(name).TeardownLocked(ctx); err != nil {
			return false, err
		}
		h.m.Store.RemoveLock(name)
		return false, nil
	}
	stopHolder(h.m, name)
	// The mark first: if this process dies now, a sweep removes the
	// machine at once instead of at its deadline.
	if err := h.m.Store.MarkEnded(name, state.Ended{At: time.Now().UTC(), Reason: "job ended"}); err != nil {
		return false, fmt.Errorf("mark %s ended: %w", name, err)
	}
	if err := h.m.Engine().Halt(ctx, name); err != nil {
		return true, fmt.Errorf("stop %s: %w", name, err)
	}
	return true, nil
}

// Reap removes machines that EndJob ended: under each one's lock, and only
// if it carries the ended mark (the proof that its job is over), the
// domain, its volumes and its state (Teardown). A machine already gone is
// success.
func (h *Host) Reap(ctx context.Context, names []string) error {
	var errs []error
	for _, name := range names {
		if err := h.reapOne(ctx, name); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

func (h *Host) reapOne(ctx context.Context, name string) error {
	var ended *state.Ended
	err := h.m.Machine(name).TeardownIf(ctx, func() (bool, error) {
		has, err := h.m.Store.Has(name)
		if err != nil || !has {
			return false, err // removed already (by a sweep)
		}
		e, err := h.m.Store.EndedOf(name)
		if err == nil && e == nil {
			err = lifecycle.NotOurs(fmt.Sprintf("refusing to reap %s: it is not marked ended", name))
		}
		ended = e
		return err == nil, err
	})
	if err == nil && ended != nil {
		// A scratch disk's reservation whose save was killed goes with
		// the machine, not hours later (hostcache.Reserve).
		if store := h.cacheStore(); store != nil {
			if uerr := store.Unreserve(name); uerr != nil {
				slog.Default().Warn("host cache: the scratch disk's reservation stays", "machine", name, "err", uerr)
			}
		}
		h.m.Record(nil, obs.Event{Kind: obs.KindReaped, Job: name, Seconds: time.Since(ended.At).Seconds()})
	}
	return err
}

// StartReaper starts, detached (a session of its own, not waited for), a
// process that reaps names (Reap) and then runs the opportunistic sweep:
// ReaperExecutable ReaperCommand --config PATH --config-stdin -- NAME... Its log goes to
// reaper.log in the state directory; it gets the stage's configuration on
// stdin (package detach). If the reaper dies, the ended marks make the next
// sweep remove the machines.
func (h *Host) StartReaper(names []string) error {
	exe := h.ReaperExe
	if exe == "" {
		var err error
		if exe, err = siblingExe(ReaperExecutable); err != nil {
			return err
		}
	}
	logPath := filepath.Join(h.m.Store.Dir, reaperLog)
	if st, err := os.Stat(logPath); err == nil && st.Size() > reaperLogMax {
		_ = os.Rename(logPath, logPath+".1")
	}
	args := append([]string{ReaperCommand, "--config", h.m.Cfg.Path, "--config-stdin", "--"}, names...)
	_, err := detach.Start(detach.Spec{Exe: exe, Args: args, Stdin: h.m.Cfg.Text, Log: logPath})
	return err
}

// sweepEvery limits the opportunistic sweeps that run after a job's
// machine is removed (the job is over: nobody waits for them).
const sweepEvery = 5 * time.Minute

// OpportunisticSweep sweeps (Sweep) if no sweep ran for sweepEvery, and
// logs what it removed.
func (h *Host) OpportunisticSweep(ctx context.Context, log *slog.Logger) {
	if !h.m.Store.Due("last-sweep", sweepEvery) {
		return
	}
	rep, err := h.m.Sweep(ctx, time.Now(), false)
	h.m.RecordSweep(log, lifecycle.SweepByCleanup, rep)
	if rep != nil && len(rep.Removed) > 0 {
		log.Warn("sweep removed leftovers", "machines", strings.Join(rep.Removed, ","))
	}
	if err != nil {
		log.Warn("sweep incomplete", "err", err)
	}
}
