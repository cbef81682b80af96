package jobvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// bannerServer listens on 127.0.0.1 and greets every connection with an
// SSH version line, as a guest's sshd does, and returns its port.
func bannerServer(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.WriteString(c, "SSH-2.0-test\r\n")
				_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
				_, _ = io.Copy(io.Discard, c) // until the prober hangs up
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// deadPort is a port on 127.0.0.1 where nothing listens.
func deadPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// poolManager is manager with standby pools: image tiny (pool idle_count
// 2), image other (pool idle_count 1, another base file) and image cold (no
// pool); every VM is 1 vCPU, 256 MiB. extra goes before the tables.
func poolManager(t *testing.T, hv *vmtest.Fake, sshPort int, extra string) (*Host, *config.Image, *lifecycletest.Sayings) {
	t.Helper()
	dir := t.TempDir()
	base := filepath.Join(dir, "tiny.qcow2")
	otherBase := filepath.Join(dir, "other.qcow2")
	require.NoError(t, os.WriteFile(base, registrytest.Qcow2(1<<30, []byte("tiny")), 0o644))
	require.NoError(t, os.WriteFile(otherBase, registrytest.Qcow2(1<<30, []byte("other")), 0o644))
	cfg, err := config.Parse([]byte(`
domain_type = "qemu"
state_dir = "` + filepath.Join(dir, "state") + `"
storage_pool = "jobs"
default_image = "tiny"
` + extra + `
[timeouts]
boot = "20s"
[defaults]
vcpus = 1
memory_mib = 256
[images.tiny]
base = "` + base + `"
[images.tiny.pool]
idle_count = 2
[images.other]
base = "` + otherBase + `"
[images.other.pool]
idle_count = 1
[images.cold]
base = "` + base + `"
`))
	require.NoError(t, err)
	img, _ := cfg.Image("tiny")
	s := lifecycletest.NewSayings(t)
	return newHost(cfg, hv, sshPort, s), img, s
}

func mustImage(t *testing.T, m *Host, name string) *config.Image {
	t.Helper()
	img, ok := m.Manager().Cfg.Image(name)
	require.True(t, ok)
	return img
}

// addStandby makes what BootStandby leaves of an idle machine of img,
// created at created, whose guest answers SSH on 127.0.0.1:port: its
// reservation and record (with the base file's version of now), and a
// running domain with the standby ownership record and a disk volume.
func addStandby(t *testing.T, m *Host, hv *vmtest.Fake, img *config.Image, suffix string, created time.Time, port int) string {
	t.Helper()
	name := lifecycle.MachinePrefix("lve", controller) + "sb-" + suffix
	require.True(t, m.Manager().Machine(name).IsStandby())
	size := m.Manager().Cfg.ImageSize(img)
	_, err := m.Manager().Store.Reserve(name, state.Reservation{VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB})
	require.NoError(t, err)
	base, err := state.VersionOf(img.Base)
	require.NoError(t, err)
	require.NoError(t, m.Manager().Store.Save(state.Machine{
		Name: name, Image: img.Name, Address: "127.0.0.1", Port: port, User: "root", Shell: "bash", Created: created.UTC(),
		Standby: &state.Standby{Image: img.Name, VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB, DiskGiB: size.DiskGiB, Base: base, Spec: lifecycle.SpecFingerprint(m.Manager().Cfg, img)},
	}))
	x, err := vm.MarshalOwner(vm.Owner{Controller: controller, Frontend: FrontendStandby, Job: img.Name, Created: created.UTC(),
		Deadline: created.Add(time.Hour + 30*time.Minute).UTC(), Volumes: []string{vm.DiskVolume(name)}})
	require.NoError(t, err)
	hv.Lock()
	hv.Domains[name] = &vmtest.Domain{XML: "<domain/>", OwnerXML: x, Active: true}
	hv.Volumes["jobs/"+vm.DiskVolume(name)] = nil
	hv.Unlock()
	return name
}

func claimRequest(m *Host, img *config.Image, job string) JobRequest {
	return JobRequest{Request: lifecycle.Request{Name: job, Image: img, Frontend: "gitlab", Job: "42", Lifetime: time.Hour}, Size: m.Manager().Cfg.ImageSize(img)}
}

// lockService plays the running pool service for the rest of the test:
// its lock held, and a look at its pools just now.
func lockService(t *testing.T, m *Host) {
	t.Helper()
	unlock, err := m.LockService(context.Background())
	require.NoError(t, err)
	t.Cleanup(unlock)
	require.NoError(t, m.Heartbeat())
	require.True(t, m.ServiceRunning())
}

// requireNoStandby asserts that err is an *ErrNoStandby whose reason
// contains want, and returns the reason.
func requireNoStandby(t *testing.T, err error, want string) string {
	t.Helper()
	var ns *ErrNoStandby
	require.ErrorAs(t, err, &ns)
	require.Contains(t, ns.Why, want)
	return ns.Why
}

func ownerOf(t *testing.T, hv *vmtest.Fake, name string) vm.Owner {
	t.Helper()
	hv.Lock()
	d, ok := hv.Domains[name]
	var x string
	if ok {
		x = d.OwnerXML
	}
	hv.Unlock()
	require.True(t, ok, "domain %s", name)
	o, err := vm.ParseOwner(x)
	require.NoError(t, err)
	return o
}

func requireGone(t *testing.T, hv *vmtest.Fake, m *Host, name string) {
	t.Helper()
	hv.Lock()
	_, dom := hv.Domains[name]
	_, disk := hv.Volumes["jobs/"+vm.DiskVolume(name)]
	_, seed := hv.Volumes["jobs/"+vm.SeedVolume(name)]
	hv.Unlock()
	require.False(t, dom, "domain %s left", name)
	require.False(t, disk, "disk of %s left", name)
	require.False(t, seed, "seed of %s left", name)
	require.NoDirExists(t, m.Manager().Store.MachineDir(name))
	locks, err := m.Manager().Store.LockNames()
	require.NoError(t, err)
	require.NotContains(t, locks, name, "lock file left")
}

func TestStandbyName(t *testing.T) {
	hv := vmtest.New()
	m, _, _ := poolManager(t, hv, 22, "")
	a, err := lifecycle.StandbyName("lve", controller)
	require.NoError(t, err)
	b, err := lifecycle.StandbyName("lve", controller)
	require.NoError(t, err)
	require.Regexp(t, `^lve-0123abcd-sb-[0-9a-f]{8}$`, a)
	require.NotEqual(t, a, b)
	require.NoError(t, vm.CheckName(a))
	require.True(t, m.Manager().Machine(a).IsStandby())
	require.False(t, m.Manager().Machine("lve-0123abcd-7").IsStandby(), "a job's machine")
	require.False(t, m.Manager().Machine("lve-ffffffff-sb-00000000").IsStandby(), "another installation's")
	other, err := lifecycle.StandbyName("lve", "ffffffff-0000-4000-8000-000000000000")
	require.NoError(t, err)
	require.False(t, m.Manager().Machine(other).IsStandby())
}

// ServiceRunning is true only while LockService's lock is held and the
// service has looked at its pools lately; a second service is refused.
func TestLockServiceAndServiceRunning(t *testing.T) {
	hv := vmtest.New()
	m, _, _ := poolManager(t, hv, 22, "")
	locked, _, looked := m.ServiceStatus()
	require.False(t, locked)
	require.False(t, looked)
	require.False(t, m.ServiceRunning())
	require.False(t, m.ServiceRunning(), "looking does not take it")

	unlock, err := m.LockService(context.Background())
	require.NoError(t, err)
	locked, _, looked = m.ServiceStatus()
	require.True(t, locked)
	require.False(t, looked)
	require.False(t, m.ServiceRunning(), "locked, but it never looked at its pools")

	require.NoError(t, m.Heartbeat())
	locked, age, looked := m.ServiceStatus()
	require.True(t, locked)
	require.True(t, looked)
	require.Less(t, age, time.Minute)
	require.True(t, m.ServiceRunning())

	// A service that stopped looking (hung) does not count.
	old := time.Now().Add(-time.Minute)
	require.NoError(t, os.Chtimes(filepath.Join(m.Manager().Store.Dir, heartbeatKey), old, old))
	require.False(t, m.ServiceRunning(), "heartbeat a minute old")
	require.NoError(t, m.Heartbeat())
	require.True(t, m.ServiceRunning())

	start := time.Now()
	_, err = m.LockService(context.Background())
	require.ErrorIs(t, err, state.ErrBusy)
	require.ErrorContains(t, err, "another libvirt-executor serve runs")
	require.Less(t, time.Since(start), 5*time.Second)
	unlock()
	require.False(t, m.ServiceRunning(), "a fresh heartbeat without the lock: stopped")
}

// A hung service (lock held, heartbeat stale) sends jobs cold.
func TestClaimWithHungServiceGoesCold(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	sb := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-time.Minute), port)
	lockService(t, m)
	old := time.Now().Add(-time.Minute)
	require.NoError(t, os.Chtimes(filepath.Join(m.Manager().Store.Dir, heartbeatKey), old, old))
	_, err := m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-7"))
	requireNoStandby(t, err, "is not running")
	cl, err := m.Manager().Store.ClaimOf(sb)
	require.NoError(t, err)
	require.Nil(t, cl)
}

