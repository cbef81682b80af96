//go:build e2e

package e2e

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// TestServicesInPodmanVM: a job's services started by the services driver
// in a real job VM of the podman image (deploy/images/build.sh podman), over
// an SSH connection to it (sshexec.Client.Exec as the driver's Guest), with
// images from a real registry reached as docker.io's mirror:
//   - a small OCI image built here (a static HTTP server answering
//     "marker=$MARKER") is pushed as library/postgres:15 and library/redis;
//   - postgres:15 (aliases postgres, db, pg) and redis both listen on 5432,
//     each at its own address; a third service on the same image waits for
//     a port nothing listens on (HEALTHCHECK_TCP_PORT): the warning with its
//     last log lines, the job goes on;
//   - the job's own script (the run stage, on the VM's OS) reaches each
//     service by each alias through /etc/hosts, and a container on the
//     job's network reaches one by its alias through the network's DNS;
//   - podman runs rootful with netavark and cgroupfs (podman info);
//   - a masked variable given to a service is in no log line;
//   - an image the registry does not have is a system failure naming it.
//
// This test drives the driver directly, step by step;
// TestServicesThroughRealRunner runs a job with services through the real
// runner (prepare starts them).
func TestServicesInPodmanVM(t *testing.T) {
	base := setup(t)
	podman := podmanImage(t, base)
	ln := base.serviceListener(t) // a port guests may reach
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	// The registry asks for a login: the job's credentials (the payload's,
	// as GitLab sends its job token) reach podman in the guest only.
	const regPassword = "registry-pw-s3cr3t"
	reg := registrytest.StartWithLogin(t, addr, "ci-user", regPassword)
	login := auth.Credential{Username: reg.User, Password: reg.Password}
	pushServiceImage(t, reg.Host, "library/postgres", "15", login)
	pushServiceImage(t, reg.Host, "library/redis", "latest", login)
	pushServiceImage(t, reg.Host, "lve-e2e/onlyhere", "1", login)

	r := base.withConfig(t, func(s string) string {
		s = setKey("default_image", `"podman"`)(s)
		// A short wait: the two services that answer do within a second;
		// the silent one's warning comes after the whole of it.
		return s + "\n" + podman + servicesConfig(reg.Host, "8s", "", "")
	})
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	defer func() {
		require.Equal(t, 0, s.run(t, "cleanup").code)
		r.requireNoLeftovers(t, "after the services job")
	}()
	c := dialMachine(t, r, s.name(t))

	const secret = "masked-e2e-s3cr3t-value"
	payload := &services.Payload{
		Variables: []services.Variable{
			{Key: "CI_JOB_ID", Value: "1", Public: true},
			{Key: "DB_PASSWORD", Value: secret, Masked: true},
		},
		Services: []services.Image{
			{Name: "postgres:15", Alias: "db,pg", Variables: []services.Variable{
				{Key: "MARKER", Value: "pg-marker", Public: true}, {Key: "PW", Value: "$DB_PASSWORD", Public: true}}},
			{Name: "redis", Variables: []services.Variable{{Key: "MARKER", Value: "redis-marker", Public: true}}},
			{Name: "redis", Alias: "silent", Variables: []services.Variable{
				{Key: "MARKER", Value: "silent", Public: true}, {Key: "HEALTHCHECK_TCP_PORT", Value: "6000", Public: true}}},
		},
		Credentials: []services.Credential{{Type: "registry", URL: reg.Host, Username: reg.User, Password: regPassword}},
	}
	opts, err := services.OptionsFrom(r.cfg.Services, 1, "podman", "root")
	require.NoError(t, err)
	plan, err := services.NewPlan(payload, opts)
	require.NoError(t, err)
	var log bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	began := time.Now()
	st, err := services.Start(ctx, c, plan, opts, &log)
	t.Logf("services started in %s:\n%s", time.Since(began), log.String())
	require.NoError(t, err)
	require.Len(t, st.Services, 3)
	out := log.String()
	require.Contains(t, out, `Skipping alias "redis" for service "redis" (services[2]): services[1] already has it`)
	require.Contains(t, out, `Service "postgres:15" (services[0]) answers on port 5432`)
	require.Contains(t, out, `Service "redis" (services[1]) answers on port 5432`)
	require.Contains(t, out, `WARNING: service "redis" (services[2]) did not answer on `)
	require.Contains(t, out, "[lve-service-2] svcserver: listening on :5432", "the warning shows the service's last log lines")
	require.NotContains(t, out, secret)
	require.Contains(t, out, "Registry credentials of the job for its pulls: "+services.AuthPath+" (removed after them)")
	require.NotContains(t, out, regPassword)
	gone, err := c.Exec(ctx, []string{"test", "-e", services.AuthPath}, nil, nil, io.Discard, io.Discard)
	require.NoError(t, err)
	require.Equal(t, 1, gone, "the credentials are gone from the guest once pulled")
	require.NotEqual(t, st.Services[0].Addr, st.Services[1].Addr, "two services on one port, each at its own address")

	// podman in the guest runs rootful with netavark, and the job's network
	// has DNS: a container on it reaches a service by an alias.
	var info, infoErr, got bytes.Buffer
	code, err := c.Exec(ctx, []string{"podman", "info", "--format", "json"}, nil, nil, &info, &infoErr)
	require.NoError(t, err)
	require.Equal(t, 0, code, infoErr.String())
	var pi struct {
		Host struct {
			NetworkBackend string `json:"networkBackend"`
			CgroupManager  string `json:"cgroupManager"`
			Security       struct {
				Rootless bool `json:"rootless"`
			} `json:"security"`
		} `json:"host"`
	}
	require.NoError(t, json.Unmarshal(info.Bytes(), &pi), "podman info: %q %q", info.String(), infoErr.String())
	require.Equal(t, "netavark", pi.Host.NetworkBackend)
	require.Equal(t, "cgroupfs", pi.Host.CgroupManager)
	require.False(t, pi.Host.Security.Rootless)
	// (stdout and stderr in buffers of their own: two copies into one
	// bytes.Buffer race, and its ReadFrom drops what the other wrote)
	podmanOut := func(argv ...string) string {
		var errb bytes.Buffer
		got.Reset()
		code, err := c.Exec(ctx, append([]string{"podman"}, argv...), nil, nil, &got, &errb)
		require.NoError(t, err)
		require.Equal(t, 0, code, "podman %v: %s", argv, errb.String())
		return strings.TrimSpace(got.String())
	}
	podmanOut("run", "--detach", "--pull", "never", "--name", "lve-dns-check", "--network", st.Network,
		"docker.io/library/redis:latest", "get", "http://db:5432/")
	require.Equal(t, "0", podmanOut("wait", "lve-dns-check"))
	require.Equal(t, "marker=pg-marker", podmanOut("logs", "lve-dns-check"), "aardvark-dns answers the alias on the job's network")

	// The job, on the VM's own OS, reaches each service by each alias.
	script := "#!/usr/bin/env bash\nset -e\nget() { exec 3<>/dev/tcp/$1/5432; printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3; echo \"$1: $(tail -n 1 <&3)\"; exec 3<&-; }\n" +
		"for h in postgres db pg redis silent; do get $h; done\n"
	res := s.runScript(t, "build_script", script)
	require.Equal(t, 0, res.code, res.stderr)
	for _, want := range []string{"postgres: marker=pg-marker", "db: marker=pg-marker", "pg: marker=pg-marker",
		"redis: marker=redis-marker", "silent: marker=silent"} {
		require.Contains(t, res.stdout, want)
	}

	// Without the job's credentials the registry refuses the pull (an
	// image only it has): a system failure naming the image, with the
	// registry's answer.
	noLogin, err := services.NewPlan(&services.Payload{Services: []services.Image{{Name: "lve-e2e/onlyhere:1"}}},
		services.Options{JobID: 3, DefaultPullPolicy: services.PullIfNotPresent})
	require.NoError(t, err)
	log.Reset()
	_, err = services.Start(ctx, c, noLogin, opts, &log)
	require.ErrorContains(t, err, `cannot get image docker.io/lve-e2e/onlyhere:1 of service "lve-e2e/onlyhere:1" (services[0])`)
	require.Contains(t, strings.ToLower(err.Error()), "unauthorized", "the registry refused it for want of a login")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))

	// An image the registry does not have: a system failure naming it.
	missing, err := services.NewPlan(&services.Payload{Services: []services.Image{{Name: "team/missing:1"}},
		Credentials: payload.Credentials}, services.Options{JobID: 2, DefaultPullPolicy: services.PullIfNotPresent})
	require.NoError(t, err)
	log.Reset()
	_, err = services.Start(ctx, c, missing, opts, &log)
	require.ErrorContains(t, err, `cannot get image docker.io/team/missing:1 of service "team/missing:1" (services[0])`)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
}

