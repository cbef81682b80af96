//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

// TestUnprivilegedRunnerUser runs a whole job with every stage executed as an
// unprivileged user in the libvirt group, as on a host where gitlab-runner
// runs as its own user, and checks that doctor agrees with that user's setup.
// A user outside the group is refused with a SYSTEM_FAILURE that says what
// to fix, and nothing is made.
func TestUnprivilegedRunnerUser(t *testing.T) {
	r := setup(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root to create the test users")
	}
	run := os.Getenv("LVE_RIG_RUN")
	if run == "" {
		run = "/var/lib/libvirt-executor-rig/run"
	}
	if _, err := os.Stat(filepath.Join(run, "reused")); err == nil {
		// A libvirtd the rig reused (LVE_RIG_REUSE) may authorise by polkit,
		// which is not running here.
		t.Skip("the rig reuses a libvirtd it did not configure")
	}
	sock, err := os.Stat("/var/run/libvirt/libvirt-sock")
	require.NoError(t, err)
	st := sock.Sys().(*syscall.Stat_t)
	require.Equal(t, "0770 libvirt", fmt.Sprintf("%04o %s", sock.Mode().Perm(), groupName(st.Gid)),
		"the rig's libvirtd grants the libvirt group its socket (deploy/rig/start.sh)")

	top, err := os.MkdirTemp("", "lve-e2e-unpriv")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(top) })
	require.NoError(t, os.Chmod(top, 0o755))
	// The checkout may live where other users cannot enter (/root): install
	// the executables as an admin would, readable by everyone.
	bin := filepath.Join(top, "bin")
	require.NoError(t, os.Mkdir(bin, 0o755))
	for _, name := range []string{"libvirt-executor-config", "libvirt-executor-prepare", "libvirt-executor-run", "libvirt-executor-cleanup", "libvirt-executor"} {
		copyFile(t, filepath.Join(r.bin, name), filepath.Join(bin, name), 0o755)
	}

	// The confined mode's own user (LVE_E2E_RUNNER_USER) has the suite's
	// rules already: this test confines one of its own.
	runnerName := "lve-e2e-runner"
	if confinedUser() == runnerName {
		runnerName = "lve-e2e-runner-p"
	}
	runner := ensureUser(t, runnerName, true)
	outsider := ensureUser(t, "lve-e2e-outsider", false)

	t.Run("job as a libvirt group member", func(t *testing.T) {
		rv, cfgPath := r.privateConfig(t, top, "runner", runner)
		// On a rig with libvirt's polkit access driver (LVE_RIG_ACCESS=polkit,
		// the default) the runner's user has only what the generated rules
		// grant: the job below runs under them, and what they refuse is tried
		// after it.
		confined := confineWithPolkit(t, run, bin, cfgPath, runner)
		// A host cache of the runner's own, for the scratch disk below.
		cacheDir := filepath.Join(top, "cache-runner")
		require.NoError(t, os.Mkdir(cacheDir, 0o700))
		require.NoError(t, os.Chown(cacheDir, int(runner.cred.Uid), int(runner.cred.Gid)))
		b, err := os.ReadFile(cfgPath)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(cfgPath, fmt.Appendf(b, "\n[cache]\ndir = %q\n", cacheDir), 0o644))
		opts, lw := rv.options(t)
		opts.Exec = installed(bin, cfgPath)
		opts.WorkDir = filepath.Join(top, "work-runner")
		require.NoError(t, os.Mkdir(opts.WorkDir, 0o755))
		opts.RunAs = runner.cred
		var mu sync.Mutex
		uids := map[string]string{}
		var files []string
		scratch := make(chan scratchRead, 1)
		opts.OnStage = func(name string, pid int) {
			if name == "build_script" {
				mu.Lock()
				files = ownership(filepath.Join(top, "state-runner"))
				mu.Unlock()
				go func() { scratch <- readScratchAs(bin, cfgPath, filepath.Join(top, "state-runner"), runner) }()
			}
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
			if m := regexp.MustCompile(`(?m)^Uid:\s+(\d+)`).FindSubmatch(b); err == nil && m != nil {
				mu.Lock()
				uids[name] = string(m[1])
				mu.Unlock()
			}
		}
		res, err := harness.RunJob(context.Background(), opts, harness.Job{
			// Long enough for the scratch disk's attach and read below
			// (a hot plug: ~2 s under TCG).
			Script: []string{"echo built-by-$((6*7))", "sleep 12"},
		})
		require.NoError(t, err)
		require.Equal(t, harness.StateSuccess, res.State, "%s: %s", res.FailureReason, res.Message)
		require.Contains(t, lw.buf.String(), "built-by-42")
		// The host cache's scratch disk, attached and read back as the
		// stages' unprivileged user does it (the admin tool): the volume's
		// file is readable to that user's group, so the host reads it
		// instead of libvirt's stream (jobvm.KeepAnswer.FromFile).
		select {
		case sr := <-scratch:
			require.NoError(t, sr.err, "%s", sr.out)
			require.Empty(t, sr.answer.Error, sr.out)
			require.True(t, sr.answer.Dropped, sr.out)
			require.True(t, sr.answer.FromFile, "the unprivileged user read the scratch volume's file: %s", sr.out)
		case <-time.After(time.Minute):
			t.Fatal("the scratch disk's attach and read did not end")
		}
		for _, stage := range []string{"config", "prepare", "build_script", "cleanup"} {
			require.Equal(t, strconv.Itoa(int(runner.cred.Uid)), uids[stage], "stage %s ran as the runner's user", stage)
		}
		t.Logf("state during the job:\n%s", strings.Join(files, "\n"))
		require.NotEmpty(t, files)
		for _, f := range files {
			require.Regexp(t, `^(drwx------|-rw-------) `+strconv.Itoa(int(runner.cred.Uid))+` `, f, "key material and state: the runner user's, private")
		}
		rv.requireNoLeftovers(t, "after the unprivileged job")
		if confined {
			requireConfined(t, rv, runner)
		}

		// A prepare killed while its VM boots, then the job's cleanup and a
		// gc, all as that user: nothing is left, no network filter binding
		// either. Under the polkit access driver libvirt may leave the
		// killed client's binding (a kill inside the start); one is made
		// here for the machine, and the machine's removal by the user's
		// own calls takes it.
		work := filepath.Join(top, "work-killed")
		require.NoError(t, os.Mkdir(work, 0o755))
		rk := *rv
		rk.bin, rk.cfgPath = bin, cfgPath
		s := newStageRunnerFor(t, &rk, nextJobID(), work)
		for _, p := range []string{work, filepath.Join(work, "response.json")} {
			require.NoError(t, os.Chown(p, int(runner.cred.Uid), int(runner.cred.Gid)))
		}
		s.cred = runner.cred
		require.Equal(t, 0, s.run(t, "config").code)
		name := s.name(t)
		rn := s.start(t, "prepare")
		rn.waitFor(t, "domain running", func() bool { _, a := rv.domainState(name); return a })
		rn.signal(syscall.SIGKILL)
		rn.wait(t, 10*time.Second)
		rv.staleBinding(t, "lvee2estale0", name)
		require.Equal(t, 0, s.run(t, "cleanup").code)
		rv.requireNoLeftovers(t, "after the killed prepare")
		for _, b := range rv.staleBindings(t) {
			require.NotContains(t, b, " "+name, "a network filter binding of the killed prepare's machine, after its removal")
		}
		gc := exec.Command(filepath.Join(bin, "libvirt-executor"), "--config", cfgPath, "gc")
		gc.SysProcAttr = &syscall.SysProcAttr{Credential: runner.cred}
		gcOut, err := gc.CombinedOutput()
		require.NoError(t, err, "gc as the runner's user: %s", gcOut)

		// doctor, as that user, finds the setup complete.
		out, err := doctor(t, bin, cfgPath, runner)
		require.NoError(t, err)
		require.Contains(t, string(out), "[ok  ] user "+runner.name+": member of the libvirt group")
		require.Regexp(t, `\[(ok  |warn)\] polkit rule`, string(out))
		require.Contains(t, string(out), "[ok  ] state dir")

		// doctor as root reads polkit's rules (libvirt-daemon-system ships
		// 60-libvirt.rules) and points at the stages' user.
		out, err = doctor(t, bin, cfgPath, testUser{name: "root"})
		require.NoError(t, err)
		require.Regexp(t, `\[ok  \] polkit rule: \S+ mentions org.libvirt.unix.manage`, string(out))
		require.Contains(t, string(out), "[warn] state dir: "+filepath.Join(top, "state-runner")+" belongs to "+runner.name)
	})

	t.Run("user outside the libvirt group", func(t *testing.T) {
		rv, cfgPath := r.privateConfig(t, top, "outsider", outsider)
		opts, lw := rv.options(t)
		opts.Exec = installed(bin, cfgPath)
		opts.WorkDir = filepath.Join(top, "work-outsider")
		require.NoError(t, os.Mkdir(opts.WorkDir, 0o755))
		opts.RunAs = outsider.cred
		res, err := harness.RunJob(context.Background(), opts, harness.Job{Script: []string{"echo never"}})
		require.NoError(t, err)
		require.Equal(t, harness.ReasonSystemFailure, res.FailureReason, "an infrastructure problem, retried by the runner")
		require.Equal(t, 3, res.PrepareAttempts)
		log := lw.buf.String()
		require.Contains(t, log, "user "+outsider.name+" may not manage libvirt")
		require.Contains(t, log, "libvirt group")
		require.NotContains(t, log, "never")
		rv.requireNoLeftovers(t, "after the refused job")

		out, err := doctor(t, bin, cfgPath, outsider)
		require.Error(t, err)
		require.Contains(t, string(out), "[FAIL] user "+outsider.name+": member of the libvirt group")
		require.Contains(t, string(out), "usermod -aG libvirt "+outsider.name)
	})
}

