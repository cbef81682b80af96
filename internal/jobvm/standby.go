package jobvm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Owner kinds (vm.Owner.Frontend) of the machines of a standby pool.
const (
	// FrontendStandby marks a machine booted ahead of any job. When a job
	// claims it, its record gets the job's front end and job.
	FrontendStandby = "standby"
)

// RetireReasons are the bounded reasons of a standby retirement
// (obs.Event.Reason of obs.KindRetired).
var RetireReasons = []string{"dead", "paused", "aged", "drained", "excess", "failed_boot", "room", "other"}

// serveLock is held by the running pool service (libvirt-executor serve);
// no machine name starts with '_'.
const serveLock = "_serve"

// LockService takes the pool service's lock: one service per installation.
// It fails with state.ErrBusy while another holds it (tried for up to a
// second, so that a prepare's look at the lock does not turn a start away).
func (h *Host) LockService(ctx context.Context) (unlock func(), err error) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	unlock, err = h.m.Store.Lock(ctx, serveLock)
	if err != nil && ctx.Err() != nil {
		return nil, fmt.Errorf("another libvirt-executor serve runs for state_dir %s: %w", h.m.Cfg.StateDir, state.ErrBusy)
	}
	return unlock, err
}

// heartbeatKey is the state file the pool service touches on every look at
// its pools.
const heartbeatKey = "serve-heartbeat"

// Heartbeat records that the pool service is looking at its pools now.
func (h *Host) Heartbeat() error { return h.m.Store.Touch(heartbeatKey) }

// heartbeatStale is how old the heartbeat may be for a service that holds
// its lock to count as running: it looks every serve.interval (at most
// 10 s).
func (h *Host) heartbeatStale() time.Duration {
	return max(10*h.m.Cfg.Serve.Interval.D(), 10*time.Second)
}

// ServiceStatus says whether the pool service holds its lock, and how long
// ago it last looked at its pools (ok false: never).
// It creates nothing (doctor may look as another user than the service's).
func (h *Host) ServiceStatus() (locked bool, lastLook time.Duration, ok bool) {
	locked, _ = h.m.Store.Held(serveLock)
	lastLook, ok = h.m.Store.Age(heartbeatKey)
	return locked, lastLook, ok
}

// ServiceRunning reports whether the pool service runs: it holds its lock
// and has looked at its pools lately (a hung or just killed service does
// not count).
func (h *Host) ServiceRunning() bool {
	locked, age, ok := h.ServiceStatus()
	return locked && ok && age < h.heartbeatStale()
}

// Standby is one standby machine as the state directory shows it.
type Standby = lifecycle.Standby

// Standbys lists this installation's standby machines from their state
// directories.
func (h *Host) Standbys() ([]Standby, error) {
	names, err := h.m.Store.Names()
	if err != nil {
		return nil, err
	}
	var out []Standby
	for _, n := range names {
		if !h.m.Machine(n).IsStandby() {
			continue
		}
		s := Standby{Name: n}
		if rec, err := h.m.Store.Record(n); err == nil {
			s.Record = rec
		}
		if s.Claim, err = h.m.Store.ClaimOf(n); err != nil {
			// Unreadable: claimed by nobody known. Never handed out, and
			// not retired either (Retire cannot read it); the sweep removes
			// it after its deadline.
			s.Claim = &state.Claim{Reason: "claim record unreadable: " + err.Error()}
		}
		out = append(out, s)
	}
	return out, nil
}

