package libvirtvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// These tests run the implementation against libvirt's in-process
// test driver (no daemon, no QEMU): real XML parsing, metadata handling and
// error codes.
func testDriver(t *testing.T) *Conn {
	t.Helper()
	l, err := Connect(context.Background(), "test:///default")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// testDriverSpec is a machine on the test driver's pool and network, with
// nothing the test driver cannot boot.
func testDriverSpec() vm.Spec {
	created := time.Date(2026, 11, 21, 15, 0, 0, 0, time.UTC)
	return vm.Spec{
		Name: "lve-0123abcd-1000", DomainType: "qemu", VCPUs: 1, MemoryMiB: 512,
		Base: "/default-pool/base.qcow2", BaseFormat: "qcow2", Machine: "pc",
		Pool: "default-pool", Network: "default", MAC: "52:54:00:aa:bb:cc",
		OEMStrings: []string{"io.systemd.credential:ssh.authorized_keys.root=ssh-ed25519 AAAA <x>&\"y\""},
		Owner: vm.Owner{Controller: "0123abcd-0000-4000-8000-000000000000", Frontend: "gitlab", Job: "1000",
			Created: created, Deadline: created.Add(90 * time.Minute)},
	}
}

// addBaseVolume creates the spec's base image in the test driver's pool.
func addBaseVolume(t *testing.T, l *Conn, s vm.Spec) {
	t.Helper()
	_, err := l.CreateVolume(context.Background(), s.Pool, &libvirtxml.StorageVolume{
		Name: "base.qcow2", Capacity: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 1 << 30},
	})
	require.NoError(t, err)
}

func TestLibvirtLifecycle(t *testing.T) {
	l := testDriver(t)
	s := testDriverSpec()
	addBaseVolume(t, l, s)

	e := &vm.Engine{HV: l, Controller: s.Owner.Controller}
	m, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	require.NotEmpty(t, m.DiskPath)

	active, err := l.IsActive(context.Background(), s.Name)
	require.NoError(t, err)
	require.True(t, active)

	ownerXML, err := l.Owner(context.Background(), s.Name)
	require.NoError(t, err)
	o, err := vm.ParseOwner(ownerXML)
	require.NoError(t, err)
	require.Equal(t, s.Owner.Controller, o.Controller)
	require.Equal(t, []string{vm.DiskVolume(s.Name)}, o.Volumes)

	vols, err := l.VolumeNames(context.Background(), s.Pool)
	require.NoError(t, err)
	require.Contains(t, vols, vm.DiskVolume(s.Name))

	// The deadline can be moved (keep-on-failure) through libvirt's metadata API.
	later := time.Now().Add(3 * time.Hour).UTC().Truncate(time.Second)
	require.NoError(t, e.Extend(context.Background(), s.Name, later))
	ownerXML, err = l.Owner(context.Background(), s.Name)
	require.NoError(t, err)
	o, err = vm.ParseOwner(ownerXML)
	require.NoError(t, err)
	require.True(t, later.Equal(o.Deadline), "deadline %s", o.Deadline)
	require.Equal(t, []string{vm.DiskVolume(s.Name)}, o.Volumes, "the rest of the record is kept")
	require.ErrorIs(t, (&vm.Engine{HV: l, Controller: "other"}).Extend(context.Background(), s.Name, later), vm.ErrNotOurs)

	// Another controller may not remove it.
	other := &vm.Engine{HV: l, Controller: "someone-else"}
	require.ErrorIs(t, other.Remove(context.Background(), s.Name, s.Pool, true), vm.ErrNotOurs)

	require.NoError(t, e.Remove(context.Background(), s.Name, s.Pool, false))
	_, err = l.Owner(context.Background(), s.Name)
	require.ErrorIs(t, err, vm.ErrNotFound)
	vols, err = l.VolumeNames(context.Background(), s.Pool)
	require.NoError(t, err)
	require.NotContains(t, vols, vm.DiskVolume(s.Name))
	require.NoError(t, e.Remove(context.Background(), s.Name, s.Pool, false), "idempotent")
}