// Claim says why it has no machine for the job: each refusal comes from
// its own cause, and refusing leaves the idle machine unclaimed.
func TestClaimSaysWhyThereIsNoStandby(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	ctx := context.Background()
	sb := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-time.Minute), port)
	job := "lve-0123abcd-7"

	c, err := m.Claim(ctx, claimRequest(m, img, job))
	require.Nil(t, c)
	requireNoStandby(t, err, "the pool service (libvirt-executor serve) is not running")

	lockService(t, m)

	cold := mustImage(t, m, "cold")
	_, err = m.Claim(ctx, claimRequest(m, cold, job))
	requireNoStandby(t, err, "image cold has no standby pool")

	req := claimRequest(m, img, job)
	req.Size.MemoryMiB = 512
	_, err = m.Claim(ctx, req)
	requireNoStandby(t, err, "the job asks for 1 vCPU, 512 MiB, 0 GiB; the pool of tiny keeps 1 vCPU, 256 MiB, 0 GiB")

	_, err = m.Claim(ctx, claimRequest(m, mustImage(t, m, "other"), job))
	why := requireNoStandby(t, err, "no idle VM of image other in the pool")
	require.NotContains(t, why, "passed over", "tiny's machine is not other's to pass over")

	cl, err := m.Manager().Store.ClaimOf(sb)
	require.NoError(t, err)
	require.Nil(t, cl, "no refusal claimed the idle machine")
	jm, err := m.Manager().Store.MachineOfJob(job)
	require.NoError(t, err)
	require.Nil(t, jm, "no refusal mapped the job")

	// The same job, asking right, gets it.
	c, err = m.Claim(ctx, claimRequest(m, img, job))
	require.NoError(t, err)
	require.Equal(t, sb, c.Machine.Name)
}

// Claim takes the oldest idle machine of the job's image: not another
// image's, not a claimed one, not one still booting. The job is recorded
// in the claim, the mapping and the ownership record.
func TestClaimTakesTheOldestIdleMachine(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	ctx := context.Background()
	now := time.Now()
	young := addStandby(t, m, hv, img, "0000000b", now.Add(-10*time.Minute), port)
	oldest := addStandby(t, m, hv, img, "0000000a", now.Add(-30*time.Minute), port)
	middle := addStandby(t, m, hv, img, "0000000c", now.Add(-20*time.Minute), port)
	otherImage := addStandby(t, m, hv, mustImage(t, m, "other"), "0000000d", now.Add(-50*time.Minute), port)
	taken := addStandby(t, m, hv, img, "0000000e", now.Add(-40*time.Minute), port)
	require.NoError(t, m.Manager().Store.Claim(taken, state.Claim{Job: "lve-0123abcd-99", At: now.UTC()}))
	booting := lifecycle.MachinePrefix("lve", controller) + "sb-" + "0000000f"
	_, err := m.Manager().Store.Reserve(booting, state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	before := ownerOf(t, hv, oldest)
	lockService(t, m)

	job := "lve-0123abcd-7"
	c, err := m.Claim(ctx, claimRequest(m, img, job))
	require.NoError(t, err)
	require.Equal(t, oldest, c.Machine.Name)
	require.Empty(t, c.Skipped)
	require.InDelta(t, (30 * time.Minute).Seconds(), c.Idle.Seconds(), 60)
	require.Positive(t, c.Took)
	require.NotNil(t, c.Machine.Standby)

	cl, err := m.Manager().Store.ClaimOf(oldest)
	require.NoError(t, err)
	require.Equal(t, job, cl.Job)
	require.False(t, cl.Retire)
	require.WithinDuration(t, time.Now(), cl.At, time.Minute)

	jm, err := m.Manager().Store.MachineOfJob(job)
	require.NoError(t, err)
	require.Equal(t, oldest, jm.Machine)
	require.True(t, jm.Warm)
	got, err := m.MachineOf(job)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: oldest, Warm: true}, got)

	// The ownership record is the job's now; what says the machine is
	// ours and what belongs to it are unchanged.
	o := ownerOf(t, hv, oldest)
	require.Equal(t, controller, o.Controller)
	require.Equal(t, "gitlab", o.Frontend)
	require.Equal(t, "42", o.Job)
	require.WithinDuration(t, time.Now().Add(time.Hour+30*time.Minute), o.Deadline, time.Minute,
		"now + the job's lifetime + timeouts.job_slack")
	require.NotEqual(t, before.Deadline, o.Deadline)
	require.Equal(t, before.Created, o.Created)
	require.Equal(t, before.Volumes, o.Volumes)

	for _, n := range []string{young, middle, otherImage, booting} {
		cl, err := m.Manager().Store.ClaimOf(n)
		require.NoError(t, err)
		require.Nil(t, cl, "%s untouched", n)
	}
	cl, err = m.Manager().Store.ClaimOf(taken)
	require.NoError(t, err)
	require.Equal(t, "lve-0123abcd-99", cl.Job, "the other job's claim stays")

	// Then the next oldest, then the youngest, then none.
	c, err = m.Claim(ctx, claimRequest(m, img, "lve-0123abcd-8"))
	require.NoError(t, err)
	require.Equal(t, middle, c.Machine.Name)
	c, err = m.Claim(ctx, claimRequest(m, img, "lve-0123abcd-9"))
	require.NoError(t, err)
	require.Equal(t, young, c.Machine.Name)
	_, err = m.Claim(ctx, claimRequest(m, img, "lve-0123abcd-10"))
	requireNoStandby(t, err, "no idle VM of image tiny in the pool")
	jm, err = m.Manager().Store.MachineOfJob("lve-0123abcd-10")
	require.NoError(t, err)
	require.Nil(t, jm)
}

