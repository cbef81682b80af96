//go:build e2e

package e2e

import (
	"debug/elf"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
)

// upgradeFrom is the commit whose build the upgrade test installs first: the
// version before the package existed (the last commit of 2026-11-27's
// GitLab Steps work). LVE_E2E_UPGRADE_FROM names another.
const upgradeFrom = "a8345977f03b3f5d4db559348ee3ba2437d9358f"

const pkgName = "libvirt-executor"

// hostCacheDir is the documented [cache] dir, which the package makes.
const hostCacheDir = "/var/cache/libvirt-executor/jobs"

// TestDebianPackage builds the package (deploy/package/build.sh, what make
// package runs) and lintian finds nothing in it. It installs a package of an
// earlier commit's build, starts its pool service, starts a job through the
// real gitlab-runner with the installed stages, and upgrades to this tree's
// package in the middle of the job: the job's later stages and its cleanup
// run the new version and succeed. The new version's pool service retires
// the earlier one's standby VM and boots its own; nothing is left. doctor and selftest then run through the
// installed files, and README's admin path runs with the installed
// configuration (adminPath: image build, config check, selftest and a first
// job through the real gitlab-runner as the runner's user). Removing keeps the configuration and the state;
// purging removes the state only when asked (LIBVIRT_EXECUTOR_PURGE_STATE).
func TestDebianPackage(t *testing.T) {
	rr := newRealRunner(t)
	rr.rootOnly(t, "installs the .deb and runs its jobs as the package's own gitlab-runner user (postinst's), with the rig's state")
	r := rr.r
	for _, tool := range []string{"dpkg", "dpkg-deb", "lintian", "git", "strip"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing (make deps installs it): %v", tool, err)
		}
	}
	if out, err := exec.Command("dpkg-query", "-W", "-f=${Status}", pkgName).Output(); err == nil && strings.Contains(string(out), "installed") {
		t.Fatalf("%s is installed on this machine already (%s): the test would replace it", pkgName, out)
	}
	for _, p := range []string{"/var/lib/libvirt-executor", "/var/cache/libvirt-executor/oci", hostCacheDir, "/etc/libvirt-executor", "/usr/bin/libvirt-executor",
		"/etc/libvirt/hooks/network.d/50-libvirt-executor-guard", "/etc/libvirt/hooks/libvirt-executor-guard.conf", "/etc/libvirt/hooks/qemu.d/50-libvirt-executor-conntrack"} {
		if _, err := os.Lstat(p); err == nil {
			t.Fatalf("%s exists on this machine already: the test would change it", p)
		}
	}
	top, err := filepath.Abs("../..")
	require.NoError(t, err)
	work := t.TempDir()
	run := func(env []string, name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s %s:\n%s", name, strings.Join(args, " "), out)
		return string(out)
	}
	// Whatever happens, the machine ends without the package and its state.
	t.Cleanup(func() {
		_ = exec.Command("dpkg", "--purge", pkgName).Run()
		_ = os.RemoveAll("/var/lib/libvirt-executor")
		_ = os.RemoveAll("/var/cache/libvirt-executor/oci")
		_ = os.RemoveAll(hostCacheDir)
		_ = os.RemoveAll("/etc/libvirt-executor")
	})

	// The runner's user: postinst adds it to libvirt's group.
	if _, err := user.Lookup("gitlab-runner"); err != nil {
		run(nil, "useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "gitlab-runner")
		t.Cleanup(func() { _ = exec.Command("userdel", "gitlab-runner").Run() })
	} else {
		inGroup := strings.Contains(" "+run(nil, "id", "-nG", "gitlab-runner")+" ", " libvirt ")
		t.Cleanup(func() {
			if !inGroup {
				_ = exec.Command("gpasswd", "-d", "gitlab-runner", "libvirt").Run()
			}
		})
	}

	// This tree's package, and lintian's verdict on it.
	fast := []string{"LVE_DEB_FAST=1"}
	newDeb := strings.TrimSpace(run(fast, filepath.Join(top, "deploy/package/build.sh"), work))
	newVersion := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(newDeb), pkgName+"_"), "_amd64.deb")
	lint := exec.Command("lintian", "--tag-display-limit", "0", newDeb)
	out, err := lint.CombinedOutput()
	t.Logf("lintian:\n%s", out)
	require.NoError(t, err, "lintian failed")
	require.NotRegexp(t, `(?m)^[EW]: `, string(out), "lintian errors or warnings (deploy/package/debian/lintian-overrides lists the accepted ones with reasons)")

	// The earlier commit's build, packaged with its version.
	from := upgradeFrom
	if v := os.Getenv("LVE_E2E_UPGRADE_FROM"); v != "" {
		from = v
	}
	full, err := exec.Command("git", "-C", top, "rev-parse", "--verify", "-q", from+"^{commit}").Output()
	if err != nil {
		t.Fatalf("commit %s (the version the upgrade starts from) is not in this clone (a shallow clone?): fetch it, or name another with LVE_E2E_UPGRADE_FROM", from)
	}
	from = strings.TrimSpace(string(full))
	oldTree := filepath.Join(work, "old-tree")
	run(nil, "git", "-C", top, "worktree", "add", "--detach", oldTree, from)
	t.Cleanup(func() { _ = exec.Command("git", "-C", top, "worktree", "remove", "--force", oldTree).Run() })
	oldCount := strings.TrimSpace(run(nil, "git", "-C", top, "rev-list", "--count", from))
	oldVersion := "0.0." + oldCount + "+g" + from[:7]
	oldBin := filepath.Join(work, "old-bin")
	ld := "-X gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo.Version=" + oldVersion
	// One go build for the six: their packages compile and link in parallel.
	build := exec.Command("go", "build", "-trimpath", "-tags", "urfave_cli_no_docs", "-ldflags", ld, "-o", oldBin+"/",
		"./cmd/admin", "./cmd/config", "./cmd/prepare", "./cmd/run", "./cmd/cleanup", "./cmd/garm")
	build.Dir = oldTree
	out, err = build.CombinedOutput()
	require.NoError(t, err, "building commit %s:\n%s", from, out)
	for dir, exe := range map[string]string{"admin": "libvirt-executor", "config": "libvirt-executor-config", "prepare": "libvirt-executor-prepare",
		"run": "libvirt-executor-run", "cleanup": "libvirt-executor-cleanup", "garm": "libvirt-executor-garm"} {
		require.NoError(t, os.Rename(filepath.Join(oldBin, dir), filepath.Join(oldBin, exe)))
	}
	oldDeb := strings.TrimSpace(run(fast, filepath.Join(top, "deploy/package/build.sh"), "--binaries", oldBin, "--version", oldVersion, filepath.Join(work, "old")))

	// Install the earlier version: nothing starts, next steps are printed.
	out1 := run(nil, "dpkg", "-i", oldDeb)
	t.Logf("dpkg -i %s:\n%s", filepath.Base(oldDeb), out1)
	require.Contains(t, out1, "installed; nothing was started")
	require.Contains(t, out1, "libvirt-executor doctor")
	require.Contains(t, run(nil, "id", "-nG", "gitlab-runner"), "libvirt", "postinst added the runner's user to libvirt's group")
	st, err := os.Stat("/var/lib/libvirt-executor")
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())
	runner, err := user.Lookup("gitlab-runner")
	require.NoError(t, err)
	// The documented [cache] dir: the runner's user's alone (#42). Before,
	// nothing made it and its parent is root's: the first job could not.
	requireOwnDir := func(what string) {
		t.Helper()
		st, err := os.Lstat(hostCacheDir)
		require.NoError(t, err, "%s: the package makes the host cache's directory", what)
		require.True(t, st.IsDir(), what)
		require.Equal(t, os.FileMode(0o700), st.Mode().Perm(), "%s: the host cache's directory is 0700", what)
		require.Equal(t, runner.Uid, strconv.FormatUint(uint64(st.Sys().(*syscall.Stat_t).Uid), 10), "%s: the host cache belongs to the runner's user", what)
	}
	requireOwnDir("install")
	require.Contains(t, run(nil, "/usr/bin/libvirt-executor", "--version"), oldVersion)
	if _, err := os.Stat("/run/systemd/system"); err == nil {
		out, _ := exec.Command("systemctl", "is-active", "libvirt-executor.service").CombinedOutput()
		require.NotEqual(t, "active", strings.TrimSpace(string(out)), "installing started the pool service")
	}

	// The earlier version's pool service keeps a standby VM through the
	// upgrade (prerm stops nothing on an upgrade).
	pr := r.withPool(t, 1)
	oldSvc, err := poolsvc.Start("/usr/bin/libvirt-executor", pr.cfgPath)
	require.NoError(t, err)
	t.Cleanup(func() {
		select {
		case <-oldSvc.Done():
		default:
			_, _ = oldSvc.Stop(poolsvc.StopWait)
		}
		pr.removeStandbys(t)
	})
	// (Its standby boots while the job below runs.)

	// A job through the installed stages; the run stage's wrapper upgrades
	// the package before the job's script stage (its prepare, holder and
	// first stages are the earlier version's).
	upgradeLog := filepath.Join(work, "upgrade.log")
	wrapper := filepath.Join(work, "run-wrapper")
	require.NoError(t, os.WriteFile(wrapper, []byte(`#!/bin/sh
# The runner passes run_args (--config FILE), the stage's script and, last, the stage's
# name (build_script: the runner's name of step_script here).
for stage in "$@"; do :; done
case $stage in build_script | step_script) up=1 ;; *) up= ;; esac
if [ -n "$up" ] && [ ! -e "$0.done" ]; then
	dpkg -i "`+newDeb+`" >"`+upgradeLog+`" 2>&1 || exit 1
	touch "$0.done"
fi
exec /usr/bin/libvirt-executor-run "$@"
`), 0o755))
	stages := jobapi.DriverStages("/usr/bin", r.cfgPath)
	stages.RunExec = wrapper
	rr.stages = stages
	res := rr.runJobs(t, jobapi.Job{Name: "upgrade", GitURL: rr.repo, SHA: rr.sha,
		Script: []string{"test -f README.md && echo CLONED-BEFORE-THE-UPGRADE"}})[0]
	require.Equal(t, jobapi.StateSuccess, res.State, res.Trace)
	require.Contains(t, res.Trace, "CLONED-BEFORE-THE-UPGRADE")
	require.Contains(t, res.Trace, "("+pkgName+" "+oldVersion+")", "the earlier version prepared the job")
	up, err := os.ReadFile(upgradeLog)
	require.NoError(t, err, "the upgrade ran in the middle of the job")
	t.Logf("the upgrade:\n%s", up)
	require.Contains(t, string(up), "upgraded from "+oldVersion)
	// Every executable says its version, commit and build date.
	for _, e := range []string{"libvirt-executor", "libvirt-executor-config", "libvirt-executor-prepare", "libvirt-executor-run", "libvirt-executor-cleanup", "libvirt-executor-garm"} {
		v := run(nil, "/usr/bin/"+e, "--version")
		require.Regexp(t, `^`+regexp.QuoteMeta(e+" version "+newVersion)+` \(commit [0-9a-f]{40}(-dirty)?, built \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\), MIT License\n$`, v, e)
	}
	// The guest agent, where guest_tools.agent = "auto" finds it, static
	// (it runs in the guests), of the same version.
	require.Regexp(t, `^`+regexp.QuoteMeta("lve-agent version "+newVersion)+` \(commit `, run(nil, "/usr/lib/libvirt-executor/lve-agent", "--version"))
	agentELF, err := elf.Open("/usr/lib/libvirt-executor/lve-agent")
	require.NoError(t, err)
	for _, prog := range agentELF.Progs {
		require.NotEqual(t, elf.PT_INTERP, prog.Type, "the packaged guest agent is dynamically linked: it must run on any guest")
	}
	_ = agentELF.Close()

	// What postinst's try-restart does: the earlier service stops (its
	// idle VM stays), the new one starts and retires the earlier version's
	// standby VM (its spec fingerprint names that version: no job claims
	// it); stopping it undoes the boot of its own.
	oldIdle := pr.waitIdle(t, 1, 3*time.Minute)
	_, err = oldSvc.Stop(poolsvc.StopWait)
	require.NoError(t, err)
	require.Equal(t, oldIdle, pr.waitIdle(t, 1, 10*time.Second), "the earlier version's idle VM outlives its service")
	newSvc, err := poolsvc.Start("/usr/bin/libvirt-executor", pr.cfgPath)
	require.NoError(t, err)
	waitFor(t, 2*time.Minute, "the earlier version's standby VM retired by the new service", func() bool {
		idle, other := pr.standbys(t)
		return !slices.Contains(append(idle, other...), oldIdle[0])
	})
	require.Contains(t, newSvc.Log(), "driver's version) changed")
	_, err = newSvc.Stop(poolsvc.StopWait)
	require.NoError(t, err)
	pr.removeStandbys(t)
	r.requireNoLeftovers(t, "after the upgraded job and pool")

	// doctor and selftest through the installed files.
	doc := exec.Command("/usr/bin/libvirt-executor", "--config", r.cfgPath, "doctor")
	out, err = doc.CombinedOutput()
	t.Logf("doctor:\n%s", out)
	require.NoError(t, err, "doctor through the installed files")
	ln := r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	// The sample jobs (produce, consume) of the installed selftest run in
	// adminPath below (README's selftest line, the same installed files):
	// here only what that one does not, the GitLab Steps job, so that two
	// sample-job VMs are not booted twice.
	args := []string{"--config", r.cfgPath, "selftest", "--runner", rr.bin, "--listen", addr, "--timeout", "5m"}
	steps := r.cfg.GuestTools.StepRunner != "none"
	if steps {
		args = append(args, "--steps", "--sample-jobs=false")
	}
	out, err = exec.Command("/usr/bin/libvirt-executor", args...).CombinedOutput()
	t.Logf("selftest:\n%s", out)
	require.NoError(t, err, "selftest through the installed files")
	require.Contains(t, string(out), "OK: VMs start")
	if steps {
		require.Contains(t, string(out), "selftest-steps     success")
		require.Contains(t, string(out), "a GitLab Steps job ran its step")
		require.NotContains(t, string(out), "selftest-produce", "--sample-jobs=false ran no sample job")
	} else {
		require.Contains(t, string(out), "selftest-produce   success")
		require.Contains(t, string(out), "selftest-consume   success")
	}

	// README's admin path with the shipped configuration: image build,
	// config check, selftest and the first job, as the runner's user.
	adminPath(t, rr, newVersion)

	// Remove: the executables go; configuration and state stay.
	run(nil, "dpkg", "-r", pkgName)
	_, err = os.Stat("/usr/bin/libvirt-executor")
	require.ErrorIs(t, err, os.ErrNotExist)
	require.FileExists(t, "/etc/libvirt-executor/config.toml")
	require.DirExists(t, "/var/lib/libvirt-executor")
	// Purge without asking: the configuration goes, the state stays.
	out2 := run(nil, "dpkg", "--purge", pkgName)
	require.Contains(t, out2, "kept /var/lib/libvirt-executor")
	require.NoFileExists(t, "/etc/libvirt-executor/config.toml")
	require.DirExists(t, "/var/lib/libvirt-executor")
	// A host cache left root's (a root admin command made it, with its
	// empty projects/ and stage/): installing again gives it back.
	require.NoError(t, os.Chown(hostCacheDir, 0, 0))
	require.NoError(t, os.Chmod(hostCacheDir, 0o755))
	for _, d := range []string{"projects", "stage"} {
		require.NoError(t, os.Mkdir(filepath.Join(hostCacheDir, d), 0o700))
	}
	// Install again, purge asking for the state: it goes.
	require.Contains(t, run(nil, "dpkg", "-i", newDeb), "gave "+hostCacheDir)
	requireOwnDir("a root-owned one, installed again")
	for _, d := range []string{"projects", "stage"} {
		st, err = os.Stat(filepath.Join(hostCacheDir, d))
		require.NoError(t, err)
		require.Equal(t, runner.Uid, strconv.FormatUint(uint64(st.Sys().(*syscall.Stat_t).Uid), 10), "root's empty %s is the runner's user's too", d)
	}
	// The default image store (docs/fleet.md): the runner's user writes it
	// (prepare pulls on first use), QEMU reads it.
	st, err = os.Stat("/var/cache/libvirt-executor/oci")
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), st.Mode().Perm())
	require.Equal(t, runner.Uid, strconv.FormatUint(uint64(st.Sys().(*syscall.Stat_t).Uid), 10), "the image store belongs to the runner's user")
	out3 := run([]string{"LIBVIRT_EXECUTOR_PURGE_STATE=yes"}, "dpkg", "--purge", pkgName)
	require.Regexp(t, regexp.MustCompile(`removed /var/lib/libvirt-executor`), out3)
	require.NoDirExists(t, "/var/lib/libvirt-executor")
	require.Contains(t, out3, "removed /var/cache/libvirt-executor/oci")
	require.NoDirExists(t, "/var/cache/libvirt-executor/oci")
	require.Contains(t, out3, "removed "+hostCacheDir)
	require.NoDirExists(t, hostCacheDir)
	_, err = exec.Command("dpkg-query", "-W", pkgName).Output()
	require.Error(t, err, "purged")
}
