package guesttools

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/agenttest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// installAt pretends the running executable is dir/bin/libvirt-executor-prepare.
func installAt(t *testing.T, dir string) {
	t.Helper()
	old := executable
	executable = func() (string, error) { return filepath.Join(dir, "bin", "libvirt-executor-prepare"), nil }
	t.Cleanup(func() { executable = old })
}

// "auto" takes the agent installed with the executables (beside them,
// else in ../lib/libvirt-executor), never one on PATH; the disk carries it
// at GuestAgentPath and the machine's record says so (the holder starts
// it by that record). None installed: a note, no agent; "none": neither.
func TestAgentOnTheToolsDisk(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = elfCopy(t, "gitlab-runner", "runner-a")
	m.Cfg.GuestTools.StepRunner = "none"
	m.Cfg.GuestTools.Agent = "auto"
	agent, err := os.ReadFile(agenttest.BuildT(t))
	require.NoError(t, err)

	// Nothing installed: a note saying where it looked; one on PATH is
	// not taken (it may be another version's).
	inst := t.TempDir()
	installAt(t, inst)
	onPath := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(onPath, "lve-agent"), agent, 0o755))
	t.Setenv("PATH", onPath)
	none, err := Get(ctx, m)
	require.NoError(t, err)
	require.Nil(t, none.Agent)
	require.Len(t, none.Notes, 1)
	require.Contains(t, none.Notes[0], "no lve-agent installed with these executables (looked for "+filepath.Join(inst, "bin", "lve-agent")+", "+filepath.Join(inst, "lib", "libvirt-executor", "lve-agent"))
	require.Contains(t, none.Notes[0], "stages run through the wrapper")

	// The package's place.
	lib := filepath.Join(inst, "lib", "libvirt-executor", "lve-agent")
	require.NoError(t, os.MkdirAll(filepath.Dir(lib), 0o755))
	require.NoError(t, os.WriteFile(lib, append(agent, "installed-lib"...), 0o755))
	got, err := Get(ctx, m)
	require.NoError(t, err)
	require.Empty(t, got.Notes)
	require.NotNil(t, got.Agent)
	require.Equal(t, lib, got.Agent.Source)
	require.NotEqual(t, none.Volume, got.Volume)
	require.Equal(t, got.Agent, got.record().Agent, "the machine's record says the disk has the agent")
	require.Contains(t, got.Describe(), "guest agent (runs the stages): "+lib)
	require.Contains(t, got.Describe(), guestinit.GuestAgentPath)
	require.True(t, bytes.Contains(isoOf(t, hv, got.Volume), []byte("installed-lib")), "the agent is on the disk")
	now, exact := Now(m)
	require.True(t, exact)
	require.Equal(t, got.Volume, now.Volume)

	// Beside the executable (make build's bin/) comes first.
	beside := filepath.Join(inst, "bin", "lve-agent")
	require.NoError(t, os.MkdirAll(filepath.Dir(beside), 0o755))
	require.NoError(t, os.WriteFile(beside, append(agent, "installed-bin"...), 0o755))
	require.NotEqual(t, got.Volume, VolumeNow(m), "another agent installed: machines booted now get another disk")
	bin, err := Get(ctx, m)
	require.NoError(t, err)
	require.Equal(t, beside, bin.Agent.Source)

	// A dynamically linked agent the admin names fails the boot.
	m.Cfg.GuestTools.Agent = "/bin/true"
	_, err = Get(ctx, m)
	require.ErrorContains(t, err, "guest_tools.agent /bin/true")
	require.ErrorContains(t, err, "must be static")
	// One installed with the executables is left out with a warning.
	require.NoError(t, os.WriteFile(beside, mustRead(t, "/bin/true"), 0o755))
	m.Cfg.GuestTools.Agent = "auto"
	warned, err := Get(ctx, m)
	require.NoError(t, err)
	require.Nil(t, warned.Agent)
	require.Len(t, warned.Notes, 1)
	require.Contains(t, warned.Notes[0], "the lve-agent installed with these executables cannot go to the guest")

	// "none": no agent and no note.
	m.Cfg.GuestTools.Agent = "none"
	off, err := Get(ctx, m)
	require.NoError(t, err)
	require.Nil(t, off.Agent)
	require.Empty(t, off.Notes)
	require.Equal(t, none.Volume, off.Volume, "the same programs, the same disk")

	// The sweep keeps the disk in use now and removes the others.
	rep, err := m.Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{got.Volume, bin.Volume}, rep.SharedVolumes)
}