// servicesConfig is the [services] table of the services and container
// job tests: the registry at host (plain HTTP) as docker.io's mirror, the
// ports' wait, and, where not "", the one allowed service image pattern
// and the one allowed container job image pattern (container jobs in
// podman-image VMs).
func servicesConfig(host, wait, allowedService, allowedContainer string) string {
	s := fmt.Sprintf("\n[services]\nenabled = true\nwait_timeout = %q\n", wait)
	if allowedService != "" {
		s += fmt.Sprintf("allowed_images = [%q]\n", allowedService)
	}
	s += fmt.Sprintf("plain_http = [%q]\n[services.mirrors]\n\"docker.io\" = [%q]\n", host, host)
	if allowedContainer != "" {
		s += fmt.Sprintf("[services.container_jobs]\nallowed_images = [%q]\nvm_image = \"podman\"\n", allowedContainer)
	}
	return s
}

// podmanImage is the [images.podman] table to add to the rig's
// configuration: none when the rig has a podman image, else the cached
// build of deploy/images/build.sh podman (instant when built before; the
// rig's namespace has no way out to Debian's mirror, so a first build
// belongs before the test).
func podmanImage(t *testing.T, r *rig) string {
	t.Helper()
	if _, ok := r.cfg.Images["podman"]; ok {
		return ""
	}
	_, file, _, _ := runtime.Caller(0)
	top := filepath.Join(filepath.Dir(file), "..", "..")
	out, err := exec.Command(filepath.Join(top, "deploy", "images", "build.sh"), "podman").Output()
	require.NoError(t, err, "deploy/images/build.sh podman (build it once outside the rig's namespace first)")
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	b, err := os.ReadFile(filepath.Join(lines[len(lines)-1], "image.toml"))
	require.NoError(t, err)
	return string(b) + "memory_mib = 1024\n"
}

