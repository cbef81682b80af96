package pool

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// guest "boots" when the fake hypervisor starts a domain
// (lifecycletest.Guest): one sshtest server for all machines, so boots
// must not overlap and most tests boot one at a time.
type guest = lifecycletest.Guest

func newGuest(t *testing.T, hv *vmtest.Fake) *guest { return lifecycletest.NewGuest(t, hv) }

type env struct {
	t   *testing.T
	hv  *vmtest.Fake
	g   *guest
	m   *jobvm.Host
	s   *Service
	img *config.Image
	log *sshtest.Buffer
}

// newEnv is a service over the fake hypervisor for image tiny, whose
// [images.tiny.pool] table is pool; serve is the [serve] table (default:
// one boot at a time); extra goes before the tables.
func newEnv(t *testing.T, pool, serve, extra string) *env {
	t.Helper()
	if serve == "" {
		serve = "boot_parallelism = 1\n"
	}
	dir := t.TempDir()
	base := filepath.Join(dir, "tiny.qcow2")
	require.NoError(t, os.WriteFile(base, registrytest.Qcow2(1<<30, []byte("tiny")), 0o644))
	cfg, err := config.Parse([]byte(`
domain_type = "qemu"
state_dir = "` + filepath.Join(dir, "state") + `"
storage_pool = "jobs"
` + extra + `
[serve]
` + serve + `
[timeouts]
boot = "20s"
[defaults]
vcpus = 1
memory_mib = 256
[images.tiny]
base = "` + base + `"
[images.tiny.pool]
` + pool))
	require.NoError(t, err)
	img, _ := cfg.Image("tiny")
	hv := vmtest.New()
	g := newGuest(t, hv)
	log := &sshtest.Buffer{}
	s := newService(t, cfg, hv, g, log)
	m := s.M
	s.init()
	e := &env{t: t, hv: hv, g: g, m: m, s: s, img: img, log: log}
	// Runs first: nothing of the service outlives the test.
	t.Cleanup(func() {
		s.wg.Wait()
		_ = m.Close()
		if t.Failed() {
			t.Logf("service log:\n%s", log.String())
		}
	})
	return e
}

// newService is a service of cfg over the fake hypervisor hv, whose
// guests answer on g, logging to log.
func newService(t *testing.T, cfg *config.Config, hv *vmtest.Fake, g *guest, log *sshtest.Buffer) *Service {
	t.Helper()
	m, err := jobvm.Open(cfg, lifecycle.Options{Connect: func(context.Context, string) (vm.Hypervisor, error) { return hv, nil }})
	require.NoError(t, err)
	m.Manager().SSHPort = g.Port()
	m.Manager().SSHPollInterval = 20 * time.Millisecond
	m.Manager().AddressPollInterval = 10 * time.Millisecond
	return &Service{M: m, Log: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug}))}
}

// tick is one look of the service, and the work it started.
func (e *env) tick() {
	e.s.Tick(context.Background())
	e.s.wg.Wait()
}

func (e *env) standbys() map[string]lifecycle.Standby {
	e.t.Helper()
	all, err := e.m.Standbys()
	require.NoError(e.t, err)
	out := map[string]lifecycle.Standby{}
	for _, s := range all {
		out[s.Name] = s
	}
	return out
}

