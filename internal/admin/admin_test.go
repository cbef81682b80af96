package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/garm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/agenttest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func testConfig(t *testing.T, extra string) *config.Config {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, registrytest.Qcow2(1<<30, nil), 0o644))
	evil := filepath.Join(dir, "evil.qcow2")
	hostFile := filepath.Join(dir, "host-file")
	require.NoError(t, os.WriteFile(hostFile, []byte("root only"), 0o600))
	out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", hostFile, "-F", "raw", evil, "1M").CombinedOutput()
	require.NoError(t, err, "%s", out)
	cfg, err := config.Parse([]byte(`
storage_pool = "default-pool"
network = "default"
domain_type = "qemu"
state_dir = "` + filepath.Join(dir, "state") + `"
default_image = "ok"
` + extra + `
[images.ok]
base = "` + base + `"
[images.missing]
base = "/nonexistent/base.qcow2"
[images.evil]
base = "` + evil + `"
`))
	require.NoError(t, err)
	return cfg
}

// testDriver connects to libvirt's in-process test driver, whatever the URI.
func testDriver(ctx context.Context, _ string) (*libvirtvm.Conn, error) {
	return libvirtvm.Connect(ctx, "test:///default")
}

// open is what the admin command does (lifecycle.Open) with hv in place of
// libvirt.
func open(t *testing.T, cfg *config.Config, hv vm.Hypervisor) *jobvm.Host {
	t.Helper()
	m, err := jobvm.Open(cfg, lifecycle.Options{Connect: func(context.Context, string) (vm.Hypervisor, error) { return hv, nil }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func TestDoctorAgainstTestDriver(t *testing.T) {
	bridgeNFAt(t, "1") // the failures below are the test driver's, not this host's
	cfg := testConfig(t, "")
	checks := Doctor(context.Background(), cfg, testDriver)
	byName := map[string]Check{}
	for _, c := range checks {
		byName[c.Name] = c
	}
	require.True(t, byName["libvirt"].OK)
	require.True(t, byName["storage pool default-pool"].OK, byName["storage pool default-pool"].Info)
	require.True(t, byName["image ok"].OK)
	require.False(t, byName["image missing"].OK)
	require.Contains(t, byName["image missing"].Info, "no such file")
	require.False(t, byName["image evil"].OK, "a base naming a host file")
	require.Contains(t, byName["image evil"].Info, "backing file")
	require.True(t, byName["domain type"].Warn, "qemu is slow: a warning")
	// The test driver has no network filters: l2_filter (default on) fails.
	require.False(t, byName["network filters"].OK)
	require.Contains(t, byName["network filters"].Info, "clean-traffic")

	var out bytes.Buffer
	err := PrintChecks(&out, checks)
	require.ErrorContains(t, err, "3 check(s) failed")
	require.Contains(t, out.String(), "[FAIL] image missing")
	require.Contains(t, out.String(), "fix: ")

	cfg.Network = "nope"
	cfg.StoragePool = "nope"
	checks = Doctor(context.Background(), cfg, testDriver)
	out.Reset()
	require.Error(t, PrintChecks(&out, checks))
	require.Contains(t, out.String(), "[FAIL] storage pool nope")
	require.Contains(t, out.String(), "virsh pool-define-as nope")
	require.Contains(t, out.String(), "[FAIL] network nope")
}

// doctor says which libvirt's machines the state directory keeps, and
// fails when that is another libvirt than the configuration's; the
// service refuses another host's libvirt.
func TestStateHostCheckAndRemoteService(t *testing.T) {
	cfg := testConfig(t, "")
	c := stateHostCheck(cfg)
	require.True(t, c.OK)
	require.Equal(t, "not tied to a libvirt yet: the first use ties it to qemu:///system", c.Info)
	require.NoError(t, os.MkdirAll(cfg.StateDir, 0o700))
	require.NoError(t, state.Store{Dir: cfg.StateDir}.BindHost("qemu:///system", false, false))
	c = stateHostCheck(cfg)
	require.True(t, c.OK)
	require.Equal(t, "keeps the machines of qemu:///system", c.Info)
	cfg.LibvirtURI = "qemu+ssh://kvm2.example/system"
	c = stateHostCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "keeps the machines of libvirt qemu:///system, and this configuration's libvirt_uri names qemu://kvm2.example/system")

	err := Serve(context.Background(), cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	require.ErrorContains(t, err, `libvirt_uri "qemu+ssh://kvm2.example/system" is another host's libvirt: the service (standby pools, metrics) runs on the host of its VMs`)
}

func TestStateDirCheck(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o700))
	require.True(t, stateDirCheck(dir).OK)
	require.NoError(t, os.Chmod(dir, 0o755))
	c := stateDirCheck(dir)
	require.True(t, c.OK)
	require.True(t, c.Warn)
	require.NoError(t, os.Chmod(dir, 0o777))
	require.False(t, stateDirCheck(dir).OK)
	require.True(t, stateDirCheck(filepath.Join(dir, "new")).OK, "created on first use")
}

func TestListAndGC(t *testing.T) {
	cfg := testConfig(t, "")
	cfg.StoragePool = "jobs"
	hv := vmtest.New()
	m := open(t, cfg, hv)
	p := "lve-" + m.Manager().Controller[:8] + "-"
	x, err := vm.MarshalOwner(vm.Owner{Controller: m.Manager().Controller, Frontend: "gitlab", Job: "9", Created: time.Now().Add(-time.Hour), Deadline: time.Now().Add(-time.Minute)})
	require.NoError(t, err)
	hv.Domains[p+"9"] = &vmtest.Domain{OwnerXML: x, Active: true}
	hv.Volumes["jobs/"+p+"9.qcow2"] = nil
	hv.Domains[p+"10"] = &vmtest.Domain{Active: true} // look-alike

	var out bytes.Buffer
	require.NoError(t, List(context.Background(), &out, m, time.Now()))
	require.Contains(t, out.String(), "gitlab:9")
	require.Contains(t, out.String(), "expired (deadline passed")
	require.Contains(t, out.String(), "foreign (no ownership metadata)")

	out.Reset()
	require.NoError(t, ListJSON(context.Background(), &out, m, time.Now()))
	var items []ListItem
	require.NoError(t, json.Unmarshal(out.Bytes(), &items), out.String())
	require.Len(t, items, 2)
	byName := map[string]ListItem{}
	for _, it := range items {
		byName[it.Name] = it
	}
	j := byName[p+"9"]
	host, _ := os.Hostname()
	require.NotEmpty(t, host)
	require.Equal(t, host, j.Host, "lists gathered from a fleet tell the hosts apart")
	require.Equal(t, "gitlab", j.Frontend)
	require.Equal(t, "9", j.Job)
	require.Equal(t, "running", j.State)
	require.Equal(t, "expired", j.Verdict)
	require.Equal(t, []string{p + "9.qcow2"}, j.Volumes)
	require.InDelta(t, 3600, j.AgeSec, 60)
	require.NotNil(t, j.Deadline)
	f := byName[p+"10"]
	require.Equal(t, "foreign", f.Verdict)
	require.Empty(t, f.Frontend)
	require.Nil(t, f.Created)

	out.Reset()
	require.NoError(t, GC(context.Background(), &out, m, true))
	require.Contains(t, out.String(), "would remove "+p+"9")
	require.Contains(t, hv.Domains, p+"9")

	out.Reset()
	require.NoError(t, GC(context.Background(), &out, m, false))
	require.Contains(t, out.String(), "removed "+p+"9")
	require.True(t, strings.Contains(out.String(), "keep "+p+"10"))
	require.NotContains(t, hv.Domains, p+"9")
	require.Contains(t, hv.Domains, p+"10")

	// The sweep left its record for the metrics: a gc removing one
	// expired machine (the dry run left none).
	var sweeps []obs.Event
	_, err = m.Manager().Events().Fold(obs.Cursor{}, obs.Reader{Apply: func(e obs.Event) { sweeps = append(sweeps, e) }, Invalid: func() {}, Save: func(obs.Cursor) error { return nil }})
	require.NoError(t, err)
	require.Len(t, sweeps, 1)
	require.Equal(t, obs.KindSweep, sweeps[0].Kind)
	require.Equal(t, "gc", sweeps[0].Trigger)
	require.Equal(t, map[string]int{"expired": 1}, sweeps[0].Removed)
}

func TestPolkitCheck(t *testing.T) {
	empty, withRule := t.TempDir(), t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(withRule, "60-libvirt.rules"),
		[]byte(`polkit.addRule(function(action, subject) { if (action.id == "org.libvirt.unix.manage" && subject.isInGroup("libvirt")) return polkit.Result.YES; });`), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(empty, "50-other.rules"), []byte(`// unrelated`), 0o644))

	c := polkitCheck([]string{empty, withRule}, false, false)
	require.True(t, c.OK)
	require.False(t, c.Warn)
	require.Contains(t, c.Info, "60-libvirt.rules")

	c = polkitCheck([]string{empty}, false, false)
	require.False(t, c.OK, "no rule and no connection: the likely cause")
	require.Contains(t, c.Fix, "org.libvirt.unix.manage")

	c = polkitCheck([]string{empty}, true, false)
	require.True(t, c.OK)
	require.True(t, c.Warn, "works by socket permissions: only a warning")

	c = polkitCheck([]string{empty}, true, true)
	require.True(t, c.Warn, "root: a missing rule concerns the runner's user")
	require.Contains(t, c.Info, "unprivileged users are refused")

	if os.Geteuid() == 0 {
		// Run as nobody to see polkit's own directories as the runner does.
		t.Log("the unreadable-directory case is covered by the e2e test as an unprivileged user")
		return
	}
	locked := t.TempDir()
	require.NoError(t, os.Chmod(locked, 0o000))
	t.Cleanup(func() { _ = os.Chmod(locked, 0o700) })
	c = polkitCheck([]string{locked}, false, false)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "cannot read")
}

