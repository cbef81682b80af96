//go:build e2e

package e2e

import (
	"net"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSelftest: `libvirt-executor selftest` runs its sample jobs through
// the real gitlab-runner and the rig's configuration on real VMs and says
// OK (with --steps also a GitLab Steps job, where the rig gives the guests a
// step-runner, as make test does); pointed at an address the guests cannot
// reach, it fails and says what to fix.
func TestSelftest(t *testing.T) {
	r := setup(t)
	bin := runnerBinary(t)
	requireGuestRunner(t, r)
	selftest := func(listen string, more ...string) (string, error) {
		args := append([]string{"--config", r.cfgPath, "selftest", "--runner", bin, "--listen", listen, "--timeout", "5m"}, more...)
		cmd := exec.Command(filepath.Join(r.bin, "libvirt-executor"), args...)
		out, err := cmd.CombinedOutput()
		t.Logf("selftest --listen %s:\n%s", listen, out)
		return string(out), err
	}
	ln := r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	// With a step-runner for the guests, --steps adds a run: job.
	steps := r.cfg.GuestTools.StepRunner != "none"
	var more []string
	if steps {
		more = append(more, "--steps")
	}
	out, err := selftest(addr, more...)
	require.NoError(t, err)
	require.Contains(t, out, "selftest-produce   success")
	require.Contains(t, out, "selftest-consume   success")
	require.Contains(t, out, "OK: VMs start")
	if steps {
		require.Contains(t, out, "selftest-steps     success")
		require.Contains(t, out, "a GitLab Steps job ran its step with the guest's step-runner")
	}

	// A port the rig's guard does not open to the guests.
	host, _, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	blocked := net.JoinHostPort(host, "31999")
	out, err = selftest(blocked)
	require.Error(t, err, "a failed self test exits non-zero")
	require.Contains(t, out, "FAILED. What to fix:")
	require.Contains(t, out, "the guest cannot reach this host at "+blocked)
}