// Many jobs claiming at once never get one machine twice, and every idle
// machine is handed out.
func TestClaimConcurrentNeverSharesAMachine(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	now := time.Now()
	var machines []string
	for i := range 4 {
		machines = append(machines, addStandby(t, m, hv, img, fmt.Sprintf("0000000%d", i), now.Add(-time.Duration(i+1)*time.Minute), port))
	}
	lockService(t, m)

	const jobs = 8
	got := make([]string, jobs)
	errs := make([]error, jobs)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := m.Claim(context.Background(), claimRequest(m, img, fmt.Sprintf("lve-0123abcd-%d", 100+i)))
			errs[i] = err
			if err == nil {
				got[i] = c.Machine.Name
			}
		}()
	}
	close(start)
	wg.Wait()

	owner := map[string]string{}
	for i, err := range errs {
		job := fmt.Sprintf("lve-0123abcd-%d", 100+i)
		if err != nil {
			requireNoStandby(t, err, "no idle VM of image tiny")
			jm, err := m.Manager().Store.MachineOfJob(job)
			require.NoError(t, err)
			require.Nil(t, jm, "a job without a machine has no mapping")
			continue
		}
		prev, dup := owner[got[i]]
		require.False(t, dup, "%s handed to %s and %s", got[i], prev, job)
		owner[got[i]] = job
		cl, err := m.Manager().Store.ClaimOf(got[i])
		require.NoError(t, err)
		require.Equal(t, job, cl.Job, "the claim on file names the job that got it")
		jm, err := m.Manager().Store.MachineOfJob(job)
		require.NoError(t, err)
		require.Equal(t, got[i], jm.Machine)
	}
	require.Len(t, owner, 4, "every idle machine claimed once")
	for _, n := range machines {
		require.Contains(t, owner, n)
	}
	mapped, err := m.Manager().Store.MappedJobs()
	require.NoError(t, err)
	require.Len(t, mapped, 4)
}

// A machine that fails a check is passed over, marked for retirement (never
// handed out, the service removes it) and the next one is taken.
func TestClaimPassesOverUnfitMachines(t *testing.T) {
	for _, tc := range []struct {
		name string
		// age of the unfit machine (it is older than the fit one).
		age time.Duration
		// dead makes its SSH port one where nothing listens.
		dead bool
		// spoil makes it unfit, before the fit machine is made.
		spoil func(t *testing.T, m *Host, hv *vmtest.Fake, img *config.Image, name string)
		want  string
	}{
		{name: "base image changed", age: 5 * time.Minute, want: "changed since it booted",
			spoil: func(t *testing.T, _ *Host, _ *vmtest.Fake, img *config.Image, _ string) {
				later := time.Now().Add(time.Hour)
				require.NoError(t, os.Chtimes(img.Base, later, later))
			}},
		{name: "base image rewritten, same mtime", age: 5 * time.Minute, want: "changed since it booted",
			spoil: func(t *testing.T, _ *Host, _ *vmtest.Fake, img *config.Image, _ string) {
				st, err := os.Stat(img.Base)
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(img.Base, registrytest.Qcow2(1<<30, []byte("a longer new image")), 0o644))
				require.NoError(t, os.Chtimes(img.Base, st.ModTime(), st.ModTime()))
			}},
		{name: "older than max_age", age: 61 * time.Minute, want: "older than pool.max_age"},
		{name: "paused", age: 5 * time.Minute, want: "is paused",
			spoil: func(t *testing.T, _ *Host, hv *vmtest.Fake, _ *config.Image, name string) {
				hv.Lock()
				hv.Domains[name].State = &vm.DomainState{Code: vm.StatePaused, Summary: "paused"}
				hv.Unlock()
			}},
		{name: "shut off", age: 5 * time.Minute, want: "is shut off",
			spoil: func(t *testing.T, _ *Host, hv *vmtest.Fake, _ *config.Image, name string) {
				hv.Lock()
				hv.Domains[name].Active = false
				hv.Unlock()
			}},
		{name: "domain gone", age: 5 * time.Minute, want: "no longer exists",
			spoil: func(t *testing.T, _ *Host, hv *vmtest.Fake, _ *config.Image, name string) {
				hv.Lock()
				delete(hv.Domains, name)
				hv.Unlock()
			}},
		{name: "SSH does not answer", age: 5 * time.Minute, dead: true, want: "its SSH port does not answer"},
		{name: "size no longer the image's", age: 5 * time.Minute, want: "its size is no longer the image's",
			spoil: func(t *testing.T, m *Host, _ *vmtest.Fake, _ *config.Image, name string) {
				rec, err := m.Manager().Store.Record(name)
				require.NoError(t, err)
				rec.Standby.MemoryMiB = 512
				require.NoError(t, m.Manager().Store.Save(*rec))
			}},
		{name: "gitlab-runner for the guests changed", age: 5 * time.Minute, want: "the guest tools disk (gitlab-runner, step-runner) changed",
			spoil: func(t *testing.T, m *Host, _ *vmtest.Fake, _ *config.Image, name string) {
				// Booted with the tools disk of an older binary.
				rec, err := m.Manager().Store.Record(name)
				require.NoError(t, err)
				rec.Tools = &state.Tools{Volume: guesttools.ToolsVolumeName(m.Manager().Cfg.NamePrefix, m.Manager().Controller, strings.Repeat("0", 64)), Source: "/old", SHA256: strings.Repeat("0", 64)}
				require.NoError(t, m.Manager().Store.Save(*rec))
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hv := vmtest.New()
			port := bannerServer(t)
			m, img, _ := poolManager(t, hv, port, "")
			badPort := port
			if tc.dead {
				badPort = deadPort(t)
			}
			bad := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-tc.age), badPort)
			if tc.spoil != nil {
				tc.spoil(t, m, hv, img, bad)
			}
			good := addStandby(t, m, hv, img, "0000000b", time.Now().Add(-time.Minute), port)
			lockService(t, m)

			c, err := m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-7"))
			require.NoError(t, err)
			require.Equal(t, good, c.Machine.Name)
			require.Len(t, c.Skipped, 1)
			require.Contains(t, c.Skipped[0], bad+": ")
			require.Contains(t, c.Skipped[0], tc.want)

			cl, err := m.Manager().Store.ClaimOf(bad)
			require.NoError(t, err)
			require.NotNil(t, cl, "marked")
			require.True(t, cl.Retire)
			require.Empty(t, cl.Job)
			require.Contains(t, cl.Reason, tc.want)

			// Never handed out: the next job finds nothing.
			_, err = m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-8"))
			why := requireNoStandby(t, err, "no idle VM of image tiny in the pool")
			require.NotContains(t, why, bad)
			jm, err := m.Manager().Store.MachineOfJob("lve-0123abcd-8")
			require.NoError(t, err)
			require.Nil(t, jm)
			got, err := m.MachineOf("lve-0123abcd-8")
			require.NoError(t, err)
			require.Equal(t, JobMachine{Name: "lve-0123abcd-8"}, got, "a retire mark is no job's claim")
		})
	}
}