// doctor runs `libvirt-executor doctor` as u (as this process if u has no
// credentials) and logs what it printed.
func doctor(t *testing.T, bin, cfgPath string, u testUser) ([]byte, error) {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "libvirt-executor"), "--config", cfgPath, "doctor")
	if u.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: u.cred}
	}
	out, err := cmd.CombinedOutput()
	t.Logf("doctor as %s:\n%s", u.name, out)
	return out, err
}

// scratchRead is what readScratchAs found.
type scratchRead struct {
	answer jobvm.KeepAnswer
	out    string
	err    error
}

// readScratchAs attaches a scratch disk to the one machine in state and
// keeps what is on it (nothing: the guest writes nothing), through the
// admin tool as u.
func readScratchAs(bin, cfgPath, state string, u testUser) scratchRead {
	ms, err := os.ReadDir(filepath.Join(state, "machines"))
	if err != nil || len(ms) != 1 {
		return scratchRead{err: fmt.Errorf("want one machine in %s: %v %v", state, ms, err)}
	}
	project, err := hostcache.ProjectID("https://gitlab.example.com", 42, false)
	if err != nil {
		return scratchRead{err: err}
	}
	run := func(req cachexfer.AdminRequest) (string, error) {
		body, err := json.Marshal(req)
		if err != nil {
			return "", err
		}
		cmd := exec.Command(filepath.Join(bin, "libvirt-executor"), "--config", cfgPath, cachexfer.AdminCommand)
		cmd.Stdin = bytes.NewReader(body)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: u.cred}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run(cachexfer.AdminRequest{Op: cachexfer.OpScratch, Machine: ms[0].Name()}); err != nil {
		return scratchRead{out: out, err: err}
	}
	out, err := run(cachexfer.AdminRequest{Op: cachexfer.OpKeep, Machine: ms[0].Name(), Project: project})
	sr := scratchRead{out: out, err: err}
	if err == nil {
		var a cachexfer.AdminAnswer
		if a, sr.err = cachexfer.ReadAdminAnswer(strings.NewReader(out), cachexfer.OpKeep); sr.err == nil {
			sr.answer = *a.Kept
		}
	}
	return sr
}

