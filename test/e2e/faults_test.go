//go:build e2e

package e2e

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// withConfig returns a view of the rig whose configuration file is a copy
// of the rig's with edit applied to its text.
func (r *rig) withConfig(t *testing.T, edit func(string) string) *rig {
	t.Helper()
	b, err := os.ReadFile(r.cfgPath)
	require.NoError(t, err)
	path, mode := filepath.Join(t.TempDir(), "config.toml"), os.FileMode(0o600)
	if r.user != nil {
		// Where the runner's user reads it.
		path, mode = filepath.Join(readableDir(t), "config.toml"), 0o644
	}
	require.NoError(t, os.WriteFile(path, []byte(edit(string(b))), mode))
	cfg, err := config.Load(path)
	require.NoError(t, err)
	return &rig{cfg: cfg, cfgPath: path, bin: r.bin, conn: r.conn, user: r.user, root: r.root}
}

// setKey replaces (or adds, at the top level) "key = value".
func setKey(key, value string) func(string) string {
	return func(s string) string {
		re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(key) + ` = .*$`)
		if re.MatchString(s) {
			return re.ReplaceAllString(s, key+" = "+value)
		}
		return key + " = " + value + "\n" + s
	}
}

// running is a stage started in the background.
type running struct {
	cmd      *exec.Cmd
	out, err sshtest.Buffer
	done     chan struct{}
	res      stageResult
}

func (s *stageRunner) start(t *testing.T, stage string, args ...string) *running {
	t.Helper()
	rn := &running{done: make(chan struct{})}
	s.handOverArgs(t, args)
	rn.cmd = exec.Command(s.r.exe(stage), append([]string{"--config", s.r.cfgPath}, args...)...)
	rn.cmd.Dir, rn.cmd.Env = s.dir, s.env
	rn.cmd.Stdout, rn.cmd.Stderr = &rn.out, &rn.err
	rn.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	require.NoError(t, rn.cmd.Start())
	go func() {
		_ = rn.cmd.Wait()
		rn.res = stageResult{code: rn.cmd.ProcessState.ExitCode(), stdout: rn.out.String(), stderr: rn.err.String()}
		close(rn.done)
	}()
	return rn
}

func (rn *running) wait(t *testing.T, within time.Duration) stageResult {
	t.Helper()
	select {
	case <-rn.done:
		t.Logf("background stage exit %d\nstdout: %s\nstderr: %s", rn.res.code, rn.res.stdout, rn.res.stderr)
		return rn.res
	case <-time.After(within):
		_ = syscall.Kill(-rn.cmd.Process.Pid, syscall.SIGKILL)
		<-rn.done
		t.Fatalf("stage still running after %s", within)
		return stageResult{}
	}
}

// ended reports whether the process has exited.
func (rn *running) ended() bool {
	select {
	case <-rn.done:
		return true
	default:
		return false
	}
}

// waitFor is waitFor (two minutes) for what the running stage itself
// brings about: a stage that ends first fails the test at once, with its
// output.
func (rn *running) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	waitFor(t, 2*time.Minute, what, func() bool {
		if cond() {
			return true
		}
		if rn.ended() {
			t.Fatalf("the stage ended (exit %d) before %s\nstdout: %s\nstderr: %s", rn.res.code, what, rn.res.stdout, rn.res.stderr)
		}
		return false
	})
}

func (rn *running) signal(sig syscall.Signal) { _ = syscall.Kill(-rn.cmd.Process.Pid, sig) }

// catches reports whether the process has a handler for sig installed
// (SigCgt in /proc/PID/status): a runner's SIGTERM comes long after start-up.
func (rn *running) catches(sig syscall.Signal) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", rn.cmd.Process.Pid))
	if err != nil {
		return false
	}
	m := regexp.MustCompile(`(?m)^SigCgt:\s*([0-9a-f]+)$`).FindSubmatch(b)
	if m == nil {
		return false
	}
	var mask uint64
	_, _ = fmt.Sscanf(string(m[1]), "%x", &mask)
	return mask&(1<<(uint(sig)-1)) != 0
}