func TestConfigFileCheck(t *testing.T) {
	p := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, os.WriteFile(p, nil, 0o644))
	for _, tc := range []struct {
		mode     os.FileMode
		ok, warn bool
	}{{0o644, true, false}, {0o600, true, false}, {0o664, true, true}, {0o666, false, false}} {
		require.NoError(t, os.Chmod(p, tc.mode))
		c := configFileCheck(p)
		require.Equal(t, tc.ok, c.OK, "%o", tc.mode)
		require.Equal(t, tc.warn, c.Warn, "%o", tc.mode)
	}
}

func TestStateDirOwnedByAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown")
	}
	dir := filepath.Join(t.TempDir(), "state")
	require.NoError(t, os.Mkdir(dir, 0o700))
	require.NoError(t, os.Chown(dir, 65534, 65534))
	c := stateDirCheck(dir)
	require.True(t, c.Warn, "root checks on behalf of the stages' user")
	require.Contains(t, c.Info, "belongs to")
	require.Contains(t, c.Fix, "runuser -u")
	require.NoError(t, os.Chmod(dir, 0o777))
	c = stateDirCheck(dir)
	require.False(t, c.OK, "open to everyone fails, whoever owns it")
}

// rm (lifecycle.Teardown, what the rm command runs for each name) refuses
// names outside this installation and volumes not provably its own, saying
// why, and deletes nothing; gc reports such volumes and leaves them.
func TestRmAndGCLeaveWhatIsNotOurs(t *testing.T) {
	cfg := testConfig(t, "")
	cfg.StoragePool = "jobs"
	hv := vmtest.New()
	m := open(t, cfg, hv)
	p := "lve-" + m.Manager().Controller[:8] + "-"
	hv.Volumes["jobs/debian-12.qcow2"] = nil // a base image kept in the pool
	hv.Volumes["jobs/"+p+"3.qcow2"] = nil    // our naming, no domain, no state

	err := m.Manager().Machine("debian-12").Teardown(context.Background())
	require.ErrorIs(t, err, vm.ErrNotOurs)
	require.ErrorContains(t, err, `refusing to remove "debian-12": not a machine of this installation (names start with "`+p+`")`)
	err = m.Manager().Machine(p + "3").Teardown(context.Background())
	require.ErrorIs(t, err, vm.ErrNotOurs)
	require.ErrorContains(t, err, "no domain and no state record of ours: volumes "+p+"3.qcow2 left alone")
	require.Contains(t, hv.Volumes, "jobs/debian-12.qcow2")
	require.Contains(t, hv.Volumes, "jobs/"+p+"3.qcow2")

	var out bytes.Buffer
	require.NoError(t, List(context.Background(), &out, m, time.Now()))
	require.Contains(t, out.String(), "unproven (volumes without a domain or a state record: not provably ours; remove by hand)")
	out.Reset()
	require.NoError(t, GC(context.Background(), &out, m, false))
	require.Contains(t, out.String(), "keep "+p+"3 (unproven: ")
	require.NotContains(t, out.String(), "removed")
	require.Contains(t, hv.Volumes, "jobs/"+p+"3.qcow2")
	require.Contains(t, hv.Volumes, "jobs/debian-12.qcow2")
}

