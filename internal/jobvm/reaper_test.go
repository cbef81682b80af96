package jobvm

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// EndJob leaves the machine paused, marked, keyless, without its holder,
// and still counted (domain, volumes, state); Reap then removes the rest.
func TestEndJobThenReap(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	req := testRequest(img)
	ready, err := m.Manager().Provision(ctx, req)
	require.NoError(t, err)
	_ = ready.Client.Close()
	dir := m.Manager().Store.MachineDir(req.Name)
	sleep, err := exec.LookPath("sleep")
	require.NoError(t, err)
	pid, err := holder.Start(dir, sleep, []string{"300"}, nil)
	require.NoError(t, err)

	jm, ended, err := m.EndJob(ctx, req.Name)
	require.NoError(t, err)
	require.Equal(t, req.Name, jm.Name)
	require.Equal(t, []string{req.Name}, ended)
	require.Zero(t, holder.Running(dir), "holder %d stopped", pid)
	hv.Lock()
	d := hv.Domains[req.Name]
	require.NotNil(t, d, "the domain is the reaper's to remove")
	require.True(t, d.Paused, "but it runs nothing any more")
	require.NotContains(t, hv.Calls, "Destroy", "cleanup does not wait for QEMU")
	hv.Unlock()
	require.NoFileExists(t, filepath.Join(dir, "id_ed25519"), "the job's key is gone")
	_, _, err = m.Manager().Machine(req.Name).Connect(ctx)
	require.Error(t, err, "nothing of the job connects any more")
	e, err := m.Manager().Store.EndedOf(req.Name)
	require.NoError(t, err)
	require.NotNil(t, e)

	// Until it is gone it still counts against the host's capacity.
	res, err := m.Manager().Store.Reservations(state.Reservation{})
	require.NoError(t, err)
	require.Contains(t, res, req.Name)

	require.NoError(t, m.Reap(ctx, ended))
	requireNothingLeft(t, hv, m)
}

// A machine that is not marked ended is never reaped.
func TestReapRefusesUnmarkedMachine(t *testing.T) {
	ctx := context.Background()
	hv, m, name := provisioned(t)
	err := m.Reap(ctx, []string{name})
	require.ErrorIs(t, err, vm.ErrNotOurs)
	require.ErrorContains(t, err, "not marked ended")
	require.True(t, hv.Domains[name].Active)
	require.NoError(t, m.Reap(ctx, []string{"lve-0123abcd-404"}), "one already gone is done")
}

// The reaper died (SIGKILL) at any point after EndJob: the next sweep
// removes the machine at once, long before its deadline.
func TestSweepRemovesEndedMachineWhoseReaperDied(t *testing.T) {
	ctx := context.Background()
	hv, m, name := provisioned(t)

	rep, err := m.Manager().Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Empty(t, rep.Removed, "a running job's machine stays")

	_, _, err = m.EndJob(ctx, name)
	require.NoError(t, err)
	items, err := m.Manager().Inventory(ctx, time.Now())
	require.NoError(t, err)
	require.Len(t, items, 1)
	require.Equal(t, lifecycle.VerdictEnded, items[0].Verdict)

	// The reaper holds the lock: the sweep leaves it to it.
	unlock, err := m.Manager().Store.TryLock(name)
	require.NoError(t, err)
	rep, err = m.Manager().Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Empty(t, rep.Removed)
	unlock()

	rep, err = m.Manager().Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Equal(t, []string{name}, rep.Removed)
	requireNothingLeft(t, hv, m)
}

// EndJob refuses a domain of the job's name that is not ours, and changes
// nothing of it.
func TestEndJobRefusesForeignDomain(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	name := "lve-0123abcd-8"
	hv.Domains[name] = &vmtest.Domain{XML: "<domain/>", Active: true}
	_, err := m.Manager().Store.Create(name)
	require.NoError(t, err)
	_, _, err = m.EndJob(ctx, name)
	require.ErrorIs(t, err, vm.ErrNotOurs)
	require.False(t, hv.Domains[name].Paused)
	require.NotContains(t, hv.Calls, "Suspend")
}

func TestStartReaperRunsDetached(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	out := filepath.Join(t.TempDir(), "argv")
	script := filepath.Join(t.TempDir(), "reaper")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\ncat > "+out+".stdin\necho \"$@\" > "+out+"\n"), 0o700))
	m.ReaperExe = script
	m.Manager().Cfg.Path = "/etc/x.toml"
	require.NoError(t, m.StartReaper([]string{"lve-0123abcd-7"}))
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(out)
		return err == nil && string(b) == ReaperCommand+" --config /etc/x.toml --config-stdin -- lve-0123abcd-7\n"
	}, 5*time.Second, 20*time.Millisecond)
	stdin, err := os.ReadFile(out + ".stdin")
	require.NoError(t, err)
	require.Equal(t, string(m.Manager().Cfg.Text), string(stdin), "the reaper gets the stage's very configuration")
	require.NotEmpty(t, stdin)
	fi, err := os.Stat(filepath.Join(m.Manager().Store.Dir, reaperLog))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
}

// A pause that fails leaves the machine marked ended and keyless: EndJob
// reports it among the ended ones with the error, so its reaper destroys it.
func TestEndJobReportsMarkedMachineWhenThePauseFails(t *testing.T) {
	ctx := context.Background()
	hv, m, name := provisioned(t)
	hv.Lock()
	hv.FailOn["Suspend"] = errors.New("suspend refused")
	hv.Unlock()
	_, ended, err := m.EndJob(ctx, name)
	require.ErrorContains(t, err, "suspend refused")
	require.Equal(t, []string{name}, ended)
	e, err := m.Manager().Store.EndedOf(name)
	require.NoError(t, err)
	require.NotNil(t, e)
	hv.Lock()
	delete(hv.FailOn, "Suspend")
	hv.Unlock()
	require.NoError(t, m.Reap(ctx, ended))
	requireNothingLeft(t, hv, m)
}

// A VM kept for debugging keeps its keys; its job is over, so its holder
// is stopped.
func TestKeepStopsTheHolder(t *testing.T) {
	ctx := context.Background()
	_, m, name := provisioned(t)
	dir := m.Manager().Store.MachineDir(name)
	sleep, err := exec.LookPath("sleep")
	require.NoError(t, err)
	_, err = holder.Start(dir, sleep, []string{"300"}, nil)
	require.NoError(t, err)
	require.NoError(t, m.Manager().Machine(name).Keep(ctx, time.Now().Add(time.Hour)))
	require.Zero(t, holder.Running(dir))
	require.FileExists(t, filepath.Join(dir, "id_ed25519"), "the debugging login needs the key")
	require.NoError(t, m.Manager().Machine(name).Teardown(ctx))
}

// provisioned is a machine provisioned on a fake hypervisor and guest, its
// SSH connection closed (as prepare leaves it).
func provisioned(t *testing.T) (*vmtest.Fake, *Host, string) {
	t.Helper()
	hv := vmtest.New()
	m, img := manager(t, hv, newGuest(t, hv))
	ready, err := m.Manager().Provision(context.Background(), testRequest(img))
	require.NoError(t, err)
	_ = ready.Client.Close()
	return hv, m, ready.Machine.Name
}