// When every idle machine is unfit, the job learns which and why.
func TestClaimAllUnfitSaysWhy(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	a := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-2*time.Minute), port)
	b := addStandby(t, m, hv, img, "0000000b", time.Now().Add(-time.Minute), port)
	require.NoError(t, os.Remove(img.Base))
	lockService(t, m)
	_, err := m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-7"))
	why := requireNoStandby(t, err, "no idle VM of image tiny in the pool (passed over: ")
	require.Contains(t, why, a+": the base image file of image tiny is missing")
	require.Contains(t, why, b+": the base image file of image tiny is missing")
	require.NotContains(t, why, img.Base, "no host path in the job log")
	for _, n := range []string{a, b} {
		cl, err := m.Manager().Store.ClaimOf(n)
		require.NoError(t, err)
		require.True(t, cl.Retire, n)
	}
}

// A machine whose lock another process holds (the service retiring it, a
// sweep) is passed over as busy, not marked.
func TestClaimPassesOverBusyMachine(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	busy := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-2*time.Minute), port)
	free := addStandby(t, m, hv, img, "0000000b", time.Now().Add(-time.Minute), port)
	unlock, err := m.Manager().Store.TryLock(busy)
	require.NoError(t, err)
	defer unlock()
	lockService(t, m)
	c, err := m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-7"))
	require.NoError(t, err)
	require.Equal(t, free, c.Machine.Name)
	require.Equal(t, []string{busy + ": busy"}, c.Skipped)
	cl, err := m.Manager().Store.ClaimOf(busy)
	require.NoError(t, err)
	require.Nil(t, cl, "a busy machine is not marked")
}

// A cancel that lands after the claim is made (while the ownership record
// is being changed) removes the machine: it never goes back to the pool,
// and nothing of it is left, nor the job's mapping.
func TestClaimCancelledAfterClaimRemovesMachine(t *testing.T) {
	hv := vmtest.New()
	hang := make(chan struct{})
	var once sync.Once
	// After the claim and the mapping, libvirt hangs: the claim's ownership
	// update blocks in the fake.
	hv.BeforeCall = func(method string) {
		if method == "SetOwner" {
			once.Do(func() {
				hv.Lock()
				hv.Hang = hang
				hv.Unlock()
			})
		}
	}
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	sb := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-time.Minute), port)
	lockService(t, m)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	job := "lve-0123abcd-7"
	done := make(chan error, 1)
	go func() {
		_, err := m.Claim(ctx, claimRequest(m, img, job))
		done <- err
	}()
	require.Eventually(t, func() bool { return hv.Hung() > 0 }, 10*time.Second, 5*time.Millisecond)
	// The claim and mapping are made; the ownership record is not yet.
	cl, err := m.Manager().Store.ClaimOf(sb)
	require.NoError(t, err)
	require.Equal(t, job, cl.Job)
	jm, err := m.Manager().Store.MachineOfJob(job)
	require.NoError(t, err)
	require.Equal(t, sb, jm.Machine)

	cancel()
	hv.Lock()
	hv.Hang = nil
	hv.Unlock()
	close(hang)
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Claim did not return after the cancel")
	}
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "claim "+sb)
	requireGone(t, hv, m, sb)
	jm, err = m.Manager().Store.MachineOfJob(job)
	require.NoError(t, err)
	require.Nil(t, jm, "mapping removed")
	all, err := m.Standbys()
	require.NoError(t, err)
	require.Empty(t, all)
}

// A failed ownership update after the claim removes the machine likewise.
func TestClaimFailedOwnerUpdateRemovesMachine(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	sb := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-time.Minute), port)
	hv.FailOn["SetOwner"] = fmt.Errorf("injected metadata failure")
	lockService(t, m)
	_, err := m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-7"))
	require.ErrorContains(t, err, "injected metadata failure")
	var ns *ErrNoStandby
	require.NotErrorAs(t, err, &ns, "a failure after the claim is no reason to go cold quietly")
	requireGone(t, hv, m, sb)
	jm, err := m.Manager().Store.MachineOfJob("lve-0123abcd-7")
	require.NoError(t, err)
	require.Nil(t, jm)
}

// A ctx that has ended before Claim looks at a machine claims nothing.
func TestClaimWithEndedContextClaimsNothing(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	sb := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-time.Minute), port)
	lockService(t, m)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := m.Claim(ctx, claimRequest(m, img, "lve-0123abcd-7"))
	require.ErrorIs(t, err, context.Canceled)
	cl, err := m.Manager().Store.ClaimOf(sb)
	require.NoError(t, err)
	require.Nil(t, cl)
	hv.Lock()
	require.Contains(t, hv.Domains, sb)
	hv.Unlock()
}

func TestMachineOf(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	now := time.Now()
	const job = "lve-0123abcd-7"

	// No mapping, no claim: the cold machine of the job's name.
	got, err := m.MachineOf(job)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: job}, got)

	// A claim without a mapping (prepare killed between the two) is found.
	a := addStandby(t, m, hv, img, "0000000a", now, port)
	require.NoError(t, m.Manager().Store.Claim(a, state.Claim{Job: job, At: now.UTC()}))
	got, err = m.MachineOf(job)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: a, Warm: true}, got)
	got, err = m.MachineOf("lve-0123abcd-8")
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: "lve-0123abcd-8"}, got, "another job's claim is not this job's")

	// A mapping whose machine's claim names another job is not believed.
	b := addStandby(t, m, hv, img, "0000000b", now, port)
	require.NoError(t, m.Manager().Store.Claim(b, state.Claim{Job: "lve-0123abcd-9", At: now.UTC()}))
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-8", state.JobMachine{Machine: b, Warm: true, At: now.UTC()}))
	got, err = m.MachineOf("lve-0123abcd-8")
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: "lve-0123abcd-8"}, got)

	// Nor one to a machine without a claim, nor to a machine that is not a
	// standby machine.
	c := addStandby(t, m, hv, img, "0000000c", now, port)
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-10", state.JobMachine{Machine: c, Warm: true, At: now.UTC()}))
	got, err = m.MachineOf("lve-0123abcd-10")
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: "lve-0123abcd-10"}, got)
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-11", state.JobMachine{Machine: "lve-0123abcd-12", At: now.UTC()}))
	_, err = m.Manager().Store.Create("lve-0123abcd-12")
	require.NoError(t, err)
	require.NoError(t, m.Manager().Store.Claim("lve-0123abcd-12", state.Claim{Job: "lve-0123abcd-11"}))
	got, err = m.MachineOf("lve-0123abcd-11")
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: "lve-0123abcd-11"}, got, "only a standby machine is found through the mapping")

	// A mapping that agrees with the claim.
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-9", state.JobMachine{Machine: b, Warm: true, At: now.UTC()}))
	got, err = m.MachineOf("lve-0123abcd-9")
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: b, Warm: true}, got)

	got, err = m.MachineOf("../x")
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: "../x"}, got, "a job name with a path has no mapping (Teardown refuses the name)")
}

