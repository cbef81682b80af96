//go:build e2e

// Package e2e runs GitLab-shaped jobs through the four real executables, driven
// by the runner-faithful harness, against real libvirtd + QEMU guests in the
// private rig (deploy/rig). Run with `make test-e2e` (root).
//
// Job scripts run as the runner runs them, with errexit and pipefail: a
// check in a guest never pipes into a reader that may leave early (`grep
// -q`, `head`), whose leaving fails the writer and so the pipeline; read
// the whole output first (CI failed once on `dmesg | grep -q`). What a test
// must do mid-stage it does while the guest waits for it (a file the test
// makes), not while the guest sleeps.
package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

type rig struct {
	cfg     *config.Config
	cfgPath string
	bin     string
	conn    *libvirt.Connect
	// user, in the confined mode (LVE_E2E_RUNNER_USER), is the runner's
	// user the driver runs as, and root the rig as it is (rootOnly).
	user *testUser
	root *rig
}

// setup finds the rig. Without it the tests skip, saying what is missing,
// unless LVE_E2E_REQUIRED is set (make test-e2e, CI), where that is a failure.
func setup(t *testing.T) *rig {
	t.Helper()
	figures.begin(t) // first: its cleanup runs after the leftover check's
	missing := func(what string) {
		if os.Getenv("LVE_E2E_REQUIRED") != "" {
			t.Fatalf("end-to-end prerequisites missing: %s", what)
		}
		t.Skipf("skipping end-to-end test: %s (run `make test-e2e` as root)", what)
	}
	cfgPath, bin := os.Getenv("LVE_E2E_CONFIG"), os.Getenv("LVE_E2E_BIN")
	if cfgPath == "" || bin == "" {
		missing("LVE_E2E_CONFIG and LVE_E2E_BIN are not set")
	}
	cfg, err := config.Load(cfgPath)
	if err != nil {
		missing(err.Error())
	}
	conn, err := libvirt.NewConnect(cfg.LibvirtURI)
	if err != nil {
		missing("libvirt: " + err.Error())
	}
	t.Cleanup(func() { _, _ = conn.Close() })
	r := &rig{cfg: cfg, cfgPath: cfgPath, bin: bin, conn: conn}
	r.confine(t)
	r.requireNoLeftovers(t, "before the test")
	t.Cleanup(func() { r.requireNoLeftovers(t, "after the test") })
	return r
}

func (r *rig) exe(stage string) string { return filepath.Join(r.bin, "libvirt-executor-"+stage) }

func (r *rig) executables() harness.Executables {
	args := []string{"--config", r.cfgPath}
	return harness.Executables{
		Config: r.exe("config"), Prepare: r.exe("prepare"), Run: r.exe("run"), Cleanup: r.exe("cleanup"),
		ConfigArgs: args, PrepareArgs: args, RunArgs: args, CleanupArgs: args,
	}
}

// logWriter keeps the job log: the harness writes it from its goroutines
// while a test reads buf (String is locked too); options prints it to the
// test log when the test failed.
type logWriter struct {
	buf sshtest.Buffer
}

func (w *logWriter) Write(p []byte) (int, error) { return w.buf.Write(p) }

func (r *rig) options(t *testing.T) (harness.Options, *logWriter) {
	lw := &logWriter{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("job log:\n%s", lw.buf.String())
		}
	})
	return harness.Options{
		Exec:              r.executables(),
		BuildExitCodeFile: true,
		GracefulKill:      30 * time.Second,
		ForceKill:         5 * time.Second,
		RetryPause:        time.Second,
		StageTimeouts:     harness.StageTimeouts{Prepare: 5 * time.Minute, Cleanup: 2 * time.Minute},
		Log:               lw,
		DebugLog:          io.Discard,
		RunAs:             r.cred(),
	}, lw
}

// requireNoLeftovers asserts that nothing with the project prefix remains:
// no domain, no volume, no state directory or key file. Each leftover is
// counted in the suite's figures.
//
// Cleanup leaves the slow part of a removal (QEMU's exit, undefine,
// volumes) to a detached reaper: what is left is looked at again until
// reaperWait has passed. A connection holder or reaper process of this
// rig's machines still running then is a leftover too.
func (r *rig) requireNoLeftovers(t *testing.T, when string) {
	t.Helper()
	deadline := time.Now().Add(reaperWait)
	left := append(r.leftovers(t), r.strayProcesses()...)
	for len(left) > 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		left = append(r.leftovers(t), r.strayProcesses()...)
	}
	figures.addLeaks(len(left))
	if len(left) > 0 {
		// Counted and failed; removed so that the tests after this one
		// start clean (one leak is one failure, not the suite's).
		t.Cleanup(func() { r.clearLeftovers(t, left) })
	}
	require.Empty(t, left, "%s: leftovers", when)
}

