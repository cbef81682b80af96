package lifecycle

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// snapshotManager is a Manager whose tiny image boots a kernel and has
// snapshot = true, with its job log recorded.
func snapshotManager(t *testing.T, hv *vmtest.Fake, g *fakeGuest) (*Manager, *config.Image, *lifecycletest.Sayings) {
	t.Helper()
	cfg, err := config.Parse([]byte(`
domain_type = "qemu"
state_dir = "` + t.TempDir() + `"
storage_pool = "jobs"
[timeouts]
boot = "5s"
[images.tiny]
base = "/img/tiny.qcow2"
boot = "kernel"
kernel = "/img/vmlinuz"
cmdline = "console=ttyS0"
memory_mib = 256
vcpus = 1
snapshot = true
`))
	require.NoError(t, err)
	img, _ := cfg.Image("tiny")
	s := lifecycletest.NewSayings(t)
	m := &Manager{Cfg: cfg, hv: hv, Store: state.Store{Dir: cfg.StateDir}, Controller: controller,
		SSHPort: g.Port(), SSHPollInterval: 20 * time.Millisecond, AddressPollInterval: 10 * time.Millisecond,
		Say: s.Say}
	return m, img, s
}

// snapEnv is a snapshotManager over a fake hypervisor and guest whose tiny
// image's snapshot is made (rec).
type snapEnv struct {
	hv  *vmtest.Fake
	g   *fakeGuest
	m   *Manager
	img *config.Image
	say *lifecycletest.Sayings
	rec *state.Snapshot
}

func newSnapEnv(t *testing.T) *snapEnv {
	t.Helper()
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img, say := snapshotManager(t, hv, g)
	rec, err := SnapshotsOf(m).Build(context.Background(), img)
	require.NoError(t, err)
	return &snapEnv{hv: hv, g: g, m: m, img: img, say: say, rec: rec}
}

// shortLeaseWait makes a restored clone's lease wait short for the test.
func shortLeaseWait(t *testing.T) {
	old := snapshotLeaseWait
	snapshotLeaseWait = 300 * time.Millisecond
	t.Cleanup(func() { snapshotLeaseWait = old })
}

func domainXML(t *testing.T, hv *vmtest.Fake, name string) *libvirtxml.Domain {
	t.Helper()
	hv.Lock()
	d, ok := hv.Domains[name]
	var x string
	if ok {
		x = d.XML
	}
	hv.Unlock()
	require.True(t, ok, "domain %s", name)
	var dx libvirtxml.Domain
	require.NoError(t, dx.Unmarshal(x))
	return &dx
}