// teardownJob removes the job's claimed machine and a cold machine a retried
// prepare of the job may have left, and the mapping; other machines stay.
func TestTeardownJob(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	ctx := context.Background()
	now := time.Now()
	const job = "lve-0123abcd-7"
	sb := addStandby(t, m, hv, img, "0000000a", now, port)
	other := addStandby(t, m, hv, img, "0000000b", now, port)
	lockService(t, m)
	c, err := m.Claim(ctx, claimRequest(m, img, job))
	require.NoError(t, err)
	require.Equal(t, sb, c.Machine.Name)
	// A cold attempt of the same job left its machine.
	hv.Lock()
	hv.Domains[job] = &vmtest.Domain{OwnerXML: owned(t, now.Add(time.Hour)), Active: true}
	hv.Volumes["jobs/"+vm.DiskVolume(job)] = nil
	hv.Unlock()
	_, err = m.Manager().Store.Create(job)
	require.NoError(t, err)

	got, err := m.teardownJob(ctx, job)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: sb, Warm: true}, got)
	requireGone(t, hv, m, sb)
	requireGone(t, hv, m, job)
	jm, err := m.Manager().Store.MachineOfJob(job)
	require.NoError(t, err)
	require.Nil(t, jm)
	hv.Lock()
	require.Contains(t, hv.Domains, other, "the idle machine stays")
	hv.Unlock()

	// Again: nothing left to do, and no error.
	got, err = m.teardownJob(ctx, job)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: job}, got)

	// A cold job: its machine of its own name.
	const cold = "lve-0123abcd-8"
	hv.Lock()
	hv.Domains[cold] = &vmtest.Domain{OwnerXML: owned(t, now.Add(time.Hour)), Active: true}
	hv.Unlock()
	_, err = m.Manager().Store.Create(cold)
	require.NoError(t, err)
	got, err = m.teardownJob(ctx, cold)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: cold}, got)
	requireGone(t, hv, m, cold)
}

func TestRetire(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	ctx := context.Background()
	now := time.Now()

	err := m.Retire(ctx, "lve-0123abcd-7", "x")
	require.ErrorIs(t, err, vm.ErrNotOurs, "a job's machine is not a standby machine")

	claimed := addStandby(t, m, hv, img, "0000000a", now, port)
	require.NoError(t, m.Manager().Store.Claim(claimed, state.Claim{Job: "lve-0123abcd-7", At: now.UTC()}))
	err = m.Retire(ctx, claimed, "x")
	require.ErrorIs(t, err, state.ErrClaimed)
	require.ErrorContains(t, err, "lve-0123abcd-7")
	hv.Lock()
	require.True(t, hv.Domains[claimed].Active, "a job's machine is left alone")
	hv.Unlock()

	busy := addStandby(t, m, hv, img, "0000000b", now, port)
	unlock, err := m.Manager().Store.TryLock(busy)
	require.NoError(t, err)
	require.ErrorIs(t, m.Retire(ctx, busy, "x"), state.ErrBusy)
	unlock()
	cl, err := m.Manager().Store.ClaimOf(busy)
	require.NoError(t, err)
	require.Nil(t, cl, "not marked while busy")

	idle := addStandby(t, m, hv, img, "0000000c", now, port)
	require.NoError(t, m.Retire(ctx, idle, "too many"))
	requireGone(t, hv, m, idle)

	marked := addStandby(t, m, hv, img, "0000000d", now, port)
	require.NoError(t, m.Manager().Store.Claim(marked, state.Claim{Retire: true, Reason: "dead"}))
	require.NoError(t, m.Retire(ctx, marked, "again"))
	requireGone(t, hv, m, marked)

	// A boot cut off: a directory without a record, and a volume.
	cut := lifecycle.MachinePrefix("lve", controller) + "sb-" + "0000000e"
	_, err = m.Manager().Store.Reserve(cut, state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	hv.Lock()
	hv.Volumes["jobs/"+vm.DiskVolume(cut)] = nil
	hv.Unlock()
	require.NoError(t, m.Retire(ctx, cut, "boot cut off"))
	requireGone(t, hv, m, cut)

	// A machine already gone: nothing to do.
	require.NoError(t, m.Retire(ctx, lifecycle.MachinePrefix("lve", controller)+"sb-"+"0000000f", "gone"))
}

// When an idle machine is marked for retirement before its removal fails,
// the mark stays: no job claims it meanwhile.
func TestRetireMarksBeforeRemoving(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	sb := addStandby(t, m, hv, img, "0000000a", time.Now(), port)
	hv.FailOn["Destroy"] = fmt.Errorf("injected destroy failure")
	require.ErrorContains(t, m.Retire(context.Background(), sb, "excess"), "injected destroy failure")
	cl, err := m.Manager().Store.ClaimOf(sb)
	require.NoError(t, err)
	require.True(t, cl.Retire)
	require.Equal(t, "excess", cl.Reason)
	lockService(t, m)
	_, err = m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-7"))
	requireNoStandby(t, err, "no idle VM")
}

// Standbys lists this installation's standby machines only, with record and
// claim; Idle is booted and unclaimed.
func TestStandbys(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	now := time.Now()
	idle := addStandby(t, m, hv, img, "0000000a", now, port)
	claimed := addStandby(t, m, hv, img, "0000000b", now, port)
	require.NoError(t, m.Manager().Store.Claim(claimed, state.Claim{Job: "j", At: now.UTC()}))
	booting := lifecycle.MachinePrefix("lve", controller) + "sb-" + "0000000c"
	_, err := m.Manager().Store.Create(booting)
	require.NoError(t, err)
	_, err = m.Manager().Store.Create("lve-0123abcd-7") // a job's
	require.NoError(t, err)
	_, err = m.Manager().Store.Create("lve-ffffffff-sb-00000000") // another installation's
	require.NoError(t, err)

	all, err := m.Standbys()
	require.NoError(t, err)
	byName := map[string]Standby{}
	for _, s := range all {
		byName[s.Name] = s
	}
	require.Len(t, byName, 3)
	require.True(t, byName[idle].Idle())
	require.False(t, byName[claimed].Idle())
	require.Equal(t, "j", byName[claimed].Claim.Job)
	require.False(t, byName[booting].Idle())
	require.Nil(t, byName[booting].Record)
}

// BootStandby makes a machine through the whole provision (fake guest):
// named as a standby machine, recorded with its image, size and base file,
// owned as "standby" until max_age + job_slack; a job then claims it.
func TestBootStandbyThenClaim(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img, _ := poolManager(t, hv, g.Port(), "")
	ctx := context.Background()
	ready, err := m.BootStandby(ctx, img, nil)
	require.NoError(t, err)
	require.NoError(t, ready.Client.Close())
	name := ready.Machine.Name
	require.Regexp(t, regexp.MustCompile(`^lve-0123abcd-sb-[0-9a-f]{8}$`), name)
	base, err := state.VersionOf(img.Base)
	require.NoError(t, err)
	require.Equal(t, &state.Standby{Image: "tiny", VCPUs: 1, MemoryMiB: 256, DiskGiB: 0, Base: base, Spec: lifecycle.SpecFingerprint(m.Manager().Cfg, mustImage(t, m, "tiny"))}, ready.Machine.Standby)
	o := ownerOf(t, hv, name)
	require.Equal(t, FrontendStandby, o.Frontend)
	require.Equal(t, "tiny", o.Job)
	require.WithinDuration(t, time.Now().Add(time.Hour+30*time.Minute), o.Deadline, time.Minute)
	all, err := m.Standbys()
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.True(t, all[0].Idle())
	res, err := m.Manager().Store.Reservations(state.Reservation{})
	require.NoError(t, err)
	require.Equal(t, state.Reservation{VCPUs: 1, MemoryMiB: 256}, res[name])

	lockService(t, m)
	c, err := m.Claim(ctx, claimRequest(m, img, "lve-0123abcd-7"))
	require.NoError(t, err, "the guest's sshd answers the probe")
	require.Equal(t, name, c.Machine.Name)
	o = ownerOf(t, hv, name)
	require.Equal(t, "gitlab", o.Frontend)
	require.Equal(t, "42", o.Job)

	// run's view: connect from the recorded state with the pinned key.
	_, client, err := m.Manager().Machine(name).Connect(ctx)
	require.NoError(t, err)
	_ = client.Close()

	_, err = m.teardownJob(ctx, "lve-0123abcd-7")
	require.NoError(t, err)
	requireGone(t, hv, m, name)
}

func TestBootStandbyRefusals(t *testing.T) {
	hv := vmtest.New()
	m, img, _ := poolManager(t, hv, 22, "")
	_, err := m.BootStandby(context.Background(), mustImage(t, m, "cold"), nil)
	require.ErrorContains(t, err, "image cold has no pool")
	require.NoError(t, os.Remove(img.Base))
	_, err = m.BootStandby(context.Background(), img, nil)
	require.ErrorContains(t, err, "base image of tiny")
	require.ErrorIs(t, err, os.ErrNotExist)
	hv.Lock()
	require.Empty(t, hv.Domains)
	hv.Unlock()
	names, err := m.Manager().Store.Names()
	require.NoError(t, err)
	require.Empty(t, names)
}

// On a full host a standby machine never waits and never makes room: it
// fails at once with lifecycle.ErrNoRoom, touches nothing, and holds no refills.
func TestBootStandbyNoWaitFailsAtOnce(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "[capacity]\nmax_vms = 1\n")
	idle := addStandby(t, m, hv, mustImage(t, m, "other"), "0000000a", time.Now(), port)
	start := time.Now()
	_, err := m.BootStandby(context.Background(), img, nil)
	require.ErrorIs(t, err, lifecycle.ErrNoRoom)
	require.ErrorContains(t, err, "1 of 1 VMs in use (capacity.max_vms)")
	require.Less(t, time.Since(start), 5*time.Second, "capacity.wait is 30m: it did not wait")
	require.False(t, m.Manager().Capacity().UnderPressure(), "a standby machine is no job waiting")
	names, err := m.Manager().Store.Names()
	require.NoError(t, err)
	require.Equal(t, []string{idle}, names, "no reservation left, the idle machine not retired")
	hv.Lock()
	require.Len(t, hv.Domains, 1)
	hv.Unlock()
	locks, err := m.Manager().Store.LockNames()
	require.NoError(t, err)
	for _, l := range locks {
		require.False(t, m.Manager().Machine(l).IsStandby() && l != idle, "lock file %s of the failed boot left", l)
	}
}

