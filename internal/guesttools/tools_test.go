package guesttools

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// fakeRunnerBinary is a copy of an ELF x86-64 executable of this host
// standing in for gitlab-runner.
func fakeRunnerBinary(t *testing.T) string { return elfCopy(t, "gitlab-runner", "") }

func toolsVolumes(hv *vmtest.Fake) map[string]int {
	hv.Lock()
	defer hv.Unlock()
	out := map[string]int{}
	for k, v := range hv.Volumes {
		if filepath.Ext(k) == ".iso" {
			out[filepath.Base(k)] = len(v)
		}
	}
	return out
}

func TestGuestToolsBuiltOncePerBinary(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	bin := fakeRunnerBinary(t)
	m.Cfg.GuestTools.GitLabRunner = bin

	t1, err := Get(context.Background(), m)
	require.NoError(t, err)
	require.Positive(t, t1.Built, "the first call builds the volume")
	require.True(t, IsToolsVolume(m.Cfg.NamePrefix, m.Controller, t1.Volume), t1.Volume)
	require.Equal(t, bin, t1.Source)
	require.Contains(t, t1.Describe(), bin)
	require.Contains(t, t1.Describe(), guestinit.GuestRunnerPath)
	vols := toolsVolumes(hv)
	require.Len(t, vols, 1)
	require.Positive(t, vols[t1.Volume], "the ISO was uploaded")
	_, isMachine := lifecycle.MachineOfVolume(t1.Volume)
	require.False(t, isMachine, "the sweep never takes it for a machine's volume")

	t2, err := Get(context.Background(), m)
	require.NoError(t, err)
	require.Zero(t, t2.Built, "the second call reuses it")
	require.Equal(t, t1.Volume, t2.Volume)
	require.Equal(t, t1.Path, t2.Path)

	// A new binary at the same path (an upgrade): a volume of its own.
	f, err := os.OpenFile(bin, os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteString("v2")
	require.NoError(t, err)
	require.NoError(t, f.Close())
	t3, err := Get(context.Background(), m)
	require.NoError(t, err)
	require.NotEqual(t, t1.SHA256, t3.SHA256)
	require.NotEqual(t, t1.Volume, t3.Volume)
	require.Positive(t, t3.Built)
	require.Len(t, toolsVolumes(hv), 2)
}

func TestGuestToolsUnfinishedBuildIsRedone(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = fakeRunnerBinary(t)
	t1, err := Get(context.Background(), m)
	require.NoError(t, err)
	// As if the building process had been killed after creating the
	// volume: the record says "not ready", the volume holds junk.
	var rec toolsRecord
	require.True(t, m.Store.GetTools(recordKey(m, t1.Volume), &rec))
	rec.Ready = false
	require.NoError(t, m.Store.PutTools(recordKey(m, t1.Volume), rec))
	// ... and left its work directory behind.
	stale := filepath.Join(m.Store.Dir, toolsWorkPrefix+"killed")
	require.NoError(t, os.MkdirAll(stale, 0o700))
	hv.Lock()
	hv.Volumes["jobs/"+t1.Volume] = []byte("partial")
	hv.Unlock()

	t2, err := Get(context.Background(), m)
	require.NoError(t, err)
	require.Positive(t, t2.Built, "made again")
	require.Greater(t, toolsVolumes(hv)[t1.Volume], len("partial"))
	_, err = os.Stat(stale)
	require.True(t, os.IsNotExist(err), "the killed build's work directory is removed")
	left, err := filepath.Glob(filepath.Join(m.Store.Dir, toolsWorkPattern))
	require.NoError(t, err)
	require.Empty(t, left)
}

func TestGuestToolsLeavesAVolumeWithoutRecordAlone(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = fakeRunnerBinary(t)
	sum, err := sourceHash(m, programs[0], m.Cfg.GuestTools.GitLabRunner)
	require.NoError(t, err)
	name := ToolsVolumeName(m.Cfg.NamePrefix, m.Controller, sum)
	hv.Lock()
	hv.Volumes["jobs/"+name] = []byte("someone else's")
	hv.Unlock()
	_, err = Get(context.Background(), m)
	require.ErrorContains(t, err, "no record of this installation says it made it")
	require.Equal(t, len("someone else's"), toolsVolumes(hv)[name], "not touched")
}

func TestGuestToolsNoneOrUnusable(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))

	m.Cfg.GuestTools.GitLabRunner = "none"
	_, err := Get(context.Background(), m)
	require.ErrorIs(t, err, ErrNoTools)
	require.ErrorContains(t, err, `"none"`)

	t.Setenv("PATH", t.TempDir())
	m.Cfg.GuestTools.GitLabRunner = "auto"
	_, err = Get(context.Background(), m)
	require.ErrorIs(t, err, ErrNoTools)
	require.ErrorContains(t, err, "no gitlab-runner on this host's PATH")

	script := filepath.Join(t.TempDir(), "gitlab-runner")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\n"), 0o755))
	m.Cfg.GuestTools.GitLabRunner = script
	_, err = Get(context.Background(), m)
	require.NotErrorIs(t, err, ErrNoTools)
	require.ErrorContains(t, err, "want a linux/amd64 gitlab-runner binary")

	m.Cfg.GuestTools.GitLabRunner = "/nonexistent/gitlab-runner"
	_, err = Get(context.Background(), m)
	require.ErrorContains(t, err, "/nonexistent/gitlab-runner")
	require.Empty(t, toolsVolumes(hv))
}

