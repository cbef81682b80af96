//go:build e2e

package e2e

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
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
	cmd := r.admin("selftest", "--runner", r.readableRunner(bin), "--listen", blocked, "--timeout", "5m")
	b, err := cmd.CombinedOutput()
	out := string(b)
	t.Logf("selftest --listen %s:\n%s", blocked, out)
	require.Error(t, err, "a failed self test exits non-zero")
	require.Contains(t, out, "FAILED. What to fix:")
	require.Contains(t, out, "the guest cannot reach this host at "+blocked)
	require.Regexp(t, `selftest-consume +skipped`, out, "no second VM for a test that already failed")
}

// TestSelftestProbesGitLab (#43): selftest asks the runner's GitLab from
// inside a guest, by its host name over HTTPS, with the runner's CA file:
// all well, it says the name resolved and TLS verified; with another CA's
// file it names the certificate; with a name the network's DNS does not
// know, it names DNS; each with its fix.
func TestSelftestProbesGitLab(t *testing.T) {
	r := setup(t)
	bin := runnerBinary(t)
	requireGuestRunner(t, r)
	backend := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(backend.Close)
	ca := newTestCA(t, gitlabHost())
	front := ca.front(t, r, backend.URL)
	other := newTestCA(t, gitlabHost())
	selftest := func(url, caFile string) (string, error) {
		ln := r.serviceListener(t)
		listen := ln.Addr().String()
		require.NoError(t, ln.Close())
		cmd := r.admin("selftest", "--runner", r.readableRunner(bin),
			"--listen", listen, "--timeout", "6m", "--url", url, "--tls-ca-file", caFile)
		b, err := cmd.CombinedOutput()
		t.Logf("selftest --url %s --tls-ca-file %s:\n%s", url, caFile, b)
		return string(b), err
	}
	out, err := selftest(front, ca.File)
	require.NoError(t, err)
	require.Contains(t, out, "resolved, reached, TLS verified with the runner's CA file "+ca.File)

	out, err = selftest(front, other.File)
	require.Error(t, err)
	require.Contains(t, out, "GitLab from the guest: certificate: ")
	require.Contains(t, out, "does not verify with the runner's CA file "+other.File)

	nowhere := strings.Replace(front, gitlabHost(), "nowhere."+gitlabHost(), 1)
	out, err = selftest(nowhere, ca.File)
	require.Error(t, err)
	require.Contains(t, out, "GitLab from the guest: DNS: ")
	require.Contains(t, out, "the guest cannot resolve nowhere."+gitlabHost())
}