// A job on a host full of idle standby machines retires the oldest idle one
// and proceeds; it tells the job log, and holds the pool's refills.
func TestAdmissionRetiresIdleStandbyForAJob(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	port := bannerServer(t)
	m, img, s := poolManager(t, hv, g.Port(), "[capacity]\nmax_vms = 2\nwait = \"10s\"\n")
	now := time.Now()
	older := addStandby(t, m, hv, img, "0000000a", now.Add(-5*time.Minute), port)
	newer := addStandby(t, m, hv, img, "0000000b", now.Add(-time.Minute), port)
	require.False(t, m.Manager().Capacity().UnderPressure())

	start := time.Now()
	ready, err := m.Manager().Provision(context.Background(), testRequest(img))
	require.NoError(t, err)
	_ = ready.Client.Close()
	require.Less(t, time.Since(start), 15*time.Second)
	require.True(t, s.Has("Retired idle standby VM %s to make room"))
	require.True(t, m.Manager().Capacity().UnderPressure(), "the pool holds its refills")

	requireGone(t, hv, m, older)
	hv.Lock()
	require.Contains(t, hv.Domains, newer, "one retired is room enough")
	hv.Unlock()
	names, err := m.Manager().Store.Names()
	require.NoError(t, err)
	require.ElementsMatch(t, []string{newer, "lve-0123abcd-7"}, names)

	require.NoError(t, m.Manager().Machine("lve-0123abcd-7").Teardown(context.Background()))
}

// A job's admission never takes a machine another job claimed: it waits
// (and here, gives up after capacity.wait).
func TestAdmissionLeavesClaimedStandby(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, g.Port(), "[capacity]\nmax_vms = 1\nwait = \"700ms\"\n")
	claimed := addStandby(t, m, hv, img, "0000000a", time.Now(), port)
	require.NoError(t, m.Manager().Store.Claim(claimed, state.Claim{Job: "lve-0123abcd-99", At: time.Now().UTC()}))
	_, err := m.Manager().Provision(context.Background(), testRequest(img))
	require.ErrorContains(t, err, "1 of 1 VMs in use (capacity.max_vms)")
	require.ErrorContains(t, err, "capacity.wait")
	require.True(t, m.Manager().Capacity().UnderPressure())
	hv.Lock()
	require.True(t, hv.Domains[claimed].Active, "the other job's machine stays")
	require.NotContains(t, hv.Domains, "lve-0123abcd-7")
	hv.Unlock()
	require.DirExists(t, m.Manager().Store.MachineDir(claimed))
}

// Idle standby machines are retired for a job only when that can make the
// room: with memory held by another job's machine that the idle ones cannot
// make up for, the pool stays and the job waits.
func TestAdmissionKeepsPoolWhenRetiringCannotHelp(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	port := bannerServer(t)
	m, img, s := poolManager(t, hv, g.Port(), "[capacity]\nmemory_budget_mib = 768\nwait = \"700ms\"\n[limits]\nmax_memory_mib = 768\n")
	idle := addStandby(t, m, hv, img, "0000000a", time.Now(), port)
	// Another job's machine holds 512 MiB; the idle one 256 MiB; this job
	// asks for 768 MiB: even without the idle one there is no room.
	_, err := m.Manager().Store.Reserve("lve-0123abcd-50", state.Reservation{VCPUs: 1, MemoryMiB: 512})
	require.NoError(t, err)
	hv.Lock()
	hv.Domains["lve-0123abcd-50"] = &vmtest.Domain{OwnerXML: owned(t, time.Now().Add(time.Hour)), Active: true}
	hv.Unlock()
	req := testRequest(img)
	req.MemoryMiB = 768
	_, err = m.Manager().Provision(context.Background(), req)
	require.ErrorContains(t, err, "capacity.memory_budget_mib")
	require.False(t, s.Has("Retired idle standby VM %s to make room"))
	all, err := m.Standbys()
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.Equal(t, idle, all[0].Name)
	require.True(t, all[0].Idle(), "the pool was not thrown away for nothing")
}

