package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
)

// The warm round: after an image's cold jobs, the benchmark starts the pool
// service (libvirt-executor serve) with a copy of the configuration that
// keeps one idle standby VM of the image, and runs Runs sequential jobs,
// each once the pool is at rest again (one idle VM, nothing booting), so
// that each can start warm. It measures each job like a cold one, plus the
// claim (from the job's timings record) and how soon the service began
// booting the claimed VM's replacement. At the end it stops the service and
// removes every standby VM, so the benchmark leaves nothing behind.

var (
	warmStartLine = regexp.MustCompile(`Warm start: VM (\S+) `)
	coldStartLine = regexp.MustCompile(`Cold start: ([^\r\n]*)`)
)

// parseStart reads from a job log how its prepare started: the standby VM
// it claimed ("Warm start: VM <name> ..."), or why it booted its own
// ("Cold start: <why>"). Both are empty when the log says neither.
func parseStart(log string) (vm, cold string) {
	if m := warmStartLine.FindStringSubmatch(log); m != nil {
		vm = m[1]
	}
	if m := coldStartLine.FindStringSubmatch(log); m != nil {
		cold = strings.TrimSpace(m[1])
	}
	return vm, cold
}

// lastTimings returns the last record in a job's own timings file, whatever
// machine it names: a warm prepare's record names the standby VM it
// claimed, not the job's machine name.
func lastTimings(path string) (lifecycle.TimingRecord, error) {
	recs, err := timingRecords(path)
	if errors.Is(err, os.ErrNotExist) {
		return lifecycle.TimingRecord{}, fmt.Errorf("no timings record: prepare wrote none (%s)", lifecycle.TimingsEnv)
	}
	if err != nil {
		return lifecycle.TimingRecord{}, err
	}
	if len(recs) == 0 {
		return lifecycle.TimingRecord{}, fmt.Errorf("no timings record in %s", path)
	}
	return recs[len(recs)-1], nil
}

// readWarm fills in a warm-round job's start: warm (its claim figures) or
// cold (why, and the cold prepare figures), from its timings record, checked
// against its job log. machine is the job's machine name, launch and exit
// its prepare's.
func (j *JobSample) readWarm(timings, log, machine string, launch, exit time.Time) error {
	vm, cold := parseStart(log)
	rec, err := lastTimings(timings)
	if err != nil {
		// No record: the log alone says how it started.
		j.Warm, j.ColdStart = vm != "", cold
		return err
	}
	if !rec.Warm {
		j.ColdStart = cold
		if cold == "" {
			j.ColdStart = `its timings record is a cold start (no "Cold start:" line in the job log)`
		}
		return j.readPrepare(timings, machine, launch, exit)
	}
	j.Warm = true
	j.Claim = &ClaimMs{VM: rec.Machine, Claim: rec.ClaimMs, Ready: rec.ReadyMs, Launch: ms(rec.Began.Sub(launch)), Claimed: rec.Claimed}
	switch {
	case vm == "":
		return fmt.Errorf(`warm timings record (VM %s) but no "Warm start: VM" line in the job log`, rec.Machine)
	case vm != rec.Machine:
		return fmt.Errorf("the job log says it claimed VM %s, its timings record VM %s", vm, rec.Machine)
	case rec.Claimed.IsZero():
		return fmt.Errorf("warm timings record of %s without its claim moment", rec.Machine)
	}
	return nil
}

// refill finds the boot that replaced a standby VM claimed at claimed by a
// job started at jobStart: of the standby VMs not in before (those of the
// pool when the job started) whose boot began (began: when each one's
// reservation was written) at or after jobStart, the earliest. It returns
// that VM and its boot's start relative to the claim.
func refill(claimed, jobStart time.Time, before map[string]bool, began map[string]time.Time) (string, float64, bool) {
	var name string
	var first time.Time
	for n, t := range began {
		if before[n] || t.IsZero() || t.Before(jobStart) {
			continue
		}
		if name == "" || t.Before(first) || (t.Equal(first) && n < name) {
			name, first = n, t
		}
	}
	if name == "" {
		return "", 0, false
	}
	return name, ms(first.Sub(claimed)), true
}

// reservationFile is the file a machine's state directory gets first when
// its boot begins (state.Store.Reserve); its modification time is that
// moment.
const reservationFile = "reservation.json"