// pending reports whether sig is still pending for the process (SigPnd or
// ShdPnd in /proc/PID/status): once it is not, a thread took it, with the
// handler the process installed (catches).
func (rn *running) pending(sig syscall.Signal) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", rn.cmd.Process.Pid))
	if err != nil {
		return false // gone
	}
	for _, m := range regexp.MustCompile(`(?m)^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$`).FindAllSubmatch(b, -1) {
		var mask uint64
		_, _ = fmt.Sscanf(string(m[1]), "%x", &mask)
		if mask&(1<<(uint(sig)-1)) != 0 {
			return true
		}
	}
	return false
}

// openWatch counts the opens of one file (inotify IN_OPEN) from its start.
type openWatch struct {
	fd int
	n  int
}

func watchOpens(t *testing.T, path string) *openWatch {
	t.Helper()
	fd, err := syscall.InotifyInit1(syscall.IN_CLOEXEC | syscall.IN_NONBLOCK)
	require.NoError(t, err)
	t.Cleanup(func() { _ = syscall.Close(fd) })
	_, err = syscall.InotifyAddWatch(fd, path, syscall.IN_OPEN)
	require.NoError(t, err, "watch %s", path)
	return &openWatch{fd: fd}
}

// count is the number of opens so far.
func (w *openWatch) count(t *testing.T) int {
	t.Helper()
	buf := make([]byte, 64*(syscall.SizeofInotifyEvent+syscall.NAME_MAX+1))
	for {
		n, err := syscall.Read(w.fd, buf)
		if errors.Is(err, syscall.EAGAIN) || n <= 0 {
			return w.n
		}
		require.NoError(t, err)
		for off := 0; off+syscall.SizeofInotifyEvent <= n; {
			mask := binary.NativeEndian.Uint32(buf[off+4:])
			nameLen := binary.NativeEndian.Uint32(buf[off+12:])
			if mask&syscall.IN_OPEN != 0 {
				w.n++
			}
			off += syscall.SizeofInotifyEvent + int(nameLen)
		}
	}
}

// ownerDeadline is the deadline in the ownership record of the domain name
// (when a sweep may remove it).
func (r *rig) ownerDeadline(t *testing.T, name string) time.Time {
	t.Helper()
	d, err := r.conn.LookupDomainByName(name)
	require.NoError(t, err)
	defer d.Free()
	x, err := d.GetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, vm.OwnerNamespace, libvirt.DOMAIN_AFFECT_CONFIG)
	require.NoError(t, err, "the ownership record of %s", name)
	o, err := vm.ParseOwner(x)
	require.NoError(t, err)
	require.False(t, o.Deadline.IsZero(), "%s has a deadline", name)
	return o.Deadline
}

func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", within, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *rig) domainState(name string) (exists, active bool) {
	d, err := r.conn.LookupDomainByName(name)
	if err != nil {
		return false, false
	}
	defer d.Free()
	active, _ = d.IsActive()
	return true, active
}

func (r *rig) volumeExists(name string) bool {
	p, err := r.conn.LookupStoragePoolByName(r.cfg.StoragePool)
	if err != nil {
		return false
	}
	defer p.Free()
	_ = p.Refresh(0)
	v, err := p.LookupStorageVolByName(name)
	if err != nil {
		return false
	}
	_ = v.Free()
	return true
}

// volumeAllocated is how many bytes of the volume are allocated (a sparse
// volume's written part), 0 when there is no such volume.
func (r *rig) volumeAllocated(name string) uint64 {
	p, err := r.conn.LookupStoragePoolByName(r.cfg.StoragePool)
	if err != nil {
		return 0
	}
	defer p.Free()
	v, err := p.LookupStorageVolByName(name)
	if err != nil {
		return 0
	}
	defer v.Free()
	info, err := v.GetInfo()
	if err != nil {
		return 0
	}
	return info.Allocation
}