func TestProvisionAttachesToolsDiskAndTeardownKeepsIt(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	m.Cfg.GuestTools.GitLabRunner = fakeRunnerBinary(t)
	ready, err := m.Provision(context.Background(), testRequest(img))
	require.NoError(t, err)
	ready.Client.Close()

	hv.Lock()
	var d libvirtxml.Domain
	require.NoError(t, d.Unmarshal(hv.Domains["lve-0123abcd-7"].XML))
	hv.Unlock()
	var serials []string
	for _, disk := range d.Devices.Disks {
		serials = append(serials, disk.Serial)
		if disk.Serial == guestinit.ToolsDiskSerial {
			require.NotNil(t, disk.ReadOnly, "the tools disk is read-only")
		}
	}
	require.Contains(t, serials, guestinit.ToolsDiskSerial)
	rec, err := m.Store.Record("lve-0123abcd-7")
	require.NoError(t, err)
	require.NotNil(t, rec.Tools)
	require.Equal(t, m.Cfg.GuestTools.GitLabRunner, rec.Tools.Source)

	require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(context.Background()))
	require.Len(t, toolsVolumes(hv), 1, "the shared tools volume outlives the machine")
}

// The sweep removes the tools volume of an earlier binary once no machine
// can use it, never the current one, never one a machine's record names,
// and none while a machine is booting.
func TestSweepRemovesToolsOfEarlierBinaries(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	bin := fakeRunnerBinary(t)
	m.Cfg.GuestTools.GitLabRunner = bin
	// A machine booted with the first binary's disk.
	ready, err := m.Provision(context.Background(), testRequest(img))
	require.NoError(t, err)
	ready.Client.Close()
	first := ready.Machine.Tools.Volume

	// An upgrade: the current binary gets a disk of its own.
	f, err := os.OpenFile(bin, os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteString("v2")
	require.NoError(t, err)
	require.NoError(t, f.Close())
	second, err := Get(context.Background(), m)
	require.NoError(t, err)
	require.Len(t, toolsVolumes(hv), 2)

	sweep := func(dry bool) []string {
		rep, err := m.Sweep(context.Background(), time.Now(), dry)
		require.NoError(t, err)
		return rep.SharedVolumes
	}
	require.Empty(t, sweep(false), "the machine still uses the first disk")

	// A machine booting (its prepare holds its lock; a state directory, no
	// record yet) might use either.
	require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(context.Background()))
	unlock, err := m.Store.Lock(context.Background(), "lve-0123abcd-9")
	require.NoError(t, err)
	_, err = m.Store.Create("lve-0123abcd-9")
	require.NoError(t, err)
	require.Empty(t, sweep(false))
	require.NoError(t, m.Store.Remove("lve-0123abcd-9"))
	unlock()

	require.Equal(t, []string{first}, sweep(true), "dry run")
	require.Len(t, toolsVolumes(hv), 2)
	require.Equal(t, []string{first}, sweep(false))
	vols := toolsVolumes(hv)
	require.Len(t, vols, 1)
	require.Contains(t, vols, second.Volume, "the current binary's disk stays")
	var rec toolsRecord
	require.False(t, m.Store.GetTools(recordKey(m, first), &rec), "its record went with it")
	require.Empty(t, sweep(false))
}

// Another storage pool (another configuration on the same state directory)
// gets a volume and a record of its own: a build there does not touch the
// first pool's.
func TestGuestToolsPerStoragePool(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = fakeRunnerBinary(t)
	t1, err := Get(context.Background(), m)
	require.NoError(t, err)

	m.Cfg.StoragePool = "small"
	hv.Lock()
	hv.FailOn["CreateVolume"] = errors.New("No space left on device")
	hv.Unlock()
	_, err = Get(context.Background(), m)
	require.ErrorContains(t, err, "No space left on device")

	hv.Lock()
	delete(hv.FailOn, "CreateVolume")
	hv.Unlock()
	m.Cfg.StoragePool = "jobs"
	t2, err := Get(context.Background(), m)
	require.NoError(t, err)
	require.Zero(t, t2.Built, "the first pool's volume is still ready: not rebuilt")
	require.Equal(t, t1.Path, t2.Path)
}

// manager is a Manager with one image, tiny, on the fake hypervisor and
// guest, with the guest tools disk as its shared disk and sweeper.
func manager(t *testing.T, hv *vmtest.Fake, g *lifecycletest.Guest) (*lifecycle.Manager, *config.Image) {
	cfg, img := lifecycletest.TinyConfig(t)
	cfg.GuestTools.Agent = "none" // agent_test.go has the agent's
	m := lifecycle.New(cfg, hv, lifecycletest.Controller, lifecycle.Options{Say: lifecycletest.NewSayings(t).Say,
		Hooks: lifecycle.Hooks{Shared: Disk{}, Sweepers: []lifecycle.Sweeper{Sweep}}})
	m.SSHPort, m.SSHPollInterval, m.AddressPollInterval = g.Port(), 20*time.Millisecond, 10*time.Millisecond
	return m, img
}

func newGuest(t *testing.T, hv *vmtest.Fake) *lifecycletest.Guest {
	return lifecycletest.NewGuest(t, hv)
}

func testRequest(img *config.Image) lifecycle.Request {
	return lifecycle.Request{Name: "lve-0123abcd-7", Image: img, VCPUs: 1, MemoryMiB: 256, Frontend: "test", Job: "7", Lifetime: time.Hour}
}