type testUser struct {
	name string
	cred *syscall.Credential
}

// ensureUser makes a system user (in the libvirt group or not) and removes
// it after the test if it did not exist before.
func ensureUser(t *testing.T, name string, inLibvirt bool) testUser {
	t.Helper()
	if _, err := user.Lookup(name); err != nil {
		out, err := exec.Command("useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
			"--shell", "/usr/sbin/nologin", name).CombinedOutput()
		require.NoError(t, err, "useradd: %s", out)
		t.Cleanup(func() { _ = exec.Command("userdel", name).Run() })
	}
	// Membership exactly as the test wants it, also for a user left over
	// from an interrupted run.
	args := []string{"-G", ""}
	if inLibvirt {
		args = []string{"-G", "libvirt"}
	}
	out, err := exec.Command("usermod", append(args, name)...).CombinedOutput()
	require.NoError(t, err, "usermod: %s", out)
	u, err := lookupTestUser(name)
	require.NoError(t, err)
	return u
}

// lookupTestUser is the user name with the groups its login would get, as
// systemd's User= gives them to gitlab-runner.
func lookupTestUser(name string) (testUser, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return testUser{}, err
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	gids, err := u.GroupIds()
	if err != nil {
		return testUser{}, err
	}
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	for _, g := range gids {
		n, _ := strconv.Atoi(g)
		cred.Groups = append(cred.Groups, uint32(n))
	}
	return testUser{name: name, cred: cred}, nil
}

