package jobvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Jobs is a front end's way to the machines of its jobs: Job gives one
// job's handle. It holds no lifecycle.Manager a front end could reach
// through; what a front end does with a job's machine is a method of Job
// or of its Session.
type Jobs struct {
	h *Host
	// Explain, if set, says in one sentence what became of the named
	// machine whose guest stopped answering, or "" (the run stage, built
	// without libvirt, asks the admin tool); nil means the Manager's
	// answer here (lifecycle.Manager.Explain).
	Explain func(ctx context.Context, name string) string
}

// OpenJobs opens the installation cfg describes with the hooks of job
// machines (Open) and gives its front-end view.
func OpenJobs(cfg *config.Config, o lifecycle.Options) (*Jobs, error) {
	h, err := Open(cfg, o)
	if err != nil {
		return nil, err
	}
	return h.Jobs(), nil
}

// Jobs is the front-end view of h.
func (h *Host) Jobs() *Jobs { return &Jobs{h: h} }

// Close closes the libvirt connection, if it was made.
func (js *Jobs) Close() error { return js.h.Close() }

// Dial makes the libvirt connection now (else made on first use).
func (js *Jobs) Dial(ctx context.Context) error { return js.h.Dial(ctx) }

// Reconnects is how often the libvirt connection was made again.
func (js *Jobs) Reconnects() int { return js.h.Reconnects() }

// ToolsNow is the guest tools disk a machine booted now gets (Host.ToolsNow).
func (js *Jobs) ToolsNow() (t *state.Tools, exact bool) { return js.h.ToolsNow() }

// Memory is where a front end remembers what it found out about an image
// (its tool check), keyed by a name of its own (state.Store.Remember).
func (js *Jobs) Memory() Memory { return js.h.m.Store }

// Memory remembers small JSON values by name (state.Store's cache).
type Memory interface {
	Remember(name string, v any) error
	Recall(name string, v any) bool
}

// JobRef names a job of a front end: the front end (the ownership
// record's), the CI instance its machine names carry
// (lifecycle.InstanceTag) and the job's id there.
type JobRef struct {
	Frontend string
	Instance string
	ID       int64
}

// Job is the handle of one job's machine. It resolves the job's name
// record, its mapping and its standby claim once, and is their only
// writer: Acquire names and maps the job, Release and Keep end what
// Acquire began. Session is the one way into the job's guest.
type Job struct {
	js *Jobs
	// name is the name the job knows its machine by (the name record's,
	// else the one this version gives); key is the name record's key.
	name, key string
	log       *slog.Logger

	// named: Acquire brought the job's image and recorded its name.
	named bool

	mu      sync.Mutex
	jm      *JobMachine
	jmErr   error
	rec     *state.Machine
	recErr  error
	recRead bool
}

// Job resolves the job's name: a job prepared by another version keeps
// the name that version gave it (an upgrade between its stages; the name
// record, state.JobName), else the name this version gives
// (lifecycle.MachineName). A name record that does not decode (cut short
// by a host crash) is ignored; one that cannot be read fails (guessing a
// name could leave the job's machine behind). log, if set, is told which
// name was taken and why.
func (js *Jobs) Job(r JobRef, log *slog.Logger) (*Job, error) {
	if log == nil {
		log = slog.Default()
	}
	m := js.h.m
	name := lifecycle.MachineName(m.Cfg.NamePrefix, m.Controller, r.Instance, r.ID)
	key := lifecycle.JobKey(r.Frontend, r.Instance, r.ID)
	rec, err := m.Store.JobNameOf(key)
	if state.IsBadRecord(err) {
		log.Warn("the job's name record does not decode; using the name this version gives the job", "err", err)
		rec, err = nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("job name record: %w", err)
	}
	if rec != nil && rec.Job != name {
		if err := m.Machine(rec.Job).CheckOurName(); err != nil {
			return nil, fmt.Errorf("job name record %s: %w", key, err)
		}
		log.Info("job prepared by another version: using the name it gave the job", "name", rec.Job, "version", rec.Version, "name_now", name)
		name = rec.Job
	}
	return &Job{js: js, name: name, key: key, log: log}, nil
}

// Name is the name the job knows its machine by: the machine's name for a
// cold start, the mapping's key for a claimed standby machine.
func (j *Job) Name() string { return j.name }

// SetLog replaces the job's logger (one with the job's attributes).
func (j *Job) SetLog(log *slog.Logger) { j.log = log }