// BootStandby boots one machine of img at its default size for the image's
// standby pool and returns it ready (SSH verified with its pinned host key;
// the caller closes the client). It never waits for room: a full host
// fails it with ErrNoRoom. Its deadline is pool.max_age (+ job_slack)
// after its creation; a job that claims it sets its own. prep, if set,
// readies the machine over its first connection before any job can claim
// it (the pool's pre-pulls); its error fails the boot.
func (h *Host) BootStandby(ctx context.Context, img *config.Image, prep func(ctx context.Context, c *Client) error) (*lifecycle.Ready, error) {
	if img.Pool == nil {
		return nil, fmt.Errorf("image %s has no pool", img.Name)
	}
	base, err := state.VersionOf(img.Base)
	if err != nil {
		return nil, fmt.Errorf("base image of %s: %w", img.Name, err)
	}
	name, err := lifecycle.StandbyName(h.m.Cfg.NamePrefix, h.m.Controller)
	if err != nil {
		return nil, err
	}
	size := h.m.Cfg.ImageSize(img)
	booted := time.Now()
	req := lifecycle.Request{
		Name: name, Image: img, VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB, DiskGiB: size.DiskGiB,
		Frontend: FrontendStandby, Job: img.Name, Lifetime: img.Pool.MaxAge.D(), NoWait: true,
		Standby: &state.Standby{Image: img.Name, VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB, DiskGiB: size.DiskGiB, Base: base,
			Spec: lifecycle.SpecFingerprint(h.m.Cfg, img)},
	}
	if prep != nil {
		req.Check = func(ctx context.Context, c *sshexec.Client, _ *state.Tools) error { return prep(ctx, c) }
	}
	ready, err := h.m.Provision(ctx, req)
	if err != nil {
		// Nothing of the machine is left (Provision undid it); its lock file
		// would be, under a name never used again.
		if unlock, lerr := h.m.Store.TryLock(name); lerr == nil {
			if has, herr := h.m.Store.Has(name); herr == nil && !has {
				h.m.Store.RemoveLock(name)
			}
			unlock()
		}
		return ready, err
	}
	if h.m.Cfg.SSH.HolderEnabled() {
		h.standbyHolder(ctx, name, booted.Add(img.Pool.MaxAge.D()+h.m.Cfg.Timeouts.JobSlack.D()))
	}
	return ready, nil
}

// standbyHolder starts a standby machine's connection holder under the
// machine's lock (a claim passes a locked machine over, as one still
// booting; starting the holder takes milliseconds), unless a job claimed
// the machine in the moment after its boot: that job starts its own. The
// holder connects and starts the guest agent while the machine waits, so
// that the first stage of the job that claims it finds them ready
// (acquireWarm keeps the holder and gives it the job's deadline; a job
// that comes within the connection's first second waits for the rest of
// it, as every job did before). Until claimed, the holder ends with the
// machine or at until. Without one the claiming job starts its own:
// nothing fails for it.
func (h *Host) standbyHolder(ctx context.Context, name string, until time.Time) {
	unlock, err := h.m.Store.Lock(ctx, name)
	if err != nil {
		return
	}
	defer unlock()
	if cl, err := h.m.Store.ClaimOf(name); err != nil || cl != nil {
		return
	}
	if err := h.StartHolder(name, until); err != nil {
		h.m.Sayf("Note: no connection holder started with the standby VM %s (the job that claims it starts one): %v", name, err)
	}
}

// Claimed is a standby machine now serving a job.
type Claimed struct {
	Machine *state.Machine
	// Idle is how long it waited for a job since it became ready.
	Idle time.Duration
	// Took is the whole claim; Skipped names the machines passed over, and
	// why.
	Took    time.Duration
	Skipped []string
	// At is when the claim was complete.
	At time.Time
}

// ErrNoStandby means no idle standby machine could serve the request; its
// message says why (the job takes the cold path).
type ErrNoStandby struct {
	Why string
	// Code is Why as a bounded word (Miss*) for metrics.
	Code string
}

// Why a claim missed (ErrNoStandby.Code).
const (
	MissNoPool      = "no_pool"
	MissSize        = "size"
	MissServiceDown = "service_down"
	MissEmpty       = "empty"
	MissError       = "error"
)

func (e *ErrNoStandby) Error() string { return e.Why }

// probeWait bounds the liveness probe of a claimed machine.
const probeWait = 2 * time.Second