// privateConfig is the rig's configuration with its own state directory,
// owned by u (the stages' user), written where u can read it.
func (r *rig) privateConfig(t *testing.T, top, tag string, u testUser) (*rig, string) {
	t.Helper()
	state := filepath.Join(top, "state-"+tag)
	require.NoError(t, os.Mkdir(state, 0o700))
	require.NoError(t, os.Chown(state, int(u.cred.Uid), int(u.cred.Gid)))
	rv := r.withConfig(t, setKey("state_dir", fmt.Sprintf("%q", state)))
	tools := false
	for _, p := range []struct{ key, name, src string }{
		{"gitlab_runner", "gitlab-runner", rv.cfg.GuestTools.GitLabRunner},
		{"step_runner", "step-runner", rv.cfg.GuestTools.StepRunner},
	} {
		if !filepath.IsAbs(p.src) {
			continue
		}
		// The guest tools disk's binaries, where u can read them (the
		// checkout may not be).
		bin := filepath.Join(top, p.name+"-"+tag)
		copyFile(t, p.src, bin, 0o755)
		rv = rv.withConfig(t, setKey(p.key, fmt.Sprintf("%q", bin)))
		tools = true
	}
	if tools {
		// This installation (its own state directory, so its own
		// controller id) builds a tools volume of its own: not kept.
		t.Cleanup(func() { r.removeToolsVolumes(t, state) })
	}
	cfgPath := filepath.Join(top, "config-"+tag+".toml")
	copyFile(t, rv.cfgPath, cfgPath, 0o644)
	return rv, cfgPath
}

func installed(bin, cfgPath string) harness.Executables {
	args := []string{"--config", cfgPath}
	exe := func(stage string) string { return filepath.Join(bin, "libvirt-executor-"+stage) }
	return harness.Executables{
		Config: exe("config"), Prepare: exe("prepare"), Run: exe("run"), Cleanup: exe("cleanup"),
		ConfigArgs: args, PrepareArgs: args, RunArgs: args, CleanupArgs: args,
	}
}

