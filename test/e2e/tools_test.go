//go:build e2e

package e2e

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// requireGuestRunner skips a test that needs the guest tools disk's
// gitlab-runner when the rig gives the guests none, and fails instead when
// a binary was expected (see runnerBinary).
func requireGuestRunner(t *testing.T, r *rig) {
	t.Helper()
	if _, ok := runnerExpected(); ok && r.cfg.GuestTools.GitLabRunner == "none" {
		t.Fatalf("a gitlab-runner binary is provided, but the rig's configuration gives the guests none (guest_tools.gitlab_runner = \"none\"): start the rig with LVE_RIG_GITLAB_RUNNER (make test does)")
	}
	if r.cfg.GuestTools.GitLabRunner == "none" {
		t.Skip("the rig gives the guests no gitlab-runner (start it with LVE_RIG_GITLAB_RUNNER=/path/to/gitlab-runner)")
	}
}

// TestGuestToolsDisk: every job VM gets the host's gitlab-runner read-only
// on the guest tools disk, on the guest's PATH, from a volume built once per
// binary and kept across jobs; the job log says where it came from.
func TestGuestToolsDisk(t *testing.T) {
	r := setup(t)
	requireGuestRunner(t, r)
	want, err := exec.Command(r.cfg.GuestTools.GitLabRunner, "--version").Output()
	require.NoError(t, err)
	wantVersion := strings.SplitN(string(want), "\n", 3)[1] // "Version:      17.9.3"

	var vol string
	for i := range 2 {
		s := newStageRunner(t, r)
		require.Equal(t, 0, s.run(t, "config").code)
		prep := s.run(t, "prepare")
		require.Equal(t, 0, prep.code)
		require.Contains(t, prep.stdout, "gitlab-runner for the guest: "+r.cfg.GuestTools.GitLabRunner)
		require.NotContains(t, prep.stdout, "gitlab-runner is not on the guest's PATH")
		if i == 1 {
			require.NotContains(t, prep.stdout, "tools disk was built", "the second job reuses the volume")
		}
		rec, err := state.Store{Dir: r.cfg.StateDir}.Record(s.name(t))
		require.NoError(t, err)
		require.NotNil(t, rec.Tools)
		if i == 0 {
			vol = rec.Tools.Volume
		}
		require.Equal(t, vol, rec.Tools.Volume, "one tools volume for both jobs")
		require.Equal(t, r.cfg.GuestTools.GitLabRunner, rec.Tools.Source)
		res := s.runScript(t, "build_script", "command -v gitlab-runner\ngitlab-runner --version\n"+
			"if touch /opt/libvirt-executor/x 2>/dev/null; then echo WRITABLE; else echo READ-ONLY; fi\n")
		require.Equal(t, 0, res.code, res.stderr)
		require.Contains(t, res.stdout, "/usr/local/bin/gitlab-runner")
		require.Contains(t, res.stdout, wantVersion)
		require.Contains(t, res.stdout, "READ-ONLY")
		require.Equal(t, 0, s.run(t, "cleanup").code)
	}
	require.True(t, guesttools.IsToolsVolume(r.cfg.NamePrefix, r.controller(t), vol), vol)
	require.Contains(t, r.poolVolumes(t), vol, "the tools volume is kept after the jobs")
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}