func TestSnapshotBuildRestoreAndSweep(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img, say := snapshotManager(t, hv, g)
	ctx := context.Background()
	snaps := SnapshotsOf(m)

	rec, err := snaps.Build(ctx, img)
	require.NoError(t, err)
	require.True(t, rec.Ready())
	require.True(t, m.Machine(rec.Template).IsSnapshotTemplate())
	// The template: no NIC, no secret, a VM generation id, the marker (its
	// XML as its save file holds it); once saved it is undefined (nothing
	// can start it and write its disk) and holds no capacity.
	hv.Lock()
	_, defined := hv.Domains[rec.Template]
	save := hv.Volumes["jobs/"+vm.SaveVolume(rec.Template)]
	hv.Unlock()
	require.False(t, defined)
	head, err := vm.ReadSaveHead(bytes.NewReader(save))
	require.NoError(t, err)
	var tx libvirtxml.Domain
	require.NoError(t, tx.Unmarshal(head.XML))
	require.Empty(t, tx.Devices.Interfaces)
	require.NotNil(t, tx.GenID)
	require.Nil(t, tx.SysInfo)
	require.Contains(t, tx.OS.Cmdline, TemplateMarker)
	require.Len(t, tx.Devices.Disks, 1)
	require.Equal(t, uint64(len(save)), rec.SaveBytes)
	require.NotEmpty(t, rec.Inputs["the libvirt and QEMU versions"])
	held, err := m.Capacity().Reservations()
	require.NoError(t, err)
	require.NotContains(t, held, rec.Template, "a saved template holds no memory")
	cur, why := snaps.Current(ctx, img)
	require.NotNil(t, cur, why)

	// A job's machine restores from it: its own NIC, its credentials disk
	// plugged last, its disk over the frozen one.
	ready, err := m.Provision(ctx, testRequest(img))
	require.NoError(t, err)
	_ = ready.Client.Close()
	require.Equal(t, StartSnapshot, ready.Timings.Start)
	require.True(t, say.Has("Restored %s from the memory snapshot"), "the job log says how it started")
	cx := domainXML(t, hv, "lve-0123abcd-7")
	require.Len(t, cx.Devices.Interfaces, 1)
	require.NotNil(t, cx.Devices.Interfaces[0].FilterRef, "the hot-plugged NIC is filtered")
	require.Equal(t, guestinit.CredentialDiskSerial, cx.Devices.Disks[len(cx.Devices.Disks)-1].Serial, "credentials plugged last")
	require.NotEqual(t, tx.UUID, cx.UUID)
	o, err := vm.ParseOwner(domainXMLOwner(t, hv, "lve-0123abcd-7"))
	require.NoError(t, err)
	require.Equal(t, "7", o.Job)
	hv.Lock()
	require.Equal(t, rec.DiskPath, hv.Backing["jobs/"+vm.DiskVolume("lve-0123abcd-7")], "the clone's disk is over the frozen one")
	persistent := !hv.Domains["lve-0123abcd-7"].Transient
	hv.Unlock()
	require.True(t, persistent, "the clone is defined, as a booted machine is")

	// While a clone's disk is over it, a replaced template stays; the
	// sweep keeps the current one.
	items, err := m.Inventory(ctx, time.Now())
	require.NoError(t, err)
	require.Equal(t, VerdictKeep, item(t, items, rec.Template).Verdict)
	require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(ctx))

	// Removed from the record: the template goes (no clone uses it).
	kept, err := snaps.Remove(ctx, "tiny")
	require.NoError(t, err)
	require.Empty(t, kept)
	_, err = snaps.Remove(ctx, "tiny")
	require.ErrorContains(t, err, "has no memory snapshot")
	requireNothingLeft(t, hv, m)
	names, err := m.Store.Names()
	require.NoError(t, err)
	require.Empty(t, names)
}

func domainXMLOwner(t *testing.T, hv *vmtest.Fake, name string) string {
	t.Helper()
	hv.Lock()
	defer hv.Unlock()
	return hv.Domains[name].OwnerXML
}

func item(t *testing.T, items []Item, name string) Item {
	t.Helper()
	for _, it := range items {
		if it.Name == name {
			return it
		}
	}
	t.Fatalf("%s not in the inventory", name)
	return Item{}
}

// A clone that cannot be restored, or whose guest does not go on, is
// removed and the machine boots cold; the job log says why.
func TestSnapshotFallsBackToColdBoot(t *testing.T) {
	for _, tc := range []struct {
		name, why string
		spoil     func(hv *vmtest.Fake, g *fakeGuest, rec *state.Snapshot)
	}{
		{"corrupt save file", "not the one it was made with", func(hv *vmtest.Fake, _ *fakeGuest, rec *state.Snapshot) {
			hv.Lock()
			hv.Volumes["jobs/"+vm.SaveVolume(rec.Template)] = []byte(strings.Repeat("garbage, not a save file ", 20))
			hv.Unlock()
		}},
		{"truncated save file", "not the one it was made with", func(hv *vmtest.Fake, _ *fakeGuest, rec *state.Snapshot) {
			hv.Lock()
			hv.Volumes["jobs/"+vm.SaveVolume(rec.Template)] = hv.Volumes["jobs/"+vm.SaveVolume(rec.Template)][:40]
			hv.Unlock()
		}},
		{"restore refused", "refused by the test", func(hv *vmtest.Fake, _ *fakeGuest, _ *state.Snapshot) {
			hv.FailOn["RestoreStream"] = errString("refused by the test")
		}},
		{"hot plug refused", "attach the network interface", func(hv *vmtest.Fake, _ *fakeGuest, _ *state.Snapshot) {
			hv.FailOn["AttachInterface"] = errString("no hot plug")
		}},
		{"guest silent", "took no address", func(_ *vmtest.Fake, g *fakeGuest, _ *state.Snapshot) {
			g.CloneSilent = true
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			shortLeaseWait(t)
			e := newSnapEnv(t)
			hv, m, img, say := e.hv, e.m, e.img, e.say
			ctx := context.Background()
			tc.spoil(hv, e.g, e.rec)
			ready, err := m.Provision(ctx, testRequest(img))
			require.NoError(t, err)
			_ = ready.Client.Close()
			require.Equal(t, StartCold, ready.Timings.Start)
			require.Regexp(t, "Memory snapshot of image tiny not used: .*"+tc.why+".*; booting cold", say.Args())
			// The machine is the cold boot's: its NIC in its definition.
			hv.Lock()
			started := hv.Domains["lve-0123abcd-7"].Transient
			hv.Unlock()
			require.False(t, started)
			cx := domainXML(t, hv, "lve-0123abcd-7")
			require.Nil(t, cx.GenID, "not the template's domain")
			require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(ctx))
		})
	}
}

