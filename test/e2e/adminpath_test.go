//go:build e2e

package e2e

import (
	"cmp"
	"encoding/xml"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
)

// adminPathSteps are the commands of README's "From a KVM host to the
// first job" block, in order: the lines of the ```sh block after the
// comment that names this test, without their trailing comments.
func adminPathSteps(t *testing.T, readme string) []string {
	t.Helper()
	b, err := os.ReadFile(readme)
	require.NoError(t, err)
	text := string(b)
	i := strings.Index(text, "<!-- test/e2e TestDebianPackage runs these lines")
	require.GreaterOrEqual(t, i, 0, "README.md has the admin path block this test runs")
	text = text[i:]
	start := strings.Index(text, "```sh\n")
	require.GreaterOrEqual(t, start, 0)
	text = text[start+len("```sh\n"):]
	end := strings.Index(text, "```")
	require.GreaterOrEqual(t, end, 0)
	comment := regexp.MustCompile(`\s+#\s.*$`)
	var steps []string
	for _, l := range strings.Split(text[:end], "\n") {
		if l = strings.TrimSpace(comment.ReplaceAllString(l, "")); l != "" && !strings.HasPrefix(l, "#") {
			steps = append(steps, l)
		}
	}
	require.NotEmpty(t, steps)
	return steps
}

