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
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// elfCopy is a copy of /bin/true (an x86-64 ELF executable) with extra
// bytes, named name in a directory of its own.
func elfCopy(t *testing.T, name, extra string) string {
	t.Helper()
	b, err := os.ReadFile("/bin/true")
	require.NoError(t, err)
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, append(b, extra...), 0o755))
	return p
}

func isoOf(t *testing.T, hv *vmtest.Fake, vol string) []byte {
	t.Helper()
	hv.Lock()
	defer hv.Unlock()
	for k, v := range hv.Volumes {
		if filepath.Base(k) == vol {
			return v
		}
	}
	t.Fatalf("no volume %s", vol)
	return nil
}

// The disk holds both programs; the volume is another one than the
// gitlab-runner's alone, and the job log and the machine's record say
// which step-runner the guest has.
func TestStepRunnerOnTheToolsDisk(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = elfCopy(t, "gitlab-runner", "runner-1")
	m.Cfg.GuestTools.StepRunner = "none"
	alone, err := Get(ctx, m)
	require.NoError(t, err)
	require.Nil(t, alone.StepRunner)
	require.Empty(t, alone.Notes, `step_runner = "none" is the admin's choice: no note on every job`)
	require.NotContains(t, alone.Describe(), "step-runner")

	sr := elfCopy(t, "step-runner", "steps-1")
	m.Cfg.GuestTools.StepRunner = sr
	both, err := Get(ctx, m)
	require.NoError(t, err)
	require.NotEqual(t, alone.Volume, both.Volume, "another set of programs, another disk")
	require.Positive(t, both.Built)
	require.NotNil(t, both.StepRunner)
	require.Equal(t, sr, both.StepRunner.Source)
	require.Contains(t, both.Describe(), "step-runner for the guest (GitLab Steps): "+sr)
	require.Contains(t, both.Describe(), guestinit.GuestStepRunnerPath)
	require.Contains(t, both.Describe(), "gitlab-runner for the guest: "+m.Cfg.GuestTools.GitLabRunner)
	img := isoOf(t, hv, both.Volume)
	require.True(t, bytes.Contains(img, []byte("steps-1")) && bytes.Contains(img, []byte("runner-1")), "both binaries are on the disk")
	require.Equal(t, both.Volume, VolumeNow(m))
	require.Equal(t, both.StepRunner, both.record().StepRunner, "the machine's record says which step-runner it has")

	// A new step-runner: a new disk; the sweep removes the old ones.
	require.NoError(t, os.WriteFile(sr, []byte("not an ELF"), 0o755))
	_, err = Get(ctx, m)
	require.ErrorContains(t, err, "guest_tools.step_runner "+sr)
	require.ErrorContains(t, err, "want a linux/amd64 step-runner binary", "a binary the admin named that is unusable fails the boot")
	require.Empty(t, VolumeNow(m))

	// Only a step-runner: a disk all the same, with a note on the
	// missing gitlab-runner.
	m.Cfg.GuestTools.GitLabRunner = "none"
	m.Cfg.GuestTools.StepRunner = elfCopy(t, "step-runner", "steps-2")
	only, err := Get(ctx, m)
	require.NoError(t, err)
	require.Empty(t, only.Source)
	require.NotNil(t, only.StepRunner)
	require.Len(t, only.Notes, 1)
	require.Contains(t, only.Notes[0], `guest_tools.gitlab_runner = "none"`)
	require.NotContains(t, only.Describe(), "gitlab-runner for the guest")
	rep, err := m.Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{alone.Volume, both.Volume}, rep.SharedVolumes)
	require.Equal(t, map[string]int{only.Volume: len(isoOf(t, hv, only.Volume))}, toolsVolumes(hv))
}

// "auto" for step-runner: none on PATH is recorded (no note: it matters to
// run: jobs only, whose prepare says so); one found later is taken, and
// once found it stays, whatever another process's PATH. Now is exact only
// while a boot would get just what it says.
func TestStepRunnerAuto(t *testing.T) {
	ctx := context.Background()
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	m.Cfg.GuestTools.GitLabRunner = elfCopy(t, "gitlab-runner", "r")
	m.Cfg.GuestTools.StepRunner = "auto"
	t.Setenv("PATH", t.TempDir())
	first, err := Get(ctx, m)
	require.NoError(t, err)
	require.Nil(t, first.StepRunner)
	require.Empty(t, first.Notes, "no step-runner is no news for jobs without run:")
	now, exact := Now(m)
	require.True(t, exact)
	require.Equal(t, first.Volume, now.Volume)
	require.Nil(t, now.StepRunner)

	sr := elfCopy(t, "step-runner", "auto-found")
	t.Setenv("PATH", filepath.Dir(sr))
	_, exact = Now(m)
	require.False(t, exact, "a boot now would find the step-runner on this PATH and build another disk")
	found, err := Get(ctx, m)
	require.NoError(t, err)
	require.NotNil(t, found.StepRunner)
	require.Equal(t, sr, found.StepRunner.Source)
	require.Empty(t, found.Notes)
	now, exact = Now(m)
	require.True(t, exact)
	require.Equal(t, found.Volume, now.Volume)
	require.Equal(t, sr, now.StepRunner.Source)

	t.Setenv("PATH", t.TempDir()) // another process, without it on PATH
	require.Equal(t, found.Volume, VolumeNow(m))
	again, err := Get(ctx, m)
	require.NoError(t, err)
	require.Equal(t, found.Volume, again.Volume, "the recorded step-runner stays")
	var rec autoRecord
	require.True(t, m.Store.GetTools("step-runner-auto", &rec))
	require.Equal(t, sr, rec.Path, "a process without it on PATH never records none over it")
	rep, err := m.Sweep(ctx, time.Now(), false)
	require.NoError(t, err)
	require.Equal(t, []string{first.Volume}, rep.SharedVolumes)

	// The admin names a step-runner whose disk is not built yet: not exact.
	m.Cfg.GuestTools.StepRunner = elfCopy(t, "step-runner", "named")
	_, exact = Now(m)
	require.False(t, exact)
}