// standbyWatch remembers when each standby VM's boot began, as often as it
// is told to look: a replacement whose boot fails is removed again, and
// must still count.
type standbyWatch struct {
	m     *jobvm.Host
	mu    sync.Mutex
	began map[string]time.Time
}

func newStandbyWatch(m *jobvm.Host) *standbyWatch {
	return &standbyWatch{m: m, began: map[string]time.Time{}}
}

func (w *standbyWatch) look() {
	names, err := w.m.Manager().Store.Names()
	if err != nil {
		return
	}
	for _, n := range names {
		if !w.m.Manager().Machine(n).IsStandby() {
			continue
		}
		w.mu.Lock()
		_, seen := w.began[n]
		w.mu.Unlock()
		if seen {
			continue
		}
		if st, err := os.Stat(filepath.Join(w.m.Manager().Store.MachineDir(n), reservationFile)); err == nil {
			w.mu.Lock()
			w.began[n] = st.ModTime()
			w.mu.Unlock()
		}
	}
}

// run looks every interval until ctx ends.
func (w *standbyWatch) run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		w.look()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (w *standbyWatch) snapshot() map[string]time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string]time.Time, len(w.began))
	for n, t := range w.began {
		out[n] = t
	}
	return out
}

// atRest reports whether the pool is exactly one idle standby VM of image:
// nothing booting, claimed or retiring; with the connection holder on
// (holderDir: the machine directory of a name), the VM's holder has made
// its connection (and started the guest agent), as it has for a VM that
// waited a moment for its job.
func atRest(all []lifecycle.Standby, image string, holderDir func(string) string) (string, bool) {
	if len(all) == 1 && all[0].Idle() && all[0].Record.Standby.Image == image {
		if holderDir != nil && !holder.Ready(holderDir(all[0].Name)) {
			return "", false
		}
		return all[0].Name, true
	}
	return "", false
}

// waitPool waits until the pool is at rest and returns its idle VM.
func (b *bench) waitPool(ctx context.Context, m *jobvm.Host, svc *poolsvc.Service, watch *standbyWatch, image string, within time.Duration) (string, error) {
	deadline := time.Now().Add(within)
	t := time.NewTicker(b.opts.Poll)
	defer t.Stop()
	for {
		watch.look()
		all, err := m.Standbys()
		if err == nil {
			var dir func(string) string
			if b.cfg.SSH.HolderEnabled() {
				dir = b.store.MachineDir
			}
			if name, ok := atRest(all, image, dir); ok {
				return name, nil
			}
		}
		if time.Now().After(deadline) {
			now := poolsvc.Describe(all)
			if err != nil {
				now = err.Error()
			}
			return "", fmt.Errorf("the pool did not come to rest (one idle standby VM of %s) within %s: %s; service log: %s",
				image, within, now, tail(svc.Log(), 5))
		}
		select {
		case <-svc.Done():
			return "", svc.ExitedError()
		case <-ctx.Done():
			return "", ctx.Err()
		case <-t.C:
		}
	}
}

// machineOfJob is the VM that serves the job named job: the standby VM it
// claimed (the job -> machine mapping), else the VM of its name.
func (b *bench) machineOfJob(job string) string {
	if jm, err := b.store.MachineOfJob(job); err == nil && jm != nil && jm.Machine != "" {
		return jm.Machine
	}
	return job
}