// doctor checks the service: not running (a warning without pools, a
// failure with them), hung (stale heartbeat), running; and its look
// creates nothing.
func TestServiceCheck(t *testing.T) {
	c := serviceCheck(testConfig(t, ""))
	require.True(t, c.OK && c.Warn, "no pool: only the metrics are missing")
	require.Contains(t, c.Info, "no metrics")

	cfg := testConfig(t, "[images.ok.pool]\nidle_count = 1\n")
	c = serviceCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "not running")
	_, err := os.Stat(cfg.StateDir)
	require.ErrorIs(t, err, os.ErrNotExist, "doctor's look made no state directory or lock file")

	m, err := jobvm.Open(cfg, lifecycle.Options{})
	require.NoError(t, err)
	defer m.Close()
	unlock, err := m.LockService(context.Background())
	require.NoError(t, err)
	defer unlock()
	c = serviceCheck(cfg)
	require.False(t, c.OK, "holds its lock but never looked")
	require.Contains(t, c.Info, "hung?")

	require.NoError(t, m.Heartbeat())
	c = serviceCheck(cfg)
	require.True(t, c.OK, c.Info)
	require.Contains(t, c.Info, "running")

	old := time.Now().Add(-time.Hour)
	require.NoError(t, os.Chtimes(filepath.Join(cfg.StateDir, "serve-heartbeat"), old, old))
	c = serviceCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "has not looked at its pools for 1h")
}