func TestLibvirtNotFoundAndNoOwner(t *testing.T) {
	l := testDriver(t)
	require.ErrorIs(t, l.Destroy(context.Background(), "lve-nope-1"), vm.ErrNotFound)
	require.ErrorIs(t, l.Undefine(context.Background(), "lve-nope-1"), vm.ErrNotFound)
	require.ErrorIs(t, l.DeleteVolume(context.Background(), "default-pool", "lve-nope-1.qcow2"), vm.ErrNotFound)
	_, err := l.Owner(context.Background(), "lve-nope-1")
	require.ErrorIs(t, err, vm.ErrNotFound)

	// The test driver's stock domain "test" has no ownership metadata.
	_, err = l.Owner(context.Background(), "test")
	require.True(t, errors.Is(err, vm.ErrNoOwner), "got %v", err)
	e := &vm.Engine{HV: l, Controller: "c"}
	require.ErrorIs(t, e.Remove(context.Background(), "test", "default-pool", true), vm.ErrNotOurs)
	active, err := l.IsActive(context.Background(), "test")
	require.NoError(t, err)
	require.True(t, active, "look-alike left running")
}

func TestLibvirtKVMAvailable(t *testing.T) {
	l := testDriver(t)
	_, err := l.KVMAvailable(context.Background())
	require.NoError(t, err)
}

// A domain undefined while running (transient) keeps its ownership record in
// its live definition: Owner reads it there, so teardown and the sweep can
// still prove it ours and remove it.
func TestOwnerOfATransientDomain(t *testing.T) {
	l := testDriver(t)
	s := testDriverSpec()
	ctx := context.Background()
	addBaseVolume(t, l, s)
	e := &vm.Engine{HV: l, Controller: s.Owner.Controller}
	_, err := e.Create(ctx, s)
	require.NoError(t, err)
	require.NoError(t, l.Undefine(ctx, s.Name), "undefined while running: transient")
	ownerXML, err := l.Owner(ctx, s.Name)
	require.NoError(t, err)
	o, err := vm.ParseOwner(ownerXML)
	require.NoError(t, err)
	require.Equal(t, s.Owner.Controller, o.Controller)
	require.NoError(t, e.Remove(ctx, s.Name, s.Pool, false))
	_, err = l.Owner(ctx, s.Name)
	require.ErrorIs(t, err, vm.ErrNotFound, "the transient domain is gone")
}

// Close waits for the calls that use the connection (an abandoned one may
// still run in C): the connection goes when the last one leaves, and no
// call starts after Close.
func TestCloseWaitsForCallsInFlight(t *testing.T) {
	l, err := Connect(context.Background(), "test:///default")
	require.NoError(t, err)
	require.NoError(t, l.enter())
	require.NoError(t, l.Close())
	alive, err := l.conn.IsAlive()
	require.NoError(t, err, "still open for the call in flight")
	require.True(t, alive)
	_, err = l.DomainNames(context.Background())
	require.ErrorIs(t, err, vm.ErrClosed)
	l.leave()
	_, err = l.conn.IsAlive()
	require.Error(t, err, "closed when the last call left")
	require.NoError(t, l.Close(), "closing twice")
}

func TestGivesUpWhenCtxHasEnded(t *testing.T) {
	l, err := Connect(context.Background(), "test:///default")
	require.NoError(t, err)
	defer l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = l.DomainNames(ctx)
	require.ErrorIs(t, err, context.Canceled)
	_, err = Connect(ctx, "test:///default")
	require.ErrorIs(t, err, context.Canceled)
}

