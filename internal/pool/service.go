// Package pool is the standby pool service (libvirt-executor serve): it
// keeps, for every image with a [images.NAME.pool] table, idle machines
// booted and SSH-verified for jobs to claim (jobvm.Host.Claim, through its
// BootStandby and Retire), and
// retires those that died, aged or whose base image changed. Everything it
// knows it reads from the state directory and libvirt on each look, so a
// restarted service (after a crash, SIGKILL or host reboot) simply carries
// on with what it finds. It knows nothing of GitLab.
package pool

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/metrics"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Service keeps the standby pools of one installation.
type Service struct {
	M   *jobvm.Host
	Log *slog.Logger
	// Started, if set, runs once the service holds its lock (only one
	// service runs per installation): the metrics endpoint starts there.
	// stop runs when the service ends.
	Started func(ctx context.Context) (stop func(), err error)
	// Load, if set, reads the configuration file again (config.Load): Run
	// then reloads with it on Reload, when the file changes and when an
	// image's source names a new image, where it would otherwise end with
	// ErrConfigChanged or ErrImageChanged.
	Load func() (*config.Config, error)
	// Notify, if set, hears the service's state for its supervisor
	// (sd_notify): "READY=1..." once the first look is done,
	// "RELOADING=1" and "READY=1" around a reload, "STOPPING=1" when it
	// stops.
	Notify func(state string)

	// cfgMu is held for writing while a reload replaces M.Cfg; readers
	// outside Run's goroutine (the metrics endpoint) hold it (Hold).
	cfgMu sync.RWMutex
	// reloadReq carries Reload's asks to Run.
	reloadReq chan chan error

	mu sync.Mutex
	// booting counts the boots started per image and not yet ended.
	booting map[string]int
	// busy names the machines a retirement or health check works on.
	busy map[string]bool
	// demand is the jobs' asks of the pools (state.Store.TakeDemand), kept
	// for the longest idle_time: the target of each pool.
	demand []state.Demand
	// claimed names the claimed machines already logged.
	claimed map[string]bool
	// checked is when each idle machine's health was last checked.
	checked map[string]time.Time
	// backoff holds an image's refills after failed boots.
	backoff map[string]backoff
	// unhealthy counts each idle machine's failed SSH probes in a row.
	unhealthy map[string]int
	// failing holds back retrying the removal of a machine whose last
	// removal failed, and remembers its error (logged when it changes).
	failing map[string]failure
	// boots cancels the boots in progress, by a number of their own.
	boots  map[int]context.CancelFunc
	bootID int
	sem    chan struct{}
	wg     sync.WaitGroup
	// images follows the images with a source (oci://).
	images *follower
	// snapping names the images whose memory snapshot is being made;
	// snapsLooked is when keepSnapshots last looked at them.
	snapping    map[string]bool
	snapsLooked time.Time
}

type backoff struct {
	failures int
	until    time.Time
}

type failure struct {
	err   string
	n     int
	until time.Time
}

func (s *Service) init() {
	s.booting = map[string]int{}
	s.busy = map[string]bool{}
	s.claimed = map[string]bool{}
	s.checked = map[string]time.Time{}
	s.backoff = map[string]backoff{}
	s.unhealthy = map[string]int{}
	s.failing = map[string]failure{}
	s.boots = map[int]context.CancelFunc{}
	s.snapping = map[string]bool{}
	s.sem = make(chan struct{}, s.M.Manager().Cfg.Serve.BootParallelism)
	s.mu.Lock()
	s.images = newFollower(s.M.Manager().Cfg, s)
	s.mu.Unlock()
}