// TestFaultSIGKILLPrepare kills prepare (uncatchable) at three points. The
// runner then runs cleanup; when the runner died too, the sweep removes
// everything once the ownership deadline has passed.
func TestFaultSIGKILLPrepare(t *testing.T) {
	base := setup(t)
	// A short deadline (job timeout 1 s + 1 s slack) so the sweep path can be
	// exercised without waiting an hour.
	r := base.withConfig(t, func(s string) string {
		return strings.Replace(s, "[timeouts]", "[timeouts]\njob_slack = \"1s\"", 1)
	})
	for _, tc := range []struct {
		point    string
		reached  func(s *stageRunner, name string) bool
		byRunner bool // cleanup by the runner, else by the sweep
	}{
		{"after the volume exists", func(s *stageRunner, n string) bool { return r.volumeExists(n + ".qcow2") }, true},
		{"after define", func(s *stageRunner, n string) bool { e, _ := r.domainState(n); return e }, false},
		{"during the boot wait", func(s *stageRunner, n string) bool { _, a := r.domainState(n); return a }, true},
		{"during the boot wait, runner gone too", func(s *stageRunner, n string) bool { _, a := r.domainState(n); return a }, false},
	} {
		t.Run(tc.point, func(t *testing.T) {
			s := newStageRunner(t, r)
			s.timeout = 1
			require.Equal(t, 0, s.run(t, "config").code)
			name := s.name(t)
			rn := s.start(t, "prepare")
			rn.waitFor(t, tc.point, func() bool { return tc.reached(s, name) })
			rn.signal(syscall.SIGKILL)
			rn.wait(t, 10*time.Second)
			figures.fault()
			if tc.byRunner {
				res := s.run(t, "cleanup")
				figures.class(res.code, 0)
				require.Equal(t, 0, res.code)
			} else {
				// gc removes the machine once the deadline in its
				// ownership record has passed (job timeout 1 s + 1 s).
				deadline := r.ownerDeadline(t, name)
				waitFor(t, 30*time.Second, "the machine's deadline ("+deadline.Format(time.RFC3339Nano)+") passed",
					func() bool { return time.Now().After(deadline) })
				out, err := r.admin("gc").CombinedOutput()
				t.Logf("gc: %s", out)
				require.NoError(t, err)
			}
			r.requireNoLeftovers(t, "after the fault")
			// A kill in the middle of the start leaves libvirt's filter
			// binding of the machine (released as the dead client): the
			// machine's removal takes it too.
			for _, b := range r.staleBindings(t) {
				require.NotContains(t, b, " "+name, "a stale filter binding of the killed prepare's machine")
			}
		})
	}
}

