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
// know, it names DNS; each with its fix, and without the second sample
// job's VM (the fix comes first). The three run at the same time.
func TestSelftestProbesGitLab(t *testing.T) {
	r := setup(t)
	bin := runnerBinary(t)
	requireGuestRunner(t, r)
	backend := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(backend.Close)
	ca := newTestCA(t, gitlabHost())
	front := ca.front(t, r, backend.URL)
	other := newTestCA(t, gitlabHost())
	// The three self tests run at the same time (each with its own job API
	// and VMs, of one vCPU each; the host has two cores); all have ended
	// before their logs and verdicts are read. Their three ports are taken
	// at once (three different ones), then freed for them to listen on.
	var listeners []net.Listener
	for range 3 {
		listeners = append(listeners, r.serviceListener(t))
	}
	var listen []string
	for _, ln := range listeners {
		listen = append(listen, ln.Addr().String())
		require.NoError(t, ln.Close())
	}
	selftest := func(url, caFile string) func() (string, error) {
		cmd := r.admin("selftest", "--runner", r.readableRunner(bin),
			"--listen", listen[0], "--timeout", "6m", "--url", url, "--tls-ca-file", caFile)
		listen = listen[1:]
		var b []byte
		var err error
		done := make(chan struct{})
		go func() { b, err = cmd.CombinedOutput(); close(done) }()
		return func() (string, error) {
			<-done
			t.Logf("selftest --url %s --tls-ca-file %s:\n%s", url, caFile, b)
			return string(b), err
		}
	}
	nowhere := strings.Replace(front, gitlabHost(), "nowhere."+gitlabHost(), 1)
	good, badCA, noDNS := selftest(front, ca.File), selftest(front, other.File), selftest(nowhere, ca.File)
	goodOut, goodErr := good()
	badCAOut, badCAErr := badCA()
	noDNSOut, noDNSErr := noDNS()

	require.NoError(t, goodErr)
	require.Contains(t, goodOut, "resolved, reached, TLS verified with the runner's CA file "+ca.File)

	require.Error(t, badCAErr)
	require.Contains(t, badCAOut, "GitLab from the guest: certificate: ")
	require.Contains(t, badCAOut, "does not verify with the runner's CA file "+other.File)

	require.Regexp(t, `selftest-consume +skipped`, badCAOut, "no second VM once the guest could not reach GitLab")

	require.Error(t, noDNSErr)
	require.Contains(t, noDNSOut, "GitLab from the guest: DNS: ")
	require.Contains(t, noDNSOut, "the guest cannot resolve nowhere."+gitlabHost())
	require.Regexp(t, `selftest-consume +skipped`, noDNSOut)
	require.NotRegexp(t, `selftest-consume +skipped`, goodOut, "all well, both sample jobs run")
}