type errString string

func (e errString) Error() string { return string(e) }

// A snapshot made from other inputs (here: another memory size) is not
// used; the job boots cold and its log says the snapshot is stale.
func TestSnapshotStaleNotUsed(t *testing.T) {
	e := newSnapEnv(t)
	hv, g, m := e.hv, e.g, e.m
	ctx := context.Background()
	m2, img2, say := snapshotManager(t, hv, g)
	m2.Cfg.StateDir, m2.Store = m.Cfg.StateDir, m.Store
	m2.Cfg.Defaults.DiskGiB++ // the image's size: another snapshot's
	req := testRequest(img2)
	ready, err := m2.Provision(ctx, req)
	require.NoError(t, err)
	_ = ready.Client.Close()
	require.Equal(t, StartCold, ready.Timings.Start)
	require.Contains(t, say.Args(), "stale")
	_, why := SnapshotsOf(m2).Current(ctx, img2)
	require.Contains(t, why, "stale")
}

// A template whose guest never says it waits fails within the boot
// timeout and leaves nothing: no domain, volume, state or record.
func TestSnapshotBuildFailureLeavesNothing(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	g.TemplateSilent = true
	m, img, _ := snapshotManager(t, hv, g)
	m.Cfg.Timeouts.Boot = config.Duration(300 * time.Millisecond)
	_, err := SnapshotsOf(m).Build(context.Background(), img)
	require.ErrorContains(t, err, TemplateWaiting)
	hv.Lock()
	require.Empty(t, hv.Domains)
	require.Empty(t, hv.Volumes)
	hv.Unlock()
	names, err := m.Store.Names()
	require.NoError(t, err)
	require.Empty(t, names)
	recs, err := m.Store.Snapshots()
	require.NoError(t, err)
	require.Empty(t, recs)
}

// An image that cannot have a snapshot is refused with what it needs.
func TestSnapshotSupport(t *testing.T) {
	cfg, img := lifecycletest.TinyConfig(t)
	_ = cfg
	require.ErrorContains(t, Support(img), "snapshot is off")
	img.Snapshot = true
	require.ErrorContains(t, Support(img), `boot = "kernel"`)
	_, err := config.Parse([]byte(`
[images.x]
base = "/img/x.qcow2"
snapshot = true
`))
	require.ErrorContains(t, err, "images.x.snapshot")
	require.True(t, strings.Contains(err.Error(), `needs boot = "kernel"`), err.Error())
}

