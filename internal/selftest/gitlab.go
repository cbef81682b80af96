package selftest

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"

	"github.com/pelletier/go-toml/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
)

// The GitLab probe: the first sample job, in the guest, asks the GitLab
// the runner is registered with (not the fake job API, which the guests
// reach by this host's address) for a repository over HTTPS with git,
// trusting the CA the runner trusts, as the job's get_sources will. The
// host reads the output and says which of DNS, route, TLS or the
// certificate is wrong, in one line, with the fix.

// ProbeKind is what the GitLab probe found.
type ProbeKind string

const (
	ProbeOK          ProbeKind = "ok"
	ProbeDNS         ProbeKind = "DNS"
	ProbeRoute       ProbeKind = "route"
	ProbeTLS         ProbeKind = "TLS"
	ProbeCertificate ProbeKind = "certificate"
	ProbeNoGit       ProbeKind = "no git"
)

// RunnerGitLab is the URL and CA file of the first [[runners]] entry of a
// gitlab-runner config.toml ("" CA when it sets none).
func RunnerGitLab(path string) (gitlabURL, caFile string, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", "", err
	}
	var c struct {
		Runners []struct {
			URL       string `toml:"url"`
			TLSCAFile string `toml:"tls-ca-file"`
		} `toml:"runners"`
	}
	if err := toml.Unmarshal(b, &c); err != nil {
		return "", "", fmt.Errorf("%s: %w", path, err)
	}
	if len(c.Runners) == 0 || c.Runners[0].URL == "" {
		return "", "", fmt.Errorf("%s: no [[runners]] entry with a url", path)
	}
	return c.Runners[0].URL, c.Runners[0].TLSCAFile, nil
}

// probeVars are the probe's variables: the GitLab URL, and the CA file's
// content as a file variable (the runner writes it into the guest).
func probeVars(gitlabURL, caFile string) ([]jobapi.Variable, error) {
	u, err := url.Parse(gitlabURL)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return nil, fmt.Errorf("GitLab URL %q: want https://HOST[:PORT]/ (the runner's url)", gitlabURL)
	}
	vars := []jobapi.Variable{{Key: "LVE_SELFTEST_GITLAB_URL", Value: strings.TrimSuffix(u.String(), "/"), Public: true}}
	if caFile != "" {
		b, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("the runner's CA file: %w", err)
		}
		vars = append(vars, jobapi.Variable{Key: "LVE_SELFTEST_GITLAB_CA", Value: string(b), File: true, Public: true})
	}
	return vars, nil
}

const (
	probeBegin = "selftest-gitlab-probe-begin"
	probeEnd   = "selftest-gitlab-probe-end"
)

// probeScript asks the GitLab for a repository that need not exist (any
// HTTP answer after a verified TLS handshake will do) with the guest's
// git, through the CA the runner uses, and prints git's own words
// between two marker lines. Nothing of it depends on the job: the URL
// and the CA come as variables. The runner's script runs with errexit and
// pipefail: a failing git must not end the job, and its words are cut to
// 2000 bytes by printf's precision (a pipe into head would fail the
// writer once head had enough).
var probeScript = []string{
	`if command -v git >/dev/null 2>&1; then ` +
		`if [ -n "${LVE_SELFTEST_GITLAB_CA:-}" ]; then export GIT_SSL_CAINFO="$LVE_SELFTEST_GITLAB_CA"; fi; ` +
		`st=0; o=$(GIT_TERMINAL_PROMPT=0 GIT_ASKPASS=true timeout 30 git ls-remote "$LVE_SELFTEST_GITLAB_URL/libvirt-executor-selftest/probe.git" 2>&1) || st=$?; ` +
		`echo ` + probeBegin + `; printf '%.2000s\n' "$o"; echo; echo "probe-status=$st"; echo ` + probeEnd + `; ` +
		`else echo ` + probeBegin + `; echo "no git in the guest"; echo ` + probeEnd + `; fi`,
}

var probeRE = regexp.MustCompile(`(?s)` + probeBegin + `\n(.*?)\n?` + probeEnd)

// probeOutput is what git said in the probe, from the job's trace.
func probeOutput(trace string) (string, bool) {
	m := probeRE.FindAllStringSubmatch(trace, -1)
	if len(m) == 0 {
		return "", false
	}
	return strings.TrimSpace(m[len(m)-1][1]), true
}