// Claim gives the job an idle standby machine of its image and size, if the
// pool service runs and one is alive: atomically (under the machine's lock,
// and by an exclusive claim file, so two jobs never get one machine), after
// checking that its base image file is unchanged, that libvirt runs it
// (not paused, not gone) and that its SSH server answers. A machine that
// fails a check is marked for retirement (the service removes it) and the
// next is tried. The job is recorded in the machine's claim, in the job ->
// machine mapping (MachineOf), and in the ownership record (live and
// persistent). If ctx ends or a step after the claim fails, the machine is
// removed, never returned to the pool. *ErrNoStandby says why there is
// none.
func (h *Host) Claim(ctx context.Context, req JobRequest) (*Claimed, error) {
	t0 := time.Now()
	p := req.Image.Pool
	if p == nil {
		return nil, &ErrNoStandby{Code: MissNoPool, Why: fmt.Sprintf("image %s has no standby pool", req.Image.Name)}
	}
	if want := h.m.Cfg.ImageSize(req.Image); req.Size != want {
		return nil, &ErrNoStandby{Code: MissSize, Why: fmt.Sprintf("the job asks for %d vCPU, %d MiB, %d GiB; the pool of %s keeps %d vCPU, %d MiB, %d GiB",
			req.Size.VCPUs, req.Size.MemoryMiB, req.Size.DiskGiB, req.Image.Name, want.VCPUs, want.MemoryMiB, want.DiskGiB)}
	}
	if !h.ServiceRunning() {
		return nil, &ErrNoStandby{Code: MissServiceDown, Why: "the pool service (libvirt-executor serve) is not running"}
	}
	// Every ask counts as demand for the pool's target, met or not.
	_ = h.m.Store.NoteDemand(req.Image.Name) // a lost record costs one boot less
	all, err := h.Standbys()
	if err != nil {
		return nil, &ErrNoStandby{Code: MissError, Why: "cannot list the standby VMs: " + err.Error()}
	}
	var idle []Standby
	for _, s := range all {
		if s.Idle() && s.Record.Standby.Image == req.Image.Name {
			idle = append(idle, s)
		}
	}
	// Oldest first: each is used before it ages out.
	slices.SortFunc(idle, func(a, b Standby) int { return a.Record.Created.Compare(b.Record.Created) })
	base, baseErr := state.VersionOf(req.Image.Base)
	c := &Claimed{}
	for _, s := range idle {
		if err := ctx.Err(); err != nil {
			return nil, context.Cause(ctx)
		}
		rec, why, err := h.claimOne(ctx, s.Name, req, base, baseErr)
		if err != nil {
			return nil, err
		}
		if why != "" {
			c.Skipped = append(c.Skipped, s.Name+": "+why)
			continue
		}
		c.At = time.Now()
		c.Machine, c.Idle, c.Took = rec, c.At.Sub(rec.Created), c.At.Sub(t0)
		return c, nil
	}
	why := fmt.Sprintf("no idle VM of image %s in the pool", req.Image.Name)
	if len(c.Skipped) > 0 {
		why += " (passed over: " + strings.Join(c.Skipped, "; ") + ")"
	}
	return nil, &ErrNoStandby{Code: MissEmpty, Why: why}
}

// claimOne tries to claim one idle machine: why is non-empty when it was
// passed over (taken by another job meanwhile, or found unfit and marked for
// retirement); err is a failure after the claim (the machine is then
// removed again).
func (h *Host) claimOne(ctx context.Context, name string, req JobRequest, base state.FileVersion, baseErr error) (*state.Machine, string, error) {
	// Until the claim file exists nothing is this job's: a failure is
	// only a reason to pass the machine over (the job can still start
	// cold).
	unlock, err := h.m.Store.TryLock(name)
	if errors.Is(err, state.ErrBusy) {
		return nil, "busy", nil
	}
	if err != nil {
		return nil, "lock: " + err.Error(), nil
	}
	defer unlock()
	// Judged again under the lock: another job may have claimed it, the
	// service retired it, a sweep removed it.
	if cl, err := h.m.Store.ClaimOf(name); err != nil || cl != nil {
		return nil, "claimed meanwhile", nil
	}
	rec, err := h.m.Store.Record(name)
	if err != nil || rec.Standby == nil {
		if has, herr := h.m.Store.Has(name); herr == nil && !has {
			h.m.Store.RemoveLock(name) // gone meanwhile: the lock file was ours to make
		}
		return nil, "no record", nil
	}
	unfit, retire := h.unfit(ctx, rec, req.Image, base, baseErr)
	if err := ctx.Err(); err != nil {
		// A stopped prepare says nothing about the machine.
		return nil, "", context.Cause(ctx)
	}
	if unfit != "" {
		if retire {
			_ = h.m.Store.Claim(name, state.Claim{Retire: true, Reason: unfit, At: time.Now().UTC()})
		}
		return nil, unfit, nil
	}
	if err := h.m.Store.Claim(name, state.Claim{Job: req.Name, At: time.Now().UTC()}); err != nil {
		if errors.Is(err, state.ErrClaimed) {
			return nil, "claimed meanwhile", nil
		}
		return nil, "", err
	}
	// From here on the machine is this job's: it never goes back to the
	// pool. What fails now removes it.
	err = h.m.Store.MapJob(req.Name, state.JobMachine{Machine: name, Warm: true, At: time.Now().UTC(), Container: req.Container})
	if err == nil {
		deadline := time.Now().Add(req.Lifetime + h.m.Cfg.Timeouts.JobSlack.D()).UTC()
		err = h.m.Engine().UpdateOwner(ctx, name, func(o *vm.Owner) {
			o.Frontend, o.Job, o.Deadline = req.Frontend, req.Job, deadline
		})
	}
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		tctx, cancel := detachctx.WithTimeout(ctx, h.m.Cfg.Timeouts.Cleanup.D())
		defer cancel()
		err = errors.Join(fmt.Errorf("claim %s: %w", name, err), h.m.Machine(name).TeardownLocked(tctx), h.m.Store.UnmapJob(req.Name))
		h.m.Store.RemoveLock(name)
		return nil, "", err
	}
	return rec, "", nil
}

