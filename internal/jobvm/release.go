package jobvm

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// Released is what Release did with the job's machine.
type Released struct {
	// Machine is the job's machine (MachineOf).
	Machine JobMachine
	// Reaper says a detached reaper removes the machine (StartReaper);
	// otherwise it was removed here.
	Reaper bool
}

// Release ends the job's machine: it stops it at once (EndJob: nothing of
// the job runs in it or connects to it any more) and leaves the slow rest
// (QEMU's exit, undefine, volumes) to a detached reaper, so the job ends
// now. A machine marked ended goes to the reaper also when ending the job
// failed after that (its pause, or another machine of the job): it
// destroys what still runs. Without a reaper the machine is removed here
// and an opportunistic sweep follows. ctx should outlive the job's cancel
// (the caller detaches it): a release is never cut short by the signal that
// ended the job.
func (h *Host) Release(ctx context.Context, job string, o Observer, log *slog.Logger) (Released, error) {
	if log == nil {
		log = slog.Default()
	}
	o = o.filled()
	t0 := time.Now()
	jm, ended, err := h.EndJob(ctx, job)
	o.Step("stop", time.Since(t0), err)
	if jm.Name != "" {
		if mach, rerr := h.m.Store.Record(jm.Name); rerr == nil {
			o.Machine(jm.Name, mach.Image)
		}
	}
	r := Released{Machine: jm, Reaper: len(ended) > 0}
	if r.Reaper {
		t1 := time.Now()
		serr := h.StartReaper(ended)
		o.Step("start reaper", time.Since(t1), serr)
		if serr != nil {
			log.Warn("no reaper; removing the VM here", "err", serr)
			r.Reaper = false
			err = errors.Join(err, h.Reap(ctx, ended))
		}
	}
	if err == nil && !r.Reaper {
		h.OpportunisticSweep(ctx, log)
	}
	return r, err
}
