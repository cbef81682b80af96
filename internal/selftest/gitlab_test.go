package selftest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// What git says when each part is wrong (git 2.39 with libcurl-gnutls, as
// in Debian 12 guests, and with OpenSSL), and when all is well.
func TestClassifyProbe(t *testing.T) {
	const u = "https://gitlab.example:8443"
	for _, c := range []struct {
		out  string
		want ProbeKind
	}{
		{"fatal: unable to access 'https://gitlab.example:8443/libvirt-executor-selftest/probe.git/': Could not resolve host: gitlab.example\nprobe-status=128", ProbeDNS},
		{"fatal: unable to access 'https://gitlab.example:8443/x/': Failed to connect to gitlab.example port 8443 after 3 ms: Couldn't connect to server\nprobe-status=128", ProbeRoute},
		{"probe-status=124", ProbeRoute},
		{"fatal: unable to access 'https://gitlab.example:8443/x/': server certificate verification failed. CAfile: /builds/tmp/LVE_SELFTEST_GITLAB_CA CRLfile: none\nprobe-status=128", ProbeCertificate},
		{"fatal: unable to access 'https://gitlab.example:8443/x/': SSL certificate problem: unable to get local issuer certificate\nprobe-status=128", ProbeCertificate},
		{"fatal: unable to access 'https://gitlab.example:8443/x/': gnutls_handshake() failed: An unexpected TLS packet was received.\nprobe-status=128", ProbeTLS},
		{"fatal: repository 'https://gitlab.example:8443/libvirt-executor-selftest/probe.git/' not found\nprobe-status=128", ProbeOK},
		{"fatal: unable to access 'https://gitlab.example:8443/x/': The requested URL returned error: 404\nprobe-status=128", ProbeOK},
		{"no git in the guest", ProbeNoGit},
	} {
		require.Equal(t, c.want, ClassifyProbe(c.out, u), c.out)
	}
	// A host whose name says ssl or tls is not a TLS fault.
	require.Equal(t, ProbeOK, ClassifyProbe("fatal: repository 'https://ssl-tls.example/x.git/' not found\nprobe-status=128", "https://ssl-tls.example"))
}

func TestProbeOutputAndVerdict(t *testing.T) {
	trace := "$ echo x\n" + probeBegin + "\nfatal: unable to access 'https://g.example/x/': Could not resolve host: g.example\n\nprobe-status=128\n" + probeEnd + "\nmore\n"
	out, ok := probeOutput(trace)
	require.True(t, ok)
	kind := ClassifyProbe(out, "https://g.example")
	require.Equal(t, ProbeDNS, kind)
	line, fix := probeVerdict(kind, "https://g.example", "", out)
	require.Contains(t, line, "DNS: fatal: unable to access")
	require.Contains(t, fix, "cannot resolve g.example")
	line, fix = probeVerdict(ProbeCertificate, "https://g.example", "/etc/ca.pem", out)
	require.Contains(t, line, "certificate")
	require.Contains(t, fix, "runner's CA file /etc/ca.pem")
	line, fix = probeVerdict(ProbeOK, "https://g.example", "/etc/ca.pem", "")
	require.Empty(t, fix)
	require.Contains(t, line, "TLS verified with the runner's CA file /etc/ca.pem")
	_, ok = probeOutput("no probe here")
	require.False(t, ok)
}

func TestRunnerGitLab(t *testing.T) {
	p := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, os.WriteFile(p, []byte("concurrent = 4\n[[runners]]\n  name = \"libvirt\"\n  url = \"https://gitlab.example.com\"\n  tls-ca-file = \"/etc/gitlab-runner/ca.crt\"\n  executor = \"custom\"\n  [runners.custom]\n    prepare_exec = \"/usr/bin/libvirt-executor-prepare\"\n"), 0o600))
	u, ca, err := RunnerGitLab(p)
	require.NoError(t, err)
	require.Equal(t, "https://gitlab.example.com", u)
	require.Equal(t, "/etc/gitlab-runner/ca.crt", ca)
	require.NoError(t, os.WriteFile(p, []byte("concurrent = 4\n"), 0o600))
	_, _, err = RunnerGitLab(p)
	require.ErrorContains(t, err, "no [[runners]] entry")
	_, err = probeVars("gitlab.example.com", "")
	require.ErrorContains(t, err, "want https://HOST")
}

// The probe runs inside the runner's script, which has errexit and
// pipefail on: git failing (what the probe is for) must not end the job,
// and its words and status come out between the markers.
func TestProbeScriptSurvivesErrexit(t *testing.T) {
	dir := t.TempDir()
	fake := "#!/bin/sh\necho \"fatal: unable to access '$3/': Could not resolve host: g.example\" >&2\nexit 128\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "git"), []byte(fake), 0o755))
	script := "set -eo pipefail\n" + strings.Join(probeScript, "\n") + "\necho AFTER-THE-PROBE\n"
	cmd := exec.Command("bash", "-c", script)
	cmd.Env = []string{"PATH=" + dir + ":/usr/bin:/bin", "LVE_SELFTEST_GITLAB_URL=https://g.example"}
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", b)
	require.Contains(t, string(b), "AFTER-THE-PROBE")
	out, ok := probeOutput(string(b))
	require.True(t, ok, "%s", b)
	require.Contains(t, out, "probe-status=128")
	require.Equal(t, ProbeDNS, ClassifyProbe(out, "https://g.example"))

	// A git that says far more than a pipe holds: its words are cut to
	// 2000 bytes, and the cut does not end the script (a pipe into head
	// would fail the writer under pipefail).
	loud := "#!/bin/sh\nhead -c 200000 /dev/zero | tr '\\0' x\nexit 128\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "git"), []byte(loud), 0o755))
	cmd = exec.Command("bash", "-c", script)
	cmd.Env = []string{"PATH=" + dir + ":/usr/bin:/bin", "LVE_SELFTEST_GITLAB_URL=https://g.example"}
	b, err = cmd.CombinedOutput()
	require.NoError(t, err, "%.3000s", b)
	require.Contains(t, string(b), "AFTER-THE-PROBE")
	out, ok = probeOutput(string(b))
	require.True(t, ok)
	require.Equal(t, strings.Repeat("x", 2000)+"\n\nprobe-status=128", out)
}