// Sweep removes a standby machine marked for retirement, keeps an idle and
// a claimed one, and removes the job mappings whose machine is gone.
func TestSweepStandbyMachines(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	ctx := context.Background()
	now := time.Now()
	idle := addStandby(t, m, hv, img, "0000000a", now.Add(-time.Minute), port)
	retired := addStandby(t, m, hv, img, "0000000b", now.Add(-time.Minute), port)
	require.NoError(t, m.Manager().Store.Claim(retired, state.Claim{Retire: true, Reason: "paused", At: now.UTC()}))
	claimed := addStandby(t, m, hv, img, "0000000c", now.Add(-time.Minute), port)
	require.NoError(t, m.Manager().Store.Claim(claimed, state.Claim{Job: "lve-0123abcd-70", At: now.UTC()}))
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-70", state.JobMachine{Machine: claimed, Warm: true, At: now.UTC()}))
	booting := lifecycle.MachinePrefix("lve", controller) + "sb-" + "0000000d"
	_, err := m.Manager().Store.Reserve(booting, state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	unlock, err := m.Manager().Store.TryLock(booting)
	require.NoError(t, err)
	defer unlock()
	// Mappings: to a machine that is gone (its cleanup did not finish), and
	// to one that is gone while a cold machine of the job's name is there.
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-71", state.JobMachine{Machine: lifecycle.MachinePrefix("lve", controller) + "sb-" + "00000999", Warm: true, At: now.UTC()}))
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-72", state.JobMachine{Machine: lifecycle.MachinePrefix("lve", controller) + "sb-" + "00000998", Warm: true, At: now.UTC()}))
	_, err = m.Manager().Store.Create("lve-0123abcd-72")
	require.NoError(t, err)
	hv.Lock()
	hv.Domains["lve-0123abcd-72"] = &vmtest.Domain{OwnerXML: owned(t, now.Add(time.Hour)), Active: true}
	hv.Unlock()

	items, err := m.Manager().Inventory(ctx, now)
	require.NoError(t, err)
	got := map[string][2]string{}
	for _, it := range items {
		got[it.Name] = [2]string{it.Verdict, it.Pool()}
	}
	require.Equal(t, map[string][2]string{
		idle:              {lifecycle.VerdictKeep, "idle"},
		retired:           {lifecycle.VerdictRetired, "retiring"},
		claimed:           {lifecycle.VerdictKeep, "claimed"},
		booting:           {lifecycle.VerdictOrphan, "booting"},
		"lve-0123abcd-72": {lifecycle.VerdictKeep, ""},
	}, got)
	for _, it := range items {
		if it.Name == retired {
			require.Contains(t, it.Reason, "paused")
		}
	}

	// A dry run changes nothing, mappings included.
	rep, err := m.Manager().Sweep(ctx, now, true)
	require.NoError(t, err)
	require.Empty(t, rep.Removed)
	jobs, err := m.Manager().Store.MappedJobs()
	require.NoError(t, err)
	require.Len(t, jobs, 3)

	rep, err = m.Manager().Sweep(ctx, now, false)
	require.NoError(t, err)
	require.Equal(t, []string{retired}, rep.Removed)
	requireGone(t, hv, m, retired)
	hv.Lock()
	for _, keep := range []string{idle, claimed, "lve-0123abcd-72"} {
		require.True(t, hv.Domains[keep].Active, "%s kept", keep)
	}
	hv.Unlock()
	require.DirExists(t, m.Manager().Store.MachineDir(booting), "a boot in progress is left alone")
	jobs, err = m.Manager().Store.MappedJobs()
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"lve-0123abcd-70", "lve-0123abcd-72"}, jobs, "only the mapping to nothing goes")
}

// A retried prepare removes the machine an earlier attempt of the same job
// claimed, before it claims (or boots) another: the first would otherwise
// run, unmapped, until its deadline (removeClaimed, as Job.Acquire finds
// the job's machine: MachineOf).
func TestRemoveEarlierClaim(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	ctx := context.Background()
	now := time.Now()
	const job = "lve-0123abcd-9"
	first := addStandby(t, m, hv, img, "0000000a", now.Add(-2*time.Minute), port)
	second := addStandby(t, m, hv, img, "0000000b", now.Add(-time.Minute), port)
	lockService(t, m)

	name, err := removeEarlierClaim(ctx, t, m, job)
	require.NoError(t, err)
	require.Empty(t, name, "no earlier attempt: nothing removed")

	c, err := m.Claim(ctx, claimRequest(m, img, job))
	require.NoError(t, err)
	require.Equal(t, first, c.Machine.Name)
	// The attempt dies after its claim; the runner retries prepare.
	name, err = removeEarlierClaim(ctx, t, m, job)
	require.NoError(t, err)
	require.Equal(t, first, name)
	requireGone(t, hv, m, first)
	jm, err := m.Manager().Store.MachineOfJob(job)
	require.NoError(t, err)
	require.Nil(t, jm, "the mapping went with it")
	c, err = m.Claim(ctx, claimRequest(m, img, job))
	require.NoError(t, err)
	require.Equal(t, second, c.Machine.Name, "the retry claims afresh")

	// Killed between the claim and the mapping: found by the claim alone.
	require.NoError(t, m.Manager().Store.UnmapJob(job))
	name, err = removeEarlierClaim(ctx, t, m, job)
	require.NoError(t, err)
	require.Equal(t, second, name)
	requireGone(t, hv, m, second)
}

// Every ask of a pool is recorded as demand for the service, met or not.
func TestClaimRecordsDemand(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	lockService(t, m)
	_, err := m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-10"))
	requireNoStandby(t, err, "no idle VM")
	addStandby(t, m, hv, img, "0000000a", time.Now(), port)
	_, err = m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-11"))
	require.NoError(t, err)
	d, err := m.Manager().Store.TakeDemand()
	require.NoError(t, err)
	require.Len(t, d, 2)
	for _, x := range d {
		require.Equal(t, "tiny", x.Image)
		require.WithinDuration(t, time.Now(), x.At, time.Minute)
	}
}

// A claim record that cannot be read counts as a claim by nobody known: the
// machine is listed, never handed out, and the listing does not fail.
func TestUnreadableClaimIsNeverHandedOut(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	n := addStandby(t, m, hv, img, "0000000a", time.Now(), port)
	// A directory in its place: unreadable as a file, even for root.
	require.NoError(t, os.Mkdir(filepath.Join(m.Manager().Store.MachineDir(n), "claim.json"), 0o700))
	all, err := m.Standbys()
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.False(t, all[0].Idle())
	require.Contains(t, all[0].Claim.Reason, "unreadable")
	lockService(t, m)
	_, err = m.Claim(context.Background(), claimRequest(m, img, "lve-0123abcd-12"))
	requireNoStandby(t, err, "no idle VM")
}

// A boot that completed after the service looked (no record then, a record
// by the time the lock is free) is left alone; one cut off is removed.
func TestRemoveCutOffBootLeavesACompletedBoot(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "")
	done := addStandby(t, m, hv, img, "0000000a", time.Now(), port)
	err := m.RemoveCutOffBoot(context.Background(), done)
	require.ErrorIs(t, err, ErrBootCompleted)
	all, err := m.Standbys()
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.True(t, all[0].Idle(), "not even marked")

	cut := lifecycle.MachinePrefix("lve", controller) + "sb-" + "0000000b"
	_, err = m.Manager().Store.Reserve(cut, state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	require.NoError(t, m.RemoveCutOffBoot(context.Background(), cut))
	has, err := m.Manager().Store.Has(cut)
	require.NoError(t, err)
	require.False(t, has)
}