// Run keeps the pools until ctx ends. Only one service runs per
// installation (state_dir); a second one fails at once. When ctx ends,
// boots in progress are undone; idle machines stay for the next start to
// adopt (a sweep removes them after their deadline if none comes).
func (s *Service) Run(ctx context.Context) error {
	unlock, err := s.M.LockService(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	s.init()
	if s.Started != nil {
		stop, err := s.Started(ctx)
		if err != nil {
			return err
		}
		defer stop()
	}
	pools := s.M.Manager().Cfg.Pooled()
	snapshots := 0
	for _, img := range s.M.Manager().Cfg.Images {
		if img.Snapshot {
			snapshots++
		}
	}
	if len(pools) == 0 && snapshots == 0 {
		s.Log.Warn("no image has a pool table ([images.NAME.pool]) or snapshot = true: nothing to keep")
	}
	for _, img := range pools {
		p := img.Pool
		s.Log.Info("keeping standby pool", "image", img.Name, "idle_count", p.IdleCount, "max_idle", p.MaxIdle,
			"idle_time", p.IdleTime.D().String(), "max_age", p.MaxAge.D().String())
	}
	for _, img := range s.M.Manager().Cfg.Pooled() {
		if !img.Pulled() {
			s.Log.Warn("no standbys of this image until its first pull (registry.pull_interval) stores it", "image", img.Name, "source", img.Source)
		}
	}
	imageChanged := make(chan string, 1)
	stopFollow := s.follow(ctx, imageChanged, 0)
	defer func() { stopFollow() }()
	cfgVersion, _ := state.VersionOf(s.M.Manager().Cfg.Path)
	t := time.NewTicker(s.M.Manager().Cfg.Serve.Interval.D())
	defer t.Stop()
	// reload reads the configuration again and, unless it is refused,
	// runs on with it (Reload).
	reload := func(why string) error {
		cfgVersion, _ = state.VersionOf(s.M.Manager().Cfg.Path)
		return s.reload(why, t, func() { stopFollow() }, func(wait time.Duration) {
			stopFollow = s.follow(ctx, imageChanged, wait)
		})
	}
	ready := false
	for {
		s.Tick(ctx)
		if !ready {
			ready = true
			s.notify(fmt.Sprintf("READY=1\nSTATUS=keeping %d standby pools", len(s.M.Manager().Cfg.Pooled())))
		}
		if v, err := state.VersionOf(s.M.Manager().Cfg.Path); s.M.Manager().Cfg.Path != "" && (err != nil || v != cfgVersion) {
			if s.Load != nil {
				_ = reload("the configuration file changed")
				continue
			}
			// Exit to be restarted (systemd: Restart=on-failure) with the
			// new file: VMs built under the old one no longer match it and
			// are drained by the next service (lifecycle.SpecFingerprint).
			s.Log.Warn("configuration file changed: stopping to be restarted with it", "config", s.M.Manager().Cfg.Path)
			s.stop()
			return ErrConfigChanged
		}
		select {
		case <-ctx.Done():
			s.notify("STOPPING=1")
			s.stop()
			return nil
		case name := <-imageChanged:
			if s.Load != nil {
				if reload("image "+name+" names a new image") != nil {
					// Asked again after registry.pull_interval.
					stopFollow = s.follow(ctx, imageChanged, s.M.Manager().Cfg.Registry.PullInterval.D())
				}
				continue
			}
			s.Log.Warn("stopping to be restarted with the new image", "image", name)
			s.stop()
			return ErrImageChanged
		case res := <-s.reloads():
			res <- reload("reload asked (SIGHUP)")
		case <-t.C:
		}
	}
}

// ImageGauges is the images with a source, for the metrics endpoint.
func (s *Service) ImageGauges() ([]metrics.ImageGauge, error) {
	defer s.Hold()()
	s.mu.Lock()
	f := s.images
	s.mu.Unlock()
	if f == nil {
		return nil, nil // not running
	}
	return f.gauges()
}

// ErrConfigChanged ends Run, when it has no Service.Load, when the
// configuration file changed under it.
var ErrConfigChanged = errors.New("configuration file changed; restart the service to use it")

// stop undoes the boots in progress and waits for the work in the
// background.
func (s *Service) stop() {
	s.Log.Info("pool service stopping: undoing boots in progress; idle VMs stay for the next start")
	s.cancelBoots()
	s.wg.Wait()
}

// Tick looks at every standby machine once and acts: retires what must go,
// checks the health of idle machines now and then, and starts boots where a
// pool is short. The work runs in the background; Tick does not wait for it.
func (s *Service) Tick(ctx context.Context) {
	_ = s.M.Heartbeat()
	all, err := s.M.Standbys()
	if err != nil {
		s.Log.Error("cannot read the standby machines", "err", err)
		return
	}
	now := time.Now()
	if d, err := s.M.Manager().Store.TakeDemand(); err == nil {
		s.mu.Lock()
		s.demand = append(s.demand, d...)
		s.mu.Unlock()
	}
	bases := map[string]baseOf{}
	idle := map[string][]lifecycle.Standby{}
	seen := map[string]bool{}
	for _, sb := range all {
		seen[sb.Name] = true
		switch {
		case sb.Claim != nil && sb.Claim.Retire:
			s.retire(ctx, sb, sb.Claim.Reason)
		case sb.Claim != nil:
			s.noteClaim(sb)
		case sb.Record == nil:
			// Booting: by us (its lock is held), or cut off by an earlier
			// service's end (removed now).
			s.removeWith(ctx, sb, "boot cut off", s.M.RemoveCutOffBoot)
		case sb.Record.Standby == nil:
			s.retire(ctx, sb, "no standby record")
		default:
			if why := s.judge(sb, bases); why != "" {
				s.retire(ctx, sb, why)
				continue
			}
			s.checkHealth(ctx, sb, now)
			idle[sb.Record.Standby.Image] = append(idle[sb.Record.Standby.Image], sb)
		}
	}
	s.forget(seen, now)
	if s.M.Manager().Capacity().UnderPressure() {
		// A job waits for room: boots in progress give theirs back (their
		// undo removes what they made); the job retires idle machines.
		if n := s.cancelBoots(); n > 0 {
			s.Log.Info("a job waits for room: cancelled standby boots in progress", "boots", n)
		}
	}
	for _, img := range s.M.Manager().Cfg.Pooled() {
		if img.Pulled() { // an image with a source waits for its first pull
			s.keep(ctx, img, idle[img.Name], now)
		}
	}
	s.keepSnapshots(ctx, now)
}

// keepSnapshots makes the memory snapshot of each image with snapshot =
// true that has no current one (issue #48, docs/pool.md): one build per
// image at a time, within the boots' parallelism, none while a job waits
// for room, and after a failed build not again before its backoff.
func (s *Service) keepSnapshots(ctx context.Context, now time.Time) {
	// Not every tick: a look reads each record, its image's files and
	// (domain_type = "auto") the host's capabilities.
	if now.Sub(s.snapsLooked) < snapshotLookEvery {
		return
	}
	s.snapsLooked = now
	cfg := s.M.Manager().Cfg
	snaps := lifecycle.SnapshotsOf(s.M.Manager())
	for _, name := range cfg.ImageNames() {
		img := cfg.Images[name]
		if !img.Snapshot || !img.Pulled() || s.M.Manager().Capacity().UnderPressure() {
			continue
		}
		key := snapshotKey(name)
		s.mu.Lock()
		busy, bo := s.snapping[name], s.backoff[key]
		s.mu.Unlock()
		if busy || now.Before(bo.until) {
			continue
		}
		rec, why := snaps.Current(ctx, img)
		if rec != nil {
			continue
		}
		failed := false
		if old, err := s.M.Manager().Store.SnapshotOf(name); err == nil && old != nil && old.Failures >= state.MaxSnapshotFailures {
			// Remade because its restores failed: a cause that lasts (a
			// libvirt that cannot restore from a pipe, a guest that never
			// reseeds) would otherwise cost a template boot every few
			// jobs; each such rebuild waits longer (1 min doubling to 1 h).
			failed = true
			s.mu.Lock()
			fb := s.backoff[snapshotKey(name)+" failed"]
			s.mu.Unlock()
			if now.Before(fb.until) {
				continue
			}
		}
		s.snapshot(ctx, img, why, failed)
	}
}

// snapshotLookEvery is how often the service looks whether a snapshot
// is missing or stale.
const snapshotLookEvery = 2 * time.Second

// snapshotKey is an image's snapshot builds' key in Service.backoff.
func snapshotKey(image string) string { return "\x00snapshot " + image }

// snapshot makes img's memory snapshot in the background (why: what is
// wrong with the one it has).
func (s *Service) snapshot(ctx context.Context, img *config.Image, why string, afterFailures bool) {
	s.mu.Lock()
	s.snapping[img.Name] = true
	s.mu.Unlock()
	s.background(ctx, func() { delete(s.snapping, img.Name) }, func(bctx context.Context) {
		s.Log.Info("making the memory snapshot", "image", img.Name, "why", why)
		t0 := time.Now()
		rec, err := lifecycle.SnapshotsOf(s.M.Manager()).Build(bctx, img)
		s.mu.Lock()
		defer s.mu.Unlock()
		key := snapshotKey(img.Name)
		bo := s.backoff[key]
		if err != nil {
			if bctx.Err() != nil {
				s.Log.Info("memory snapshot cancelled and undone", "image", img.Name)
				return
			}
			bo.failures++
			wait := min(10*time.Second<<min(bo.failures-1, 6), 10*time.Minute)
			bo.until = time.Now().Add(wait)
			s.backoff[key] = bo
			s.Log.Error("memory snapshot not made", "image", img.Name, "err", err, "retry_in", wait.String())
			return
		}
		delete(s.backoff, key)
		if afterFailures {
			// Kept apart, and not cleared by a good build: the next
			// rebuild for failed restores waits longer.
			fk := key + " failed"
			fb := s.backoff[fk]
			fb.failures++
			wait := min(time.Minute<<min(fb.failures-1, 6), time.Hour)
			fb.until = time.Now().Add(wait)
			s.backoff[fk] = fb
			s.Log.Warn("memory snapshot made again after its restores failed; the next such rebuild waits", "image", img.Name, "template", rec.Template, "wait", wait.String())
		}
		s.Log.Info("memory snapshot made", "image", img.Name, "template", rec.Template, "took", vm.Round(time.Since(t0)).String())
	})
}

// baseOf caches one look at an image's base file per tick.
type baseOf struct {
	v   state.FileVersion
	err error
}

// judge says why an idle machine must be retired, or "": it no longer
// matches the configuration (lifecycle.Manager.Outdated).
func (s *Service) judge(sb lifecycle.Standby, bases map[string]baseOf) string {
	rec := sb.Record.Standby
	img, ok := s.M.Manager().Cfg.Image(rec.Image)
	if !ok {
		return s.M.Outdated(sb.Record, nil, state.FileVersion{}, nil)
	}
	b, ok := bases[img.Name]
	if !ok {
		b.v, b.err = state.VersionOf(img.Base)
		bases[img.Name] = b
	}
	return s.M.Outdated(sb.Record, img, b.v, b.err)
}

// keep retires idle machines beyond the pool's target that waited longer
// than idle_time, and starts boots while the pool is short of it.
func (s *Service) keep(ctx context.Context, img *config.Image, idle []lifecycle.Standby, now time.Time) {
	p := img.Pool
	target := s.target(img, now)
	s.mu.Lock()
	booting := s.booting[img.Name]
	bo := s.backoff[img.Name]
	s.mu.Unlock()
	have := len(idle) + booting
	if excess := have - target; excess > 0 {
		slices.SortFunc(idle, func(a, b lifecycle.Standby) int { return a.Record.Created.Compare(b.Record.Created) })
		for _, sb := range idle {
			if excess == 0 {
				break
			}
			if now.Sub(sb.Record.Created) > p.IdleTime.D() {
				s.retire(ctx, sb, fmt.Sprintf("idle longer than pool.idle_time %s above the pool's target %d", p.IdleTime.D(), target))
				excess--
			}
		}
	}
	need := target - have
	if need <= 0 || now.Before(bo.until) || ctx.Err() != nil {
		return
	}
	if s.M.Manager().Capacity().UnderPressure() {
		return // a job waited for room: jobs first (Tick cancels the boots)
	}
	for range need {
		s.boot(ctx, img, len(idle), target)
	}
}

// target is the pool's size now: the claims of the last idle_time, at
// least idle_count and at most max_idle.
func (s *Service) target(img *config.Image, now time.Time) int {
	p := img.Pool
	s.mu.Lock()
	defer s.mu.Unlock()
	demand := 0
	for _, d := range s.demand {
		if d.Image == img.Name && now.Sub(d.At) <= p.IdleTime.D() {
			demand++
		}
	}
	return min(max(demand, p.IdleCount), max(p.MaxIdle, p.IdleCount))
}

// noteClaim logs a claimed machine once.
func (s *Service) noteClaim(sb lifecycle.Standby) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.claimed[sb.Name] {
		return
	}
	s.claimed[sb.Name] = true
	image := ""
	if sb.Record != nil && sb.Record.Standby != nil {
		image = sb.Record.Standby.Image
	}
	s.Log.Info("standby VM claimed", "vm", sb.Name, "image", image, "by", sb.Claim.Job, "note", sb.Claim.Reason)
}