// Importing the package registers it as vm.Connect's Connector (the
// default of lifecycle.Open).
func TestRegisteredAsTheConnector(t *testing.T) {
	hv, err := vm.Connect(context.Background(), "test:///default")
	require.NoError(t, err)
	defer hv.Close()
	require.IsType(t, &Conn{}, hv)
	names, err := hv.DomainNames(context.Background())
	require.NoError(t, err)
	require.Contains(t, names, "test")
}

func TestDescribeState(t *testing.T) {
	for _, tc := range []struct {
		st      libvirt.DomainState
		reason  int
		want    string
		code    vm.StateCode
		running bool
		ioerr   bool
	}{
		{libvirt.DOMAIN_RUNNING, int(libvirt.DOMAIN_RUNNING_BOOTED), "running", vm.StateRunning, true, false},
		{libvirt.DOMAIN_BLOCKED, 0, "running", vm.StateRunning, true, false},
		{libvirt.DOMAIN_PAUSED, int(libvirt.DOMAIN_PAUSED_IOERROR), "paused (I/O error)", vm.StatePaused, false, true},
		{libvirt.DOMAIN_PAUSED, int(libvirt.DOMAIN_PAUSED_USER), "paused (by a user)", vm.StatePaused, false, false},
		{libvirt.DOMAIN_SHUTDOWN, 0, "shutting down", vm.StateShuttingDown, false, false},
		{libvirt.DOMAIN_SHUTOFF, int(libvirt.DOMAIN_SHUTOFF_DESTROYED), "shut off (destroyed)", vm.StateShutOff, false, false},
		{libvirt.DOMAIN_SHUTOFF, int(libvirt.DOMAIN_SHUTOFF_CRASHED), "shut off (crashed)", vm.StateShutOff, false, false},
		{libvirt.DOMAIN_CRASHED, int(libvirt.DOMAIN_CRASHED_PANICKED), "crashed (guest kernel panic)", vm.StateCrashed, false, false},
		{libvirt.DOMAIN_PMSUSPENDED, 0, "suspended by the guest", vm.StateSuspended, false, false},
		{libvirt.DOMAIN_SHUTOFF, 99, "shut off", vm.StateShutOff, false, false},
		{libvirt.DOMAIN_NOSTATE, 0, "state 0, reason 0", vm.StateUnknown, false, false},
	} {
		got := describeState(tc.st, tc.reason)
		require.Equal(t, tc.want, got.Summary)
		require.Equal(t, tc.code, got.Code, tc.want)
		require.Equal(t, tc.running, got.Running, tc.want)
		require.Equal(t, tc.ioerr, got.IOError, tc.want)
	}
}

// libvirt's errors of a connection that is gone are marked
// vm.ErrConnectionLost, which is all vm.Reconnecting looks at; the other
// errors pass unmarked.
func TestConnectionLostClassification(t *testing.T) {
	l := testDriver(t)
	for _, tc := range []struct {
		err  error
		lost bool
	}{
		{libvirt.Error{Code: libvirt.ERR_SYSTEM_ERROR, Domain: libvirt.FROM_RPC}, true},
		{libvirt.Error{Code: libvirt.ERR_SYSTEM_ERROR, Domain: libvirt.FROM_REMOTE}, true},
		{libvirt.Error{Code: libvirt.ERR_RPC, Domain: libvirt.FROM_RPC}, true},
		{libvirt.Error{Code: libvirt.ERR_INVALID_CONN, Domain: libvirt.FROM_NONE}, true},
		{fmt.Errorf("wrapped: %w", libvirt.Error{Code: libvirt.ERR_NO_CONNECT}), true},
		{fmt.Errorf("%w: already marked", vm.ErrConnectionLost), true},
		{libvirt.Error{Code: libvirt.ERR_SYSTEM_ERROR, Domain: libvirt.FROM_QEMU}, false},
		{libvirt.Error{Code: libvirt.ERR_NO_DOMAIN}, false},
		{errors.New("x"), false},
	} {
		marked := l.markLost(tc.err)
		require.Equal(t, tc.lost, errors.Is(marked, vm.ErrConnectionLost), "%v", tc.err)
		require.ErrorIs(t, marked, tc.err, "the original error is kept")
	}
	require.NoError(t, l.markLost(nil))
}

