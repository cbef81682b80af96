//go:build e2e

package e2e

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
)

// The confined mode (make test-e2e-confined): with LVE_E2E_RUNNER_USER=NAME
// every driver executable the suite runs as the GitLab runner would (the
// stages, the real gitlab-runner with its Custom executor, the pool service,
// gc, rm, image and the other admin commands of the runner's user) runs as
// that system user, a member of the libvirt group confined by the polkit
// rules of `libvirt-executor polkit-rules --user NAME` (docs/security.md).
// Without the variable nothing here runs and the suite is as it was.

// runnerUserEnv names the confined runner's user.
const runnerUserEnv = "LVE_E2E_RUNNER_USER"

// confinedTop holds what the confined mode keeps between runs: the suite's
// configuration, its state directory (the user's), and copies of the
// executables where the user can run them.
const confinedTop = "/var/lib/lve-e2e-confined"

// suiteRulesName is the confined suite's polkit rules file in the rig's
// rules directory; the privilege tests write their own
// (50-libvirt-executor.rules) for their own users.
const suiteRulesName = "40-lve-e2e-suite.rules"

// confinedSuite is the confined mode's setup, made once per test process.
type confinedSuite struct {
	user    testUser
	cfgPath string
	cfg     *config.Config
	bin     string
	runner  string // the real gitlab-runner, started as the user (a wrapper)
	testBin string // a copy of this test binary, for managerAs
	rules   string // the polkit rules file, removed when the tests end
}

var (
	confinedOnce sync.Once
	confined     *confinedSuite
	confinedErr  error
)

// confinedUser is the confined runner's user's name ("" in the default mode).
func confinedUser() string { return os.Getenv(runnerUserEnv) }

// confine switches r to the confined suite: its configuration, its
// executables and its user. The first call sets the suite up.
func (r *rig) confine(t *testing.T) {
	t.Helper()
	name := confinedUser()
	if name == "" {
		return
	}
	if os.Geteuid() != 0 {
		t.Fatalf("%s=%s needs root to make and confine that user", runnerUserEnv, name)
	}
	confinedOnce.Do(func() {
		confined, confinedErr = setupConfined(r, name)
		if confinedErr == nil {
			t.Logf("confined mode: the driver runs as %s (uid %d) under %s, configuration %s", name, confined.user.cred.Uid, confined.rules, confined.cfgPath)
		}
	})
	require.NoError(t, confinedErr, "the confined runner's user %s", name)
	r.root = &rig{cfg: r.cfg, cfgPath: r.cfgPath, bin: r.bin, conn: r.conn}
	r.cfg, r.cfgPath, r.bin, r.user = confined.cfg, confined.cfgPath, confined.bin, &confined.user
}

// rootOnly keeps the test as root (the rig's own configuration and state)
// in the confined mode, saying why; in the default mode it does nothing.
func (r *rig) rootOnly(t *testing.T, why string) {
	t.Helper()
	if r.root == nil {
		return
	}
	t.Logf("confined mode: this test runs the driver as root: %s", why)
	*r = *r.root
}

// rootOnly is rig.rootOnly for a real-runner test: the runner runs as
// root too.
func (rr *realRunner) rootOnly(t *testing.T, why string) {
	t.Helper()
	rr.r.rootOnly(t, why)
	rr.asUser = ""
}

