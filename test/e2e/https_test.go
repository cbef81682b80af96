//go:build e2e

package e2e

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
)

// gitlabHost is the name the rig's network DNS answers with its gateway
// (deploy/rig/env.sh).
func gitlabHost() string {
	if h := os.Getenv("LVE_RIG_GITLAB_HOST"); h != "" {
		return h
	}
	return "gitlab.lve-rig.test"
}

// testCA is a private CA and a server certificate it signed for host.
type testCA struct {
	File string // the CA certificate, PEM
	cert tls.Certificate
}

func newTestCA(t *testing.T, host string) *testCA {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "libvirt-executor e2e CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	leafTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: host}, DNSNames: []string{host},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, ca, &key.PublicKey, caKey)
	require.NoError(t, err)
	file := filepath.Join(readableDir(t), "gitlab-ca.pem")
	require.NoError(t, os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644))
	return &testCA{File: file, cert: tls.Certificate{Certificate: [][]byte{leafDER, caDER}, PrivateKey: key}}
}

// front serves backend (an http URL) over HTTPS at the rig's gateway, on
// a service port the guests may reach, with ca's certificate for the
// GitLab host name, and returns its https://HOST:PORT/ URL.
func (ca *testCA) front(t *testing.T, r *rig, backend string) string {
	t.Helper()
	target, err := url.Parse(backend)
	require.NoError(t, err)
	ln := r.serviceListener(t)
	_, port, err := net.SplitHostPort(ln.Addr().String())
	require.NoError(t, err)
	srv := &http.Server{Handler: httputil.NewSingleHostReverseProxy(target), ReadHeaderTimeout: 30 * time.Second,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{ca.cert}, MinVersion: tls.VersionTLS12}}
	go func() { _ = srv.ServeTLS(ln, "", "") }()
	t.Cleanup(func() { _ = srv.Close() })
	return "https://" + gitlabHost() + ":" + port + "/"
}

// byNameOverHTTPS puts rr's fake GitLab and its repository behind TLS
// with a private CA, at a host name the rig network's DNS answers (not an
// IP, not plain HTTP), and gives the runner the name and the CA file
// (--tls-ca-file), as a real GitLab is reached. It returns the
// repository's URL by that name.
func byNameOverHTTPS(t *testing.T, rr *realRunner) (gitURL string) {
	t.Helper()
	ca := newTestCA(t, gitlabHost())
	apiURL := ca.front(t, rr.r, rr.api.URL())
	require.NoError(t, rr.api.SetPublicURL(apiURL))
	git, err := url.Parse(rr.repo)
	require.NoError(t, err)
	gitURL = strings.TrimSuffix(ca.front(t, rr.r, git.Scheme+"://"+git.Host+"/"), "/") + git.Path
	rr.url, rr.caFile = apiURL, ca.File
	return gitURL
}

// httpsScript are script lines that show what a job cloned over HTTPS
// (requireClonedByName checks them).
var httpsScript = []string{
	`echo "head=$(git rev-parse HEAD)"`,
	`echo "remote=$(git remote get-url origin | sed 's#//[^@/]*@#//#')"`,
}

// requireClonedByName: the job of img (its script began with httpsScript)
// cloned rr's repository at its commit by the GitLab host name over
// HTTPS, and nothing in its log says the name or the certificate failed.
func requireClonedByName(t *testing.T, rr *realRunner, res jobapi.Result, img string) {
	t.Helper()
	require.Contains(t, res.Trace, "head="+rr.sha, "%s: cloned by name over HTTPS", img)
	require.Contains(t, res.Trace, "remote=https://"+gitlabHost()+":", "%s: by the host name", img)
	require.NotRegexp(t, regexp.MustCompile(`Could not resolve host|server certificate verification failed|x509: `), res.Trace, img)
}

// TestGitLabByNameOverHTTPS (#43): the fake GitLab and the repository by
// name over HTTPS (byNameOverHTTPS). A job clones by name, builds,
// uploads an artifact and keeps a cache, on the tiny image cold and warm
// (a standby VM), the warm one restoring the cache the cold one kept.
// The other images (the Debian, cloud-init and podman guests: each
// resolves the name through the DHCP-given server and trusts the CA the
// runner hands its git and helper) are checked in the VMs of
// TestHostCacheBetweenJobs, whose jobs run over the same HTTPS by name:
// one cold VM per image for both tests.
func TestGitLabByNameOverHTTPS(t *testing.T) {
	rr, _, r := hostCacheRig(t, "", 1)
	gitURL := byNameOverHTTPS(t, rr)

	cache := &jobapi.Cache{Key: "deps-https", Paths: []string{"vendor/"}}
	job := func(img string) jobapi.Job {
		script := append(slices.Clone(httpsScript),
			"mkdir -p vendor out",
			`echo "restored=$(cat vendor/dep.txt 2>/dev/null || echo none)"`,
			"echo dep-"+img+"-$CI_JOB_ID > vendor/dep.txt",
			"echo built-on-"+img+" > out/r.txt",
		)
		return jobapi.Job{Name: "https-" + img, Image: img, GitURL: gitURL, SHA: rr.sha, Cache: cache,
			Artifacts: &jobapi.Artifacts{Paths: []string{"out/"}}, Script: script}
	}
	check := func(res jobapi.Result, img, prev string) {
		t.Helper()
		require.Equal(t, jobapi.StateSuccess, res.State, "%s: %s", img, res.Trace)
		requireClonedByName(t, rr, res, img)
		if prev != "" {
			require.Regexp(t, `restored=dep-`+prev+`-\d+`, res.Trace, "%s: the cache the job before kept", img)
		}
		require.Regexp(t, `Host cache: kept 1 file`, res.Trace, img)
		require.Equal(t, "built-on-"+img+"\n", zipFiles(t, res.Artifacts)["out/r.txt"], "%s: the artifact uploaded by the guest's helper over HTTPS", img)
	}
	def := r.cfg.DefaultImage
	// Cold, before the standby pool is up; the pool service starts once
	// the cold job has its machine, and its standby boots while that job
	// runs.
	cold := rr.api.Enqueue(job(def))
	coldDone := rr.start(t, 1)
	waitFor(t, 5*time.Minute, "the cold job's machine", func() bool {
		return strings.Contains(rr.api.Trace(cold), "Machine ready")
	})
	r.serve(t)
	coldRes := rr.results(t, coldDone, []int64{cold})[0]
	check(coldRes, def, "")
	require.NotRegexp(t, warmRE, coldRes.Trace, "the first job's VM was made for it")
	// Warm: a standby VM claimed.
	r.waitIdle(t, 1, 3*time.Minute)
	res := rr.runJobs(t, job(def))[0]
	check(res, def, def)
	require.Regexp(t, warmRE, res.Trace, "a standby VM was claimed")
}