// A template no record names (its build was killed after the save, or
// its record was lost) is removed by the sweep; one a record names is kept.
func TestSweepRemovesUnrecordedTemplate(t *testing.T) {
	e := newSnapEnv(t)
	hv, m, img, rec := e.hv, e.m, e.img, e.rec
	ctx := context.Background()
	rep, err := m.Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Empty(t, rep.Removed, "the recorded template stays")
	// A new snapshot replaces it: the old template stays a while for the
	// prepares that chose it a moment ago, then goes.
	rec2, err := SnapshotsOf(m).Build(ctx, img)
	require.NoError(t, err)
	require.Equal(t, rec.Template, rec2.Previous)
	rep, err = m.Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Empty(t, rep.Removed, "the replaced template stays for replacedGrace")
	rep, err = m.Sweep(ctx, time.Now().Add(replacedGrace+time.Second), false)
	require.NoError(t, err)
	require.Equal(t, []string{rec.Template}, rep.Removed)
	rec = rec2
	require.NoError(t, m.Store.ForgetSnapshot(context.Background(), "tiny", ""))
	// An unreadable record might be the one that names it: kept.
	require.NoError(t, os.WriteFile(filepath.Join(m.Store.Dir, state.SnapshotsDir, "other.json"), []byte("{cut"), 0o600))
	items, err := m.Inventory(ctx, time.Now())
	require.NoError(t, err)
	require.Equal(t, VerdictKeep, item(t, items, rec.Template).Verdict)
	require.NoError(t, os.Remove(filepath.Join(m.Store.Dir, state.SnapshotsDir, "other.json")))
	items, err = m.Inventory(ctx, time.Now())
	require.NoError(t, err)
	it := item(t, items, rec.Template)
	require.Equal(t, VerdictExpired, it.Verdict, it.Reason)
	rep, err = m.Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Equal(t, []string{rec.Template}, rep.Removed)
	hv.Lock()
	require.Empty(t, hv.Domains)
	require.Empty(t, hv.Volumes)
	hv.Unlock()
}

// A snapshot whose restores libvirt refuses MaxSnapshotFailures times in a
// row is no longer used; jobs boot cold meanwhile.
func TestSnapshotNotUsedAfterFailedRestores(t *testing.T) {
	e := newSnapEnv(t)
	hv, m, img, say := e.hv, e.m, e.img, e.say
	ctx := context.Background()
	hv.FailOn["RestoreStream"] = errString("refused by the test")
	for range state.MaxSnapshotFailures {
		ready, err := m.Provision(ctx, testRequest(img))
		require.NoError(t, err)
		_ = ready.Client.Close()
		require.Equal(t, StartCold, ready.Timings.Start)
		require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(ctx))
	}
	_, why := SnapshotsOf(m).Current(ctx, img)
	require.Contains(t, why, "restores failed")
	require.Contains(t, say.Args(), "libvirt refused the restore")
}

// Failures in a row: a machine that becomes ready from the snapshot clears
// the count; a clone that does not go on adds to it.
func TestSnapshotFailuresInARow(t *testing.T) {
	shortLeaseWait(t)
	e := newSnapEnv(t)
	g, m, img := e.g, e.m, e.img
	ctx := context.Background()
	start := func() string {
		ready, err := m.Provision(ctx, testRequest(img))
		require.NoError(t, err)
		_ = ready.Client.Close()
		require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(ctx))
		return ready.Timings.Start
	}
	failures := func() int {
		rec, err := m.Store.SnapshotOf("tiny")
		require.NoError(t, err)
		return rec.Failures
	}
	g.CloneSilent = true
	require.Equal(t, StartCold, start())
	require.Equal(t, StartCold, start())
	require.Equal(t, 2, failures())
	g.CloneSilent = false
	// The good start gets the whole wait: a loaded machine must not make
	// it a silent one.
	snapshotLeaseWait = 30 * time.Second
	require.Equal(t, StartSnapshot, start())
	require.Equal(t, 0, failures(), "a good start clears the count")
}

// Which failures count against a snapshot: the file's, libvirt's refusal
// and a silent clone; not a lost connection or a cancelled job.
func TestSnapshotsFault(t *testing.T) {
	require.True(t, snapshotsFault(fmt.Errorf("x: %w", vm.ErrSaveImage)))
	require.True(t, snapshotsFault(fmt.Errorf("x: %w: y", vm.ErrRestore)))
	require.True(t, snapshotsFault(fmt.Errorf("%w within 30s: %w", errCloneSilent, context.DeadlineExceeded)))
	require.False(t, snapshotsFault(fmt.Errorf("%w: header: %w", vm.ErrSaveImage, fmt.Errorf("stream: %w", vm.ErrConnectionLost))),
		"a stream cut by a lost connection is not the file's fault")
	require.False(t, snapshotsFault(fmt.Errorf("restore: %w", context.DeadlineExceeded)))
	require.False(t, snapshotsFault(fmt.Errorf("restore: %w", context.Canceled)))
	require.False(t, snapshotsFault(errString("attach the network interface: no")))
}