// unfit says why an idle machine must not be handed out, or "" if it may:
// its image is no longer pooled or its configuration changed (size, the
// base file's path, size or mtime, anything else the machine was built
// from, or the driver's version), it is too old, libvirt does not run it,
// or its guest does not accept a TCP connection on the SSH port (refused:
// sshd or the network is gone). retire says the machine is done for; a
// probe that only timed out (a loaded host) passes it over without that
// verdict, which the service's own health check makes.
func (h *Host) unfit(ctx context.Context, rec *state.Machine, img *config.Image, base state.FileVersion, baseErr error) (why string, retire bool) {
	if why := h.Outdated(rec, img, base, baseErr); why != "" {
		return why, true
	}
	if why := h.m.Machine(rec.Name).Explain(ctx); why != "" {
		return why, true
	}
	pctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	if err := sshexec.ProbeTCP(pctx, net.JoinHostPort(rec.Address, strconv.Itoa(rec.Port))); err != nil {
		return fmt.Sprintf("its SSH port does not answer: %v", err), pctx.Err() == nil
	}
	return "", false
}

// Outdated says why a standby machine no longer matches the configuration
// of img now (base is the base file's version now, or baseErr), or "". img
// is nil when the image is no longer configured. It looks at nothing but
// the record (the claim and the pool service both judge by it).
func (h *Host) Outdated(rec *state.Machine, img *config.Image, base state.FileVersion, baseErr error) string {
	sb := rec.Standby
	switch {
	case img == nil || img.Pool == nil || sb.Image != img.Name:
		return "its image is no longer pooled"
	case (config.Size{VCPUs: sb.VCPUs, MemoryMiB: sb.MemoryMiB, DiskGiB: sb.DiskGiB}) != h.m.Cfg.ImageSize(img):
		return "its size is no longer the image's"
	// The job log shows these reasons: the image's name, never the host's
	// paths.
	case baseErr != nil && errors.Is(baseErr, fs.ErrNotExist):
		return fmt.Sprintf("the base image file of image %s is missing", img.Name)
	case baseErr != nil:
		return fmt.Sprintf("the base image file of image %s cannot be read", img.Name)
	case sb.Base != base:
		return fmt.Sprintf("the base image file of image %s changed since it booted", img.Name)
	case sb.Spec != lifecycle.SpecFingerprint(h.m.Cfg, img):
		return "the configuration it was built from (or the driver's version) changed since it booted"
	case guesttools.VolumeOf(rec) != guesttools.VolumeNow(h.m):
		return "the guest tools disk (gitlab-runner, step-runner) changed since it booted"
	case time.Since(rec.Created) > img.Pool.MaxAge.D():
		return fmt.Sprintf("older than pool.max_age (%s)", vm.Round(time.Since(rec.Created)))
	}
	return ""
}

// Retire removes an unclaimed standby machine (or one already marked for
// retirement) with its volumes and state: it marks it first, so no job
// claims it meanwhile. A machine a job has claimed is refused (it is the
// job's to remove); one whose lock another process holds returns
// state.ErrBusy.
func (h *Host) Retire(ctx context.Context, name, reason string) error {
	return h.retire(ctx, name, reason, nil)
}