func copyFile(t *testing.T, from, to string, mode os.FileMode) {
	t.Helper()
	in, err := os.Open(from)
	require.NoError(t, err)
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	require.NoError(t, err)
	_, err = io.Copy(out, in)
	require.NoError(t, err)
	require.NoError(t, out.Close())
	require.NoError(t, os.Chmod(to, mode))
}

// ownership lists "mode uid path" for everything under dir.
func ownership(dir string) []string {
	var out []string
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		out = append(out, fmt.Sprintf("%s %d %s", info.Mode().Perm()|info.Mode().Type()&fs.ModeDir, info.Sys().(*syscall.Stat_t).Uid, p))
		return nil
	})
	return out
}

func groupName(gid uint32) string {
	if g, err := user.LookupGroupId(strconv.Itoa(int(gid))); err == nil {
		return g.Name
	}
	return strconv.Itoa(int(gid))
}

// removeToolsVolumes deletes the guest tools volumes of the installation
// whose state directory is stateDir.
func (r *rig) removeToolsVolumes(t *testing.T, stateDir string) {
	t.Helper()
	ctrl, err := os.ReadFile(filepath.Join(stateDir, "controller-id"))
	if err != nil {
		return // it never ran a stage
	}
	pool, err := r.conn.LookupStoragePoolByName(r.cfg.StoragePool)
	require.NoError(t, err)
	defer pool.Free()
	for _, v := range r.poolVolumes(t) {
		if !guesttools.IsToolsVolume(r.cfg.NamePrefix, strings.TrimSpace(string(ctrl)), v) {
			continue
		}
		vol, err := pool.LookupStorageVolByName(v)
		require.NoError(t, err)
		require.NoError(t, vol.Delete(0), "delete %s", v)
		_ = vol.Free()
	}
}

// confineWithPolkit puts the rules of `libvirt-executor polkit-rules --user`
// for cfgPath into the rig's polkit rules directory when the rig's libvirtd
// runs libvirt's polkit access driver (deploy/rig/start.sh), and reports
// whether it does. Before the rules, the user is refused what the rules then
// allow: the access driver is on, and the rules are what lets the job run.
func confineWithPolkit(t *testing.T, run, bin, cfgPath string, u testUser) bool {
	t.Helper()
	mode, err := os.ReadFile(filepath.Join(run, "access"))
	if err != nil || strings.TrimSpace(string(mode)) != "polkit" {
		t.Logf("the rig's libvirtd has no access driver (%s/access: %q, %v): socket permissions only", run, mode, err)
		return false
	}
	rules := filepath.Join(run, "polkit-rules.d", "50-libvirt-executor.rules")
	t.Cleanup(func() { _ = os.Remove(rules) })
	cfg, err := config.Load(cfgPath)
	require.NoError(t, err)
	refresh := func() (string, error) { return virshAs(t, u, cfg.LibvirtURI, "pool-refresh", cfg.StoragePool) }

	_ = os.Remove(rules) // a rules file of an earlier run on this rig
	waitFor(t, 30*time.Second, "polkit refuses the runner's user without the rules", func() bool {
		out, err := refresh()
		return err != nil && strings.Contains(out, "access denied")
	})

	cmd := exec.Command(filepath.Join(bin, "libvirt-executor"), "--config", cfgPath, "polkit-rules", "--user", u.name)
	var js, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &js, &stderr
	require.NoError(t, cmd.Run(), "polkit-rules: %s", stderr.String())
	require.Contains(t, js.String(), fmt.Sprintf("var user = %q;", u.name))
	require.NoError(t, os.WriteFile(rules, []byte(js.String()), 0o644))
	// polkitd reloads its rules when the directory changes.
	waitFor(t, 30*time.Second, "polkit loads the generated rules", func() bool {
		_, err := refresh()
		return err == nil
	})
	return true
}