// forget drops what it knows of machines that are gone, and demand older
// than its pool's idle_time.
func (s *Service) forget(seen map[string]bool, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for n := range s.checked {
		if !seen[n] {
			delete(s.checked, n)
		}
	}
	for n := range s.claimed {
		if !seen[n] {
			delete(s.claimed, n)
		}
	}
	for n := range s.unhealthy {
		if !seen[n] {
			delete(s.unhealthy, n)
		}
	}
	for n := range s.failing {
		if !seen[n] {
			delete(s.failing, n)
		}
	}
	s.demand = slices.DeleteFunc(s.demand, func(d state.Demand) bool {
		img, ok := s.M.Manager().Cfg.Image(d.Image)
		return !ok || img.Pool == nil || now.Sub(d.At) > img.Pool.IdleTime.D()
	})
}

// boot starts one boot for img's pool in the background, at most
// serve.boot_parallelism at once.
func (s *Service) boot(ctx context.Context, img *config.Image, idle, target int) {
	s.mu.Lock()
	s.booting[img.Name]++
	s.mu.Unlock()
	s.background(ctx, func() { s.booting[img.Name]-- }, func(bctx context.Context) {
		if s.M.Manager().Capacity().UnderPressure() {
			return // a job began to wait for room meanwhile
		}
		ctx := bctx
		s.Log.Info("booting standby VM", "image", img.Name, "idle", idle, "target", target)
		t0 := time.Now()
		ready, err := s.M.BootStandby(ctx, img, s.prepull(img))
		s.mu.Lock()
		defer s.mu.Unlock()
		bo := s.backoff[img.Name]
		if err != nil {
			if ctx.Err() != nil {
				s.Log.Info("standby boot cancelled and undone", "image", img.Name)
				return
			}
			wait := 5 * time.Second
			if !errors.Is(err, lifecycle.ErrNoRoom) {
				bo.failures++
				wait = min(5*time.Second<<min(bo.failures-1, 5), 2*time.Minute)
			}
			bo.until = time.Now().Add(wait)
			s.backoff[img.Name] = bo
			lvl := slog.LevelError
			if errors.Is(err, lifecycle.ErrNoRoom) {
				lvl = slog.LevelInfo
			}
			s.Log.Log(ctx, lvl, "standby VM not booted", "image", img.Name, "err", err, "retry_in", wait.String())
			return
		}
		_ = ready.Client.Close()
		delete(s.backoff, img.Name)
		s.Log.Info("standby VM ready", "vm", ready.Machine.Name, "image", img.Name, "took", vm.Round(time.Since(t0)).String())
	})
}

