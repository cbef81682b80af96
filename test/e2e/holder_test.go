//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// holderPID is the running connection holder of the job's machine.
func (s *stageRunner) holderPID(t *testing.T) int {
	t.Helper()
	pid := holder.Running(filepath.Join(s.r.cfg.StateDir, "machines", s.name(t)))
	require.NotZero(t, pid, "the job has a connection holder")
	return pid
}

func killHolder(t *testing.T, pid int) {
	t.Helper()
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	waitFor(t, 5*time.Second, "the holder gone", func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		return err != nil || strings.Contains(string(b), ") Z ")
	})
}

// TestHolderServesEveryStage: every stage of a job runs through the one
// holder prepare started (none falls back to a connection of its own), and
// the holder ends with the job.
func TestHolderServesEveryStage(t *testing.T) {
	r := setup(t)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	res := s.run(t, "prepare")
	require.Equal(t, 0, res.code)
	require.Contains(t, res.stdout, "Connection holder started")
	pid := s.holderPID(t)
	for i := range 3 {
		res := s.runScript(t, "build_script", fmt.Sprintf("echo stage-%d\n", i))
		require.Equal(t, 0, res.code)
		require.Contains(t, res.stdout, fmt.Sprintf("stage-%d", i))
		require.NotContains(t, res.stderr, "connects directly")
	}
	res = s.runScript(t, "build_script", "exit 3\n")
	require.Equal(t, 1, res.code, "the script's own failure through the holder is a build failure")
	require.Equal(t, pid, s.holderPID(t), "one holder for the whole job")
	require.Equal(t, 0, s.run(t, "cleanup").code)
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	require.True(t, os.IsNotExist(err) || procZombie(pid), "cleanup stopped the holder")
}

func procZombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err == nil && strings.Contains(string(b), ") Z ")
}

// TestFaultHolderKilledMidStage: the holder is SIGKILLed while a stage's
// script runs. The stage is a system failure (never the script's), the
// script is stopped in the guest, and the next stage connects directly.
func TestFaultHolderKilledMidStage(t *testing.T) {
	r := setup(t)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	pid := s.holderPID(t)
	path := filepath.Join(s.dir, "script.")
	require.NoError(t, os.WriteFile(path, []byte("#!/usr/bin/env bash\necho $$ > /tmp/lve-mid-stage.pid\necho started\nsleep 600\necho never\n"), 0o700))
	rn := s.start(t, "run", path, "build_script")
	waitFor(t, 60*time.Second, "script started", func() bool { return strings.Contains(rn.out.String(), "started") })
	killHolder(t, pid)
	res := rn.wait(t, 60*time.Second)
	figures.fault()
	figures.class(res.code, 2)
	require.Equal(t, 2, res.code, "SYSTEM_FAILURE: the holder died, not the script")
	require.NotContains(t, res.stdout, "never")
	require.Contains(t, res.stderr, "the stage was stopped in the guest")

	next := s.runScript(t, "after_script", "if kill -0 $(cat /tmp/lve-mid-stage.pid) 2>/dev/null; then echo still-running; else echo stopped; fi\n")
	require.Equal(t, 0, next.code)
	require.Contains(t, next.stdout, "stopped", "nothing of the interrupted stage runs on")
	require.Contains(t, next.stderr, "connects directly", "the job log says the stage fell back")
	require.Equal(t, 0, s.run(t, "cleanup").code)
}

// TestFaultHolderKilledBetweenStages: with the holder gone, every later
// stage connects directly, with the right exit class, and says so.
func TestFaultHolderKilledBetweenStages(t *testing.T) {
	r := setup(t)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	require.Equal(t, 0, s.runScript(t, "prepare_script", "echo one\n").code)
	killHolder(t, s.holderPID(t))
	figures.fault()
	res := s.runScript(t, "build_script", "echo two\n")
	figures.class(res.code, 0)
	require.Equal(t, 0, res.code)
	require.Contains(t, res.stdout, "two")
	require.Contains(t, res.stderr, "connects directly")
	res = s.runScript(t, "build_script", "exit 3\n")
	figures.class(res.code, 1)
	require.Equal(t, 1, res.code, "the script's failure stays a build failure on the fallback path")
	require.Equal(t, 0, s.run(t, "cleanup").code)
}