// TestFaultSIGTERM sends SIGTERM to prepare during the boot wait and to
// cleanup right after it starts.
func TestFaultSIGTERM(t *testing.T) {
	r := setup(t)
	t.Run("prepare", func(t *testing.T) {
		s := newStageRunner(t, r)
		require.Equal(t, 0, s.run(t, "config").code)
		name := s.name(t)
		rn := s.start(t, "prepare")
		rn.waitFor(t, "domain running", func() bool { _, a := r.domainState(name); return a })
		t0 := time.Now()
		rn.signal(syscall.SIGTERM)
		res := rn.wait(t, 60*time.Second)
		figures.fault()
		figures.class(res.code, 2)
		require.Equal(t, 2, res.code, "SYSTEM_FAILURE")
		require.Less(t, time.Since(t0), 30*time.Second, "prompt")
		// Prepare undid its own work before exiting: nothing left even
		// before the runner's cleanup.
		r.requireNoLeftovers(t, "after the fault")
		require.Equal(t, 0, s.run(t, "cleanup").code)
	})
	// SIGTERM after SSH answered, while prepare takes its last look at the
	// guest: the attempt is still undone, never reported as ready.
	t.Run("prepare after SSH ready", func(t *testing.T) {
		// A state directory of its own: the guest tool check, the step
		// after SSH answers, is remembered per image in the state directory
		// and would otherwise be skipped.
		stateDir := r.userDir(t)
		r := r.withConfig(t, setKey("state_dir", fmt.Sprintf("%q", stateDir)))
		// Another installation (controller id): its own tools volume, not kept.
		t.Cleanup(func() { r.removeToolsVolumes(t, stateDir) })
		s := newStageRunner(t, r)
		require.Equal(t, 0, s.run(t, "config").code)
		rn := s.start(t, "prepare")
		rn.waitFor(t, "SSH ready", func() bool { return strings.Contains(rn.out.String(), "SSH ready") })
		rn.signal(syscall.SIGTERM)
		res := rn.wait(t, 60*time.Second)
		figures.fault()
		figures.class(res.code, 2)
		require.Equal(t, 2, res.code, "SYSTEM_FAILURE")
		// Aimed at the guest tool check (~0.3 s under TCG, far less on
		// KVM): a SIGTERM that lands after it still fails the job and
		// leaves nothing, which is the guarantee.
		if strings.Contains(res.stdout, "Machine ready") {
			t.Logf("the SIGTERM landed after the machine was ready (the aim at the tool check missed); prepare still exited 2")
		}
		r.requireNoLeftovers(t, "after the fault")
		require.Equal(t, 0, s.run(t, "cleanup").code)
	})
	t.Run("cleanup", func(t *testing.T) {
		s := newStageRunner(t, r)
		require.Equal(t, 0, s.run(t, "config").code)
		require.Equal(t, 0, s.run(t, "prepare").code)
		// Cleanup takes tens of milliseconds now (the reaper finishes the
		// removal). The test holds the machine's lock, so cleanup waits for
		// it mid-work when the signal comes; then lets it go.
		name := s.name(t)
		unlock, err := state.Store{Dir: r.cfg.StateDir}.TryLock(name)
		require.NoError(t, err)
		// (The confined mode: the lock file stays the stages' user's.)
		r.handOver(t, filepath.Join(r.cfg.StateDir, "locks", name+".lock"))
		// Cleanup tries the lock every 50 ms, opening its file each time:
		// a second open means the first found it taken and cleanup waits.
		opens := watchOpens(t, filepath.Join(r.cfg.StateDir, "locks", name+".lock"))
		rn := s.start(t, "cleanup")
		waitFor(t, 10*time.Second, "cleanup to catch SIGTERM", func() bool { return rn.catches(syscall.SIGTERM) })
		waitFor(t, time.Minute, "cleanup waiting for the machine's lock (its second try)", func() bool { return opens.count(t) >= 2 || rn.ended() })
		require.False(t, rn.ended(), "cleanup waits for the machine's lock")
		rn.signal(syscall.SIGTERM)
		waitFor(t, 10*time.Second, "SIGTERM delivered to cleanup (no longer pending)", func() bool { return !rn.pending(syscall.SIGTERM) })
		unlock()
		res := rn.wait(t, 60*time.Second)
		figures.fault()
		figures.class(res.code, 0)
		require.Equal(t, 0, res.code, "cleanup finishes on its own deadline")
		r.requireNoLeftovers(t, "after the fault")
	})
}

// TestFaultLinkDown cuts the guest's network link during build_script with
// the default keepalive settings, and measures how long run takes to notice.
func TestFaultLinkDown(t *testing.T) {
	base := setup(t)
	r := base.withConfig(t, func(s string) string {
		s = regexp.MustCompile(`(?m)^keepalive_(interval|count) = .*$`).ReplaceAllString(s, "")
		return s
	})
	require.Equal(t, 3*time.Second, r.cfg.SSH.KeepaliveInterval.D(), "default keepalive")
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	name := s.name(t)
	path := filepath.Join(s.dir, "script.")
	require.NoError(t, os.WriteFile(path, []byte("#!/usr/bin/env bash\necho started\nsleep 600\n"), 0o700))
	rn := s.start(t, "run", path, "build_script")
	waitFor(t, 30*time.Second, "script started", func() bool { return strings.Contains(rn.out.String(), "started") })
	d, err := r.conn.LookupDomainByName(name)
	require.NoError(t, err)
	x, err := d.GetXMLDesc(0)
	require.NoError(t, err)
	iface := regexp.MustCompile(`(?s)<interface type=.network.>.*?</interface>`).FindString(x)
	require.NotEmpty(t, iface)
	down := strings.Replace(iface, "</interface>", "<link state='down'/></interface>", 1)
	t0 := time.Now()
	require.NoError(t, d.UpdateDeviceFlags(down, libvirt.DOMAIN_DEVICE_MODIFY_LIVE))
	_ = d.Free()
	res := rn.wait(t, 60*time.Second)
	latency := time.Since(t0)
	figures.fault()
	figures.class(res.code, 2)
	figures.detected(latency)
	require.Equal(t, 2, res.code, "a cut-off guest is a system failure")
	require.Contains(t, res.stderr, "keepalive")
	require.Less(t, latency, 15*time.Second)
	t.Logf("link down noticed after %s", latency)
	require.Equal(t, 0, s.run(t, "cleanup").code)
}