// setupConfined makes the user (kept afterwards), its state directory, the
// suite's configuration and the polkit rules, and waits until polkit has
// loaded them.
func setupConfined(r *rig, name string) (*confinedSuite, error) {
	// ensureUser's work, without a test to remove the user after it: the
	// user is made once and left for later runs.
	if _, err := user.Lookup(name); err != nil {
		out, err := exec.Command("useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
			"--shell", "/usr/sbin/nologin", name).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("useradd %s: %v: %s", name, err, out)
		}
	}
	if out, err := exec.Command("usermod", "-G", "libvirt", name).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("usermod: %v: %s", err, out)
	}
	u, err := lookupTestUser(name)
	if err != nil {
		return nil, err
	}
	uid, gid := int(u.cred.Uid), int(u.cred.Gid)
	s := &confinedSuite{user: u}

	if err := os.MkdirAll(confinedTop, 0o755); err != nil {
		return nil, err
	}
	// The executables, readable by everyone (the checkout may not be).
	s.bin = filepath.Join(confinedTop, "bin")
	if err := os.MkdirAll(s.bin, 0o755); err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(r.bin)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		if e.IsDir() || !strings.HasPrefix(e.Name(), "libvirt-executor") && e.Name() != "lve-agent" {
			continue
		}
		if err := installCopy(filepath.Join(r.bin, e.Name()), filepath.Join(s.bin, e.Name())); err != nil {
			return nil, err
		}
	}
	// This test binary, for what the tests do in-process with the user's
	// installation (managerAs).
	if self, err := os.Executable(); err == nil {
		s.testBin = filepath.Join(s.bin, "e2e.test")
		if err := installCopy(self, s.testBin); err != nil {
			return nil, err
		}
	}
	// The state directory: the user's, private, kept between runs (one
	// controller id, so one guest tools volume).
	state := filepath.Join(confinedTop, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		return nil, err
	}
	// What root may have left there (an interrupted run) goes to the user.
	if out, err := exec.Command("chown", "-R", fmt.Sprintf("%d:%d", uid, gid), state).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("chown %s: %v: %s", state, err, out)
	}
	for _, d := range []string{"configs", "work"} {
		if err := os.MkdirAll(filepath.Join(confinedTop, d), 0o755); err != nil {
			return nil, err
		}
	}
	b, err := os.ReadFile(r.cfgPath)
	if err != nil {
		return nil, err
	}
	text := setKey("state_dir", fmt.Sprintf("%q", state))(string(b))
	for _, p := range []struct{ key, src string }{
		{"gitlab_runner", r.cfg.GuestTools.GitLabRunner},
		{"step_runner", r.cfg.GuestTools.StepRunner},
	} {
		if _, err := os.Stat(p.src); err != nil || !filepath.IsAbs(p.src) {
			continue // "none", a name on PATH, or what the stages will report missing
		}
		dst := filepath.Join(s.bin, "guest-"+filepath.Base(p.src))
		if err := installCopy(p.src, dst); err != nil {
			return nil, err
		}
		text = setKey(p.key, fmt.Sprintf("%q", dst))(text)
	}
	s.cfgPath = filepath.Join(confinedTop, "config.toml")
	if err := os.WriteFile(s.cfgPath, []byte(text), 0o644); err != nil {
		return nil, err
	}
	if s.cfg, err = config.Load(s.cfgPath); err != nil {
		return nil, err
	}
	if v := os.Getenv("LVE_E2E_GITLAB_RUNNER"); v != "" {
		// The real gitlab-runner, as the user (as systemd's User= runs it).
		rb := filepath.Join(s.bin, "gitlab-runner")
		if err := installCopy(v, rb); err != nil {
			return nil, err
		}
		s.runner = filepath.Join(s.bin, "gitlab-runner-as-"+name)
		script := fmt.Sprintf("#!/bin/sh\nexec setpriv --reuid=%d --regid=%d --init-groups -- %s \"$@\"\n", uid, gid, rb)
		if err := os.WriteFile(s.runner, []byte(script), 0o755); err != nil {
			return nil, err
		}
	}

	// The polkit rules, when the rig's libvirtd runs the access driver.
	run := cmp.Or(os.Getenv("LVE_RIG_RUN"), "/var/lib/libvirt-executor-rig/run")
	mode, _ := os.ReadFile(filepath.Join(run, "access"))
	if strings.TrimSpace(string(mode)) != "polkit" {
		return nil, fmt.Errorf("the rig's libvirtd runs no access driver (%s/access: %q): nothing to confine the user with", run, mode)
	}
	cmd := exec.Command(filepath.Join(s.bin, "libvirt-executor"), "--config", s.cfgPath, "polkit-rules", "--user", name)
	var js, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &js, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("polkit-rules: %v: %s", err, stderr.String())
	}
	s.rules = filepath.Join(run, "polkit-rules.d", suiteRulesName)
	if err := os.WriteFile(s.rules, []byte(js.String()), 0o644); err != nil {
		return nil, err
	}
	// polkitd reloads its rules when the directory changes.
	var out string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if out, err = virshQuiet(u, s.cfg.LibvirtURI, "pool-refresh", s.cfg.StoragePool); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("polkit did not load %s within 30 s: virsh pool-refresh as %s: %v: %s", s.rules, name, err, out)
		}
	}
	// And the rules confine: the user cannot define a pool, which a
	// libvirt that let it do anything would allow (the whole confined
	// suite would then prove nothing).
	forbidden := "lve-e2e-forbidden-pool"
	if out, err = virshQuiet(u, s.cfg.LibvirtURI, "pool-define-as", forbidden, "dir", "--target", "/nonexistent/lve-e2e-forbidden"); err == nil {
		_, _ = virshQuiet(u, s.cfg.LibvirtURI, "pool-undefine", forbidden)
		return nil, fmt.Errorf("the rules in %s do not confine %s: it defined the storage pool %s", s.rules, name, forbidden)
	}
	if !strings.Contains(out, "access denied") {
		return nil, fmt.Errorf("pool-define-as as %s failed, but not for want of access: %s", name, out)
	}
	return s, nil
}