// When libvirt refuses a hot-plugged disk (the test driver can neither
// upload into a volume nor attach a device), nothing of it is left: no
// volume, and the machine's ownership record as it was.
func TestLibvirtHotDiskRefusedLeavesNothing(t *testing.T) {
	l := testDriver(t)
	s := testDriverSpec()
	addBaseVolume(t, l, s)
	e := &vm.Engine{HV: l, Controller: s.Owner.Controller}
	_, err := e.Create(context.Background(), s)
	require.NoError(t, err)

	require.ErrorContains(t, e.AttachData(context.Background(), s.Name, s.Pool, strings.NewReader("hello"), 5), "virStorageVolUpload")
	require.ErrorContains(t, e.AttachScratch(context.Background(), s.Name, s.Pool, 4096), "virDomainAttachDeviceFlags")
	vols, err := l.VolumeNames(context.Background(), s.Pool)
	require.NoError(t, err)
	require.NotContains(t, vols, vm.DataVolume(s.Name))
	require.NotContains(t, vols, vm.ScratchVolume(s.Name))
	ownerXML, err := l.Owner(context.Background(), s.Name)
	require.NoError(t, err)
	o, err := vm.ParseOwner(ownerXML)
	require.NoError(t, err)
	require.Equal(t, []string{vm.DiskVolume(s.Name)}, o.Volumes)
	_, err = e.ReadScratch(context.Background(), s.Name, s.Pool, io.Discard)
	require.ErrorIs(t, err, vm.ErrNotFound)
}

// Another host's libvirt gives no DAC label and no volume file (its users,
// groups and paths are not this host's), without asking it.
func TestRemoteGivesNoLabelNorFile(t *testing.T) {
	l := &Conn{remote: true} // no connection: a call would fail
	label, err := l.DACImageLabel(context.Background(), "lve-x")
	require.NoError(t, err)
	require.Empty(t, label)
	f, err := l.VolumeFile(context.Background(), "pool", "lve-x-scratch.img")
	require.NoError(t, err)
	require.Nil(t, f)
}

// Static DHCP entries through libvirt's API (the test driver's "default"
// network): an entry added is there, a second for the address is taken,
// a removal of one that is not there, or on a network that is not, is
// not found (what Engine.Remove ignores).
func TestDHCPHostEntries(t *testing.T) {
	ctx := context.Background()
	l, err := Connect(ctx, "test:///default")
	require.NoError(t, err)
	defer func() { _ = l.Close() }()
	info, err := l.NetworkDHCP(ctx, "default")
	require.NoError(t, err)
	require.True(t, info.Enabled)
	cands := info.Candidates(2)
	require.Len(t, cands, 2)
	h := vm.DHCPHost{MAC: "52:54:00:12:34:56", Name: "lve-0123abcd-77", IP: cands[0].String()}
	require.NoError(t, l.AddDHCPHost(ctx, "default", h))
	after, err := l.NetworkDHCP(ctx, "default")
	require.NoError(t, err)
	require.Contains(t, after.Hosts, h)
	require.ErrorIs(t, l.AddDHCPHost(ctx, "default", vm.DHCPHost{MAC: "52:54:00:12:34:57", Name: "lve-0123abcd-78", IP: h.IP}), vm.ErrAddressTaken)
	require.NoError(t, l.DeleteDHCPHost(ctx, "default", h.Name))
	require.ErrorIs(t, l.DeleteDHCPHost(ctx, "default", h.Name), vm.ErrNotFound)
	require.ErrorIs(t, l.DeleteDHCPHost(ctx, "no-such-network", h.Name), vm.ErrNotFound)
}