// TestFaultVMDestroyedLatency destroys the VM during build_script with the
// default keepalive settings.
func TestFaultVMDestroyedLatency(t *testing.T) {
	base := setup(t)
	r := base.withConfig(t, func(s string) string {
		return regexp.MustCompile(`(?m)^keepalive_(interval|count) = .*$`).ReplaceAllString(s, "")
	})
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	path := filepath.Join(s.dir, "script.")
	require.NoError(t, os.WriteFile(path, []byte("#!/usr/bin/env bash\necho started\nsleep 600\n"), 0o700))
	rn := s.start(t, "run", path, "build_script")
	waitFor(t, 30*time.Second, "script started", func() bool { return strings.Contains(rn.out.String(), "started") })
	t0 := time.Now()
	require.NoError(t, r.destroyJobDomain())
	res := rn.wait(t, 60*time.Second)
	latency := time.Since(t0)
	figures.fault()
	figures.class(res.code, 2)
	figures.detected(latency)
	require.Equal(t, 2, res.code)
	require.Less(t, latency, 15*time.Second)
	require.Equal(t, 0, s.run(t, "cleanup").code)
}

// rigLibvirtdPID is the rig's libvirtd (from its pidfile).
func rigLibvirtdPID(t *testing.T) int {
	t.Helper()
	run := os.Getenv("LVE_RIG_RUN")
	if run == "" {
		run = "/var/lib/libvirt-executor-rig/run"
	}
	b, err := os.ReadFile(filepath.Join(run, "libvirtd.pid"))
	require.NoError(t, err, "the rig's libvirtd pidfile")
	var pid int
	_, err = fmt.Sscan(string(b), &pid)
	require.NoError(t, err)
	return pid
}