// rigConfigPath is the rig's own configuration file (the confined suite's
// is elsewhere).
func (r *rig) rigConfigPath() string {
	if r.root != nil {
		return r.root.cfgPath
	}
	return r.cfgPath
}

// readableRunner is the real gitlab-runner binary where the driver's user
// can run it (selftest hands it to the guest): the confined suite's copy.
func (r *rig) readableRunner(bin string) string {
	if r.user == nil || confined == nil || confined.runner == "" {
		return bin
	}
	return filepath.Join(confined.bin, "gitlab-runner")
}

// endConfined removes the suite's polkit rules (the user and its state
// stay): later runs of the default mode expect the user unconfined by them.
func endConfined() {
	if confined != nil && confined.rules != "" {
		_ = os.Remove(confined.rules)
	}
}

// installCopy copies an executable where every user can run it, through a
// rename (a helper process of an earlier run may still run the old one).
func installCopy(from, to string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	tmp := to + ".new"
	if err := os.WriteFile(tmp, b, 0o755); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	return os.Rename(tmp, to)
}

// userDir is a fresh directory for the test that the driver's user can
// use: t.TempDir() in the default mode, else one in /tmp given to the user
// (t.TempDir's parents are root's, closed to it).
func (r *rig) userDir(t *testing.T) string {
	t.Helper()
	if r.user == nil {
		return t.TempDir()
	}
	dir, err := os.MkdirTemp("", "lve-e2e-confined-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	r.handOver(t, dir)
	return dir
}

// readableDir is a fresh directory for files the runner's user reads (a
// configuration, a CA file, an image to push): t.TempDir() in the default
// mode, else one in /tmp open to every user.
func readableDir(t *testing.T) string {
	t.Helper()
	if confinedUser() == "" {
		return t.TempDir()
	}
	dir, err := os.MkdirTemp("", "lve-e2e-confined-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	return dir
}

// handOver gives paths to the driver's user (nothing in the default mode).
func (r *rig) handOver(t *testing.T, paths ...string) {
	t.Helper()
	if r.user == nil {
		return
	}
	for _, p := range paths {
		require.NoError(t, os.Lchown(p, int(r.user.cred.Uid), int(r.user.cred.Gid)))
	}
}

// cred is the driver's user's credentials (nil: this process's).
func (r *rig) cred() *syscall.Credential {
	if r.user == nil {
		return nil
	}
	return r.user.cred
}

// admin is `libvirt-executor --config CFG args...` as the runner's user
// would run it.
func (r *rig) admin(args ...string) *exec.Cmd {
	return r.adminContext(context.Background(), args...)
}

func (r *rig) adminContext(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(r.bin, "libvirt-executor"), append([]string{"--config", r.cfgPath}, args...)...)
	if c := r.cred(); c != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c}
	}
	return cmd
}

// virshQuiet runs virsh as u against uri, without a test to log to.
func virshQuiet(u testUser, uri string, args ...string) (string, error) {
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
	return string(out), err
}

// The pool tests look at and remove standby VMs through the installation,
// in this process. In the confined mode the installation is the runner's
// user's, and the state directory refuses root's changes (state.CheckOwner):
// the same calls run in a copy of this test binary as that user.

// managerOpEnv makes the test binary run one manager operation (TestMain).
const managerOpEnv = "LVE_E2E_MANAGER_OP"

// managerAnswer is what a manager operation printed, as JSON.
type managerAnswer struct {
	Idle, Other []string
	Errors      []string
	Age         time.Duration
	OK          bool
}