// Machine is the machine that serves the job (Host.MachineOf), resolved
// on first use and remembered.
func (j *Job) Machine() (JobMachine, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.jm == nil && j.jmErr == nil {
		jm, err := j.js.h.MachineOf(j.name)
		j.jm, j.jmErr = &jm, err
	}
	if j.jmErr != nil {
		return JobMachine{}, j.jmErr
	}
	return *j.jm, nil
}

// Record is the job machine's record (state.Store.Record), read on first
// use and remembered.
func (j *Job) Record() (*state.Machine, error) {
	jm, err := j.Machine()
	if err != nil {
		return nil, err
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if !j.recRead {
		j.rec, j.recErr = j.js.h.m.Store.Record(jm.Name)
		j.recRead = true
	}
	return j.rec, j.recErr
}

// Container is the container the job's scripts run in ("" for none):
// what its mapping names (JobRequest.Container), else, for a job an
// earlier version prepared, what the machine's record names.
func (j *Job) Container() (string, error) {
	jm, err := j.Machine()
	if err != nil || jm.Container != "" {
		return jm.Container, err
	}
	rec, err := j.Record()
	if err != nil {
		return "", err
	}
	return rec.Container, nil
}

// MachineDir is the state directory of the job's machine (its keys are
// there: a kept VM's ssh command names it).
func (j *Job) MachineDir() (string, error) {
	jm, err := j.Machine()
	if err != nil {
		return "", err
	}
	return j.js.h.m.Store.MachineDir(jm.Name), nil
}

// Explain says in one sentence what became of the job's machine whose
// guest stopped answering, or "" (Jobs.Explain, else libvirt's answer).
func (j *Job) Explain(ctx context.Context) string {
	name := j.name
	if jm, err := j.Machine(); err == nil {
		name = jm.Name
	}
	if j.js.Explain != nil {
		return j.js.Explain(ctx, name)
	}
	return j.js.h.m.Machine(name).Explain(ctx)
}

// AcquireRequest is what a front end says of the machine its job needs
// (JobRequest without the job's name, which the handle knows).
type AcquireRequest = JobRequest

// Acquire gives the job its machine (Host.Acquire). First, what is the
// job's own, once per handle (a front end that asks again, for a cold
// machine after a refused warm one, does not do it twice): it makes sure
// the job's image is on this host (ensureImage, with the request's Pull
// and Refresh; nothing of the job is made when that fails), and it records
// the job's name for the later stages of any version (an upgrade in the
// middle of the job finds the machine by it: an error there is
// ErrNameRecord). Then it removes the standby machine an earlier attempt
// of the job claimed (the runner retries a failed prepare), found as the
// handle resolved the job.
func (j *Job) Acquire(ctx context.Context, req AcquireRequest) (*Acquired, error) {
	h := j.js.h
	if !j.named {
		if err := ensureImage(ctx, h.m.Cfg, req.Image, req.Pull, req.Refresh, h.m.Sayf, j.log); err != nil {
			return nil, err
		}
		if err := h.m.Store.NameJob(j.key, state.JobName{Job: j.name, Version: buildinfo.Version, At: time.Now().UTC()}); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrNameRecord, err)
		}
		j.named = true
	}
	jm, err := j.Machine()
	if err != nil {
		return nil, fmt.Errorf("find what an earlier attempt of this job claimed: %w", err)
	}
	earlier, err := h.removeClaimed(ctx, j.name, jm)
	if err != nil {
		return nil, fmt.Errorf("remove the VM %s an earlier attempt of this job claimed: %w", earlier, err)
	}
	if earlier != "" {
		h.m.Sayf("Removed VM %s that an earlier attempt of this job claimed", earlier)
	}
	req.Name = j.name
	a, err := h.Acquire(ctx, req)
	j.mu.Lock()
	j.jm, j.jmErr, j.recRead = nil, nil, false // mapped anew
	j.mu.Unlock()
	if err == nil && req.Container != "" {
		// The job's mapping names its container; the machine's record
		// names it too, for a run stage of the previous version (a
		// rollback in the middle of the job), which reads only that. The
		// record is the one the acquisition holds: nothing is read again.
		m := *a.record()
		m.Container = req.Container
		if err = h.m.Store.Save(m); err != nil {
			err = fmt.Errorf("record the job's container: %w", err)
		}
	}
	return a, err
}

// ErrNameRecord is Acquire's failure to record the job's name.
var ErrNameRecord = errors.New("record the job's name")

// Release ends the job's machine (Host.Release) and, once it did, removes
// the job's name record (a failure there is only logged: the sweep removes
// it).
func (j *Job) Release(ctx context.Context, o Observer) (Released, error) {
	r, err := j.js.h.Release(ctx, j.name, o, j.log)
	if err != nil {
		return r, err
	}
	if ferr := j.js.h.m.Store.ForgetJobName(j.key); ferr != nil {
		j.log.Warn("could not remove the job's name record (the sweep will)", "err", ferr)
	}
	return r, nil
}