// explain-machine: one sentence for a machine of this installation that is
// gone or stopped, nothing for one that runs, and a refusal for a name that
// is not of this installation.
func TestExplainMachine(t *testing.T) {
	cfg := testConfig(t, "")
	cfg.StoragePool = "jobs"
	hv := vmtest.New()
	m := open(t, cfg, hv)
	ctx := context.Background()
	name := lifecycle.MachineName(cfg.NamePrefix, m.Manager().Controller, lifecycle.InstanceTag("x"), 7)

	var out bytes.Buffer
	require.NoError(t, ExplainMachine(ctx, &out, m, name))
	require.Equal(t, "VM "+name+" no longer exists\n", out.String())

	hv.Domains[name] = &vmtest.Domain{Active: true}
	out.Reset()
	require.NoError(t, ExplainMachine(ctx, &out, m, name))
	require.Empty(t, out.String(), "a running guest: nothing to say")

	hv.Domains[name].State = &vm.DomainState{Code: vm.StatePaused, Summary: "paused (I/O error)", IOError: true}
	out.Reset()
	require.NoError(t, ExplainMachine(ctx, &out, m, name))
	require.Contains(t, out.String(), "storage pool jobs is probably full")
	require.Equal(t, 1, strings.Count(out.String(), "\n"), "one line")

	for _, bad := range []string{"--config=/etc/passwd", "Lve-x", "lve-x; reboot", "lve-0000000-7", "other-" + m.Manager().Controller[:8] + "-x-7"} {
		out.Reset()
		require.Error(t, ExplainMachine(ctx, &out, m, bad), bad)
		require.Empty(t, out.String())
	}
	calls := len(hv.Calls)
	require.ErrorContains(t, ExplainMachine(ctx, &out, m, "lve-00000000-x-7"), "not a machine of this installation")
	require.Len(t, hv.Calls, calls, "libvirt not asked about a foreign name")
}

