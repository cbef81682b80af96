package guesttools

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// runnerOnPath puts a gitlab-runner (a copy of /bin/true with extra bytes,
// so each call's binary is its own) alone on PATH.
func runnerOnPath(t *testing.T, extra string) string {
	t.Helper()
	p := elfCopy(t, "gitlab-runner", extra)
	t.Setenv("PATH", filepath.Dir(p))
	return p
}

// "auto" is resolved once, by the process that builds the disk; a process
// with another PATH (the reaper, the service, the gc timer) sees the same
// current volume: its sweep keeps it, and a standby machine booted with it
// is not outdated. Before, each process resolved its own PATH: the sweep
// deleted the current volume and its record.
func TestAutoResolvedOnceAcrossPATHs(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = config.GuestToolsAuto
	first := runnerOnPath(t, "a")
	built, err := Get(ctx, m)
	require.NoError(t, err)
	require.Equal(t, first, built.Source)

	// Another process, another PATH: another gitlab-runner, then none.
	for _, other := range []func(){
		func() { runnerOnPath(t, "b") },
		func() { t.Setenv("PATH", t.TempDir()) },
	} {
		other()
		require.Equal(t, built.Volume, VolumeNow(m), "the current volume is the recorded binary's")
		rep, err := m.Sweep(ctx, time.Now(), false)
		require.NoError(t, err)
		require.Empty(t, rep.SharedVolumes)
		require.Contains(t, toolsVolumes(hv), built.Volume, "the current volume is kept")
		var rec toolsRecord
		require.True(t, m.Store.GetTools(recordKey(m, built.Volume), &rec), "and its record")
		again, err := Get(ctx, m)
		require.NoError(t, err)
		require.Equal(t, built.Volume, again.Volume, "a prepare under this PATH attaches the same disk")
		require.Zero(t, again.Built)
	}

	// The recorded binary gone: resolved again, from this PATH.
	require.NoError(t, os.Remove(first))
	second := runnerOnPath(t, "c")
	next, err := Get(ctx, m)
	require.NoError(t, err)
	require.Equal(t, second, next.Source)
	require.NotEqual(t, built.Volume, next.Volume)
}

// A process that never built the disk under "auto" knows no current
// volume: its sweep removes none (whatever its own PATH finds).
func TestAutoUnresolvedSweepRemovesNoTools(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = fakeRunnerBinary(t)
	old, err := Get(ctx, m) // a volume of this installation, by its record
	require.NoError(t, err)
	m.Cfg.GuestTools.GitLabRunner = config.GuestToolsAuto
	runnerOnPath(t, "x")
	rep, err := m.Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Empty(t, rep.SharedVolumes)
	require.Contains(t, toolsVolumes(hv), old.Volume)
}

// The sweep of old volumes holds admission: no machine is admitted (and
// attaches a volume) between its look at the machines and its delete.
func TestToolsSweepWaitsForAdmission(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = fakeRunnerBinary(t)
	_, err := Get(context.Background(), m)
	require.NoError(t, err)
	// an upgrade: the first binary's volume is old, the sweep's to remove
	m.Cfg.GuestTools.GitLabRunner = fakeRunnerBinary(t)
	require.NoError(t, os.WriteFile(m.Cfg.GuestTools.GitLabRunner, append(mustRead(t, m.Cfg.GuestTools.GitLabRunner), "v2"...), 0o755))
	_, err = Get(context.Background(), m)
	require.NoError(t, err)
	unlock, err := m.Capacity().Hold(context.Background())
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = m.Sweep(ctx, time.Now(), false)
	require.ErrorIs(t, err, context.DeadlineExceeded, "it waits for the admission lock")
	unlock()
	rep, err := m.Sweep(context.Background(), time.Now(), false)
	require.NoError(t, err)
	require.Len(t, rep.SharedVolumes, 1, "then it removes the old volume")
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}