// dialMachine connects to a job's VM as the stages do: its recorded
// address, user, key and pinned host key.
func dialMachine(t *testing.T, r *rig, name string) *sshexec.Client {
	t.Helper()
	dir := filepath.Join(r.cfg.StateDir, "machines", name)
	b, err := os.ReadFile(filepath.Join(dir, "machine.json"))
	require.NoError(t, err)
	var m struct {
		Address string `json:"address"`
		Port    int    `json:"port"`
		User    string `json:"user"`
		HostKey string `json:"host_key"`
	}
	require.NoError(t, json.Unmarshal(b, &m))
	keyPEM, err := os.ReadFile(filepath.Join(dir, "id_ed25519"))
	require.NoError(t, err)
	signer, err := ssh.ParsePrivateKey(keyPEM)
	require.NoError(t, err)
	hostKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(m.HostKey))
	require.NoError(t, err)
	port := m.Port
	if port == 0 {
		port = 22
	}
	c, err := sshexec.Dial(context.Background(), sshexec.Target{Addr: net.JoinHostPort(m.Address, strconv.Itoa(port)), User: m.User,
		Signer: signer, HostKey: hostKey, KeepaliveInterval: 2 * time.Second, KeepaliveCount: 10})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// pushServiceImage builds the svcserver (testdata) statically and pushes