// warmRound runs the warm round of image (see the top of this file).
func (b *bench) warmRound(ctx context.Context, image string) (w WarmRound) {
	fail := func(err error) {
		w.Errors = append(w.Errors, err.Error())
		b.progress("%s warm: ERROR: %s", image, firstLine(err.Error()))
	}
	if pooled := b.cfg.Pooled(); len(pooled) > 0 {
		var names []string
		for _, img := range pooled {
			names = append(names, img.Name)
		}
		fail(fmt.Errorf("%s already has standby pools (%s): the warm round needs a configuration without, it adds its own (or use --warm=false)",
			b.opts.ConfigPath, strings.Join(names, ", ")))
		return w
	}
	dir, err := os.MkdirTemp("", "lve-bench-warm-")
	if err != nil {
		fail(err)
		return w
	}
	defer func() { _ = os.RemoveAll(dir) }()
	text, err := os.ReadFile(b.opts.ConfigPath)
	if err != nil {
		fail(err)
		return w
	}
	path := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(path, []byte(poolsvc.WithPool(string(text), image, 1)), 0o600); err != nil {
		fail(err)
		return w
	}
	cfg, err := config.Load(path)
	if err != nil {
		fail(fmt.Errorf("the warm round's configuration (with [images.%s.pool]): %w", image, err))
		return w
	}
	if img, ok := cfg.Image(image); !ok || img.Pool == nil || img.Pool.IdleCount != 1 || len(cfg.Pooled()) != 1 {
		fail(fmt.Errorf("the warm round's configuration does not keep exactly one pool of one idle VM of %s", image))
		return w
	}
	m, err := jobvm.Open(cfg, lifecycle.Options{})
	if err != nil {
		fail(err)
		return w
	}
	defer func() { _ = m.Close() }()
	if locked, _, _ := m.ServiceStatus(); locked {
		fail(fmt.Errorf("a libvirt-executor serve already runs for state_dir %s: the warm round needs its own", cfg.StateDir))
		return w
	}
	if all, err := m.Standbys(); err != nil || len(all) > 0 {
		if err == nil {
			err = fmt.Errorf("standby VMs of this installation exist before the warm round (%s): remove them first (libvirt-executor list, rm NAME)",
				poolsvc.Describe(all))
		}
		fail(err)
		return w
	}

	t0 := time.Now()
	svc, err := poolsvc.Start(filepath.Join(b.opts.BinDir, "libvirt-executor"), path)
	if err != nil {
		fail(err)
		return w
	}
	b.progress("%s warm: pool service started (pid %d), waiting for its first idle standby VM", image, svc.Pid())
	watch := newStandbyWatch(m)
	wctx, stopWatch := context.WithCancel(ctx)
	var wwg sync.WaitGroup
	wwg.Add(1)
	go func() {
		defer wwg.Done()
		watch.run(wctx, 50*time.Millisecond)
	}()
	defer func() {
		stopWatch()
		wwg.Wait()
		took, err := svc.Stop(poolsvc.StopWait)
		if err != nil && !slices.Contains(w.Errors, err.Error()) { // an exit waitPool has reported
			fail(err)
		}
		removed, errs := poolsvc.RemoveStandbys(context.WithoutCancel(ctx), m, cfg.Timeouts.Cleanup.D()+time.Minute, "lve-bench: warm round over")
		w.Removed = removed
		for _, err := range errs {
			fail(err)
		}
		if b.opts.JobLog != nil {
			fmt.Fprintf(b.opts.JobLog, "=== pool service (%s)\n%s", image, svc.Log())
		}
		b.progress("%s warm: pool service stopped in %s; removed %d standby VM(s)", image, fmtMs(ms(took)), len(removed))
	}()

	within := cfg.Timeouts.Boot.D() + 2*time.Minute
	idle, err := b.waitPool(ctx, m, svc, watch, image, within)
	if err != nil {
		fail(err)
		return w
	}
	w.FirstIdleMs = ms(time.Since(t0))
	b.progress("%s warm: standby VM %s idle %s after the service started", image, idle, fmtMs(w.FirstIdleMs))
	mode := jobMode{exec: b.exec, warm: true}
	args := []string{"--config", path}
	mode.exec.ConfigArgs, mode.exec.PrepareArgs, mode.exec.RunArgs, mode.exec.CleanupArgs = args, args, args, args
	for run := 1; run <= b.opts.Runs && ctx.Err() == nil; run++ {
		before := map[string]bool{idle: true}
		start := time.Now()
		j := b.runJob(ctx, image, run, mode)
		// At rest again: the claimed VM is gone with the job, its
		// replacement booted. The next job can start warm, and the
		// replacement's boot is known.
		next, err := b.waitPool(ctx, m, svc, watch, image, within)
		if c := j.Claim; c != nil && !c.Claimed.IsZero() {
			if name, d, ok := refill(c.Claimed, start, before, watch.snapshot()); ok {
				c.Refill, c.Replacement = &d, name
			}
		}
		w.Jobs = append(w.Jobs, j)
		b.progress("%s warm run %d/%d: %s", image, run, b.opts.Runs, describeJob(j))
		if err != nil {
			fail(fmt.Errorf("after warm run %d: %w", run, err))
			return w
		}
		idle = next
	}
	return w
}
