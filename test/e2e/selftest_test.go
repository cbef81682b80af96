//go:build e2e

package e2e

import (
	"net"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSelftest: `libvirt-executor selftest` pointed at an address the
// guests cannot reach fails after its first job, says what to fix, and
// boots no VM for the second. Its passing run (with
// --steps where the rig gives the guests a step-runner) is part of
// TestDebianPackage, through the installed files.
func TestSelftest(t *testing.T) {
	r := setup(t)
	bin := runnerBinary(t)
	requireGuestRunner(t, r)
	ln := r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	// A port the rig's guard does not open to the guests.
	host, _, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	blocked := net.JoinHostPort(host, "31999")
	cmd := exec.Command(filepath.Join(r.bin, "libvirt-executor"), "--config", r.cfgPath, "selftest", "--runner", bin, "--listen", blocked, "--timeout", "5m")
	b, err := cmd.CombinedOutput()
	out := string(b)
	t.Logf("selftest --listen %s:\n%s", blocked, out)
	require.Error(t, err, "a failed self test exits non-zero")
	require.Contains(t, out, "FAILED. What to fix:")
	require.Contains(t, out, "the guest cannot reach this host at "+blocked)
	require.Regexp(t, `selftest-consume +skipped`, out, "no second VM for a test that already failed")
}