func TestGuestToolsCheck(t *testing.T) {
	cfg := &config.Config{}
	cfg.GuestTools.GitLabRunner = "none"
	c := guestToolsCheck(cfg)
	require.True(t, c.OK)
	require.True(t, c.Warn, "no binary for the guests: a warning with the fix")
	require.Contains(t, c.Fix, "[guest_tools] gitlab_runner")

	cfg.GuestTools.GitLabRunner = "/bin/true" // an x86_64 ELF executable stands in for gitlab-runner
	c = guestToolsCheck(cfg)
	require.True(t, c.OK)
	require.False(t, c.Warn)
	require.Contains(t, c.Info, "/bin/true")

	script := filepath.Join(t.TempDir(), "gitlab-runner")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\n"), 0o755))
	cfg.GuestTools.GitLabRunner = script
	c = guestToolsCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "linux/amd64")
}

func TestStepRunnerCheck(t *testing.T) {
	cfg := &config.Config{}
	cfg.GuestTools.StepRunner = "none"
	c := stepRunnerCheck(cfg)
	require.True(t, c.OK)
	require.False(t, c.Warn, `"none" is the admin's choice`)
	require.Contains(t, c.Info, `guest_tools.step_runner = "none"`)

	t.Setenv("PATH", t.TempDir())
	cfg.GuestTools.StepRunner = "auto"
	c = stepRunnerCheck(cfg)
	require.True(t, c.OK)
	require.False(t, c.Warn, "steps are optional: no warning")
	require.Contains(t, c.Info, `no step-runner on this host's PATH (guest_tools.step_runner = "auto")`)
	require.NotContains(t, c.Info, "gitlab-runner", "the message names the program it is about")
	require.Contains(t, c.Info, "[guest_tools] step_runner")

	cfg.GuestTools.StepRunner = "/bin/true" // an x86_64 ELF executable stands in for step-runner
	c = stepRunnerCheck(cfg)
	require.True(t, c.OK)
	require.Contains(t, c.Info, "step-runner /bin/true goes read-only into every VM")

	script := filepath.Join(t.TempDir(), "step-runner")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\n"), 0o755))
	cfg.GuestTools.StepRunner = script
	c = stepRunnerCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "linux/amd64 step-runner")
}

func TestAgentCheck(t *testing.T) {
	cfg := &config.Config{}
	cfg.GuestTools.Agent = "none"
	c := agentCheck(cfg)
	require.True(t, c.OK)
	require.False(t, c.Warn, `"none" is the admin's choice`)
	require.Contains(t, c.Info, `guest_tools.agent = "none"`)

	// The test binary's directory has no lve-agent beside it.
	cfg.GuestTools.Agent = "auto"
	c = agentCheck(cfg)
	require.True(t, c.OK)
	require.True(t, c.Warn, "no agent: every stage is slower")
	require.Contains(t, c.Info, "no lve-agent installed with these executables")
	require.Contains(t, c.Fix, "/usr/lib/libvirt-executor/lve-agent")

	cfg.GuestTools.Agent = agenttest.BuildT(t)
	c = agentCheck(cfg)
	require.True(t, c.OK, c.Info)
	require.Contains(t, c.Info, "the stages run through it")

	// A dynamically linked program cannot be the agent (a guest may lack
	// its libraries).
	cfg.GuestTools.Agent = "/bin/true"
	c = agentCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "dynamically linked")
}