// it to the registry as repo:tag: a one-layer OCI image whose entrypoint is
// /svcserver and which exposes 5432/tcp. Built with oras-go (already the
// driver's registry client) and image-spec's types: no container tool.
func pushServiceImage(t *testing.T, host, repo, tag string, login ...auth.Credential) {
	t.Helper()
	exe := buildSvcserver(t)
	var tarBuf bytes.Buffer
	tw := tar.NewWriter(&tarBuf)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "svcserver", Mode: 0o755, Size: int64(len(exe)), Typeflag: tar.TypeReg}))
	_, err := tw.Write(exe)
	require.NoError(t, err)
	require.NoError(t, tw.Close())
	pushOCIImage(t, host, repo, tag, tarBuf.Bytes(), ocispec.ImageConfig{Entrypoint: []string{"/svcserver"},
		ExposedPorts: map[string]struct{}{"5432/tcp": {}}, Env: []string{"PATH=/"}}, login...)
}

// buildSvcserver builds the svcserver (testdata) statically and returns
// the executable.
func buildSvcserver(t *testing.T) []byte {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	bin := filepath.Join(t.TempDir(), "svcserver")
	build := exec.Command("go", "build", "-trimpath", "-o", bin, "./testdata/svcserver")
	build.Dir = filepath.Dir(file)
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build svcserver: %s", out)
	exe, err := os.ReadFile(bin)
	require.NoError(t, err)
	return exe
}

// pushOCIImage pushes a one-layer OCI image (layer: an uncompressed tar,
// gzipped here; its config ic) to the registry as repo:tag, with oras-go
// and image-spec's types: no container tool.
func pushOCIImage(t *testing.T, host, repo, tag string, layer []byte, ic ocispec.ImageConfig, login ...auth.Credential) {
	t.Helper()
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, err := zw.Write(layer)
	require.NoError(t, err)
	require.NoError(t, zw.Close())

	cfg, err := json.Marshal(ocispec.Image{
		Platform: ocispec.Platform{Architecture: "amd64", OS: "linux"},
		Config:   ic,
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(layer)}},
		// One history entry for the layer, as a built image has: podman
		// build (buildah) cannot commit a step on a base image whose
		// history lists fewer layers than it has.
		History: []ocispec.History{{CreatedBy: "the libvirt-executor e2e test's layer"}},
	})
	require.NoError(t, err)

	ctx := context.Background()
	rp, err := remote.NewRepository(host + "/" + repo)
	require.NoError(t, err)
	rp.PlainHTTP = true
	if len(login) > 0 {
		rp.Client = &auth.Client{Credential: auth.StaticCredential(host, login[0])}
	}
	push := func(mediaType string, b []byte) ocispec.Descriptor {
		d := content.NewDescriptorFromBytes(mediaType, b)
		exists, err := rp.Exists(ctx, d)
		require.NoError(t, err)
		if !exists {
			require.NoError(t, rp.Push(ctx, d, bytes.NewReader(b)))
		}
		return d
	}
	man, err := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
		Config: push(ocispec.MediaTypeImageConfig, cfg), Layers: []ocispec.Descriptor{push(ocispec.MediaTypeImageLayerGzip, gz.Bytes())}})
	require.NoError(t, err)
	md := content.NewDescriptorFromBytes(ocispec.MediaTypeImageManifest, man)
	require.NoError(t, rp.PushReference(ctx, md, bytes.NewReader(man), tag))
}