// TestFaultGuestDiesWhileOnlyHolderConnected: the guest dies between
// stages, while only the guest agent's session of the holder's connection
// is open. Once the holder's keepalive noticed, the next stage fails at once;
// a stage that starts before that fails within the keepalive bound. Both
// are system failures that say what became of the VM.
func TestFaultGuestDiesWhileOnlyHolderConnected(t *testing.T) {
	r := setup(t)
	for _, tc := range []struct {
		name    string
		noticed bool // the stage starts once the holder's keepalive gave the guest up
		within  time.Duration
	}{
		{"stage right after", false, 20 * time.Second},
		{"stage after the holder noticed", true, 5 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStageRunner(t, r)
			require.Equal(t, 0, s.run(t, "config").code)
			require.Equal(t, 0, s.run(t, "prepare").code)
			alive := s.runScript(t, "prepare_script", "echo alive\n")
			require.Equal(t, 0, alive.code)
			require.Contains(t, alive.stderr, agentSaid, "between stages only the guest agent's session is open")
			pid := s.holderPID(t)
			require.NotEmpty(t, tcpSockets(pid), "the holder is connected to the guest")
			require.NoError(t, r.destroyJobDomain())
			if tc.noticed {
				// The keepalive closes the connection when it gives the
				// guest up (9-12 s with the defaults); a destroyed guest
				// never answers, so only that closes it.
				waitFor(t, 30*time.Second, "the holder's keepalive to close its connection to the dead guest",
					func() bool { return len(tcpSockets(pid)) == 0 })
			}
			t0 := time.Now()
			res := s.runScript(t, "build_script", "echo never\n")
			took := time.Since(t0)
			figures.fault()
			figures.class(res.code, 2)
			figures.detected(took)
			require.Equal(t, 2, res.code)
			require.Less(t, took, tc.within)
			require.Contains(t, res.stderr, s.name(t)+" is shut off", "the stage says what became of the VM")
			require.Equal(t, 0, s.run(t, "cleanup").code)
		})
	}
}

// domainRunState is the state of domain name, from one look (found is
// false when there is no such domain, also when it went between the lookup
// and the look at its state).
func (r *rig) domainRunState(t *testing.T, name string) (st libvirt.DomainState, found bool) {
	t.Helper()
	d, err := r.conn.LookupDomainByName(name)
	if lverr, ok := err.(libvirt.Error); ok && lverr.Code == libvirt.ERR_NO_DOMAIN {
		return 0, false
	}
	require.NoError(t, err)
	defer d.Free()
	st, _, err = d.GetState()
	if lverr, ok := err.(libvirt.Error); ok && lverr.Code == libvirt.ERR_NO_DOMAIN {
		return 0, false
	}
	require.NoError(t, err)
	return st, true
}

// holderProcesses lists the connection holders of machine name.
func holderProcesses(name string) []string {
	var found []string
	for _, p := range driverProcesses(name) {
		if strings.Contains(p, "("+jobvm.HolderCommand+" ") {
			found = append(found, p)
		}
	}
	return found
}

// lockHeldBy reports whether process pid holds the lock of machine name
// (its flock in /proc/locks, on the lock file now at the path).
func (r *rig) lockHeldBy(name string, pid int) bool {
	if pid == 0 {
		return false
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(r.cfg.StateDir, "locks", name+".lock"), &st); err != nil {
		return false
	}
	b, err := os.ReadFile("/proc/locks")
	if err != nil {
		return false
	}
	// "1: FLOCK  ADVISORY  WRITE 1234 fd:01:56789 0 EOF"
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 || f[1] != "FLOCK" || f[4] != fmt.Sprint(pid) {
			continue
		}
		if dev := strings.Split(f[5], ":"); len(dev) == 3 && dev[2] == fmt.Sprint(st.Ino) {
			return true
		}
	}
	return false
}

// tcpSockets lists the TCP connections (remote addresses, as in
// /proc/net/tcp) that process pid has open.
func tcpSockets(pid int) []string {
	inodes := map[string]bool{}
	fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	var found []string
	for _, tab := range []string{"tcp", "tcp6"} {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, tab))
		for _, line := range strings.Split(string(b), "\n")[1:] {
			// sl local rem st tx:rx tr:when retrnsmt uid timeout inode
			f := strings.Fields(line)
			if len(f) > 9 && inodes[f[9]] {
				found = append(found, f[2])
			}
		}
	}
	return found
}