// A machine that serves a job without waiting for room (garm's instances:
// a lifecycle.Request launched with NoWait and MakeRoom) takes the room of an
// idle standby machine on a full host, as a GitLab job does; without
// MakeRoom (a standby's own boot) it fails at once and retires nothing.
func TestLaunchForAJobRetiresIdleStandby(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, _ := poolManager(t, hv, port, "[capacity]\nmax_vms = 1\n")
	idle := addStandby(t, m, hv, img, "0000000a", time.Now().Add(-time.Minute), port)
	req := lifecycle.Request{Name: lifecycle.MachinePrefix("lve", controller) + "garm-x", Image: img, VCPUs: 1, MemoryMiB: 256,
		Frontend: FrontendGarm, Job: "x", Lifetime: time.Hour, NoWait: true}

	_, err := m.Manager().Launch(context.Background(), req)
	require.ErrorIs(t, err, lifecycle.ErrNoRoom, "without MakeRoom a full host refuses at once")
	hv.Lock()
	require.Contains(t, hv.Domains, idle, "nothing retired without MakeRoom")
	hv.Unlock()

	req.MakeRoom = true
	start := time.Now()
	_, err = m.Manager().Launch(context.Background(), req)
	require.NoError(t, err)
	require.Less(t, time.Since(start), 10*time.Second)
	requireGone(t, hv, m, idle)
	names, err := m.Manager().Store.Names()
	require.NoError(t, err)
	require.Equal(t, []string{req.Name}, names)

	// A full host of machines that are no idle standbys still refuses at once.
	other := req
	other.Name += "2"
	_, err = m.Manager().Launch(context.Background(), other)
	require.ErrorIs(t, err, lifecycle.ErrNoRoom)
	require.NoError(t, m.Manager().Machine(req.Name).Teardown(context.Background()))
}

// A hook job's shared directories go into a claimed standby machine by
// hot plug: the standby machines of github_hooks.vm_image boot with
// shared memory. A machine that does not take them is removed and the
// job starts cold.
func TestAcquireWarmHotPlugsTheJobsDirs(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img, _ := poolManager(t, hv, g.Port(), "")
	img.SharedMemory = true // [images.tiny] shared_memory = true
	ctx := context.Background()
	boot := func() string {
		ready, err := m.BootStandby(ctx, img, nil)
		require.NoError(t, err)
		require.NoError(t, ready.Client.Close())
		require.Contains(t, domainXML(t, hv, ready.Machine.Name), `<access mode="shared"></access>`, "booted with shared memory, no share yet")
		return ready.Machine.Name
	}
	name := boot()
	lockService(t, m)
	dirs := []vm.SharedDir{{Socket: "/run/lve-hooks/x/fs.sock", Tag: "lve-work"}}
	req := claimRequest(m, img, "lve-0123abcd-gh-7")
	req.Dirs = dirs
	req.Container = "lve-job-42-build"
	a, err := m.Acquire(ctx, req)
	require.NoError(t, err)
	require.True(t, a.Warm)
	require.Equal(t, name, a.Name)
	jm, err := m.MachineOf(req.Name)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: name, Warm: true, Container: "lve-job-42-build"}, jm, "the mapping names the job's container")
	x := domainXML(t, hv, name)
	require.Contains(t, x, `<source socket="/run/lve-hooks/x/fs.sock"></source>`)
	require.Contains(t, x, `<target dir="lve-work"></target>`)
	_, err = m.teardownJob(ctx, req.Name)
	require.NoError(t, err)
	requireGone(t, hv, m, name)

	// The hot plug refused: that standby goes, and Acquire says so (the
	// shares' servers may have spent their one connection: the caller
	// starts them again before it asks for a cold machine).
	name = boot()
	hv.Lock()
	hv.FailOn["AttachFilesystem"] = errors.New("device_add refused")
	hv.Unlock()
	req.Name = "lve-0123abcd-gh-8"
	a, err = m.Acquire(ctx, req)
	var refused *SharesRefusedError
	require.ErrorAs(t, err, &refused)
	require.Equal(t, name, refused.Machine)
	require.Nil(t, a)
	requireGone(t, hv, m, name)
	left, err := m.Manager().Store.MachineOfJob(req.Name)
	require.NoError(t, err)
	require.Nil(t, left, "nothing of the job is left")

	// A cold machine's mapping names the job's container too.
	cold := *img
	cold.Pool = nil
	req.Image, req.Name, req.Dirs = &cold, "lve-0123abcd-gh-9", nil
	a, err = m.Acquire(ctx, req)
	require.NoError(t, err)
	require.False(t, a.Warm)
	jm, err = m.MachineOf(req.Name)
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: req.Name, Container: "lve-job-42-build"}, jm)
	_, err = m.teardownJob(ctx, req.Name)
	require.NoError(t, err)
	requireGone(t, hv, m, req.Name)
}

// domainXML is the fake's XML of domain name.
func domainXML(t *testing.T, hv *vmtest.Fake, name string) string {
	t.Helper()
	hv.Lock()
	defer hv.Unlock()
	d, ok := hv.Domains[name]
	require.True(t, ok, "domain %s", name)
	return d.XML
}

// The handle's Acquire removes what an earlier attempt of its job claimed
// (found as the handle resolved the job), says so, and claims afresh.
func TestJobAcquireRemovesEarlierClaim(t *testing.T) {
	hv := vmtest.New()
	port := bannerServer(t)
	m, img, says := poolManager(t, hv, port, "")
	ctx := context.Background()
	now := time.Now()
	first := addStandby(t, m, hv, img, "0000000a", now.Add(-2*time.Minute), port)
	second := addStandby(t, m, hv, img, "0000000b", now.Add(-time.Minute), port)
	lockService(t, m)
	j, err := m.Jobs().Job(JobRef{Frontend: "gitlab", Instance: lifecycle.InstanceTag("https://gitlab.example", "runner"), ID: 9}, nil)
	require.NoError(t, err)

	// The first attempt dies after its claim; the runner retries prepare.
	c, err := m.Claim(ctx, claimRequest(m, img, j.Name()))
	require.NoError(t, err)
	require.Equal(t, first, c.Machine.Name)
	a, err := j.Acquire(ctx, AcquireRequest{
		Request: lifecycle.Request{Image: img, Frontend: "gitlab", Job: "9", Lifetime: time.Hour},
		Size:    m.Manager().Cfg.ImageSize(img),
	})
	require.NoError(t, err)
	require.True(t, a.Warm)
	require.Equal(t, second, a.Name, "the retry claims afresh")
	requireGone(t, hv, m, first)
	require.Contains(t, says.Args(), "Removed VM "+first+" that an earlier attempt of this job claimed", "the job log says so")
	jm, err := j.Machine()
	require.NoError(t, err)
	require.Equal(t, JobMachine{Name: second, Warm: true}, jm, "the handle resolves the new mapping")
}

func removeEarlierClaim(ctx context.Context, t *testing.T, m *Host, job string) (string, error) {
	t.Helper()
	jm, err := m.MachineOf(job)
	require.NoError(t, err)
	return m.removeClaimed(ctx, job, jm)
}