// restartLibvirtd stops the rig's libvirtd and starts a new one in the same
// network namespace (this test process runs inside it).
func restartLibvirtd(t *testing.T) {
	t.Helper()
	run := os.Getenv("LVE_RIG_RUN")
	if run == "" {
		run = "/var/lib/libvirt-executor-rig/run"
	}
	pidfile := filepath.Join(run, "libvirtd.pid")
	b, err := os.ReadFile(pidfile)
	require.NoError(t, err, "the rig's libvirtd pidfile")
	var pid int
	_, err = fmt.Sscan(string(b), &pid)
	require.NoError(t, err)
	comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	require.Equal(t, "libvirtd", strings.TrimSpace(string(comm)), "only the rig's own libvirtd is restarted")
	// Start it again exactly as the rig did (its own libvirtd.conf, pidfile),
	// in a mount namespace of its own that sees the rig's hooks directory
	// in place of /etc/libvirt/hooks, as deploy/rig/start.sh arranges.
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	require.NoError(t, err)
	argv := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
	// The D-Bus of the rig's polkit access driver (LVE_RIG_ACCESS=polkit): a
	// libvirtd that cannot reach polkitd refuses every call, root's too.
	env := append(os.Environ(), "LIBVIRT_LOG_OUTPUTS=3:file:"+filepath.Join(run, "libvirtd.log"))
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	require.NoError(t, err)
	for _, kv := range strings.Split(string(environ), "\x00") {
		if strings.HasPrefix(kv, "DBUS_SYSTEM_BUS_ADDRESS=") {
			env = append(env, kv)
		}
	}
	require.NoError(t, syscall.Kill(pid, syscall.SIGTERM))
	waitFor(t, 30*time.Second, "libvirtd to exit", func() bool { return syscall.Kill(pid, 0) != nil })
	wrapper := []string{"unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount --bind "$1" /etc/libvirt/hooks && shift && exec "$@"`, "sh", filepath.Join(run, "hooks")}
	cmd := exec.Command(wrapper[0], append(wrapper[1:], argv...)...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	waitFor(t, 60*time.Second, "libvirtd to answer", func() bool {
		c, err := libvirt.NewConnect("qemu:///system")
		if err != nil {
			return false
		}
		_, _ = c.Close()
		return true
	})
	// The new daemon sees the rig's network hook, as the old one did.
	b, err = os.ReadFile(pidfile)
	require.NoError(t, err)
	_, err = fmt.Sscan(string(b), &pid)
	require.NoError(t, err)
	require.FileExists(t, fmt.Sprintf("/proc/%d/root/etc/libvirt/hooks/network.d/50-libvirt-executor-guard", pid))
}

// reconnect replaces the libvirt connection of r and of the rigs it was
// made from (after restartLibvirtd).
func (r *rig) reconnect(t *testing.T, bases ...*rig) {
	t.Helper()
	c, err := libvirt.NewConnect(r.cfg.LibvirtURI)
	require.NoError(t, err)
	// Not closed by a cleanup of t's: setup's leftover check, which runs
	// after it, still uses it.
	_, _ = r.conn.Close()
	r.conn = c
	for _, b := range bases {
		b.conn = c
	}
}

// TestFaultLibvirtdRestart restarts libvirtd in the middle of prepare (which
// polls libvirt for the address) and in the middle of run.
func TestFaultLibvirtdRestart(t *testing.T) {
	if os.Getenv("LVE_E2E_ALLOW_LIBVIRTD_RESTART") == "" {
		t.Skip("restarts the shared libvirtd: set LVE_E2E_ALLOW_LIBVIRTD_RESTART=1 (make test-e2e does)")
	}
	r := setup(t)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	name := s.name(t)
	rn := s.start(t, "prepare")
	rn.waitFor(t, "domain running", func() bool { _, a := r.domainState(name); return a })
	restartLibvirtd(t)
	// The test's own connection broke too.
	c, err := libvirt.NewConnect(r.cfg.LibvirtURI)
	require.NoError(t, err)
	r.conn = c
	res := rn.wait(t, 3*time.Minute)
	figures.fault()
	figures.class(res.code, 0)
	require.Equal(t, 0, res.code, "prepare reconnects and carries on")

	path := filepath.Join(s.dir, "script.")
	require.NoError(t, os.WriteFile(path, []byte("#!/usr/bin/env bash\necho started\nsleep 4\necho survived\n"), 0o700))
	rn = s.start(t, "run", path, "build_script")
	waitFor(t, 30*time.Second, "script started", func() bool { return strings.Contains(rn.out.String(), "started") })
	restartLibvirtd(t)
	c2, err := libvirt.NewConnect(r.cfg.LibvirtURI)
	require.NoError(t, err)
	_, _ = r.conn.Close()
	r.conn = c2
	res = rn.wait(t, time.Minute)
	figures.fault()
	figures.class(res.code, 0)
	require.Equal(t, 0, res.code, "run does not depend on libvirtd")
	require.Contains(t, res.stdout, "survived")

	// After the restarts the guest still opens new connections from its
	// address: its network filter carries the address (what the filter had
	// only learnt, libvirt forgets with the restart).
	ln := r.serviceListener(t)
	defer ln.Close()
	go acceptAndClose(ln)
	hp := ln.Addr().(*net.TCPAddr)
	res = s.runScript(t, "build_script", "#!/usr/bin/env bash\n"+tcpProbe+fmt.Sprintf("probe %s %d host\n", hp.IP, hp.Port))
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "host=REACHED", "the guest's network works after libvirtd's restart")
	require.Equal(t, 0, s.run(t, "cleanup").code)
	r.requireNoLeftovers(t, "after the fault")
}

// TestFaultPoolFull clones into a storage pool with no room: prepare fails as
// a system failure and leaves nothing.
func TestFaultPoolFull(t *testing.T) {
	r := setup(t).smallPool(t, "64k", true)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	res := s.run(t, "prepare")
	figures.fault()
	figures.class(res.code, 2)
	require.Equal(t, 2, res.code, "a full pool is the infrastructure's failure")
	require.Regexp(t, `(?i)space|quota|disk full`, res.stderr, "failed for want of space")
	require.Equal(t, 0, s.run(t, "cleanup").code)
	r.requireNoLeftovers(t, "after the fault")
}

// TestFaultDiskFullDuringRun fills the storage under a running job: QEMU
// pauses the guest when its disk write fails, the job's connection goes
// quiet, and run reports a system failure that says why.
func TestFaultDiskFullDuringRun(t *testing.T) {
	r := setup(t).smallPool(t, "16m", false)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	t0 := time.Now()
	res := s.runScript(t, "build_script", "dd if=/dev/zero of=/lve-big bs=1M count=64 2>&1; sync; echo dd-finished")
	figures.fault()
	figures.class(res.code, 2)
	require.Equal(t, 2, res.code, "the host's storage is full: system failure, not the job's")
	require.NotContains(t, res.stdout, "dd-finished")
	require.Contains(t, res.stderr, "paused by QEMU after a disk write failed")
	require.Contains(t, res.stderr, "storage pool lve-e2e-small is probably full")
	t.Logf("run noticed the paused guest after %s", time.Since(t0).Round(time.Millisecond))
	require.Equal(t, 0, s.run(t, "cleanup").code)
	r.requireNoLeftovers(t, "after the fault")
}

// smallPool is the rig with a transient storage pool "lve-e2e-small" on a
// tmpfs of the given size (optionally filled up at once), removed after
// the test.
func (base *rig) smallPool(t *testing.T, size string, fill bool) *rig {
	t.Helper()
	// Not under t.TempDir(): its 0700 parent would keep QEMU (an unprivileged
	// user) out, and the test must fail for want of space, nothing else.
	dir, err := os.MkdirTemp("/var/lib", "lve-e2e-smallpool-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.Remove(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	// `ip netns exec` gives every process its own mount namespace: mount the
	// small filesystem where libvirtd sees it, and fill it through
	// /proc/PID/root, which resolves paths in libvirtd's namespace.
	pid := rigLibvirtdPID(t)
	ns := func(args ...string) {
		out, err := exec.Command("nsenter", append([]string{"-t", fmt.Sprint(pid), "-m", "--"}, args...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
	ns("mount", "-t", "tmpfs", "-o", "size="+size+",mode=0755", "tmpfs", dir)
	t.Cleanup(func() { ns("umount", "-l", dir) })
	if fill {
		filler, err := os.Create(fmt.Sprintf("/proc/%d/root%s/filler", pid, dir))
		require.NoError(t, err)
		_, werr := filler.Write(make([]byte, 1<<20))
		require.ErrorIs(t, werr, syscall.ENOSPC)
		_ = filler.Close()
	}
	poolXML := fmt.Sprintf("<pool type='dir'><name>lve-e2e-small</name><target><path>%s</path></target></pool>", dir)
	pool, err := base.conn.StoragePoolCreateXML(poolXML, 0) // transient
	require.NoError(t, err)
	t.Cleanup(func() { _ = pool.Destroy(); _ = pool.Free() })
	// No guest tools disk (neither program): its 110 MB would not fit,
	// and these tests are about the machine's own disk.
	r := base.withConfig(t, setKey("storage_pool", `"lve-e2e-small"`)).withConfig(t, setKey("gitlab_runner", `"none"`)).
		withConfig(t, setKey("step_runner", `"none"`))
	r.allowConfig(t) // the confined runner's rules name this pool
	return r
}

// TestFaultPrepareFailsThreeTimes: a broken image makes every prepare attempt
// fail; the runner tries three times with cleanup between, and nothing is left.
func TestFaultPrepareFailsThreeTimes(t *testing.T) {
	base := setup(t)
	r := base.withConfig(t, func(s string) string {
		return regexp.MustCompile(`(?m)^base = ".*tiny.*"$`).ReplaceAllString(s, `base = "/nonexistent/tiny.qcow2"`)
	})
	opts, _ := r.options(t)
	res, err := harness.RunJob(context.Background(), opts, harness.Job{Script: []string{"true"}})
	require.NoError(t, err)
	figures.fault()
	require.Equal(t, 3, res.PrepareAttempts)
	require.Equal(t, harness.ReasonSystemFailure, res.FailureReason)
	for _, st := range res.Stage("prepare") {
		figures.class(st.ExitCode, 2)
		require.Equal(t, 2, st.ExitCode)
	}
	require.Len(t, res.Stage("cleanup"), 3, "cleanup after every attempt")
}

// TestCapacityAdmissionOnRealVMs: with room for one VM, two jobs at once:
// one of them waits in prepare (saying so in its job log) instead of
// starting a second guest, and runs once the other job's VM is gone.
func TestCapacityAdmissionOnRealVMs(t *testing.T) {
	r := setup(t).withConfig(t, func(s string) string {
		return s + "\n[capacity]\nmax_vms = 1\nwait = \"5m\"\n"
	})
	type job struct {
		res *harness.Result
		log *logWriter
		err error
	}
	var jobs [2]job
	var wg sync.WaitGroup
	for i := range jobs {
		opts, lw := r.options(t)
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := harness.RunJob(context.Background(), opts, harness.Job{Script: []string{fmt.Sprintf("echo job-%d-ran", i), "sleep 3"}})
			jobs[i] = job{res, lw, err}
		}()
	}
	wg.Wait()
	waited := 0
	for i, j := range jobs {
		require.NoError(t, j.err, "job %d", i)
		require.Equal(t, harness.StateSuccess, j.res.State, "job %d: %s %s", i, j.res.FailureReason, j.res.Message)
		log := j.log.buf.String()
		require.Contains(t, log, fmt.Sprintf("job-%d-ran", i))
		if strings.Contains(log, "Waiting for room on the host") {
			waited++
			require.Contains(t, log, "Room on the host after")
		}
	}
	require.Equal(t, 1, waited, "exactly one of the two jobs waited for the other's VM")
}

// TestFaultLibvirtdHung stops the rig's libvirtd (SIGSTOP: it accepts
// connections but never answers) between run and cleanup. run does not need
// libvirt; cleanup gives up by its own deadline (timeouts.cleanup) as a
// system failure instead of hanging; once libvirtd answers again a second
// cleanup removes everything.
func TestFaultLibvirtdHung(t *testing.T) {
	if os.Getenv("LVE_E2E_ALLOW_LIBVIRTD_RESTART") == "" {
		t.Skip("stops the shared libvirtd: set LVE_E2E_ALLOW_LIBVIRTD_RESTART=1 (make test-e2e does)")
	}
	base := setup(t)
	const cleanupDeadline = 8 * time.Second
	r := base.withConfig(t, func(s string) string {
		return strings.Replace(s, "[timeouts]\n", fmt.Sprintf("[timeouts]\ncleanup = %q\n", cleanupDeadline.String()), 1)
	})
	require.Equal(t, cleanupDeadline, r.cfg.Timeouts.Cleanup.D())
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)

	pid := rigLibvirtdPID(t)
	comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	require.Equal(t, "libvirtd", strings.TrimSpace(string(comm)), "only the rig's own libvirtd is stopped")
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	defer resume()

	res := s.runScript(t, "build_script", "#!/usr/bin/env bash\necho ran-without-libvirt\n")
	require.Equal(t, 0, res.code, "run does not need libvirtd")
	require.Contains(t, res.stdout, "ran-without-libvirt")

	t0 := time.Now()
	res = s.run(t, "cleanup")
	took := time.Since(t0)
	figures.fault()
	figures.class(res.code, 2)
	require.Equal(t, 2, res.code, "cleanup reports that it could not finish")
	require.Less(t, took, cleanupDeadline+5*time.Second, "cleanup ends by its deadline, not when libvirtd answers")
	require.Contains(t, res.stderr, "libvirt")
	t.Logf("cleanup against a hung libvirtd returned after %s (deadline %s)", took.Round(100*time.Millisecond), cleanupDeadline)

	resume()
	waitFor(t, 30*time.Second, "libvirtd answering again", func() bool {
		c, err := libvirt.NewConnect(r.cfg.LibvirtURI)
		if err != nil {
			return false
		}
		_, _ = c.Close()
		return true
	})
	require.Equal(t, 0, s.run(t, "cleanup").code, "the next cleanup removes everything")
	r.requireNoLeftovers(t, "after the fault")
}