// ErrBootCompleted is RemoveCutOffBoot's answer for a machine whose boot
// completed after the caller looked: nothing was done.
var ErrBootCompleted = errors.New("its boot completed meanwhile")

// RemoveCutOffBoot removes a standby machine whose boot was cut off (its
// state directory has no record and nobody holds its lock: the service
// that booted it ended). A machine whose record exists by the time its
// lock is taken is left alone with ErrBootCompleted.
func (h *Host) RemoveCutOffBoot(ctx context.Context, name string) error {
	return h.retire(ctx, name, "boot cut off", func() bool {
		_, err := h.m.Store.Record(name)
		return errors.Is(err, state.ErrNoMachine)
	})
}

// retire is Retire; when still is set, it must hold under the lock too.
func (h *Host) retire(ctx context.Context, name, reason string, still func() bool) error {
	if !h.m.Machine(name).IsStandby() {
		return lifecycle.NotOurs(fmt.Sprintf("refusing to retire %q: not a standby machine of this installation", name))
	}
	unlock, err := h.m.Store.TryLock(name)
	if err != nil {
		return err
	}
	defer unlock()
	cl, err := h.m.Store.ClaimOf(name)
	if err != nil {
		return err
	}
	if cl != nil && !cl.Retire {
		return fmt.Errorf("%s: claimed by job %s: %w", name, cl.Job, state.ErrClaimed)
	}
	if still != nil && cl == nil && !still() {
		return fmt.Errorf("%s: %w", name, ErrBootCompleted)
	}
	if has, err := h.m.Store.Has(name); err != nil {
		return err
	} else if has && cl == nil {
		if err := h.m.Store.Claim(name, state.Claim{Retire: true, Reason: reason, At: time.Now().UTC()}); err != nil {
			return err
		}
	}
	if err := h.m.Machine(name).TeardownLocked(ctx); err != nil {
		return err
	}
	h.m.Store.RemoveLock(name)
	return nil
}

// retireIdle retires one idle standby machine (the oldest) to make room for
// a job and returns its name, or "" if there was none to retire.
func (h *Host) retireIdle(ctx context.Context, reason string) string {
	all, err := h.Standbys()
	if err != nil {
		return ""
	}
	slices.SortFunc(all, func(a, b Standby) int {
		// Booting ones (no record) last; they are not idle anyway.
		switch {
		case a.Record == nil && b.Record == nil:
			return strings.Compare(a.Name, b.Name)
		case a.Record == nil:
			return 1
		case b.Record == nil:
			return -1
		}
		return a.Record.Created.Compare(b.Record.Created)
	})
	for _, s := range all {
		if !s.Idle() && (s.Claim == nil || !s.Claim.Retire) {
			continue
		}
		if err := h.Retire(ctx, s.Name, reason); err == nil {
			image := ""
			if s.Record != nil && s.Record.Standby != nil {
				image = s.Record.Standby.Image
			}
			h.m.Record(nil, obs.Event{Kind: obs.KindRetired, Job: s.Name, Image: image, Reason: "room"})
			return s.Name
		}
	}
	return ""
}

// makeRoom is admission's lifecycle.Hooks.MakeRoom: idle standby machines
// go first, if removing them can make the room a job waits for
// (otherwise the job waits for running jobs anyway, and the pool would be
// lost for nothing).
func (h *Host) makeRoom(ctx context.Context, short lifecycle.Shortfall, reason string) string {
	if !h.idleCanCover(short) {
		return ""
	}
	n := h.retireIdle(ctx, reason)
	if n != "" {
		h.m.Sayf("Retired idle standby VM %s to make room (jobs come first)", n)
	}
	return n
}

// idleCanCover reports whether removing every idle (or retiring) standby
// machine would make up for short.
func (h *Host) idleCanCover(short lifecycle.Shortfall) bool {
	all, err := h.Standbys()
	if err != nil {
		return false
	}
	held, err := h.m.Capacity().Reservations()
	if err != nil {
		return false
	}
	vms, mem := 0, 0
	for _, s := range all {
		if s.Idle() || (s.Claim != nil && s.Claim.Retire) {
			vms++
			mem += held[s.Name].MemoryMiB
		}
	}
	return vms > 0 && vms >= short.VMs && mem >= short.MemoryMiB
}
