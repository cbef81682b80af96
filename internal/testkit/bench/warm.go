package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// The warm round: after an image's cold jobs, the benchmark starts the pool
// service (libvirt-executor serve) with a copy of the configuration that
// keeps one idle standby VM of the image, and runs Runs sequential jobs,
// each once the pool is at rest again (one idle VM, nothing booting), so
// that each can start warm. It measures each job like a cold one, plus the
// claim (from the job's timings record) and how soon the service began
// booting the claimed VM's replacement. At the end it stops the service and
// removes every standby VM, so the benchmark leaves nothing behind.

// serviceStopWait is how long the service gets to stop after SIGTERM
// before its process group is killed.
const serviceStopWait = 3 * time.Minute

// derivedConfig is the configuration text of the warm round: the given one
// with a standby pool of one idle VM for image and, unless it configures the
// service itself, health checks every second (as the end-to-end tests use).
func derivedConfig(text, image string) string {
	out := text + "\n[images." + tomlKey(image) + ".pool]\nidle_count = 1\n"
	if !serveTable.MatchString(text) {
		out += "\n[serve]\nhealth_interval = \"1s\"\n"
	}
	return out
}

// serveTable matches a [serve] table header.
var serveTable = regexp.MustCompile(`(?m)^[ \t]*\[[ \t]*"?serve"?[ \t]*\]`)

var bareKey = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

// tomlKey writes a key as TOML wants it: bare when it can be.
func tomlKey(k string) string {
	if bareKey.MatchString(k) {
		return k
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(k) + `"`
}

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
	m     *lifecycle.Manager
	mu    sync.Mutex
	began map[string]time.Time
}

func newStandbyWatch(m *lifecycle.Manager) *standbyWatch {
	return &standbyWatch{m: m, began: map[string]time.Time{}}
}