// clearLeftovers removes what requireNoLeftovers found: the machines
// through the admin tool's rm (which proves ownership and stops their
// holders), then the helper processes of this rig that are still there,
// by their PIDs (the tests started them).
func (r *rig) clearLeftovers(t *testing.T, left []string) {
	names := map[string]bool{}
	var pids []int
	for _, l := range left {
		kind, rest, _ := strings.Cut(l, " ")
		switch kind {
		case "domain", "state":
			names[rest] = true
		case "volume":
			if m, ok := lifecycle.MachineOfVolume(rest); ok {
				names[m] = true
			}
		case "process":
			pid, what, _ := strings.Cut(rest, " ")
			if n, err := strconv.Atoi(pid); err == nil {
				pids = append(pids, n)
			}
			if f := strings.Fields(strings.Trim(what, "()")); len(f) == 2 {
				names[f[1]] = true
			}
		}
	}
	var args []string
	for n := range names {
		args = append(args, n)
	}
	if len(args) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := r.adminContext(ctx, append([]string{"rm"}, args...)...)
		out, err := cmd.CombinedOutput()
		t.Logf("removing the leftovers %v: %v\n%s", args, err, out)
	}
	// Only those whose command line still names this rig's machines.
	still := map[int]bool{}
	for _, l := range r.strayProcesses() {
		f := strings.Fields(l)
		if n, err := strconv.Atoi(f[1]); err == nil {
			still[n] = true
		}
	}
	for _, pid := range pids {
		if p, err := os.FindProcess(pid); err == nil && still[pid] {
			_ = p.Kill()
		}
	}
}

// reaperWait bounds how long a reaper may take to remove a machine after
// its cleanup returned (a destroy takes 1-2 s on these machines; more
// under load).
const reaperWait = 60 * time.Second

// strayProcesses lists connection holders and reapers of this rig's
// machines (by their command lines).
func (r *rig) strayProcesses() []string {
	return driverProcesses(r.cfg.NamePrefix + "-")
}

// driverProcesses lists the driver's helper processes (holders, reapers)
// whose command line names a machine starting with prefix.
func driverProcesses(prefix string) []string {
	var found []string
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) < 2 || (args[1] != jobvm.HolderCommand && args[1] != jobvm.ReaperCommand) {
			continue
		}
		for _, a := range args[2:] {
			if strings.HasPrefix(a, prefix) {
				found = append(found, fmt.Sprintf("process %s (%s %s)", filepath.Base(filepath.Dir(p)), args[1], a))
				break
			}
		}
	}
	return found
}

func (r *rig) leftovers(t *testing.T) []string {
	t.Helper()
	prefix := r.cfg.NamePrefix + "-"
	// A memory snapshot a test made and still records is its own, not a
	// leftover: the test removes it (makeSnapshot), and the check after
	// the test then finds none.
	snapshot := map[string]bool{}
	if recs, err := (state.Store{Dir: r.cfg.StateDir}).Snapshots(); err == nil {
		for _, rec := range recs {
			snapshot[rec.Template] = true
		}
	}
	var left []string
	doms, err := r.conn.ListAllDomains(0)
	require.NoError(t, err)
	for _, d := range doms {
		name, _ := d.GetName()
		_ = d.Free()
		if strings.HasPrefix(name, prefix) && !snapshot[name] {
			left = append(left, "domain "+name)
		}
	}
	for _, v := range r.poolVolumes(t) {
		// The guest tools disk is shared by every job and kept (this
		// installation's, or the rig's when r is a test's own installation).
		m, _ := lifecycle.MachineOfVolume(v)
		if strings.HasPrefix(v, prefix) && !toolsVolumeRE.MatchString(strings.TrimPrefix(v, prefix)) && !snapshot[m] {
			left = append(left, "volume "+v)
		}
	}
	entries, _ := os.ReadDir(filepath.Join(r.cfg.StateDir, "machines"))
	for _, e := range entries {
		if !snapshot[e.Name()] {
			left = append(left, "state "+e.Name())
		}
	}
	// Stale network filter bindings are not counted here: a prepare killed
	// in the middle of its start leaves one under libvirt's polkit access
	// driver until the driver's next start or sweep removes it
	// (TestStaleFilterBindings); the rig's stop counts what is left then.
	return left
}

