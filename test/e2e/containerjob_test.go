//go:build e2e

package e2e

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// containerOSRelease is the job image's /etc/os-release: only the
// container has it (the podman VM's is Debian's).
const containerOSRelease = "ID=lve-container-test\nPRETTY_NAME=\"libvirt-executor container job test\"\n"

// pushShellImage pushes a small shell image built here as repo:tag: the
// host's static busybox (Debian's busybox-static) as /bin/busybox with a
// link for each of its applets (sh, sleep, wget, ...), and
// containerOSRelease, and the svcserver as /bin/svcserver ("svcserver get
// URL": Go's own resolver asks the job network's DNS, which the static
// busybox's glibc cannot without its NSS modules). Its shell runs the runner's scripts as Alpine's
// does (busybox ash reads bash's $'...' quoting).
func pushShellImage(t *testing.T, host, repo, tag string) {
	t.Helper()
	const bb = "/bin/busybox"
	exe, err := os.ReadFile(bb)
	require.NoError(t, err, "the test's container image needs a static busybox on this host (Debian: busybox-static)")
	list, err := exec.Command(bb, "--list").Output()
	require.NoError(t, err)
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	for _, d := range []string{"bin/", "etc/", "tmp/"} {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: d, Mode: 0o755, Typeflag: tar.TypeDir}))
	}
	file := func(name string, mode int64, b []byte) {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Mode: mode, Size: int64(len(b)), Typeflag: tar.TypeReg}))
		_, err := tw.Write(b)
		require.NoError(t, err)
	}
	file("bin/busybox", 0o755, exe)
	file("etc/os-release", 0o644, []byte(containerOSRelease))
	file("bin/svcserver", 0o755, buildSvcserver(t))
	for _, a := range strings.Fields(string(list)) {
		if a != "busybox" && !strings.Contains(a, "/") {
			require.NoError(t, tw.WriteHeader(&tar.Header{Name: "bin/" + a, Linkname: "busybox", Typeflag: tar.TypeSymlink}))
		}
	}
	require.NoError(t, tw.Close())
	pushOCIImage(t, host, repo, tag, layer.Bytes(), ocispec.ImageConfig{Cmd: []string{"/bin/sh"}, Env: []string{"PATH=/bin"}})
}