// background runs work in its own goroutine, at most
// serve.boot_parallelism at once (boots and snapshot builds together),
// cancelled by cancelBoots and waited for by the service's end; ended
// runs under s.mu when it is over, whether work ran or not.
func (s *Service) background(ctx context.Context, ended func(), work func(ctx context.Context)) {
	bctx, cancel := context.WithCancel(ctx)
	s.mu.Lock()
	s.bootID++
	id := s.bootID
	s.boots[id] = cancel
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer func() {
			s.mu.Lock()
			ended()
			delete(s.boots, id)
			s.mu.Unlock()
			cancel()
		}()
		select {
		case s.sem <- struct{}{}:
		case <-bctx.Done():
			return
		}
		defer func() { <-s.sem }()
		work(bctx)
	}()
}

// cancelBoots cancels every boot in progress and returns how many.
func (s *Service) cancelBoots() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.boots {
		c()
	}
	return len(s.boots)
}

// retire removes a standby machine in the background (once at a time per
// machine). A machine a job claimed meanwhile, or whose lock another
// process holds (a boot in progress), is left alone.
func (s *Service) retire(ctx context.Context, sb lifecycle.Standby, reason string) {
	s.removeWith(ctx, sb, reason, func(ctx context.Context, name string) error { return s.M.Retire(ctx, name, reason) })
}