// managerOp runs op ("standbys", "remove-standbys", "service-status") on
// the installation of the configuration in LVE_E2E_CONFIG and prints its
// answer; it returns the exit code.
func managerOp(op string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cfg, err := config.Load(os.Getenv("LVE_E2E_CONFIG"))
	if err != nil {
		return fail(err)
	}
	m, err := jobvm.Open(cfg, lifecycle.Options{})
	if err != nil {
		return fail(err)
	}
	defer m.Close()
	var a managerAnswer
	switch op {
	case "standbys":
		if a.Idle, a.Other, err = standbysOf(m); err != nil {
			return fail(err)
		}
	case "remove-standbys":
		_, errs := poolsvc.RemoveStandbys(context.Background(), m, 2*time.Minute, "test over")
		for _, e := range errs {
			a.Errors = append(a.Errors, e.Error())
		}
	case "service-status":
		_, a.Age, a.OK = m.ServiceStatus()
	default:
		return fail(fmt.Errorf("unknown manager operation %q", op))
	}
	if err := json.NewEncoder(os.Stdout).Encode(a); err != nil {
		return fail(err)
	}
	return 0
}

// managerAs runs op as the runner's user and decodes its answer into a.
func (r *rig) managerAs(t *testing.T, op string, a *managerAnswer) {
	t.Helper()
	require.NotEmpty(t, confined.testBin, "the test binary, where the runner's user can run it")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, confined.testBin)
	cmd.Env = []string{managerOpEnv + "=" + op, "LVE_E2E_CONFIG=" + r.cfgPath, "PATH=/usr/bin:/bin", "HOME=/nonexistent"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: r.user.cred}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "%s as %s: %s", op, r.user.name, stderr.String())
	require.NoError(t, json.Unmarshal(out, a), "%s as %s: %s", op, r.user.name, out)
}

// serviceStatus returns a look at the pool service's heartbeat: its age
// and whether there is one.
func (r *rig) serviceStatus(t *testing.T) func() (time.Duration, bool) {
	t.Helper()
	if r.user != nil {
		return func() (time.Duration, bool) {
			var a managerAnswer
			r.managerAs(t, "service-status", &a)
			return a.Age, a.OK
		}
	}
	m := r.manager(t)
	return func() (time.Duration, bool) {
		_, age, ok := m.ServiceStatus()
		return age, ok
	}
}

// testRulesName is the polkit rules file of a test whose configuration
// names a storage pool of its own. The generated rules answer NO for any
// pool but their configuration's, so it sorts before the suite's file
// (polkit takes the first rule that answers) and is removed when the test
// ends.
const testRulesName = "39-lve-e2e-test.rules"

// allowConfig, in the confined mode, confines the runner's user to r's
// configuration instead of the suite's for the rest of the test (a test
// with a storage pool of its own), as an admin would regenerate the rules
// after changing the pool, and waits until polkit has loaded them and,
// after the test, the suite's again. In the default mode it does nothing.
func (r *rig) allowConfig(t *testing.T) {
	t.Helper()
	if r.user == nil {
		return
	}
	run := cmp.Or(os.Getenv("LVE_RIG_RUN"), "/var/lib/libvirt-executor-rig/run")
	out, err := exec.Command(filepath.Join(r.bin, "libvirt-executor"), "--config", r.cfgPath, "polkit-rules", "--user", r.user.name).Output()
	require.NoError(t, err, "polkit-rules for %s", r.cfgPath)
	path := filepath.Join(run, "polkit-rules.d", testRulesName)
	require.NoError(t, os.WriteFile(path, out, 0o644))
	u, uri, suitePool := *r.user, r.cfg.LibvirtURI, confined.cfg.StoragePool
	t.Cleanup(func() {
		_ = os.Remove(path)
		waitFor(t, 30*time.Second, "polkit loads the suite's rules again", func() bool {
			_, err := virshQuiet(u, uri, "pool-refresh", suitePool)
			return err == nil
		})
	})
	waitFor(t, 30*time.Second, "polkit loads the rules for pool "+r.cfg.StoragePool, func() bool {
		_, err := virshQuiet(u, uri, "pool-refresh", r.cfg.StoragePool)
		return err == nil
	})
	t.Logf("confined mode: %s confined to this test's configuration (pool %s) by %s", u.name, r.cfg.StoragePool, path)
}
