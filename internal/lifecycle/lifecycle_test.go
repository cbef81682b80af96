package lifecycle

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

const controller = lifecycletest.Controller

// fakeGuest is the fake guest every test here boots (lifecycletest.Guest).
type fakeGuest = lifecycletest.Guest

func newGuest(t *testing.T, hv *vmtest.Fake) *fakeGuest { return lifecycletest.NewGuest(t, hv) }

func manager(t *testing.T, hv *vmtest.Fake, g *fakeGuest) (*Manager, *config.Image) {
	cfg, img := lifecycletest.TinyConfig(t)
	s := lifecycletest.NewSayings(t)
	m := &Manager{Cfg: cfg, hv: hv, Store: state.Store{Dir: cfg.StateDir}, Controller: controller,
		SSHPort: g.Port(), SSHPollInterval: 20 * time.Millisecond, AddressPollInterval: 10 * time.Millisecond,
		Say: s.Say}
	return m, img
}

func testRequest(img *config.Image) Request {
	return Request{Name: "lve-0123abcd-7", Image: img, VCPUs: 1, MemoryMiB: 256, Frontend: "test", Job: "7", Lifetime: time.Hour}
}

func requireNothingLeft(t *testing.T, hv *vmtest.Fake, m *Manager) {
	t.Helper()
	lifecycletest.RequireNothingLeft(t, hv, m.Store)
}

func TestProvisionAndTeardown(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	ready, err := m.Provision(context.Background(), testRequest(img))
	require.NoError(t, err)
	defer ready.Client.Close()
	require.Equal(t, "127.0.0.1", ready.Machine.Address)
	require.Equal(t, 1, g.Logins())

	// The domain carries our ownership record with a deadline.
	o, err := vm.ParseOwner(hv.Domains["lve-0123abcd-7"].OwnerXML)
	require.NoError(t, err)
	require.Equal(t, controller, o.Controller)
	require.WithinDuration(t, time.Now().Add(time.Hour+30*time.Minute), o.Deadline, time.Minute)

	// The network filter carries the address the machine booted with (no
	// learnt-only address for a libvirtd restart to forget).
	var dx libvirtxml.Domain
	require.NoError(t, dx.Unmarshal(hv.Domains["lve-0123abcd-7"].XML))
	ref := dx.Devices.Interfaces[0].FilterRef
	require.NotNil(t, ref)
	require.Equal(t, vm.FilterName, ref.Filter)
	params := map[string]string{}
	for _, p := range ref.Parameters {
		params[p.Name] = p.Value
	}
	require.Equal(t, "127.0.0.1", params["IP"])
	require.NotContains(t, params, "CTRL_IP_LEARNING")

	// run's view: connect again from the recorded state, pinned key.
	_, c, err := m.Machine("lve-0123abcd-7").Connect(context.Background())
	require.NoError(t, err)
	_ = c.Close()

	require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(context.Background()))
	requireNothingLeft(t, hv, m)
}

// A filter that cannot be pinned to the address fails the boot: the
// machine would lose its network at the next libvirtd restart.
func TestProvisionUnpinnedFilterUndoes(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	hv.FailOn["PinFilterAddress"] = errors.New("update device: unsupported")
	_, err := m.Provision(context.Background(), testRequest(img))
	require.ErrorContains(t, err, "pin address 127.0.0.1")
	requireNothingLeft(t, hv, m)
}

func TestProvisionRefusesImpostorHostKeyAndUndoes(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	g.OwnHostKey = true
	m, img := manager(t, hv, g)
	m.Cfg.Timeouts.Boot = config.Duration(3 * time.Second)
	_, err := m.Provision(context.Background(), testRequest(img))
	require.Error(t, err)
	require.ErrorContains(t, err, "host key mismatch")
	require.Zero(t, g.Logins(), "never authenticated to the impostor")
	requireNothingLeft(t, hv, m)
}

func TestProvisionBootTimeoutUndoes(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	g.NoLease = true
	m, img := manager(t, hv, g)
	m.Cfg.Timeouts.Boot = config.Duration(time.Second)
	start := time.Now()
	_, err := m.Provision(context.Background(), testRequest(img))
	require.ErrorContains(t, err, "boot timeout 1s (timeouts.boot) reached")
	require.Less(t, time.Since(start), 10*time.Second)
	requireNothingLeft(t, hv, m)
}

func TestProvisionCancelUndoes(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	g.NoLease = true
	m, img := manager(t, hv, g)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := m.Provision(ctx, testRequest(img))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	requireNothingLeft(t, hv, m)
}

// A cancel that lands during the front end's check, which itself carries on
// (it only logs), still undoes the whole machine: prepare must not report a
// cancelled attempt as ready.
func TestProvisionCancelDuringCheckUndoes(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req := testRequest(img)
	var checked bool
	req.Check = func(_ context.Context, c *sshexec.Client, _ *state.Tools) error {
		checked = c != nil
		cancel()
		return nil
	}
	_, err := m.Provision(ctx, req)
	require.ErrorIs(t, err, context.Canceled)
	require.True(t, checked, "the check ran with the connected client")
	requireNothingLeft(t, hv, m)
}

// A check that fails undoes the machine like any other failed step.
func TestProvisionFailedCheckUndoes(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	req := testRequest(img)
	req.Check = func(context.Context, *sshexec.Client, *state.Tools) error { return errors.New("guest unusable") }
	_, err := m.Provision(context.Background(), req)
	require.ErrorContains(t, err, "check: guest unusable")
	requireNothingLeft(t, hv, m)
}