// idle lists the idle machines, sorted.
func (e *env) idle() []string {
	e.t.Helper()
	var out []string
	for n, s := range e.standbys() {
		if s.Idle() {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

func (e *env) domains() []string {
	e.hv.Lock()
	defer e.hv.Unlock()
	var out []string
	for n := range e.hv.Domains {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (e *env) calls(name string) int {
	e.hv.Lock()
	defer e.hv.Unlock()
	n := 0
	for _, c := range e.hv.Calls {
		if c == name {
			n++
		}
	}
	return n
}

func (e *env) name(suffix string) string {
	return lifecycle.MachinePrefix(e.m.Manager().Cfg.NamePrefix, e.m.Manager().Controller) + "sb-" + suffix
}

// addStandby makes what a boot leaves of an idle machine created at
// created, whose SSH answers on 127.0.0.1:port (0: the guest's server).
func (e *env) addStandby(suffix string, created time.Time, port int) string {
	t := e.t
	t.Helper()
	name := e.name(suffix)
	require.True(t, e.m.Manager().Machine(name).IsStandby())
	if port == 0 {
		port = e.g.Port()
	}
	size := e.m.Manager().Cfg.ImageSize(e.img)
	_, err := e.m.Manager().Store.Reserve(name, state.Reservation{VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB})
	require.NoError(t, err)
	base, err := state.VersionOf(e.img.Base)
	require.NoError(t, err)
	require.NoError(t, e.m.Manager().Store.Save(state.Machine{
		Name: name, Image: e.img.Name, Address: "127.0.0.1", Port: port, User: "root", Shell: "bash", Created: created.UTC(),
		Standby: &state.Standby{Image: e.img.Name, VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB, DiskGiB: size.DiskGiB, Base: base, Spec: lifecycle.SpecFingerprint(e.m.Manager().Cfg, e.img)},
	}))
	x, err := vm.MarshalOwner(vm.Owner{Controller: e.m.Manager().Controller, Frontend: jobvm.FrontendStandby, Job: e.img.Name,
		Created: created.UTC(), Deadline: created.Add(3 * time.Hour).UTC(), Volumes: []string{vm.DiskVolume(name)}})
	require.NoError(t, err)
	e.hv.Lock()
	e.hv.Domains[name] = &vmtest.Domain{XML: "<domain/>", OwnerXML: x, Active: true}
	e.hv.Volumes["jobs/"+vm.DiskVolume(name)] = nil
	e.hv.Unlock()
	return name
}

func (e *env) requireGone(name string) {
	t := e.t
	t.Helper()
	e.hv.Lock()
	_, dom := e.hv.Domains[name]
	_, disk := e.hv.Volumes["jobs/"+vm.DiskVolume(name)]
	e.hv.Unlock()
	require.False(t, dom, "domain %s left", name)
	require.False(t, disk, "disk of %s left", name)
	require.NoDirExists(t, e.m.Manager().Store.MachineDir(name))
}

func deadPort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// Tick boots the pool up to idle_count, verified and recorded as standby
// machines of the image, then keeps it there.
func TestTickBootsUpToIdleCount(t *testing.T) {
	e := newEnv(t, "idle_count = 2\n", "", "")
	e.tick()
	idle := e.idle()
	require.Len(t, idle, 2)
	base, err := state.VersionOf(e.img.Base)
	require.NoError(t, err)
	for _, n := range idle {
		rec := e.standbys()[n].Record
		require.Equal(t, &state.Standby{Image: "tiny", VCPUs: 1, MemoryMiB: 256, Base: base, Spec: lifecycle.SpecFingerprint(e.m.Manager().Cfg, e.img)}, rec.Standby)
		e.hv.Lock()
		o, err := vm.ParseOwner(e.hv.Domains[n].OwnerXML)
		active := e.hv.Domains[n].Active
		e.hv.Unlock()
		require.NoError(t, err)
		require.Equal(t, jobvm.FrontendStandby, o.Frontend)
		require.True(t, active)
	}
	_, age, looked := e.m.ServiceStatus()
	require.True(t, looked, "the look is recorded (doctor, ServiceRunning)")
	require.Less(t, age, time.Minute)
	require.Equal(t, 2, e.calls("Define"))

	// Full: more looks boot nothing, and the health checks pass.
	e.tick()
	e.tick()
	require.Equal(t, idle, e.idle())
	require.Equal(t, 2, e.calls("Define"))
	require.Equal(t, idle, e.domains())
	e.s.mu.Lock()
	require.Zero(t, e.s.booting["tiny"])
	require.Len(t, e.s.checked, 2, "both idle machines checked")
	e.s.mu.Unlock()
	require.NotContains(t, e.log.String(), "level=ERROR")
}

// A new base image file drains the pool: every idle machine of the old one
// is retired and replaced by one of the new.
func TestTickDrainsOnBaseChangeAndRefills(t *testing.T) {
	e := newEnv(t, "idle_count = 2\n", "", "")
	e.tick()
	old := e.idle()
	require.Len(t, old, 2)

	later := time.Now().Add(time.Hour)
	require.NoError(t, os.Chtimes(e.img.Base, later, later))
	base, err := state.VersionOf(e.img.Base)
	require.NoError(t, err)
	e.tick()
	for _, n := range old {
		e.requireGone(n)
	}
	now := e.idle()
	require.Len(t, now, 2, "refilled")
	for _, n := range now {
		require.NotContains(t, old, n)
		require.Equal(t, base, e.standbys()[n].Record.Standby.Base, "of the new base file")
	}
	require.Contains(t, e.log.String(), "changed")
	require.Equal(t, now, e.domains())
}

// An idle machine older than max_age is retired and replaced.
func TestTickRetiresAgedMachine(t *testing.T) {
	e := newEnv(t, "idle_count = 1\nmax_age = \"1h\"\n", "", "")
	aged := e.addStandby("0000000a", time.Now().Add(-61*time.Minute), 0)
	e.tick()
	e.requireGone(aged)
	idle := e.idle()
	require.Len(t, idle, 1)
	require.NotEqual(t, aged, idle[0])
	require.WithinDuration(t, time.Now(), e.standbys()[idle[0]].Record.Created, time.Minute)
	require.Contains(t, e.log.String(), "older than pool.max_age")
}

// Idle machines of an image whose pool table is gone, or whose size is no
// longer the image's, are retired; a pool no longer configured boots
// nothing.
func TestTickRetiresWhenPoolOrSizeChanged(t *testing.T) {
	e := newEnv(t, "idle_count = 1\n", "", "")
	resized := e.addStandby("0000000a", time.Now().Add(-time.Minute), 0)
	rec, err := e.m.Manager().Store.Record(resized)
	require.NoError(t, err)
	rec.Standby.MemoryMiB = 512
	require.NoError(t, e.m.Manager().Store.Save(*rec))
	e.tick()
	e.requireGone(resized)
	require.Contains(t, e.log.String(), "its size is no longer the image's")
	idle := e.idle()
	require.Len(t, idle, 1, "replaced by one of the image's size")

	e.img.Pool = nil
	e.tick()
	e.requireGone(idle[0])
	require.Contains(t, e.log.String(), "its image is no longer pooled")
	e.tick()
	require.Empty(t, e.standbys())
	require.Empty(t, e.domains())
}

// A standby directory without a record whose lock nobody holds is a boot an
// earlier service did not finish: removed. One whose lock is held is a boot
// in progress: left alone until it ends.
func TestTickRemovesCutOffBoot(t *testing.T) {
	e := newEnv(t, "idle_count = 1\n", "", "")
	cut := e.name("0000000a")
	_, err := e.m.Manager().Store.Reserve(cut, state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	e.hv.Lock()
	e.hv.Volumes["jobs/"+vm.DiskVolume(cut)] = nil
	e.hv.Unlock()
	inProgress := e.name("0000000b")
	_, err = e.m.Manager().Store.Reserve(inProgress, state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	unlock, err := e.m.Manager().Store.TryLock(inProgress)
	require.NoError(t, err)

	e.tick()
	e.requireGone(cut)
	require.DirExists(t, e.m.Manager().Store.MachineDir(inProgress))
	cl, err := e.m.Manager().Store.ClaimOf(inProgress)
	require.NoError(t, err)
	require.Nil(t, cl, "a boot in progress is not even marked")
	require.Len(t, e.idle(), 1, "and the pool is filled meanwhile")

	unlock()
	e.tick()
	require.NoDirExists(t, e.m.Manager().Store.MachineDir(inProgress))
}

// A machine marked for retirement is removed; one a job claimed is the
// job's, whatever its age or base.
func TestTickRemovesMarkedKeepsClaimed(t *testing.T) {
	e := newEnv(t, "idle_count = 1\n", "", "")
	marked := e.addStandby("0000000a", time.Now().Add(-time.Minute), 0)
	require.NoError(t, e.m.Manager().Store.Claim(marked, state.Claim{Retire: true, Reason: "paused", At: time.Now().UTC()}))
	claimed := e.addStandby("0000000b", time.Now().Add(-2*time.Hour), 0)
	require.NoError(t, e.m.Manager().Store.Claim(claimed, state.Claim{Job: "lve-x-7", At: time.Now().UTC()}))
	later := time.Now().Add(time.Hour)
	require.NoError(t, os.Chtimes(e.img.Base, later, later))

	e.tick()
	e.requireGone(marked)
	e.hv.Lock()
	require.True(t, e.hv.Domains[claimed].Active, "the job's machine stays")
	e.hv.Unlock()
	cl, err := e.m.Manager().Store.ClaimOf(claimed)
	require.NoError(t, err)
	require.Equal(t, "lve-x-7", cl.Job)
	require.Len(t, e.idle(), 1, "the claimed machine does not count as idle: one booted")
}

// While a job waits for room, the service boots nothing (jobs first); once
// the pressure is old, it refills.
func TestTickHoldsBootsUnderPressure(t *testing.T) {
	e := newEnv(t, "idle_count = 2\n", "", "")
	require.False(t, e.m.Manager().Capacity().UnderPressure())
	require.NoError(t, e.m.Manager().Store.Touch("pool-pressure"))
	require.True(t, e.m.Manager().Capacity().UnderPressure(), "the key a waiting job touches")

	e.tick()
	e.tick()
	require.Empty(t, e.idle())
	require.Zero(t, e.calls("Define"))

	old := time.Now().Add(-lifecycle.PressureHold - time.Second)
	require.NoError(t, os.Chtimes(filepath.Join(e.m.Manager().Store.Dir, "pool-pressure"), old, old))
	require.False(t, e.m.Manager().Capacity().UnderPressure())
	e.tick()
	require.Len(t, e.idle(), 2)
}

// At most serve.boot_parallelism machines boot at once; the rest wait their
// turn. Ending the service's ctx undoes the boots in progress.
func TestBootParallelism(t *testing.T) {
	e := newEnv(t, "idle_count = 4\n", "boot_parallelism = 2\n", "")
	var mu sync.Mutex
	inflight, most, starts := 0, 0, 0
	gate := make(chan struct{})
	e.hv.OnStart = func(name string, d *libvirtxml.Domain) {
		mu.Lock()
		inflight++
		starts++
		most = max(most, inflight)
		mu.Unlock()
		<-gate
		mu.Lock()
		inflight--
		mu.Unlock()
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.s.Tick(ctx)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return inflight == 2
	}, 10*time.Second, 5*time.Millisecond)
	e.s.mu.Lock()
	require.Equal(t, 4, e.s.booting["tiny"], "four boots started")
	e.s.mu.Unlock()
	mu.Lock()
	require.Equal(t, 2, starts, "the other two wait for a turn")
	mu.Unlock()

	// A look meanwhile counts the boots in progress: no more are started.
	e.s.Tick(ctx)
	e.s.mu.Lock()
	require.Equal(t, 4, e.s.booting["tiny"])
	e.s.mu.Unlock()

	cancel()
	close(gate)
	e.s.wg.Wait()
	mu.Lock()
	require.Equal(t, 2, most, "never more than boot_parallelism at once")
	mu.Unlock()
	require.Empty(t, e.domains(), "boots in progress undone")
	require.Empty(t, e.standbys())
	e.s.mu.Lock()
	require.Zero(t, e.s.booting["tiny"])
	require.Empty(t, e.s.backoff, "a stop is no failure")
	e.s.mu.Unlock()
}

// The target is the asks of the last idle_time, at least idle_count and at
// most max_idle; only the image's own asks count.
func TestTargetFollowsDemand(t *testing.T) {
	e := newEnv(t, "idle_count = 1\nmax_idle = 3\nidle_time = \"10m\"\n", "", "")
	now := time.Now()
	set := func(d []state.Demand) {
		e.s.mu.Lock()
		e.s.demand = d
		e.s.mu.Unlock()
	}
	recent := func(n int, image string, ago time.Duration) []state.Demand {
		var out []state.Demand
		for range n {
			out = append(out, state.Demand{Image: image, At: now.Add(-ago)})
		}
		return out
	}
	set(nil)
	require.Equal(t, 1, e.s.target(e.img, now), "idle_count without demand")
	set(recent(1, "tiny", time.Minute))
	require.Equal(t, 1, e.s.target(e.img, now))
	set(recent(2, "tiny", time.Minute))
	require.Equal(t, 2, e.s.target(e.img, now))
	set(recent(3, "tiny", 9*time.Minute))
	require.Equal(t, 3, e.s.target(e.img, now))
	set(recent(7, "tiny", time.Minute))
	require.Equal(t, 3, e.s.target(e.img, now), "at most max_idle")
	set(recent(7, "tiny", 11*time.Minute))
	require.Equal(t, 1, e.s.target(e.img, now), "asks older than idle_time are no demand")
	set(recent(5, "other", time.Minute))
	require.Equal(t, 1, e.s.target(e.img, now), "another image's asks are not this pool's demand")

	// forget drops asks older than idle_time, and those of images
	// without a pool.
	fresh := state.Demand{Image: "tiny", At: now.Add(-time.Minute)}
	set(append(recent(2, "tiny", 11*time.Minute), fresh, state.Demand{Image: "other", At: now}))
	e.s.forget(map[string]bool{}, now)
	e.s.mu.Lock()
	require.Equal(t, []state.Demand{fresh}, e.s.demand)
	e.s.mu.Unlock()
}

// Asks recorded by jobs (met or not) raise the target at the next look: the
// pool refills to the demand, also from idle_count = 0.
func TestTickRefillsToDemand(t *testing.T) {
	e := newEnv(t, "idle_count = 0\nmax_idle = 3\n", "", "")
	e.tick()
	require.Empty(t, e.idle(), "idle_count 0 and no demand: nothing booted")
	for range 2 {
		require.NoError(t, e.m.Manager().Store.NoteDemand("tiny"))
	}
	e.tick()
	require.Len(t, e.idle(), 2, "two asks in idle_time: target 2")
	d, err := e.m.Manager().Store.TakeDemand()
	require.NoError(t, err)
	require.Empty(t, d, "the service took the records")
}

// A claimed machine is logged once.
func TestTickLogsClaimOnce(t *testing.T) {
	e := newEnv(t, "idle_count = 0\nmax_idle = 1\n", "", "")
	n := e.addStandby("00000001", time.Now().Add(-time.Minute), 0)
	require.NoError(t, e.m.Manager().Store.Claim(n, state.Claim{Job: "lve-x-7", At: time.Now().UTC()}))
	e.tick()
	e.tick()
	require.Equal(t, 1, strings.Count(e.log.String(), "standby VM claimed"))
}

// Idle machines above the target that waited longer than idle_time are
// retired, oldest first; younger ones wait for a job.
func TestTickRetiresExcessIdle(t *testing.T) {
	e := newEnv(t, "idle_count = 1\nidle_time = \"10m\"\n", "", "")
	now := time.Now()
	oldest := e.addStandby("0000000a", now.Add(-30*time.Minute), 0)
	old := e.addStandby("0000000b", now.Add(-20*time.Minute), 0)
	young := e.addStandby("0000000c", now.Add(-time.Minute), 0)
	younger := e.addStandby("0000000d", now.Add(-30*time.Second), 0)
	// Their health was just checked: a check in progress would keep a
	// machine busy, and its retirement for the next look.
	e.s.mu.Lock()
	for _, n := range []string{oldest, old, young, younger} {
		e.s.checked[n] = now
	}
	e.s.mu.Unlock()
	e.tick()
	e.requireGone(oldest)
	e.requireGone(old)
	require.Equal(t, []string{young, younger}, e.idle(), "below idle_time they stay, above target or not")
	require.Zero(t, e.calls("Define"), "nothing booted")
	require.Contains(t, e.log.String(), "idle longer than pool.idle_time")
}

// Without the health checks set aside, the excess goes all the same (at
// the latest on the next look: a machine whose check runs is busy).
func TestTickRetiresExcessIdleEventually(t *testing.T) {
	e := newEnv(t, "idle_count = 1\nidle_time = \"10m\"\n", "", "")
	now := time.Now()
	old := e.addStandby("0000000a", now.Add(-30*time.Minute), 0)
	young := e.addStandby("0000000b", now.Add(-time.Minute), 0)
	e.tick()
	e.tick()
	e.requireGone(old)
	require.Equal(t, []string{young}, e.idle())
}

// A health check retires an idle machine that libvirt does not run, or
// whose SSH does not answer; the next look refills.
func TestTickRetiresUnhealthy(t *testing.T) {
	e := newEnv(t, "idle_count = 2\n", "", "")
	paused := e.addStandby("0000000a", time.Now().Add(-time.Minute), 0)
	e.hv.Lock()
	e.hv.Domains[paused].State = &vm.DomainState{Code: vm.StatePaused, Summary: "paused"}
	e.hv.Unlock()
	silent := e.addStandby("0000000b", time.Now().Add(-time.Minute), deadPort(t))
	e.tick()
	e.requireGone(paused)
	require.Contains(t, e.standbys(), silent, "one failed probe is not enough (a loaded host)")
	e.s.mu.Lock()
	e.s.checked[silent] = time.Now().Add(-time.Hour) // the next check is due
	e.s.mu.Unlock()
	e.tick()
	e.requireGone(silent)
	log := e.log.String()
	require.Contains(t, log, "is paused")
	require.Contains(t, log, "SSH does not answer")
	e.tick()
	idle := e.idle()
	require.Len(t, idle, 2)
	require.NotContains(t, idle, paused)
	require.NotContains(t, idle, silent)
}

// Health checks run every serve.health_interval, not on every look.
func TestHealthCheckInterval(t *testing.T) {
	e := newEnv(t, "idle_count = 1\n", "boot_parallelism = 1\nhealth_interval = \"1h\"\n", "")
	n := e.addStandby("0000000a", time.Now().Add(-time.Minute), 0)
	e.tick()
	require.Equal(t, 1, e.calls("State"), "checked on first sight")
	// Paused now, but the next check is not due: it stays for now (a claim
	// checks again anyway).
	e.hv.Lock()
	e.hv.Domains[n].State = &vm.DomainState{Code: vm.StatePaused, Summary: "paused"}
	e.hv.Unlock()
	e.tick()
	require.Equal(t, 1, e.calls("State"))
	require.Equal(t, []string{n}, e.idle())
	e.s.mu.Lock()
	e.s.checked[n] = time.Now().Add(-2 * time.Hour)
	e.s.mu.Unlock()
	e.tick()
	e.requireGone(n)
}

// A failed boot holds the image's refills for a while (backoff), growing
// with each failure; a full host holds them briefly without counting as a
// failure.
func TestBootFailureBacksOff(t *testing.T) {
	e := newEnv(t, "idle_count = 1\n", "", "")
	e.hv.FailOn["Define"] = errors.New("injected define failure")
	t0 := time.Now()
	e.tick()
	require.Equal(t, 1, e.calls("Define"))
	e.s.mu.Lock()
	bo := e.s.backoff["tiny"]
	e.s.mu.Unlock()
	require.Equal(t, 1, bo.failures)
	requireBackoffUntil(t, t0, 5*time.Second, bo.until)
	require.Contains(t, e.log.String(), "injected define failure")
	require.Empty(t, e.standbys(), "the failed boot is undone")
	locks, err := e.m.Manager().Store.LockNames()
	require.NoError(t, err)
	for _, l := range locks {
		require.False(t, e.m.Manager().Machine(l).IsStandby(), "lock file %s of the failed boot left", l)
	}

	delete(e.hv.FailOn, "Define")
	e.tick()
	require.Equal(t, 1, e.calls("Define"), "no boot while backing off")

	// The next failure waits longer.
	e.hv.FailOn["Define"] = errors.New("injected define failure")
	e.s.mu.Lock()
	bo = e.s.backoff["tiny"]
	bo.until = time.Time{}
	e.s.backoff["tiny"] = bo
	e.s.mu.Unlock()
	t0 = time.Now()
	e.tick()
	e.s.mu.Lock()
	bo = e.s.backoff["tiny"]
	e.s.mu.Unlock()
	require.Equal(t, 2, bo.failures)
	requireBackoffUntil(t, t0, 10*time.Second, bo.until)

	// Once it may try again and succeeds, the backoff is forgotten.
	delete(e.hv.FailOn, "Define")
	e.s.mu.Lock()
	bo.until = time.Time{}
	e.s.backoff["tiny"] = bo
	e.s.mu.Unlock()
	e.tick()
	require.Len(t, e.idle(), 1)
	e.s.mu.Lock()
	require.NotContains(t, e.s.backoff, "tiny")
	e.s.mu.Unlock()
}

func TestBootOnFullHostBacksOffBriefly(t *testing.T) {
	e := newEnv(t, "idle_count = 1\n", "", "[capacity]\nmax_vms = 1\n")
	// A job's machine, alive (its lock is held), fills the host.
	_, err := e.m.Manager().Store.Reserve("lve-x-job", state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	unlock, err := e.m.Manager().Store.TryLock("lve-x-job")
	require.NoError(t, err)
	defer unlock()
	t0 := time.Now()
	e.tick()
	require.Zero(t, e.calls("Define"))
	e.s.mu.Lock()
	bo := e.s.backoff["tiny"]
	e.s.mu.Unlock()
	require.Zero(t, bo.failures, "no room is no failure")
	requireBackoffUntil(t, t0, 5*time.Second, bo.until)
	require.False(t, e.m.Manager().Capacity().UnderPressure(), "the service's boots are no waiting job")
	require.NotContains(t, e.log.String(), "level=ERROR")
	require.DirExists(t, e.m.Manager().Store.MachineDir("lve-x-job"), "the job's machine is not touched")
}

// Run holds the service lock (one service per state_dir), keeps the pool,
// and on stop leaves the idle machines for the next start.
func TestRunKeepsPoolAndStops(t *testing.T) {
	e := newEnv(t, "idle_count = 2\n", "boot_parallelism = 1\ninterval = \"50ms\"\n", "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- e.s.Run(ctx) }()
	require.Eventually(t, func() bool { return e.m.ServiceRunning() }, 5*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return len(e.idle()) == 2 }, 20*time.Second, 20*time.Millisecond)

	second := &Service{M: e.m, Log: e.s.Log}
	err := second.Run(context.Background())
	require.ErrorIs(t, err, state.ErrBusy, "one service per installation")

	// A job claims one; the service refills.
	c, err := e.m.Claim(context.Background(), jobvm.JobRequest{
		Request: lifecycle.Request{Name: "lve-x-7", Image: e.img, Frontend: "gitlab", Job: "7", Lifetime: time.Hour}, Size: e.m.Manager().Cfg.ImageSize(e.img)})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(e.idle()) == 2 }, 20*time.Second, 20*time.Millisecond)
	require.NotContains(t, e.idle(), c.Machine.Name)

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not stop")
	}
	require.False(t, e.m.ServiceRunning())
	require.Len(t, e.idle(), 2, "idle machines stay for the next start")
	require.Len(t, e.domains(), 3)
}

// A job that waits for room cancels the boots in progress: their undo
// gives the room back.
func TestPressureCancelsBootsInProgress(t *testing.T) {
	e := newEnv(t, "idle_count = 1\n", "", "")
	e.hv.Lock()
	e.hv.OnStart = nil // no lease: the boot waits for its address
	e.hv.Unlock()
	e.s.Tick(context.Background()) // a look, without waiting for its boot
	require.Eventually(t, func() bool { return e.calls("Start") == 1 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, e.m.Manager().Store.Touch("pool-pressure"))
	t0 := time.Now()
	e.tick()
	require.Less(t, time.Since(t0), 10*time.Second, "cancelled, not run into the boot timeout")
	require.Contains(t, e.log.String(), "cancelled standby boots in progress")
	e.s.wg.Wait()
	require.Empty(t, e.domains(), "the cancelled boot was undone")
	require.Empty(t, e.standbys())
	e.s.mu.Lock()
	require.Zero(t, e.s.booting["tiny"])
	e.s.mu.Unlock()
}

// When its configuration file changes, Run stops (to be restarted with the
// new file) and says why.
func TestRunStopsWhenConfigChanges(t *testing.T) {
	e := newEnv(t, "idle_count = 0\nmax_idle = 1\n", "interval = \"50ms\"\n", "")
	path := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, os.WriteFile(path, []byte("# v1\n"), 0o600))
	e.m.Manager().Cfg.Path = path
	done := make(chan error, 1)
	go func() { done <- e.s.Run(context.Background()) }()
	require.Eventually(t, func() bool { return e.m.ServiceRunning() }, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, os.WriteFile(path, []byte("# v2, longer\n"), 0o600))
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrConfigChanged)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not stop after the configuration changed")
	}
	require.Contains(t, e.log.String(), "configuration file changed")
}

// A removal that keeps failing is retried with backoff and logged once per
// distinct error, not on every look.
func TestRetireFailureBacksOff(t *testing.T) {
	e := newEnv(t, "idle_count = 0\nmax_idle = 1\n", "", "")
	n := e.addStandby("0000000a", time.Now().Add(-time.Minute), 0)
	require.NoError(t, e.m.Manager().Store.Claim(n, state.Claim{Retire: true, Reason: "test", At: time.Now().UTC()}))
	e.hv.Lock()
	e.hv.FailOn["Destroy"] = errors.New("injected destroy failure")
	e.hv.Unlock()
	for range 5 {
		e.tick()
	}
	require.Equal(t, 1, strings.Count(e.log.String(), "could not retire standby VM"), "logged once")
	require.Equal(t, 1, e.calls("Destroy"), "not retried before its backoff")
	e.hv.Lock()
	delete(e.hv.FailOn, "Destroy")
	e.hv.Unlock()
	e.s.mu.Lock()
	f := e.s.failing[n]
	f.until = time.Now()
	e.s.failing[n] = f
	e.s.mu.Unlock()
	e.tick()
	e.requireGone(n)
}

// A standby directory whose record lacks the standby part (written by
// hand, or damaged) is retired, not a crash of the service.
func TestTickRetiresRecordWithoutStandbyPart(t *testing.T) {
	e := newEnv(t, "idle_count = 0\nmax_idle = 1\n", "", "")
	n := e.addStandby("0000000a", time.Now().Add(-time.Minute), 0)
	rec, err := e.m.Manager().Store.Record(n)
	require.NoError(t, err)
	rec.Standby = nil
	require.NoError(t, e.m.Manager().Store.Save(*rec))
	e.tick()
	e.requireGone(n)
	require.Contains(t, e.log.String(), "no standby record")
}

// An image with snapshot = true gets its memory snapshot from the service,
// and a new one when its base file changes (the old template is left to
// the sweep, lifecycle's TestSweepRemovesUnrecordedTemplate).
func TestTickKeepsSnapshots(t *testing.T) {
	e := newEnv(t, "idle_count = 0\nmax_idle = 1\n", "", "")
	e.img.Boot, e.img.Kernel, e.img.Snapshot = config.BootKernel, "/img/vmlinuz", true
	e.tick()
	snaps := lifecycle.SnapshotsOf(e.m.Manager())
	rec, why := snaps.Current(context.Background(), e.img)
	require.NotNil(t, rec, why)
	require.Contains(t, e.log.String(), "memory snapshot made")
	e.tick() // within the look interval: nothing
	e.s.snapsLooked = time.Time{}
	e.tick() // current: nothing to do
	again, _ := snaps.Current(context.Background(), e.img)
	require.Equal(t, rec.Template, again.Template)

	// The base file changes: the snapshot is stale, and replaced.
	later := time.Now().Add(time.Minute)
	require.NoError(t, os.Chtimes(e.img.Base, later, later))
	_, why = snaps.Current(context.Background(), e.img)
	require.Contains(t, why, "stale")
	e.s.snapsLooked = time.Time{}
	e.tick()
	rec2, why := snaps.Current(context.Background(), e.img)
	require.NotNil(t, rec2, why)
	require.NotEqual(t, rec.Template, rec2.Template)
	require.Equal(t, rec.Template, rec2.Previous, "the old template is the sweep's, after a grace")
	require.Empty(t, e.domains(), "a saved template is undefined")

	// Its restores fail: it is made again once, then such rebuilds wait.
	fail := func() {
		for range state.MaxSnapshotFailures {
			require.NoError(t, e.m.Manager().Store.NoteSnapshotRestore(context.Background(), "tiny", rec2.Template, true))
		}
	}
	fail()
	e.s.snapsLooked = time.Time{}
	e.tick()
	rec3, why := snaps.Current(context.Background(), e.img)
	require.NotNil(t, rec3, why)
	require.NotEqual(t, rec2.Template, rec3.Template)
	require.Contains(t, e.log.String(), "made again after its restores failed")
	rec2 = rec3
	fail()
	e.s.snapsLooked = time.Time{}
	e.tick()
	_, why = snaps.Current(context.Background(), e.img)
	require.Contains(t, why, "restores failed", "the next rebuild for failures waits")
	require.NotContains(t, e.log.String(), "level=ERROR")
}

// requireBackoffUntil requires until to be d after a moment between since
// (taken before the tick that set it) and now: exact however long the
// tick took on a loaded host.
func requireBackoffUntil(t *testing.T, since time.Time, d time.Duration, until time.Time) {
	t.Helper()
	require.False(t, until.Before(since.Add(d)), "backoff until %s: before %s after the tick began", until.Format(time.StampMilli), d)
	require.False(t, until.After(time.Now().Add(d)), "backoff until %s: more than %s from now", until.Format(time.StampMilli), d)
}
