package jobvm

import (
	"context"
	"errors"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// JobMachine is the machine that serves a job, found through the job ->
// machine mapping.
type JobMachine struct {
	Name string
	Warm bool
	// Container is the container the job's scripts run in, as its
	// mapping names it ("" for none, or a job mapped by an earlier
	// version: Job.Container looks at the machine's record then).
	Container string
}

// MachineOf finds the machine of the job known by name job: a standby
// machine the job claimed (through the mapping, checked against the
// machine's own claim, which must name this job), else the machine named
// job (a cold start). A claim without a mapping (a prepare killed between
// the two) is found by looking at the standby machines' claims.
func (h *Host) MachineOf(job string) (JobMachine, error) {
	jm, err := h.m.Store.MachineOfJob(job)
	if err != nil {
		// Unreadable (cut short by a host crash): as if there were none;
		// the claims still name the job's standby machine.
		jm = nil
	}
	if jm != nil && jm.Machine != job {
		if cl, err := h.m.Store.ClaimOf(jm.Machine); err == nil && cl != nil && cl.Job == job && h.m.Machine(jm.Machine).IsStandby() {
			return JobMachine{Name: jm.Machine, Warm: true, Container: jm.Container}, nil
		}
	}
	if jm == nil {
		all, err := h.Standbys()
		if err != nil {
			return JobMachine{}, err
		}
		for _, s := range all {
			if s.Claim != nil && s.Claim.Job == job {
				return JobMachine{Name: s.Name, Warm: true}, nil
			}
		}
	}
	if jm != nil && jm.Machine == job {
		return JobMachine{Name: job, Container: jm.Container}, nil
	}
	return JobMachine{Name: job}, nil
}

// removeClaimed removes the standby machine that an earlier attempt of
// the job claimed (the runner retries a failed prepare), jm as MachineOf
// found it, with its mapping, and returns its name; "" if jm is no claimed
// standby machine. Without this a retried prepare would map the job to a
// new machine and leave the first running until its deadline.
func (h *Host) removeClaimed(ctx context.Context, job string, jm JobMachine) (string, error) {
	if !jm.Warm {
		return "", nil
	}
	if err := h.m.Machine(jm.Name).Teardown(ctx); err != nil {
		return jm.Name, err
	}
	return jm.Name, h.m.Store.UnmapJob(job)
}

// teardownJob removes the job's machine (MachineOf) and its mapping.
func (h *Host) teardownJob(ctx context.Context, job string) (JobMachine, error) {
	jm, err := h.MachineOf(job)
	if err != nil {
		return jm, err
	}
	if err := h.m.Machine(jm.Name).Teardown(ctx); err != nil {
		return jm, err
	}
	if jm.Name != job {
		// A cold attempt of the same job (a retried prepare) may have left
		// its own machine too.
		if err := h.m.Machine(job).Teardown(ctx); err != nil {
			return jm, err
		}
	}
	return jm, h.m.Store.UnmapJob(job)
}

// sweepJobMappings removes the job -> machine mappings whose machine has no
// state directory any more (its job's cleanup did not run to the end): a
// lifecycle.Hooks.Sweepers entry.
func sweepJobMappings(_ context.Context, m *lifecycle.Manager, _ *lifecycle.SweepReport, dryRun bool) error {
	if dryRun {
		return nil
	}
	jobs, err := m.Store.MappedJobs()
	if err != nil {
		return err
	}
	var errs []error
	for _, j := range jobs {
		jm, err := m.Store.MachineOfJob(j)
		if err != nil {
			// Unreadable: MachineOf ignores it anyway.
			errs = append(errs, m.Store.UnmapJob(j))
			continue
		}
		if jm == nil {
			continue
		}
		if has, err := m.Store.Has(jm.Machine); err == nil && !has {
			if has, err := m.Store.Has(j); err == nil && !has {
				errs = append(errs, m.Store.UnmapJob(j))
			}
		}
	}
	return errors.Join(append(errs, sweepJobNames(m))...)
}

// staleJobName is how old a job name record without a mapping and a
// machine must be before the sweep removes it: prepare writes it before it
// maps the job, so a young one may be a prepare in progress.
const staleJobName = time.Hour

// sweepJobNames removes the job name records (state.JobName) of jobs whose
// cleanup did not run to the end: no mapping, no machine, older than
// staleJobName.
func sweepJobNames(m *lifecycle.Manager) error {
	keys, err := m.Store.JobNameKeys()
	if err != nil {
		return err
	}
	var errs []error
	for _, k := range keys {
		jn, err := m.Store.JobNameOf(k)
		if state.IsBadRecord(err) {
			// Cut short by a crash: no stage can use it; gone once old.
			if age, ok := m.Store.Age(state.JobNamePath(k)); ok && age > staleJobName {
				errs = append(errs, m.Store.ForgetJobName(k))
			}
			continue
		}
		if err != nil || jn == nil {
			// Of a newer format, or not readable: left to the version
			// that wrote it (its cleanup removes it).
			continue
		}
		if time.Since(jn.At) < staleJobName {
			continue
		}
		mapped, err := m.Store.MachineOfJob(jn.Job)
		if err != nil || mapped != nil {
			continue
		}
		if has, err := m.Store.Has(jn.Job); err == nil && !has {
			errs = append(errs, m.Store.ForgetJobName(k))
		}
	}
	return errors.Join(errs...)
}