// staleBindings lists, as "binding DEV OWNER", the network filter bindings
// of the project's filters whose owner is one of this rig's machines and
// does not run: what libvirt leaves when it cannot release a stopped
// domain's interface, and the next VM given that tap name cannot start.
func (r *rig) staleBindings(t *testing.T) []string {
	t.Helper()
	prefix := r.cfg.NamePrefix + "-"
	bs, err := r.conn.ListAllNWFilterBindings(0)
	require.NoError(t, err)
	var left []string
	for i := range bs {
		x, err := bs[i].GetXMLDesc(0)
		_ = bs[i].Free()
		var b libvirtxml.NWFilterBinding
		if err != nil || b.Unmarshal(x) != nil || b.Owner == nil || b.PortDev == nil || b.FilterRef == nil {
			continue
		}
		if !strings.HasPrefix(b.Owner.Name, prefix) || !slices.Contains(vm.FilterNames, b.FilterRef.Filter) {
			continue
		}
		if _, active := r.domainState(b.Owner.Name); !active {
			left = append(left, "binding "+b.PortDev.Name+" "+b.Owner.Name)
		}
	}
	return left
}

// gateway is the host side of the rig network, where the guest reaches the
// test's git server.
func (r *rig) gateway(t *testing.T) string {
	t.Helper()
	n, err := r.conn.LookupNetworkByName(r.cfg.Network)
	require.NoError(t, err)
	defer n.Free()
	x, err := n.GetXMLDesc(0)
	require.NoError(t, err)
	var nx libvirtxml.Network
	require.NoError(t, nx.Unmarshal(x))
	require.NotEmpty(t, nx.IPs)
	return nx.IPs[0].Address
}

// serviceListener listens on the host side of the rig network on a port the
// rig's guard lets guests reach (LVE_RIG_SERVICE_PORTS, default 20000:20999).
func (r *rig) serviceListener(t *testing.T) net.Listener {
	t.Helper()
	lo, hi := 20000, 20999
	if v := os.Getenv("LVE_RIG_SERVICE_PORTS"); v != "" {
		_, _ = fmt.Sscanf(v, "%d:%d", &lo, &hi)
	}
	gw := r.gateway(t)
	for p := lo + rand.IntN(hi-lo+1); ; p = lo + rand.IntN(hi-lo+1) {
		ln, err := net.Listen("tcp", net.JoinHostPort(gw, fmt.Sprint(p)))
		if err == nil {
			return ln
		}
	}
}

// repo serves a fresh demo repository to the guests.
func (r *rig) repo(t *testing.T) (url, sha string) {
	t.Helper()
	bare, sha, err := harness.MakeDemoRepo(t.TempDir())
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ln := r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	url, stop, err := harness.ServeGit(ctx, bare, addr)
	require.NoError(t, err)
	t.Cleanup(func() { stop(); cancel() })
	return url, sha
}

// destroyJobDomain pulls the plug on the one job VM of the test.
func (r *rig) destroyJobDomain() error {
	doms, err := r.conn.ListAllDomains(libvirt.CONNECT_LIST_DOMAINS_ACTIVE)
	if err != nil {
		return err
	}
	var found []string
	for _, d := range doms {
		name, _ := d.GetName()
		if strings.HasPrefix(name, r.cfg.NamePrefix+"-") {
			found = append(found, name)
			if err := d.Destroy(); err != nil {
				return err
			}
		}
		_ = d.Free()
	}
	if len(found) != 1 {
		return fmt.Errorf("expected one running job domain, found %v", found)
	}
	return nil
}

func stageExit(t *testing.T, res *harness.Result, name string) harness.StageResult {
	t.Helper()
	st := res.Stage(name)
	require.NotEmpty(t, st, "stage %s ran; stages: %v", name, res.StageNames())
	return st[len(st)-1]
}

// controller is the installation id of the rig's state directory.
func (r *rig) controller(t *testing.T) string {
	t.Helper()
	st := state.Store{Dir: r.cfg.StateDir}
	if r.user != nil {
		// The runner's user's state directory: root only reads it (the
		// confined suite's setup made the id, as that user).
		id, err := st.ExistingControllerID()
		require.NoError(t, err)
		return id
	}
	id, err := st.ControllerID()
	require.NoError(t, err)
	return id
}

// poolVolumes lists the volumes of the rig's storage pool.
func (r *rig) poolVolumes(t *testing.T) []string {
	t.Helper()
	pool, err := r.conn.LookupStoragePoolByName(r.cfg.StoragePool)
	require.NoError(t, err)
	defer pool.Free()
	require.NoError(t, pool.Refresh(0))
	vols, err := pool.ListStorageVolumes()
	require.NoError(t, err)
	return vols
}

// toolsVolumeRE is the name of a guest tools volume after "<prefix>-"
// (guesttools.ToolsVolumeName), whatever the controller.
var toolsVolumeRE = regexp.MustCompile(`^[0-9a-f]{8}-tools-[0-9a-f]{16}\.iso$`)
