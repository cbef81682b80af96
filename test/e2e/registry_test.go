//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// TestImageFromRegistry: VM images from an OCI registry (a real
// docker-registry on the rig namespace's loopback), on real VMs:
//   - `image push --image tiny` sends the rig's tiny image (disk, kernel,
//     initrd) as one artifact;
//   - a job on an image whose source names it pulls it at prepare (the job
//     log says so, with the digest) and runs on it;
//   - the tag moves to another image (the same disk converted with
//     another cluster size: other bytes); `image pull` stores it;
//   - a tag whose disk blob was corrupted in the registry is refused,
//     nothing of it stored, the current image kept;
//   - with the registry stopped, the next job runs on the new digest (the
//     last verified image) without asking the registry;
//   - `image prune` removes the old digest once no VM uses it, and keeps
//     the current one.
func TestImageFromRegistry(t *testing.T) {
	base := setup(t)
	reg := registrytest.Start(t)
	require.NoError(t, os.MkdirAll("/var/cache/libvirt-executor", 0o755))
	store, err := os.MkdirTemp("/var/cache/libvirt-executor", "oci-e2e-") // QEMU reads the stored files
	require.NoError(t, err)
	require.NoError(t, os.Chmod(store, 0o755))
	base.handOver(t, store)
	t.Cleanup(func() { _ = os.RemoveAll(store) })
	tiny, ok := base.cfg.Image("tiny")
	require.True(t, ok, "the rig's tiny image")
	src := "oci://" + reg.Host + "/vm/tiny:stable"
	r := base.withConfig(t, func(s string) string {
		return s + fmt.Sprintf(`
[registry]
dir = %q
plain_http = [%q]

[images.oci]
source = %q
user = %q
shell = %q
builds_dir = %q
cache_dir = %q
key_injection = %q
boot = "kernel"
cmdline = %q
`, store, reg.Host, src, tiny.User, tiny.Shell, tiny.BuildsDir, tiny.CacheDir, tiny.KeyInjection, tiny.Cmdline)
	})
	admin := func(args ...string) (string, error) {
		out, err := r.admin(args...).CombinedOutput()
		t.Logf("libvirt-executor %s:\n%s", strings.Join(args, " "), out)
		return string(out), err
	}
	digestRE := regexp.MustCompile(`sha256:[0-9a-f]{64}`)

	out, err := admin("image", "push", "--image", "tiny", src)
	require.NoError(t, err)
	v1 := digestRE.FindString(out)
	require.NotEmpty(t, v1)
	require.Contains(t, out, "3 files")

	job := func(what string) *harness.Result {
		t.Helper()
		opts, lw := r.options(t)
		res, err := harness.RunJob(context.Background(), opts, harness.Job{Image: "oci", Script: []string{"echo " + what, "uname -r"}})
		require.NoError(t, err)
		require.Equal(t, harness.StateSuccess, res.State, "%s: %s\n%s", res.FailureReason, res.Message, lw.buf.String())
		require.Contains(t, res.Log, what)
		return res
	}
	// First use: prepare pulls it.
	res := job("on-v1")
	require.Contains(t, res.Log, "Image oci is not on this host yet: pulling "+src)
	require.Regexp(t, `Pulled `+regexp.QuoteMeta(src)+` \(`+v1+`, [0-9.]+ MiB received, [0-9.]+ MiB stored\) in `, res.Log)

	// The tag moves: the same disk in other bytes, same kernel and initrd.
	disk2 := filepath.Join(readableDir(t), "disk.qcow2")
	conv, err := exec.Command("qemu-img", "convert", "-O", "qcow2", "-o", "cluster_size=131072", tiny.Base, disk2).CombinedOutput()
	require.NoError(t, err, "%s", conv)
	out, err = admin("image", "push", "--disk", disk2, "--kernel", tiny.Kernel, "--initrd", tiny.Initrd, src)
	require.NoError(t, err)
	v2 := digestRE.FindString(out)
	require.NotEqual(t, v1, v2)
	out, err = admin("image", "pull", "oci")
	require.NoError(t, err)
	require.Contains(t, out, "oci: new "+v2)

	// A corrupted blob under another tag: refused, nothing stored.
	bad := "oci://" + reg.Host + "/vm/tiny:bad"
	small := filepath.Join(readableDir(t), "disk.qcow2")
	conv, err = exec.Command("qemu-img", "create", "-f", "qcow2", small, "64M").CombinedOutput()
	require.NoError(t, err, "%s", conv)
	_, err = admin("image", "push", "--disk", small, bad)
	require.NoError(t, err)
	// The registry's stored bytes of the disk layer change behind its back
	// (a disk error, a tampered mirror).
	req, err := http.NewRequest(http.MethodGet, "http://"+reg.Host+"/v2/vm/tiny/manifests/bad", nil)
	require.NoError(t, err)
	req.Header.Set("Accept", "application/vnd.oci.image.manifest.v1+json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	var man struct {
		Layers []struct{ Digest string } `json:"layers"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&man))
	_ = resp.Body.Close()
	require.Len(t, man.Layers, 1)
	blob := reg.BlobPath(strings.TrimPrefix(man.Layers[0].Digest, "sha256:"))
	data, err := os.ReadFile(blob)
	require.NoError(t, err)
	data[len(data)/2] ^= 0xff
	require.NoError(t, os.WriteFile(blob, data, 0o644))
	out, err = admin("image", "pull", bad)
	require.Error(t, err)
	require.Contains(t, out, "refused")
	out, err = admin("image", "list")
	require.NoError(t, err)
	require.Equal(t, 2, len(regexp.MustCompile(`(?m)^sha256:`).FindAllString(out, -1)), "v1 and v2 only: %s", out)
	require.Contains(t, out, v2)
	left, _ := os.ReadDir(filepath.Join(store, "tmp"))
	require.Empty(t, left, "nothing of the refused pull")

	// The registry gone: the next job runs on the new digest, the last
	// verified image, without asking the registry.
	reg.Stop()
	res = job("on-v2")
	require.Contains(t, res.Log, "Image oci: "+v2+" from "+src)
	require.NotContains(t, res.Log, "pulling")

	// v1 is no longer named; no VM uses it once the jobs are gone.
	r.requireNoLeftovers(t, "after the jobs")
	out, err = admin("image", "prune")
	require.NoError(t, err)
	require.Contains(t, out, "removed "+v1)
	out, err = admin("image", "list")
	require.NoError(t, err)
	require.NotContains(t, out, v1)
	require.Contains(t, out, v2)
}

// TestImageNamingAHostFileRefused (#42): a registry image whose qcow2
// header names a root-only file of the host as its raw backing file is
// pushed and configured; a job on it through a real runner fails as a
// system failure that names the field and the file, before any VM is
// made; nothing of it is stored, and the file is as it was (content,
// owner, mode: libvirt's labelling would have made it the QEMU user's).
func TestImageNamingAHostFileRefused(t *testing.T) {
	rr := newRealRunner(t)
	reg := registrytest.Start(t)
	require.NoError(t, os.MkdirAll("/var/cache/libvirt-executor", 0o755))
	store, err := os.MkdirTemp("/var/cache/libvirt-executor", "oci-e2e-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(store, 0o755))
	rr.r.handOver(t, store)
	t.Cleanup(func() { _ = os.RemoveAll(store) })

	secretDir, err := os.MkdirTemp("/var/lib", "lve-e2e-secret-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(secretDir) })
	secret := filepath.Join(secretDir, "host-key")
	content := []byte("LVE-HOST-SECRET-" + strings.Repeat("x", 4000) + "\n")
	require.NoError(t, os.WriteFile(secret, content, 0o600))
	before, err := os.Stat(secret)
	require.NoError(t, err)

	evil := filepath.Join(readableDir(t), "disk.qcow2")
	out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", secret, "-F", "raw", evil, "64M").CombinedOutput()
	require.NoError(t, err, "%s", out)
	tiny, ok := rr.r.cfg.Image("tiny")
	require.True(t, ok, "the rig's tiny image")
	src := "oci://" + reg.Host + "/vm/evil:v1"
	r := rr.r.withConfig(t, func(s string) string {
		return s + fmt.Sprintf(`
[registry]
dir = %q
plain_http = [%q]

[images.evil]
source = %q
user = %q
shell = %q
builds_dir = %q
cache_dir = %q
key_injection = %q
boot = "kernel"
cmdline = %q
`, store, reg.Host, src, tiny.User, tiny.Shell, tiny.BuildsDir, tiny.CacheDir, tiny.KeyInjection, tiny.Cmdline)
	})
	rr.cfgPath = r.cfgPath
	push, err := r.admin("image", "push",
		"--disk", evil, "--kernel", tiny.Kernel, "--initrd", tiny.Initrd, src).CombinedOutput()
	require.NoError(t, err, "%s", push)

	res := rr.runJobs(t, jobapi.Job{Name: "reads-the-host", Image: "evil",
		Script: []string{"echo SCRIPT-RAN", "grep -a LVE-HOST-SECRET /dev/vda | head -c 40"}})[0]
	require.Equal(t, jobapi.StateFailed, res.State, res.Trace)
	require.Equal(t, "runner_system_failure", res.FailureReason, res.Trace)
	require.NotContains(t, res.Trace, "SCRIPT-RAN")
	require.Contains(t, res.Trace, `backing file "`+secret+`"`, "the job log names the field and the file")
	require.Contains(t, res.Trace, "refused")

	after, err := os.Stat(secret)
	require.NoError(t, err)
	got, err := os.ReadFile(secret)
	require.NoError(t, err)
	require.Equal(t, content, got, "the host file's content")
	require.Equal(t, before.Mode(), after.Mode(), "the host file's mode")
	require.Equal(t, before.Sys().(*syscall.Stat_t).Uid, after.Sys().(*syscall.Stat_t).Uid, "the host file's owner")
	require.Equal(t, before.Sys().(*syscall.Stat_t).Gid, after.Sys().(*syscall.Stat_t).Gid, "the host file's group")
	imgs, _ := os.ReadDir(filepath.Join(store, "images"))
	require.Empty(t, imgs, "nothing of the refused image stored")
	refs, _ := os.ReadDir(filepath.Join(store, "refs"))
	require.Empty(t, refs, "no record names it")
	tmp, _ := os.ReadDir(filepath.Join(store, "tmp"))
	require.Empty(t, tmp, "nothing of the pull left")
}