// doctor asks the metrics endpoint: this service's metrics, another
// program's answer, nobody listening.
func TestMetricsCheck(t *testing.T) {
	body := "# TYPE libvirt_executor_build_info gauge\nlibvirt_executor_build_info{version=\"x\"} 1\n"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		_, _ = io.WriteString(w, body)
	}))
	defer srv.Close()
	listen := strings.TrimPrefix(srv.URL, "http://")
	c := metricsCheck(context.Background(), listen)
	require.True(t, c.OK, c.Info)
	body = "something else\n"
	c = metricsCheck(context.Background(), listen)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "not with this service's metrics")
	srv.Close()
	c = metricsCheck(context.Background(), listen)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "does not answer")
	c = metricsCheck(context.Background(), "off")
	require.True(t, c.OK && c.Warn)
	require.Equal(t, "http://127.0.0.1:9451/metrics", MetricsURL("0.0.0.0:9451"))
	require.Equal(t, "http://127.0.0.1:9451/metrics", MetricsURL(":9451"))
	require.Equal(t, "http://[::1]:9451/metrics", MetricsURL("[::1]:9451"))
}

// TestListReportsGarmOrphans: a garm instance whose pool garm has not
// named for garm.orphan_after is listed as an orphan (text and JSON), one
// of a pool garm still names is not; neither is removed for it.
func TestListReportsGarmOrphans(t *testing.T) {
	cfg := testConfig(t, "[garm]\norphan_after = \"30m\"\nmax_age = \"24h\"\n")
	hv := vmtest.New()
	m := open(t, cfg, hv)
	p := "lve-" + m.Manager().Controller[:8] + "-garm-"
	const ctrl, live, gone = "11111111-2222-3333-4444-555555555555", "aaaaaaaa-0000-0000-0000-000000000001", "bbbbbbbb-0000-0000-0000-000000000002"
	now := time.Now()
	for name, pool := range map[string]string{"live": live, "gone": gone} {
		x, err := vm.MarshalOwner(vm.Owner{Controller: m.Manager().Controller, Frontend: garm.Frontend, Job: "garm-" + name,
			Created: now.Add(-2 * time.Hour), Deadline: now.Add(22 * time.Hour),
			Tags: []vm.Tag{{Key: garm.TagController, Value: ctrl}, {Key: garm.TagPool, Value: pool}}})
		require.NoError(t, err)
		hv.Domains[p+name] = &vmtest.Domain{OwnerXML: x, Active: true}
	}
	require.NoError(t, garm.MarkPoolSeen(cfg.StateDir, ctrl, live, now.Add(-time.Minute)))

	var out bytes.Buffer
	require.NoError(t, List(context.Background(), &out, m, now))
	var goneLine, liveLine string
	for _, l := range strings.Split(out.String(), "\n") {
		switch {
		case strings.HasPrefix(l, p+"gone"):
			goneLine = l
		case strings.HasPrefix(l, p+"live"):
			liveLine = l
		}
	}
	require.Contains(t, goneLine, "ORPHAN: garm (controller "+ctrl+") has not named pool "+gone+" for 2h0m0s")
	require.NotContains(t, liveLine, "ORPHAN")

	out.Reset()
	require.NoError(t, ListJSON(context.Background(), &out, m, now))
	var items []ListItem
	require.NoError(t, json.Unmarshal(out.Bytes(), &items))
	orphans := map[string]string{}
	for _, it := range items {
		orphans[it.Name] = it.Orphan
	}
	require.Contains(t, orphans[p+"gone"], "has not named pool")
	require.Empty(t, orphans[p+"live"])

	out.Reset()
	require.NoError(t, GC(context.Background(), &out, m, false))
	require.Contains(t, hv.Domains, p+"gone", "an orphan stays until garm.max_age")
}

func TestDHCPRangeCheck(t *testing.T) {
	_, sub, _ := net.ParseCIDR("10.0.0.0/24")
	c := dhcpRangeCheck("ci", vm.DHCPInfo{Enabled: true, Subnet: sub, Ranges: [][2]net.IP{{net.ParseIP("10.0.0.10"), net.ParseIP("10.0.0.250")}}})
	require.True(t, c.OK)
	require.True(t, c.Warn)
	require.Contains(t, c.Info, "10.0.0.10-10.0.0.250")
	require.Contains(t, c.Fix, "virsh net-edit ci")
	c = dhcpRangeCheck("ci", vm.DHCPInfo{Enabled: true, Subnet: sub, Hosts: []vm.DHCPHost{{}}})
	require.True(t, c.OK)
	require.False(t, c.Warn)
	require.Contains(t, c.Info, "one lease per VM")
}