// requireConfined checks, as the confined runner's user, that the rules
// refuse a storage pool of its own (which could point at any host
// directory), a domain outside the name prefix (defining one, and reading,
// starting or removing one of root's), and a volume outside the prefix; and
// that none of it happened.
func requireConfined(t *testing.T, r *rig, u testUser) {
	t.Helper()
	uri := r.cfg.LibvirtURI
	denied := func(what string, args ...string) {
		t.Helper()
		out, err := virshAs(t, u, uri, args...)
		require.Error(t, err, "%s: allowed: %s", what, out)
		require.Contains(t, out, "access denied", "%s: %s", what, out)
	}
	outside := fmt.Sprintf("e2e-outside-%d", os.Getpid())
	require.False(t, strings.HasPrefix(outside, r.cfg.NamePrefix+"-"))

	denied("a storage pool of its own", "pool-define-as", outside, "dir", "--target", "/etc")
	if _, err := r.conn.LookupStoragePoolByName(outside); err == nil {
		t.Fatalf("pool %s exists after the refusal", outside)
	}

	// A domain of root's, outside the prefix: defined, never started.
	// (where the user can read it: its home, which virshAs made)
	xmlPath := filepath.Join(os.TempDir(), "lve-e2e-home-"+u.name, "outside.xml")
	domXML := fmt.Sprintf("<domain type='qemu'><name>%s</name><memory unit='MiB'>32</memory><os><type arch='x86_64'>hvm</type></os></domain>", outside)
	require.NoError(t, os.WriteFile(xmlPath, []byte(domXML), 0o644))
	dom, err := r.conn.DomainDefineXML(domXML)
	require.NoError(t, err)
	t.Cleanup(func() { _ = dom.Undefine(); _ = dom.Free() })
	// virsh looks a domain up by id, UUID and name and reports only that it
	// failed: root reads the same domain (below), so the failure is the rules'.
	hidden := func(what string, args ...string) {
		t.Helper()
		out, err := virshAs(t, u, uri, args...)
		require.Error(t, err, "%s: allowed: %s", what, out)
		require.Regexp(t, `access denied|failed to get domain '`+outside+`'`, out, what)
	}
	hidden("reading root's domain", "dominfo", outside)
	hidden("starting root's domain", "start", outside)
	hidden("removing root's domain", "undefine", outside)
	out, err := virshAs(t, u, uri, "list", "--all", "--name")
	require.NoError(t, err, out)
	require.NotContains(t, out, outside, "root's domain is not even listed")
	active, err := dom.IsActive()
	require.NoError(t, err)
	require.False(t, active, "root's domain was started")
	_, err = dom.GetName()
	require.NoError(t, err, "root's domain is still defined")

	require.NoError(t, os.WriteFile(xmlPath, []byte(strings.ReplaceAll(domXML, outside, outside+"-u")), 0o644))
	denied("defining a domain outside the prefix", "define", xmlPath)
	_, err = r.conn.LookupDomainByName(outside + "-u")
	require.Error(t, err, "the refused domain exists")
	denied("a volume outside the prefix", "vol-create-as", r.cfg.StoragePool, outside+".qcow2", "1M", "--format", "qcow2")
	denied("stopping the network", "net-destroy", r.cfg.Network)
}

// virshAs runs virsh as u against uri and returns what it printed.
func virshAs(t *testing.T, u testUser, uri string, args ...string) (string, error) {
	t.Helper()
	home := filepath.Join(os.TempDir(), "lve-e2e-home-"+u.name)
	if err := os.MkdirAll(home, 0o700); err == nil {
		_ = os.Chown(home, int(u.cred.Uid), int(u.cred.Gid))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "virsh", append([]string{"-q", "-c", uri}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: u.cred}
	cmd.Env = []string{"HOME=" + home, "PATH=/usr/bin:/bin", "LC_ALL=C"}
	cmd.Dir = home
	out, err := cmd.CombinedOutput()
	t.Logf("virsh %s as %s: %v\n%s", strings.Join(args, " "), u.name, err, out)
	return string(out), err
}
