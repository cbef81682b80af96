package ghshare

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
)

// WorkerComm is the name of the runner's worker process (Runner.Worker),
// which runs a job's steps and calls the hook for each command.
const WorkerComm = "Runner.Worker"

// FindWorker finds the runner's worker among pid and its ancestors (the
// hook's parent may be the worker or a process under it, such as the
// runner's node): its pid and start time, or 0, 0 when there is none
// (the hook run by hand, or by a test). Four levels up at most.
func FindWorker(pid int) (int, uint64) {
	for i := 0; i < 5 && pid > 1; i++ {
		comm, ppid, start, err := procInfo(pid)
		if err != nil {
			return 0, 0
		}
		if comm == WorkerComm {
			return pid, start
		}
		pid = ppid
	}
	return 0, 0
}

// procInfo reads a process's command name, parent and start time.
func procInfo(pid int) (comm string, ppid int, start uint64, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", 0, 0, err
	}
	s := string(b)
	i, j := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if i < 0 || j < i {
		return "", 0, 0, fmt.Errorf("/proc/%d/stat: no command field", pid)
	}
	f := strings.Fields(s[j+1:])
	if len(f) < 20 {
		return "", 0, 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	ppid, _ = strconv.Atoi(f[1])
	start, err = strconv.ParseUint(f[19], 10, 64)
	return s[i+1 : j], ppid, start, err
}

// orphanAge is how old a record whose machine is gone must be before the
// sweep ends its virtiofsd: prepare_job records the share before the
// machine exists.
const orphanAge = time.Hour

// Machines is what the sweep needs of the engine: whether a machine has a
// state directory, and its removal.
type Machines interface {
	Has(name string) (bool, error)
	Teardown(ctx context.Context, name string) error
	// Serving is the machine the job's mapping names ("" for none): a
	// claimed standby machine, before the record's VM was written (a
	// prepare_job killed between the claim and that).
	Serving(job string) (string, error)
}

// SweepRecords removes the hook jobs whose runner is gone: a job whose
// recorded worker (pid and start time) no longer runs never gets its
// cleanup_job, so its machine is removed and its virtiofsd stopped; a
// record whose machine is gone (removed at its deadline) and older than
// orphanAge has its virtiofsd stopped. It returns the machines it removed
// (with dryRun: would remove).
func SweepRecords(ctx context.Context, stateDir string, ms Machines, now time.Time, dryRun bool) ([]string, error) {
	paths, err := filepath.Glob(filepath.Join(stateDir, shareDir, "*.json"))
	if err != nil {
		return nil, err
	}
	var removed []string
	var errs []error
	for _, p := range paths {
		name := strings.TrimSuffix(filepath.Base(p), ".json")
		s, err := Load(stateDir, name)
		if err != nil || s == nil {
			if err != nil {
				errs = append(errs, err)
			}
			continue
		}
		if s.VM == "" {
			if m, err := ms.Serving(s.Machine); err == nil && m != "" {
				s.VM = m
			}
		}
		has, err := ms.Has(s.vm())
		if err != nil {
			errs = append(errs, err)
			continue
		}
		runnerGone := s.RunnerPID > 0 && !alive(s.RunnerPID, s.RunnerStart)
		switch {
		case runnerGone:
			removed = append(removed, s.vm())
			if dryRun {
				continue
			}
			if has {
				if err := ms.Teardown(ctx, s.vm()); err != nil {
					errs = append(errs, fmt.Errorf("remove %s (its runner is gone): %w", s.vm(), err))
					continue
				}
			}
			errs = append(errs, Stop(stateDir, s))
		case !has && now.Sub(s.At) > orphanAge:
			if !dryRun {
				errs = append(errs, Stop(stateDir, s))
			}
		}
	}
	return removed, errors.Join(errs...)
}

// Sweep is SweepRecords as a lifecycle sweeper (lifecycle.Hooks.Sweepers):
// every sweep (gc, the reaper's, the pool service's) also removes the
// machines of hook jobs whose runner is gone.
func Sweep(ctx context.Context, m *lifecycle.Manager, rep *lifecycle.SweepReport, dryRun bool) error {
	removed, err := SweepRecords(ctx, m.Cfg.StateDir, managerMachines{m}, time.Now(), dryRun)
	if !dryRun {
		// A dry run's report lists no removals (as lifecycle's own).
		rep.Removed = append(rep.Removed, removed...)
	}
	return err
}

type managerMachines struct{ m *lifecycle.Manager }

func (mm managerMachines) Has(name string) (bool, error) { return mm.m.Store.Has(name) }
func (mm managerMachines) Serving(job string) (string, error) {
	jm, err := mm.m.Store.MachineOfJob(job)
	if err != nil || jm == nil {
		return "", err
	}
	return jm.Machine, nil
}
func (mm managerMachines) Teardown(ctx context.Context, name string) error {
	return mm.m.Machine(name).Teardown(ctx)
}