// reaperPID finds the reaper of the machine name (0 if none runs).
func reaperPID(name string) int {
	for _, p := range driverProcesses(name) {
		var pid int
		if _, err := fmt.Sscanf(p, "process %d (reap-machines", &pid); err == nil {
			return pid
		}
	}
	return 0
}

// TestFaultReaperKilled: cleanup returns once the VM runs nothing any more
// and hands the rest to a reaper. The reaper is SIGKILLed at three points;
// the VM keeps counting against the host's capacity and the next sweep
// (gc) removes it at once, long before its deadline.
func TestFaultReaperKilled(t *testing.T) {
	r := setup(t)
	for _, tc := range []struct {
		point   string
		reached func(name string) bool
	}{
		{"at its start", func(string) bool { return true }},
		// The reaper removes the machine under its lock: holding it with
		// the domain still there, it is judging or destroying it.
		{"during the destroy", func(name string) bool {
			e, _ := r.domainState(name)
			return e && r.lockHeldBy(name, reaperPID(name))
		}},
		{"after the domain is gone", func(name string) bool { e, _ := r.domainState(name); return !e }},
	} {
		t.Run(tc.point, func(t *testing.T) {
			s := newStageRunner(t, r)
			require.Equal(t, 0, s.run(t, "config").code)
			require.Equal(t, 0, s.run(t, "prepare").code)
			name := s.name(t)
			t0 := time.Now()
			res := s.run(t, "cleanup")
			took := time.Since(t0)
			require.Equal(t, 0, res.code)
			var pid int
			deadline := time.Now().Add(5 * time.Second)
			for pid == 0 && time.Now().Before(deadline) {
				pid = reaperPID(name)
			}
			if pid == 0 {
				t.Logf("the reaper had finished within %s of cleanup (%s): point not reached", time.Since(t0), took)
				r.requireNoLeftovers(t, "after the reaper")
				return
			}
			deadline = time.Now().Add(reaperWait)
			for !tc.reached(name) && reaperPID(name) == pid {
				if time.Now().After(deadline) {
					t.Fatalf("reaper %d neither reached %q nor ended within %s", pid, tc.point, reaperWait)
				}
				time.Sleep(2 * time.Millisecond) // the poll's interval
			}
			if reaperPID(name) != pid {
				// Done before the point (never signal a pid that may
				// have been reused).
				t.Logf("the reaper finished before the point %q (cleanup %s)", tc.point, took)
				r.requireNoLeftovers(t, "after the reaper")
				return
			}
			_ = syscall.Kill(pid, syscall.SIGKILL)
			figures.fault()
			t.Logf("cleanup took %s; reaper %d killed %s", took, pid, tc.point)
			// What is left runs nothing, and nothing of the job reaches it.
			// Which of the states it is in depends on how far the reaper
			// got before the signal landed (libvirtd finishes a destroy
			// it was asked for): paused by cleanup, shut off by the
			// reaper's destroy, or gone. Never running. While the destroy
			// is under way libvirt reports "being shut down" (4: QEMU's
			// SHUTDOWN event on the destroy's SIGTERM) for the paused
			// guest: that ends shut off or gone.
			st, found := r.domainRunState(t, name)
			if found && st == libvirt.DOMAIN_SHUTDOWN {
				t.Logf("%s is being shut down (the killed reaper's destroy)", name)
				waitFor(t, 30*time.Second, "the destroy under way to end", func() bool {
					st, found = r.domainRunState(t, name)
					return !found || st != libvirt.DOMAIN_SHUTDOWN
				})
			}
			if found {
				require.Contains(t, []libvirt.DomainState{libvirt.DOMAIN_PAUSED, libvirt.DOMAIN_SHUTOFF}, st,
					"the VM a killed reaper left is paused (3) or shut off (5) until it is removed, got %d", st)
			}
			require.NoFileExists(t, filepath.Join(r.cfg.StateDir, "machines", name, "id_ed25519"))
			waitFor(t, 10*time.Second, "no connection holder of "+name, func() bool { return len(holderProcesses(name)) == 0 })
			out, err := r.admin("gc").CombinedOutput()
			t.Logf("gc: %s", out)
			require.NoError(t, err)
			left := r.leftovers(t)
			figures.addLeaks(len(left))
			require.Empty(t, left, "gc removes what the killed reaper left, at once")
		})
	}
}