// TestContainerJobThroughRealRunner: a job written for the Docker
// executor (image: alpine:3.19, a postgres:15 service with an alias) runs
// unchanged through the real runner in a podman-image VM: its script runs
// in the job's container (the container's /etc/os-release), with the
// job's variables, reaches the service by its alias on the job's
// network, and writes an artifact and a cache (the runner's own stages,
// on the VM's OS, upload them from the bind-mounted builds directory).
// The next job, in the same image, gets both and ends with exit 3: a
// script_failure with code 3; it runs warm, on a standby VM the pool
// service booted while the first job ran. An image that is neither a VM
// image nor allowed is refused naming the allow-list, before any machine
// is made.
func TestContainerJobThroughRealRunner(t *testing.T) {
	rr := newRealRunner(t)
	podman := podmanImage(t, rr.r)
	ln := rr.r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	reg := registrytest.StartAt(t, addr)
	pushServiceImage(t, reg.Host, "library/postgres", "15")
	pushShellImage(t, reg.Host, "library/alpine", "3.19")
	r := rr.r.withConfig(t, func(s string) string {
		return poolsvc.WithPool(s+"\n"+podman+servicesConfig(reg.Host, "60s", "", "alpine:*"), "podman", 1)
	})
	rr.cfgPath = r.cfgPath

	cache := &jobapi.Cache{Key: "container-deps", Paths: []string{"vendor/"}}
	first := rr.api.Enqueue(jobapi.Job{
		Name: "produce-in-container", Stage: "build", Image: "alpine:3.19", Cache: cache,
		Variables: []jobapi.Variable{{Key: "MARKER", Value: "from-the-job", Public: true}},
		Services:  []jobapi.Service{{Name: "postgres:15", Alias: "db"}},
		Script: []string{
			"grep '^ID=' /etc/os-release",
			`echo "db says: $(svcserver get http://db:5432/)"`,
			`echo "variable: $MARKER"`,
			"mkdir -p out vendor", "echo artifact-from-$CI_JOB_ID > out/result.txt", "echo cached-$CI_JOB_ID > vendor/dep.txt",
		},
		Artifacts: &jobapi.Artifacts{Name: "out", Paths: []string{"out/"}},
	})
	second := rr.api.Enqueue(jobapi.Job{
		Name: "consume-in-container", Stage: "test", Image: "alpine:3.19", Dependencies: []int64{first}, Cache: cache,
		Script: []string{`echo "got: $(cat out/result.txt)"`, `echo "restored: $(cat vendor/dep.txt)"`, "exit 3"},
	})
	refused := rr.api.Enqueue(jobapi.Job{Name: "not-allowed", Image: "ubuntu:24.04", Script: []string{"echo NEVER-RUNS"}})
	// The first job starts cold (no pool service yet). Once its VM is up
	// (two podman guests booting at once on 2 cores took as long as one
	// after the other), the pool service boots a standby VM while that job
	// runs, and the second job, run by a second runner once the first has
	// ended, claims it. The service then stops (undoing its refill's
	// boot): nothing here needs another VM.
	vmReady := func(id int64) func() bool {
		return func() bool {
			tr := rr.api.Trace(id)
			return strings.Contains(tr, "Machine ready in") || strings.Contains(tr, "ERROR: Job failed")
		}
	}
	wait1 := rr.start(t, 1)
	waitFor(t, 5*time.Minute, "the first job's VM", vmReady(first))
	svc := r.serve(t)
	out1, err1 := wait1()
	r.waitIdle(t, 1, 5*time.Minute)
	wait2 := rr.start(t, 2)
	waitFor(t, 5*time.Minute, "the second job's VM", vmReady(second))
	_, err := svc.Stop(poolsvc.StopWait)
	require.NoError(t, err)
	res := rr.results(t, func() (string, error) {
		out2, err2 := wait2()
		return out1 + "\n" + out2, errors.Join(err1, err2)
	}, []int64{first, second, refused})

	ok := res[0]
	require.Equal(t, jobapi.StateSuccess, ok.State, ok.Trace)
	require.Contains(t, ok.Trace, "Cold start: the pool service (libvirt-executor serve) is not running")
	require.Contains(t, ok.Trace, "Started the job's container lve-job-")
	require.Contains(t, ok.Trace, "ID=lve-container-test", "the script ran in the container")
	require.Contains(t, ok.Trace, "db says: marker=from-the-job", "the service by its alias, from the container")
	require.Contains(t, ok.Trace, "variable: from-the-job")
	require.Equal(t, fmt.Sprintf("artifact-from-%d\n", first), zipFiles(t, ok.Artifacts)["out/result.txt"])
	require.Contains(t, ok.Trace, "Created cache")

	failed := res[1]
	require.Equal(t, jobapi.StateFailed, failed.State, failed.Trace)
	require.Equal(t, "script_failure", failed.FailureReason, failed.Trace)
	require.Equal(t, 3, failed.ExitCode)
	require.Contains(t, failed.Trace, fmt.Sprintf("got: artifact-from-%d", first))
	require.Contains(t, failed.Trace, fmt.Sprintf("restored: cached-%d", first))
	require.Regexp(t, warmRE, failed.Trace, "the second job claimed the standby VM")
	require.Contains(t, failed.Trace, "Started the job's container lve-job-")

	no := res[2]
	require.Equal(t, jobapi.StateFailed, no.State, no.Trace)
	require.Contains(t, no.Trace, `services.container_jobs.allowed_images: ["alpine:*"]`)
	require.NotContains(t, no.Trace, "NEVER-RUNS")
	require.NotContains(t, no.Trace, "Preparing a fresh")
	r.removeStandbys(t)
	r.requireNoLeftovers(t, "after the container jobs")
}