// ClassifyProbe says what git's words in the probe mean: which of DNS,
// route, TLS or the certificate is wrong (git with libcurl, GnuTLS or
// OpenSSL), or ok (any answer of the server: a repository that does not
// exist, a login asked for).
func ClassifyProbe(out, gitlabURL string) ProbeKind {
	// git quotes the URL: a host named ssl.example says nothing about TLS
	if u, err := url.Parse(gitlabURL); err == nil && u.Host != "" {
		out = strings.ReplaceAll(out, u.Host, "HOST")
	}
	l := strings.ToLower(out)
	switch {
	case strings.Contains(l, "no git in the guest"):
		return ProbeNoGit
	case strings.Contains(l, "probe-status=124"):
		return ProbeRoute // no answer within the probe's 30 s
	case strings.Contains(l, "could not resolve host"), strings.Contains(l, "couldn't resolve host"), strings.Contains(l, "name or service not known"):
		return ProbeDNS
	case strings.Contains(l, "failed to connect"), strings.Contains(l, "couldn't connect"), strings.Contains(l, "connection refused"),
		strings.Contains(l, "no route to host"), strings.Contains(l, "network is unreachable"), strings.Contains(l, "timed out"):
		return ProbeRoute
	case strings.Contains(l, "certificate"), strings.Contains(l, "issuer"), strings.Contains(l, "cafile"), strings.Contains(l, "self-signed"),
		strings.Contains(l, "self signed"), strings.Contains(l, "no alternative certificate subject name"):
		return ProbeCertificate
	case strings.Contains(l, "ssl"), strings.Contains(l, "tls"), strings.Contains(l, "gnutls"), strings.Contains(l, "handshake"):
		return ProbeTLS
	}
	return ProbeOK
}

// probeVerdict is the one line the self test says about the probe, and
// the fix ("" when the probe passed).
func probeVerdict(kind ProbeKind, gitlabURL, caFile, out string) (line, fix string) {
	host := gitlabURL
	if u, err := url.Parse(gitlabURL); err == nil {
		host = u.Hostname()
	}
	first := out
	if i := strings.IndexByte(first, '\n'); i >= 0 {
		first = first[:i]
	}
	if len(first) > 200 {
		first = first[:200]
	}
	switch kind {
	case ProbeOK:
		how := "the system CA store"
		if caFile != "" {
			how = "the runner's CA file " + caFile
		}
		return fmt.Sprintf("GitLab %s from the guest: resolved, reached, TLS verified with %s", gitlabURL, how), ""
	case ProbeDNS:
		return "GitLab from the guest: DNS: " + first,
			fmt.Sprintf("DNS: the guest cannot resolve %s: the guests ask the libvirt network's DNS (dnsmasq, from DHCP); add the name there (<dns><host> in the network, or a forwarder that knows it: docs/install.md) and make sure the image writes resolv.conf from DHCP (docs/images.md)", host)
	case ProbeRoute:
		return "GitLab from the guest: route: " + first,
			fmt.Sprintf("route: the guest resolves %s but cannot reach it: the network's NAT/forward mode, the guard (egress) or a firewall between the host and GitLab stops it", host)
	case ProbeCertificate:
		if caFile == "" {
			return "GitLab from the guest: certificate: " + first,
				fmt.Sprintf("certificate: %s's certificate is not trusted by the guest's CA store: give the runner its CA (tls-ca-file in the runner's config.toml; the runner hands it to the job), or put the CA into the image's store", host)
		}
		return "GitLab from the guest: certificate: " + first,
			fmt.Sprintf("certificate: %s's certificate does not verify with the runner's CA file %s (another CA signed it, or it does not name %s): fix tls-ca-file or the server's certificate", host, caFile, host)
	case ProbeTLS:
		return "GitLab from the guest: TLS: " + first,
			fmt.Sprintf("TLS: the TLS handshake with %s failed (protocol or cipher the guest's git does not speak, or not TLS at that port)", host)
	case ProbeNoGit:
		return "GitLab from the guest: the guest has no git", "the image has no git: jobs cannot fetch their sources (docs/images.md)"
	}
	return "", ""
}

var errNoProbe = errors.New("the GitLab probe did not run (the first job's log has no probe output)")