// removeWith is retire with its own removal (remove).
func (s *Service) removeWith(ctx context.Context, sb lifecycle.Standby, reason string, remove func(ctx context.Context, name string) error) {
	name := sb.Name
	s.mu.Lock()
	f := s.failing[name]
	s.mu.Unlock()
	if time.Now().Before(f.until) || !s.take(name) {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer s.release(name)
		// Retiring runs to its end on its own deadline, even when the
		// service stops meanwhile.
		rctx, cancel := detachctx.WithTimeout(ctx, s.M.Manager().Cfg.Timeouts.Cleanup.D())
		defer cancel()
		err := remove(rctx, name)
		s.mu.Lock()
		defer s.mu.Unlock()
		switch {
		case err == nil:
			delete(s.failing, name)
			delete(s.unhealthy, name)
			s.Log.Info("retired standby VM", "vm", name, "reason", reason)
			image := ""
			if sb.Record != nil && sb.Record.Standby != nil {
				image = sb.Record.Standby.Image
			}
			s.M.Manager().Record(s.Log, obs.Event{Kind: obs.KindRetired, Job: name, Image: image, Reason: RetireCode(reason)})
		case errors.Is(err, state.ErrBusy), errors.Is(err, state.ErrClaimed), errors.Is(err, jobvm.ErrBootCompleted):
		default:
			// Tried again after 5 s, doubling to 5 min; logged when the
			// error changes, not on every look.
			f := s.failing[name]
			f.n++
			f.until = time.Now().Add(min(5*time.Second<<min(f.n-1, 6), 5*time.Minute))
			if f.err != err.Error() {
				f.err = err.Error()
				s.Log.Error("could not retire standby VM", "vm", name, "reason", reason, "err", err, "retry_in", time.Until(f.until).Round(time.Second).String())
			}
			s.failing[name] = f
		}
	}()
}