// KeptVMs lists the machines kept for debugging now (oldest first).
func (j *Job) KeptVMs() ([]state.Kept, error) { return j.js.h.m.Store.KeptMachines() }

// KeepDecision is a front end's answer whether to keep the job's machine
// for debugging: Release names the kept machines to remove first; Why
// says why not (or what goes for it).
type KeepDecision struct {
	Keep    bool
	Release []state.Kept
	Why     string
}

// Keep keeps the failed job's machine for debugging until until, for
// project, where decide (the front end's caps, given the machines kept
// now and the job machine's name) says so. It decides under the host's
// keep lock, so two jobs at once cannot both take the last place; the
// kept machines decide names go first. It reports whether the machine was
// kept; otherwise the caller releases it.
func (j *Job) Keep(ctx context.Context, project string, until time.Time, decide func(kept []state.Kept, self string) KeepDecision) bool {
	m := j.js.h.m
	unlock, err := m.Store.LockKept(ctx)
	if err != nil {
		j.log.Error("could not keep the VM; removing it", "err", err)
		return false
	}
	defer unlock()
	jm, err := j.Machine()
	if err != nil {
		if !errors.Is(err, vm.ErrNotFound) {
			j.log.Error("could not keep the VM; removing it", "err", err)
		}
		return false
	}
	kept, err := m.Store.KeptMachines()
	if err != nil {
		j.log.Error("could not keep the VM (the kept VMs cannot be counted); removing it", "err", err)
		return false
	}
	plan := decide(kept, jm.Name)
	if !plan.Keep {
		j.log.Warn("not keeping the failed job's VM; removing it", "vm", jm.Name, "why", plan.Why)
		return false
	}
	for _, k := range plan.Release {
		if err := m.Machine(k.Name).Teardown(ctx); err != nil {
			j.log.Error("could not remove the project's oldest kept VM; not keeping this one", "vm", jm.Name, "oldest", k.Name, "err", err)
			return false
		}
		j.log.Info("removed a kept VM: its project keeps a newer one (debug.keep_max_per_project)", "vm", k.Name, "kept_since", k.At.UTC().Format(time.RFC3339), "for", jm.Name)
	}
	// The mark first: a kept VM the cap cannot count must not exist.
	if err := m.Store.MarkKept(jm.Name, state.Kept{Project: project, At: time.Now(), Until: until}); err != nil {
		j.log.Error("could not keep the VM; removing it", "err", err)
		return false
	}
	if err := m.Machine(jm.Name).Keep(ctx, until); err != nil {
		if !errors.Is(err, vm.ErrNotFound) {
			j.log.Error("could not keep the VM; removing it", "err", err)
		}
		return false
	}
	j.log.Warn("kept the failed job's VM for debugging", "vm", jm.Name, "until", until.UTC().Format(time.RFC3339))
	return true
}

// AttachCache is Host.AttachCache: the host cache's restore disk for the
// job machine name (the run stage's own process, when it links libvirt).
func (js *Jobs) AttachCache(ctx context.Context, store *hostcache.Store, name, project string, want []string) (hostcache.RestoreResult, error) {
	return js.h.AttachCache(ctx, store, name, project, want)
}

// AttachScratch is Host.AttachScratch.
func (js *Jobs) AttachScratch(ctx context.Context, name string, capacity int64) error {
	return js.h.AttachScratch(ctx, name, capacity)
}

// KeepCache is Host.KeepCache.
func (js *Jobs) KeepCache(ctx context.Context, store *hostcache.Store, name, project string, keep []string) Kept {
	return js.h.KeepCache(ctx, store, name, project, keep)
}

// DropDisks is Host.DropDisks.
func (js *Jobs) DropDisks(ctx context.Context, name string) error { return js.h.DropDisks(ctx, name) }

// Controller is this installation's controller id (the ownership records').
func (js *Jobs) Controller() string { return js.h.m.Controller }

// connect opens an SSH connection to the guest of the job machine name
// (lifecycle.Machine.Connect: the pinned host key, the job's client key):
// the one place a job's guest connections are made, for a Session, the
// connection holder (Hold) and the check of a claimed standby machine
// (Acquire).
func (h *Host) connect(ctx context.Context, name string) (*state.Machine, *sshexec.Client, error) {
	return h.m.Machine(name).Connect(ctx)
}