func (w *standbyWatch) look() {
	names, err := w.m.Store.Names()
	if err != nil {
		return
	}
	for _, n := range names {
		if !w.m.IsStandby(n) {
			continue
		}
		w.mu.Lock()
		_, seen := w.began[n]
		w.mu.Unlock()
		if seen {
			continue
		}
		if st, err := os.Stat(filepath.Join(w.m.Store.MachineDir(n), reservationFile)); err == nil {
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

// service is a libvirt-executor serve process the benchmark started, in
// its own process group.
type service struct {
	cmd  *exec.Cmd
	log  lockedBuffer
	done chan struct{}
	err  error // Wait's, once done is closed
}

func startService(exe, configPath string) (*service, error) {
	if _, err := os.Stat(exe); err != nil {
		return nil, fmt.Errorf("pool service: %w (build it first: make build)", err)
	}
	s := &service{done: make(chan struct{})}
	s.cmd = exec.Command(exe, "--config", configPath, "serve")
	s.cmd.Stdout, s.cmd.Stderr = &s.log, &s.log
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("pool service: %w", err)
	}
	go func() {
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	return s, nil
}

// exitedError describes a service that ended by itself.
func (s *service) exitedError() error {
	why := "exit status 0"
	if s.err != nil {
		why = s.err.Error()
	}
	return fmt.Errorf("the pool service exited (%s): %s", why, tail(s.log.String(), 10))
}

// stop ends the service with SIGTERM (as systemd does) and waits for it;
// after wait it kills its process group.
func (s *service) stop(wait time.Duration) (time.Duration, error) {
	select {
	case <-s.done:
		return 0, s.exitedError()
	default:
	}
	t0 := time.Now()
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
		if s.err != nil {
			return time.Since(t0), fmt.Errorf("the pool service ended with %v after SIGTERM: %s", s.err, tail(s.log.String(), 10))
		}
		return time.Since(t0), nil
	case <-time.After(wait):
		_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.done
		return time.Since(t0), fmt.Errorf("the pool service did not stop within %s of SIGTERM: killed: %s", wait, tail(s.log.String(), 10))
	}
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// describeStandbys says what each standby VM is doing.
func describeStandbys(all []lifecycle.Standby) string {
	if len(all) == 0 {
		return "no standby VM"
	}
	var out []string
	for _, s := range all {
		what := "idle"
		switch {
		case s.Claim != nil && s.Claim.Retire:
			what = "retiring (" + s.Claim.Reason + ")"
		case s.Claim != nil:
			what = "claimed by " + s.Claim.Job
		case s.Record == nil:
			what = "booting"
		case s.Record.Standby == nil:
			what = "no standby record"
		default:
			what += " (" + s.Record.Standby.Image + ")"
		}
		out = append(out, s.Name+" "+what)
	}
	slices.Sort(out)
	return strings.Join(out, ", ")
}

// atRest reports whether the pool is exactly one idle standby VM of image:
// nothing booting, claimed or retiring.
func atRest(all []lifecycle.Standby, image string) (string, bool) {
	if len(all) == 1 && all[0].Idle() && all[0].Record.Standby.Image == image {
		return all[0].Name, true
	}
	return "", false
}

// waitPool waits until the pool is at rest and returns its idle VM.
func (b *bench) waitPool(ctx context.Context, m *lifecycle.Manager, svc *service, watch *standbyWatch, image string, within time.Duration) (string, error) {
	deadline := time.Now().Add(within)
	t := time.NewTicker(b.opts.Poll)
	defer t.Stop()
	for {
		watch.look()
		all, err := m.Standbys()
		if err == nil {
			if name, ok := atRest(all, image); ok {
				return name, nil
			}
		}
		if time.Now().After(deadline) {
			now := describeStandbys(all)
			if err != nil {
				now = err.Error()
			}
			return "", fmt.Errorf("the pool did not come to rest (one idle standby VM of %s) within %s: %s; service log: %s",
				image, within, now, tail(svc.log.String(), 5))
		}
		select {
		case <-svc.done:
			return "", svc.exitedError()
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
	if err := os.WriteFile(path, []byte(derivedConfig(string(text), image)), 0o600); err != nil {
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
	m, err := lifecycle.Open(cfg, lifecycle.Options{})
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
				describeStandbys(all))
		}
		fail(err)
		return w
	}

	t0 := time.Now()
	svc, err := startService(filepath.Join(b.opts.BinDir, "libvirt-executor"), path)
	if err != nil {
		fail(err)
		return w
	}
	b.progress("%s warm: pool service started (pid %d), waiting for its first idle standby VM", image, svc.cmd.Process.Pid)
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
		took, err := svc.stop(serviceStopWait)
		if err != nil && !slices.Contains(w.Errors, err.Error()) { // an exit waitPool has reported
			fail(err)
		}
		removed, errs := removeStandbys(context.WithoutCancel(ctx), m, cfg.Timeouts.Cleanup.D()+time.Minute)
		w.Removed = removed
		for _, err := range errs {
			fail(err)
		}
		if b.opts.JobLog != nil {
			fmt.Fprintf(b.opts.JobLog, "=== pool service (%s)\n%s", image, svc.log.String())
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

// removeStandbys removes every standby VM of the installation (the service
// has stopped), each within each. One a job claimed and its cleanup left
// is removed as `libvirt-executor rm` would.
func removeStandbys(ctx context.Context, m *lifecycle.Manager, each time.Duration) (removed []string, errs []error) {
	all, err := m.Standbys()
	if err != nil {
		return nil, []error{fmt.Errorf("standby VMs after the warm round: %w", err)}
	}
	for _, s := range all {
		rctx, cancel := context.WithTimeout(ctx, each)
		err := m.Retire(rctx, s.Name, "lve-bench: warm round over")
		if errors.Is(err, state.ErrClaimed) {
			if err = m.Teardown(rctx, s.Name); err == nil && s.Claim != nil {
				_ = m.Store.UnmapJob(s.Claim.Job)
			}
		}
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("removing standby VM %s: %w", s.Name, err))
			continue
		}
		removed = append(removed, s.Name)
	}
	return removed, errs
}