// checkHealth checks, every serve.health_interval, that libvirt runs the
// idle machine (not paused, not gone) and that its SSH server answers;
// otherwise it is retired (and its place refilled).
func (s *Service) checkHealth(ctx context.Context, sb lifecycle.Standby, now time.Time) {
	s.mu.Lock()
	last, ok := s.checked[sb.Name]
	due := !ok || now.Sub(last) >= s.M.Manager().Cfg.Serve.HealthInterval.D()
	if due {
		s.checked[sb.Name] = now
	}
	s.mu.Unlock()
	if !due || !s.take(sb.Name) {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		why := s.M.Manager().Machine(sb.Name).Explain(ctx)
		if why == "" && ctx.Err() == nil {
			pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			err := sshexec.Probe(pctx, net.JoinHostPort(sb.Record.Address, strconv.Itoa(sb.Record.Port)))
			cancel()
			s.mu.Lock()
			if err != nil && ctx.Err() == nil {
				// Twice in a row: one slow answer on a loaded host is no
				// reason to throw a VM away (and load the host with a boot).
				if s.unhealthy[sb.Name]++; s.unhealthy[sb.Name] >= 2 {
					why = "SSH does not answer: " + err.Error()
				}
			} else if err == nil {
				delete(s.unhealthy, sb.Name)
			}
			s.mu.Unlock()
		}
		s.release(sb.Name)
		if why != "" {
			s.retire(ctx, sb, why)
		}
	}()
}