func TestProvisionRemovesLeftoversOfEarlierAttempt(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	// An earlier attempt was killed after define: domain, disk and state remain.
	owner, err := vm.MarshalOwner(vm.Owner{Controller: controller, Job: "7"})
	require.NoError(t, err)
	hv.Domains["lve-0123abcd-7"] = &vmtest.Domain{OwnerXML: owner, XML: "<domain/>"}
	hv.Volumes["jobs/lve-0123abcd-7.qcow2"] = nil
	_, err = m.Store.Create("lve-0123abcd-7")
	require.NoError(t, err)

	ready, err := m.Provision(context.Background(), testRequest(img))
	require.NoError(t, err, "no 'already exists'")
	_ = ready.Client.Close()
	require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(context.Background()))
	requireNothingLeft(t, hv, m)
}

func TestProvisionStopsAtForeignDomain(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	hv.Domains["lve-0123abcd-7"] = &vmtest.Domain{XML: "<domain/>", Active: true}
	_, err := m.Provision(context.Background(), testRequest(img))
	require.ErrorIs(t, err, vm.ErrNotOurs)
	require.True(t, hv.Domains["lve-0123abcd-7"].Active, "foreign domain untouched")
}

// A guest that QEMU paused after a failed disk write (full storage) never
// answers; the boot failure says why instead of only "timeout".
func TestProvisionBootFailureSaysGuestWasPausedByIOError(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	g.NoLease = true
	hv.OnStart = func(name string, d *libvirtxml.Domain) {
		hv.Lock()
		defer hv.Unlock()
		hv.Domains[name].State = &vm.DomainState{Code: vm.StatePaused, Summary: "paused (I/O error)", IOError: true}
	}
	m, img := manager(t, hv, g)
	m.Cfg.Timeouts.Boot = config.Duration(500 * time.Millisecond)
	_, err := m.Provision(context.Background(), testRequest(img))
	require.ErrorContains(t, err, "boot timeout")
	require.ErrorContains(t, err, "paused by QEMU after a disk write failed")
	require.ErrorContains(t, err, "storage pool jobs is probably full")
	requireNothingLeft(t, hv, m)
}

// Teardown (admin rm, cleanup, sweep) deletes only what is provably this
// installation's: a name of its prefix, and either a domain carrying its
// ownership record or, for volumes without a domain, its state directory.
func TestTeardownRefusesWhatIsNotOurs(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name, why string
		domain    *vmtest.Domain
		state     bool
	}{
		{"debian-12", `refusing to remove "debian-12": not a machine of this installation (names start with "lve-0123abcd-")`, nil, false},
		{"other-1234abcd-5", `not a machine of this installation`, nil, true},
		{"lve-0123abcd-8", "no ownership metadata", &vmtest.Domain{XML: "<domain/>", Active: true}, true},
		{"lve-0123abcd-9", "no domain and no state record of ours: volumes lve-0123abcd-9.qcow2, lve-0123abcd-9-seed.img left alone", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hv := vmtest.New()
			m, _ := manager(t, hv, newGuest(t, hv))
			hv.Volumes["jobs/"+vm.DiskVolume(tc.name)] = nil
			hv.Volumes["jobs/"+vm.SeedVolume(tc.name)] = nil
			if tc.domain != nil {
				hv.Domains[tc.name] = tc.domain
			}
			if tc.state {
				_, err := m.Store.Create(tc.name)
				require.NoError(t, err)
			}
			err := m.Machine(tc.name).Teardown(ctx)
			require.ErrorIs(t, err, vm.ErrNotOurs)
			require.ErrorContains(t, err, tc.why)
			require.Len(t, hv.Volumes, 2, "no volume deleted")
			if tc.domain != nil {
				require.True(t, hv.Domains[tc.name].Active, "domain untouched")
			}
			if tc.state {
				require.DirExists(t, m.Store.MachineDir(tc.name), "state untouched")
			}
			require.NotContains(t, hv.Calls, "DeleteVolume")
			require.NotContains(t, hv.Calls, "Destroy")
			require.NotContains(t, hv.Calls, "Undefine")
		})
	}
}

// Volumes of our naming without a domain, with the state directory that
// prepare makes before any volume: a prepare SIGKILLed before define. They
// are ours, and go.
func TestTeardownRemovesOrphanVolumesWithStateRecord(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	const name = "lve-0123abcd-7"
	hv.Volumes["jobs/"+vm.DiskVolume(name)] = nil
	hv.Volumes["jobs/"+vm.SeedVolume(name)] = nil
	hv.Volumes["jobs/debian-12.qcow2"] = nil
	_, err := m.Store.Create(name)
	require.NoError(t, err)
	require.NoError(t, m.Machine(name).Teardown(context.Background()))
	require.Equal(t, map[string][]byte{"jobs/debian-12.qcow2": nil}, hv.Volumes)
	require.NoDirExists(t, m.Store.MachineDir(name))
}

// When a failed prepare cannot delete its volumes, its state directory stays
// as the record that they are ours, so that a later sweep removes them (they
// would otherwise be unproven, and left for good).
func TestProvisionUndoKeepsStateWhileVolumesRemain(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	hv.FailOn["Start"] = errors.New("injected start failure")
	hv.FailOn["DeleteVolume"] = errors.New("injected delete failure")
	_, err := m.Provision(context.Background(), testRequest(img))
	require.ErrorContains(t, err, "injected start failure")
	require.Contains(t, hv.Volumes, "jobs/lve-0123abcd-7.qcow2")
	require.DirExists(t, m.Store.MachineDir("lve-0123abcd-7"), "the record of the volumes left")

	delete(hv.FailOn, "Start")
	delete(hv.FailOn, "DeleteVolume")
	rep, err := m.Sweep(context.Background(), time.Now(), false)
	require.NoError(t, err)
	require.Equal(t, []string{"lve-0123abcd-7"}, rep.Removed)
	requireNothingLeft(t, hv, m)
}