// TestServicesThroughRealRunner: a job written for the Docker executor's
// services, run unchanged through the real runner, warm: the pool service
// keeps an idle podman-image VM with the service's image pre-pulled
// ([images.podman.pool] prepull), the job claims it and prepare starts its
// postgres:15 service (alias db) there before the first script without a
// pull; the script on the VM's own OS reaches it by its derived name and
// its alias, the service got the job's public variables, the masked one
// is in no log line, CI_DEBUG_SERVICES streams what the service wrote
// during the script, and nothing is left after cleanup. A service image
// the admin does not allow fails the next job before any machine is made.
// A container job (image: alpine:3.19, pre-pulled too) claims the other
// idle VM and runs its script in the job's container without a pull.
// (TestContainerJobThroughRealRunner starts services and a container job
// in cold VMs.)
func TestServicesThroughRealRunner(t *testing.T) {
	rr := newRealRunner(t)
	podman := podmanImage(t, rr.r)
	ln := rr.r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	reg := registrytest.StartAt(t, addr)
	pushServiceImage(t, reg.Host, "library/postgres", "15")
	pushShellImage(t, reg.Host, "library/alpine", "3.19")
	r := rr.r.withConfig(t, func(s string) string {
		return s + "\n" + podman + servicesConfig(reg.Host, "60s", "postgres:*", "alpine:*")
	})
	r = r.withConfig(t, func(s string) string {
		return strings.Replace(poolsvc.WithPool(s, "podman", 2), "[images.podman.pool]\n", "[images.podman.pool]\nprepull = [\"postgres:15\", \"alpine:3.19\"]\n", 1)
	})
	rr.cfgPath = r.cfgPath
	svc := r.serve(t)
	idle := r.waitIdle(t, 2, 5*time.Minute)
	require.Regexp(t, `pre-pull into a standby VM.*Pulled image docker.io/library/postgres:15`, svc.Log())

	before := serviceStarts(t, r)
	const secret = "masked-svc-s3cr3t-value"
	get := func(host string) string {
		return `exec 3<>/dev/tcp/` + host + `/5432; printf 'GET / HTTP/1.0\r\n\r\n' >&3; echo "` + host + ` says: $(tail -n 1 <&3)"; exec 3<&-`
	}
	jobs := []jobapi.Job{{
		Name: "with-services", Image: "podman", GitURL: rr.repo, SHA: rr.sha,
		Variables: []jobapi.Variable{
			{Key: "MARKER", Value: "from-the-job", Public: true},
			{Key: "DB_PASSWORD", Value: secret, Masked: true},
			{Key: "CI_DEBUG_SERVICES", Value: "true", Public: true},
		},
		Services: []jobapi.Service{{Name: "postgres:15", Alias: "db"}},
		Script:   []string{get("postgres"), get("db"), `echo "password seen as $DB_PASSWORD"`},
	}, jobapi.Job{
		Name: "container-warm", Image: "alpine:3.19", GitURL: rr.repo, SHA: rr.sha,
		Variables: []jobapi.Variable{{Key: "MARKER", Value: "from-the-job", Public: true}},
		Script:    []string{"grep '^ID=' /etc/os-release", `echo "variable: $MARKER"`},
	}, jobapi.Job{
		Name: "not-allowed", Image: "podman", GitURL: rr.repo, SHA: rr.sha,
		Services: []jobapi.Service{{Name: "redis:7"}},
		Script:   []string{"echo NEVER-RUNS"},
	}}
	ids := make([]int64, len(jobs))
	for i, j := range jobs {
		ids[i] = rr.api.Enqueue(j)
	}
	wait := rr.start(t, len(jobs))
	// Once both warm jobs have their VMs, the pool service stops (undoing
	// its refill's boots): nothing here needs the refilled VMs, and their
	// boots and pre-pulls took the 2 cores from the jobs and the selftest
	// below. (A job that fails before its VM is ready fails below.)
	waitFor(t, 5*time.Minute, "the warm jobs' VMs", func() bool {
		for _, id := range ids[:2] {
			if tr := rr.api.Trace(id); !strings.Contains(tr, "Machine ready in") && !strings.Contains(tr, "ERROR: Job failed") {
				return false
			}
		}
		return true
	})
	_, err := svc.Stop(poolsvc.StopWait)
	require.NoError(t, err)
	res := rr.results(t, wait, ids)
	ok, inContainer, refused := res[0], res[1], res[2]
	require.Equal(t, jobapi.StateSuccess, ok.State, ok.Trace)
	require.Contains(t, ok.Trace, "postgres says: marker=from-the-job")
	require.Contains(t, ok.Trace, "db says: marker=from-the-job")
	require.Regexp(t, `Services ready in \S+: 1 started`, ok.Trace)
	require.Contains(t, idle, warmVM(ok.Trace), "the job claimed an idle VM")
	require.Contains(t, ok.Trace, `Using image docker.io/library/postgres:15 for service "postgres:15" (services[0]) (pull policy if-not-present: already in the VM)`)
	require.NotContains(t, ok.Trace, "Pulling image", "a warm job with a pre-pulled image pulls nothing")
	// CI_DEBUG_SERVICES: what the service wrote while the script ran (one
	// line per request it answered) is in the job log.
	require.Contains(t, ok.Trace, "[service lve-service-0] svcserver: GET / answered")
	require.NotContains(t, ok.Trace, "does not provide services")
	require.NotContains(t, ok.Trace, secret)

	require.Equal(t, jobapi.StateSuccess, inContainer.State, inContainer.Trace)
	require.Contains(t, idle, warmVM(inContainer.Trace), "the container job claimed the other idle VM")
	require.NotEqual(t, warmVM(ok.Trace), warmVM(inContainer.Trace))
	require.Contains(t, inContainer.Trace, "ID=lve-container-test", "the script ran in the container")
	require.Contains(t, inContainer.Trace, "variable: from-the-job")
	require.Contains(t, inContainer.Trace, `Using image docker.io/library/alpine:3.19 for the job's image "alpine:3.19" (pull policy if-not-present: already in the VM)`)
	require.NotContains(t, inContainer.Trace, "Pulling image")

	require.Equal(t, jobapi.StateFailed, refused.State, refused.Trace)
	require.Contains(t, refused.Trace, "redis:7")
	require.NotContains(t, refused.Trace, "NEVER-RUNS")
	require.NotContains(t, refused.Trace, "Preparing a fresh", "refused before any machine is made")

	// The prepare's event record (what the metrics fold) says it started
	// one service.
	var starts []string
	for _, l := range serviceStarts(t, r) {
		if !slices.Contains(before, l) {
			starts = append(starts, l)
		}
	}
	require.Len(t, starts, 2, "two prepares started services or a container: %v", starts)
	var withService, withContainer int
	for _, l := range starts {
		if regexp.MustCompile(`"services":\{"started":1,"s":[0-9.e+-]+,"result":"ok"\}`).MatchString(l) {
			withService++
		}
		if regexp.MustCompile(`"services":\{"started":0,"s":[0-9.e+-]+,"container":true,"result":"ok"\}`).MatchString(l) {
			withContainer++
		}
	}
	require.Equal(t, 1, withService, "one prepare started one service: %v", starts)
	require.Equal(t, 1, withContainer, "one prepare started the job's container: %v", starts)

	// selftest --services (#46 item 4): what an admin runs before pointing
	// GitLab at the host; its services job (in a podman VM of this
	// configuration, cold: the pool service is stopped) pulls and starts
	// the service, finds it by its alias and connects to its port. The two
	// sample jobs are left out (TestSelftest* run them).
	ln2 := r.serviceListener(t)
	listen := ln2.Addr().String()
	require.NoError(t, ln2.Close())
	cmd := r.admin("selftest", "--runner", r.readableRunner(rr.bin),
		"--listen", listen, "--timeout", "6m", "--sample-jobs=false",
		"--services", "postgres:15", "--services-image", "podman", "--service-port", "5432")
	b, err := cmd.CombinedOutput()
	t.Logf("selftest --services:\n%s", b)
	require.NoError(t, err)
	require.Regexp(t, `selftest-services +success`, string(b))
	require.NotContains(t, string(b), "selftest-produce")
	require.Contains(t, string(b), "a job's service container started in its VM and the job found it by its alias")
	// The service's cleanup (idle VMs removed), then setup's check that
	// nothing is left, run when the test ends.
}

// serviceStarts are the event spool's prepare records that started
// services, as written.
func serviceStarts(t *testing.T, r *rig) []string {
	t.Helper()
	var out []string
	segs, _ := filepath.Glob(filepath.Join(r.cfg.StateDir, "events", "*"))
	for _, seg := range segs {
		b, err := os.ReadFile(seg)
		require.NoError(t, err)
		for _, l := range strings.Split(string(b), "\n") {
			var ev struct {
				Stage    string          `json:"stage"`
				Services json.RawMessage `json:"services"`
			}
			if json.Unmarshal([]byte(l), &ev) == nil && ev.Stage == "prepare" && len(ev.Services) > 0 {
				out = append(out, l)
			}
		}
	}
	return out
}