func (s *Service) take(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.busy[name] {
		return false
	}
	s.busy[name] = true
	return true
}

func (s *Service) release(name string) {
	s.mu.Lock()
	delete(s.busy, name)
	s.mu.Unlock()
}

// RetireCode is a retirement's reason as one of jobvm.RetireReasons.
func RetireCode(reason string) string {
	r := strings.ToLower(reason)
	has := func(words ...string) bool {
		for _, w := range words {
			if strings.Contains(r, w) {
				return true
			}
		}
		return false
	}
	switch {
	case has("boot cut off"):
		return "failed_boot"
	case has("idle longer than"):
		return "excess"
	case has("room", "pressure"):
		return "room"
	case has("max_age", "older than"):
		return "aged"
	case has("paused"):
		return "paused"
	case has("changed", "no longer"):
		return "drained"
	case has("ssh", "shut off", "gone", "crash", "not running", "dead"):
		return "dead"
	}
	return "other"
}

// Gauges counts the standby machines of every pooled image now (boots
// by this service's own count: a booting machine has no record yet).
func (s *Service) Gauges() ([]metrics.PoolGauge, error) {
	defer s.Hold()()
	all, err := s.M.Standbys()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	var out []metrics.PoolGauge
	for _, img := range s.M.Manager().Cfg.Pooled() {
		g := metrics.PoolGauge{Image: img.Name}
		for _, sb := range all {
			if sb.Record == nil || sb.Record.Standby == nil || sb.Record.Standby.Image != img.Name {
				continue
			}
			switch {
			case sb.Claim != nil && sb.Claim.Retire:
				g.Retiring++
			case sb.Claim != nil:
				g.Claimed++
			default:
				g.Idle++
			}
		}
		s.mu.Lock()
		g.Booting = s.booting[img.Name]
		s.mu.Unlock()
		g.Target = s.target(img, now)
		out = append(out, g)
	}
	return out, nil
}

// prepullTimeout bounds the pre-pulls into one idle VM.
const prepullTimeout = 10 * time.Minute

// prepull is the boot's preparation of an idle VM of img: its pool's
// prepull images pulled in before any job can claim it (nil without
// any). A failed pull is a warning: the VM is handed out all the same,
// and the job pulls what it lacks.
func (s *Service) prepull(img *config.Image) func(ctx context.Context, c *jobvm.Client) error {
	if img.Pool == nil || len(img.Pool.Prepull) == 0 {
		return nil
	}
	cfg := s.M.Manager().Cfg
	images := slices.Clone(img.Pool.Prepull)
	return func(ctx context.Context, c *jobvm.Client) error {
		// Bounded: a registry that does not answer holds no boot for long.
		pctx, cancel := context.WithTimeout(ctx, prepullTimeout)
		defer cancel()
		o, err := services.OptionsFrom(cfg.Services, 0, img.Name, img.User)
		if err == nil {
			var log bytes.Buffer
			err = services.Prepull(pctx, c, images, o, &log)
			s.Log.Info("pre-pull into a standby VM", "image", img.Name, "log", obs.Clip(log.String(), 4096))
		}
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			s.Log.Warn("pre-pull into a standby VM failed: its jobs pull what they need", "image", img.Name, "err", err)
		}
		return nil
	}
}