// adminPath runs README's admin path on the installed package (version)
// with the shipped configuration: every line of the block, in order, with
// only the rig's substitutions, then the first job through the real
// gitlab-runner, as the runner's user, with the settings of the block's
// `gitlab-runner register`. The rig's substitutions: the package is
// installed already (dpkg -i, the upgrade); the rig's pool and network
// are not named ci, so the configuration names the rig's (what
// docs/install.md tells an admin whose names differ); the rig's libvirtd
// runs libvirt's polkit access driver, so the runner's user gets the
// rules polkit-rules makes (docs/install.md); sudo is runuser;
// selftest gets the rig's runner binary and a port the rig's guard lets
// guests reach; gitlab-runner is not on PATH but in a directory put first
// on it; and there is no GitLab to register with.
func adminPath(t *testing.T, rr *realRunner, version string) {
	r := rr.r
	const conf = "/etc/libvirt-executor/config.toml"
	shipped, err := os.ReadFile("../../deploy/config.example.toml")
	require.NoError(t, err)
	installed, err := os.ReadFile(conf)
	require.NoError(t, err)
	require.Equal(t, string(shipped), string(installed), "the upgrade installed this tree's example configuration")
	runnerUser, err := user.Lookup("gitlab-runner")
	require.NoError(t, err)
	uid, _ := strconv.Atoi(runnerUser.Uid)
	gid, _ := strconv.Atoi(runnerUser.Gid)

	// gitlab-runner where the runner's user can run it, first on PATH (on
	// an admin's host: /usr/bin/gitlab-runner, from its package).
	tools, err := os.MkdirTemp("", "lve-e2e-adminpath-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(tools) })
	require.NoError(t, os.Chmod(tools, 0o755))
	runnerBin := filepath.Join(tools, "gitlab-runner")
	copyFile(t, rr.bin, runnerBin, 0o755)
	path := "PATH=" + tools + ":" + os.Getenv("PATH")

	// The guest tools volume the installation's first VM uploads is its
	// own (kept for its next jobs): it goes with the test.
	before := map[string]bool{}
	for _, v := range r.poolVolumes(t) {
		before[v] = true
	}
	t.Cleanup(func() {
		pool, err := r.conn.LookupStoragePoolByName(r.cfg.StoragePool)
		if err != nil {
			return
		}
		defer pool.Free()
		_ = pool.Refresh(0)
		vols, _ := pool.ListAllStorageVolumes(0)
		for _, v := range vols {
			if name, err := v.GetName(); err == nil && !before[name] && toolsVolumeRE.MatchString(strings.TrimPrefix(name, r.cfg.NamePrefix+"-")) {
				_ = v.Delete(0)
			}
			_ = v.Free()
		}
	})

	// The link image build makes in the rig's image cache goes with the test.
	imageLink := "/var/cache/libvirt-executor/images/debian"
	if _, err := os.Lstat(imageLink); err != nil {
		t.Cleanup(func() { _ = os.Remove(imageLink) })
	}

	sh := func(line string, env ...string) string {
		t.Helper()
		cmd := exec.Command("bash", "-c", line)
		cmd.Env = append(append(os.Environ(), path), env...)
		out, err := cmd.CombinedOutput()
		t.Logf("$ %s\n%s", line, out)
		require.NoError(t, err, "README's admin path: %s", line)
		return string(out)
	}
	edit := func(from, to string) {
		t.Helper()
		b, err := os.ReadFile(conf)
		require.NoError(t, err)
		require.Equal(t, 1, strings.Count(string(b), from+"\n"), "%s: the shipped configuration has %q once", conf, from)
		require.NoError(t, os.WriteFile(conf, []byte(strings.Replace(string(b), from+"\n", to+"\n", 1)), 0o640))
	}
	var custom *jobapi.CustomConfig
	selftested := false
	confined := false
	runnerAs := testUser{name: runnerUser.Username, cred: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	gids, err := runnerUser.GroupIds()
	require.NoError(t, err)
	for _, g := range gids {
		n, _ := strconv.Atoi(g)
		runnerAs.cred.Groups = append(runnerAs.cred.Groups, uint32(n))
	}
	for _, step := range adminPathSteps(t, "../../README.md") {
		switch {
		case strings.HasPrefix(step, "apt-get install ./libvirt-executor_"):
			// Installed already: the upgrade's dpkg -i of this tree's package.
			out, err := exec.Command("dpkg-query", "-W", "-f=${Status} ${Version}", pkgName).Output()
			require.NoError(t, err)
			require.Equal(t, "install ok installed "+version, string(out))
		case strings.HasPrefix(step, "virsh pool-define-as ci "):
			// The rig's pool instead of ci.
			edit(`storage_pool = "ci"`, fmt.Sprintf("storage_pool = %q", r.cfg.StoragePool))
		case strings.HasPrefix(step, "virsh net-define "):
			// The rig's network instead of ci. The shipped definition is a
			// network named ci.
			f := strings.Fields(step)[2]
			b, err := os.ReadFile(f)
			require.NoError(t, err, "the package ships %s", f)
			var nx libvirtxml.Network
			require.NoError(t, xml.Unmarshal(b, &nx))
			require.Equal(t, "ci", nx.Name)
			require.Len(t, nx.IPs, 1)
			require.NotNil(t, nx.IPs[0].DHCP, "the network serves DHCP")
			edit(`network = "ci"`, fmt.Sprintf("network = %q", r.cfg.Network))
		case strings.HasPrefix(step, "libvirt-executor image build "):
			// The rig's libvirtd runs libvirt's polkit access driver
			// (deploy/rig/start.sh), where Debian's libvirt lets the
			// libvirt group manage everything: the rules polkit-rules
			// makes for this configuration (docs/install.md, "The
			// runner's user") go into the rig's rules directory.
			if !confined {
				confined = true
				runDir := cmp.Or(os.Getenv("LVE_RIG_RUN"), "/var/lib/libvirt-executor-rig/run")
				confineWithPolkit(t, runDir, "/usr/bin", conf, runnerAs)
			}
			out := sh(step)
			name := strings.Fields(step)[3]
			// One line per step, then the table, then the image's path last.
			require.Regexp(t, `(?m)^\[1\] `+name+`: starting the recipe \(/usr/share/libvirt-executor/images/`+name+`/recipe.sh\), `, out)
			require.Contains(t, out, "[images."+name+"]\n")
			require.Contains(t, out, `kernel = "`+imageLink+`/vmlinuz"`)
			require.Regexp(t, `image `+name+`: `+regexp.QuoteMeta(imageLink)+` -> `+name+`-[0-9a-f]{16}, [^\n]+\n$`, out)
			require.FileExists(t, imageLink+"/disk.qcow2")
		case strings.HasPrefix(step, "sudo -u gitlab-runner libvirt-executor config check"):
			out := sh(strings.Replace(step, "sudo -u gitlab-runner ", "runuser -u gitlab-runner -- ", 1))
			require.Contains(t, out, "OK: "+conf)
		case strings.HasPrefix(step, "sudo -u gitlab-runner libvirt-executor selftest"):
			ln := r.serviceListener(t)
			addr := ln.Addr().String()
			require.NoError(t, ln.Close())
			out := sh(strings.Replace(step, "sudo -u gitlab-runner ", "runuser -u gitlab-runner -- ", 1) + " --runner " + runnerBin + " --listen " + addr + " --timeout 10m")
			require.Contains(t, out, "selftest-produce   success")
			require.Contains(t, out, "selftest-consume   success")
			require.Contains(t, out, "OK: VMs start")
			selftested = true
		case strings.HasPrefix(step, "gitlab-runner register "):
			custom = registered(t, step)
		default:
			t.Fatalf("README's admin path has a step this test does not know: %q (adminPath in test/e2e/adminpath_test.go)", step)
		}
	}
	require.NotNil(t, custom, "README's admin path registers the runner")
	// TestDebianPackage leaves the installed selftest's sample jobs to this
	// step: README must keep it.
	require.True(t, selftested, "README's admin path runs selftest as the runner's user")

	// The first job, as README shows it, through the real gitlab-runner
	// running as the runner's user with the registered settings.
	home, err := os.MkdirTemp("", "lve-e2e-adminpath-runner-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(home) })
	require.NoError(t, os.Chown(home, uid, gid))
	work := filepath.Join(home, "work")
	require.NoError(t, os.Mkdir(work, 0o755))
	require.NoError(t, os.Chown(work, uid, gid))
	asRunner := filepath.Join(tools, "gitlab-runner-as-user")
	require.NoError(t, os.WriteFile(asRunner, []byte("#!/bin/sh\nexec setpriv --reuid="+runnerUser.Uid+" --regid="+runnerUser.Gid+" --init-groups -- "+runnerBin+" \"$@\"\n"), 0o755))
	first := *rr
	first.bin, first.home, first.workDir, first.stages = asRunner, home, work, custom
	t.Setenv("PATH", tools+":"+os.Getenv("PATH"))
	res := first.runJobs(t, jobapi.Job{Name: "first-job", Image: "debian-12", GitURL: rr.repo, SHA: rr.sha,
		Script: []string{"git --version", "grep PRETTY_NAME /etc/os-release", "test -f README.md && echo FIRST-JOB-CLONED"}})[0]
	require.Equal(t, jobapi.StateSuccess, res.State, res.Trace)
	require.Regexp(t, `(?m)^git version \d`, res.Trace)
	require.Contains(t, res.Trace, `PRETTY_NAME="Debian GNU/Linux 12`)
	require.Contains(t, res.Trace, "FIRST-JOB-CLONED")
	require.Contains(t, res.Trace, "("+pkgName+" "+version+")", "the installed stages ran the job")
	r.requireNoLeftovers(t, "after the admin path's jobs")
}

// registered is the Custom executor's settings of README's `gitlab-runner
// register` line: the executables it names, with no arguments (the stages
// read /etc/libvirt-executor/config.toml).
func registered(t *testing.T, line string) *jobapi.CustomConfig {
	t.Helper()
	f := strings.Fields(line)
	flags := map[string]string{}
	for i := 2; i < len(f); i++ {
		require.True(t, strings.HasPrefix(f[i], "--"), "register: %q", f[i])
		if f[i] == "--non-interactive" {
			continue
		}
		require.Less(t, i+1, len(f), "register: %s has no value", f[i])
		flags[f[i]] = f[i+1]
		i++
	}
	require.Equal(t, "custom", flags["--executor"])
	// What realRunner.start gives run-single.
	require.Equal(t, "/builds", flags["--builds-dir"])
	require.Equal(t, "/cache", flags["--cache-dir"])
	c := &jobapi.CustomConfig{ConfigExec: flags["--custom-config-exec"], PrepareExec: flags["--custom-prepare-exec"],
		RunExec: flags["--custom-run-exec"], CleanupExec: flags["--custom-cleanup-exec"]}
	for _, e := range []string{c.ConfigExec, c.PrepareExec, c.RunExec, c.CleanupExec} {
		require.FileExists(t, e, "register names an installed executable")
	}
	require.Len(t, flags, 9, "register's flags: %v (adminPath knows these)", flags)
	return c
}
