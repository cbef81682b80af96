package ghshare

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

func TestResolveShareUser(t *testing.T) {
	g := config.GitHubHooks{QEMUGroup: "root"}
	_, err := ResolveUser(g, 0)
	require.ErrorContains(t, err, "share_user is not set and the hook runs as root: virtiofsd never runs as root")
	g.ShareUser = "root"
	_, err = ResolveUser(g, 0)
	require.ErrorContains(t, err, "share_user is root")
	g.ShareUser = "nobody"
	su, err := ResolveUser(g, 0)
	require.NoError(t, err)
	require.True(t, su.asOther)
	require.Equal(t, "nobody", su.Name)
	_, err = ResolveUser(g, 4242)
	require.ErrorContains(t, err, "the hook runs as user 4242, not root: it starts virtiofsd only as itself")
	g.QEMUGroup = "no-such-group-here"
	_, err = ResolveUser(g, 0)
	require.ErrorContains(t, err, `github_hooks.qemu_group "no-such-group-here"`)
}

func TestProcStartTellsProcessesApart(t *testing.T) {
	start, err := procStart(os.Getpid())
	require.NoError(t, err)
	require.NotZero(t, start)
	require.True(t, alive(os.Getpid(), start))
	require.False(t, alive(os.Getpid(), start+1), "another start time: another process under the same pid")
	cmd := exec.Command("true")
	require.NoError(t, cmd.Run())
	require.False(t, alive(cmd.Process.Pid, 0), "an ended process")
}

func TestStopShareIsIdempotent(t *testing.T) {
	state := t.TempDir()
	sock := filepath.Join(t.TempDir(), "lve-x")
	require.NoError(t, os.Mkdir(sock, 0o700))
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = nil
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
	start, err := procStart(cmd.Process.Pid)
	require.NoError(t, err)
	// another start time: not this process, left alone
	s := &Share{Machine: "lve-x", SocketDir: sock, PID: cmd.Process.Pid, Start: start + 1}
	require.NoError(t, save(state, s))
	got, err := Load(state, "lve-x")
	require.NoError(t, err)
	require.Equal(t, s.PID, got.PID)
	require.NoError(t, Stop(state, got))
	require.True(t, alive(cmd.Process.Pid, start), "a process the record does not name is not ended")
	require.NoDirExists(t, sock)
	got, err = Load(state, "lve-x")
	require.NoError(t, err)
	require.Nil(t, got, "the record is gone")
	require.NoError(t, Stop(state, s), "a second stop finds nothing and succeeds")
}

// fakeMachines records teardowns.
type fakeMachines struct {
	have     map[string]bool
	serving  map[string]string // job -> machine (the job's mapping)
	tornDown []string
}

func (f *fakeMachines) Has(name string) (bool, error)      { return f.have[name], nil }
func (f *fakeMachines) Serving(job string) (string, error) { return f.serving[job], nil }
func (f *fakeMachines) Teardown(_ context.Context, name string) error {
	f.tornDown = append(f.tornDown, name)
	delete(f.have, name)
	return nil
}

// TestSweepRemovesJobsWhoseRunnerIsGone: a job whose runner's worker ended
// without a cleanup_job loses its machine and its virtiofsd in the sweep;
// one whose worker runs, or that names none, is left alone; a record
// whose machine is gone has its virtiofsd stopped once it is old.
func TestSweepRemovesJobsWhoseRunnerIsGone(t *testing.T) {
	state := t.TempDir()
	start := func() (*exec.Cmd, uint64) {
		cmd := exec.Command("sleep", "60")
		// a group of its own, as detach.Start gives virtiofsd
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
		st, err := procStart(cmd.Process.Pid)
		require.NoError(t, err)
		return cmd, st
	}
	worker, wStart := start()
	gone, gStart := start()
	vfs, vStart := start() // stands for the job's virtiofsd
	sockDir := filepath.Join(t.TempDir(), "lve-a")
	require.NoError(t, os.Mkdir(sockDir, 0o700))
	now := time.Now()
	recs := []*Share{
		{Machine: "lve-a", SocketDir: sockDir, PID: vfs.Process.Pid, Start: vStart, RunnerPID: gone.Process.Pid, RunnerStart: gStart, At: now},
		{Machine: "lve-b", RunnerPID: worker.Process.Pid, RunnerStart: wStart, At: now},
		{Machine: "lve-c", At: now},
		{Machine: "lve-d", At: now.Add(-2 * orphanAge)},
	}
	for _, r := range recs {
		require.NoError(t, save(state, r))
	}
	ms := &fakeMachines{have: map[string]bool{"lve-a": true, "lve-b": true, "lve-c": true}}

	removed, err := SweepRecords(context.Background(), state, ms, now, false)
	require.NoError(t, err)
	require.Empty(t, removed, "every runner still runs")

	require.NoError(t, gone.Process.Kill())
	_, _ = gone.Process.Wait()
	removed, err = SweepRecords(context.Background(), state, ms, now, true)
	require.NoError(t, err)
	require.Equal(t, []string{"lve-a"}, removed, "dry run: would remove")
	require.Empty(t, ms.tornDown)
	removed, err = SweepRecords(context.Background(), state, ms, now, false)
	require.NoError(t, err)
	require.Equal(t, []string{"lve-a"}, removed)
	require.Equal(t, []string{"lve-a"}, ms.tornDown, "the machine of the job whose runner is gone")
	_, _ = vfs.Process.Wait()
	require.False(t, alive(vfs.Process.Pid, vStart), "the job's virtiofsd is stopped")
	require.NoDirExists(t, sockDir)
	for name, want := range map[string]bool{"lve-a": false, "lve-b": true, "lve-c": true, "lve-d": false} {
		s, err := Load(state, name)
		require.NoError(t, err)
		require.Equal(t, want, s != nil, "record of %s kept", name)
	}
}

// TestFindWorker: the runner's worker is found from a process under it
// (the hook's parent may be the runner's node), and not where there is
// none.
func TestFindWorker(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, WorkerComm)
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\nsleep 60\n"), 0o755))
	cmd := exec.Command(script)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
	var child int
	for i := 0; i < 1000 && child == 0; i++ {
		b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "task", strconv.Itoa(cmd.Process.Pid), "children"))
		if f := strings.Fields(string(b)); len(f) > 0 {
			child, _ = strconv.Atoi(f[0])
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.NotZero(t, child, "the worker's child")
	pid, start := FindWorker(child)
	require.Equal(t, cmd.Process.Pid, pid)
	want, err := procStart(cmd.Process.Pid)
	require.NoError(t, err)
	require.Equal(t, want, start)
	pid, _ = FindWorker(os.Getpid())
	require.Zero(t, pid, "a test is no runner's worker")
}

func TestParseSubIDs(t *testing.T) {
	content := "other:100000:65536\n# comment\nrunner:0:65536\nrunner:300000:1000\n1001:400000:200000\n"
	got, err := parseSubIDs(content, "/etc/subuid", "runner", 1000)
	require.NoError(t, err)
	require.Equal(t, "300000,0,1000", got, "the first usable range of the user (a range at 0 is not one)")
	got, err = parseSubIDs(content, "/etc/subuid", "someone", 1001)
	require.NoError(t, err)
	require.Equal(t, "400000,0,65536", got, "by uid, at most 65536 ids")
	_, err = parseSubIDs(content, "/etc/subgid", "nobody-here", 5)
	require.ErrorContains(t, err, "/etc/subgid has no range for the share user nobody-here")
}

func TestOthersCanReach(t *testing.T) {
	root := t.TempDir()
	require.NoError(t, os.Chmod(filepath.Dir(root), 0o711)) // the test's own directory
	require.NoError(t, os.Chmod(root, 0o755))
	home := filepath.Join(root, "home")
	ext := filepath.Join(home, "externals")
	require.NoError(t, os.MkdirAll(ext, 0o755))
	require.NoError(t, os.Chmod(home, 0o755))
	require.NoError(t, othersCanReach(ext))
	require.NoError(t, os.Chmod(home, 0o700))
	require.ErrorContains(t, othersCanReach(ext), "mode -rwx------) does not let other users pass")
	require.NoError(t, os.Chmod(home, 0o711))
	require.NoError(t, othersCanReach(ext))
	require.Equal(t, othersCanReach(ext) == nil, SetuidReachable(ext) || nosuid(t, ext), "reachable: a setuid risk unless the filesystem is nosuid")
	require.NoError(t, os.Chmod(ext, 0o750))
	require.ErrorContains(t, othersCanReach(ext), "is not readable by other users")
	require.False(t, SetuidReachable(ext), "closed to others: no setuid risk")
}

func TestStopEndsTheExternalsDaemonToo(t *testing.T) {
	state := t.TempDir()
	var cmds []*exec.Cmd
	for range 2 {
		cmd := exec.Command("sleep", "60")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
		cmds = append(cmds, cmd)
	}
	st0, err := procStart(cmds[0].Process.Pid)
	require.NoError(t, err)
	st1, err := procStart(cmds[1].Process.Pid)
	require.NoError(t, err)
	s := &Share{Machine: "lve-y", PID: cmds[0].Process.Pid, Start: st0, ExtPID: cmds[1].Process.Pid, ExtStart: st1}
	require.NoError(t, save(state, s))
	require.NoError(t, Stop(state, s))
	for _, c := range cmds {
		_ = c.Wait()
		require.False(t, alive(c.Process.Pid, 0))
	}
	got, err := Load(state, "lve-y")
	require.NoError(t, err)
	require.Nil(t, got, "the record goes with them")
}

// A warm job's record names the claimed standby VM that serves it: the
// sweep removes that machine, not the job's name (which no machine has).
func TestSweepRemovesTheClaimedVM(t *testing.T) {
	state := t.TempDir()
	gone := exec.Command("sleep", "60")
	require.NoError(t, gone.Start())
	st, err := procStart(gone.Process.Pid)
	require.NoError(t, err)
	require.NoError(t, gone.Process.Kill())
	_ = gone.Wait()
	s := &Share{Machine: "lve-0123abcd-gh-9", RunnerPID: gone.Process.Pid, RunnerStart: st, At: time.Now()}
	require.NoError(t, save(state, s))
	require.NoError(t, SetVM(state, s, "lve-0123abcd-sb-1"))
	ms := &fakeMachines{have: map[string]bool{"lve-0123abcd-sb-1": true}}
	removed, err := SweepRecords(context.Background(), state, ms, time.Now(), false)
	require.NoError(t, err)
	require.Equal(t, []string{"lve-0123abcd-sb-1"}, removed)
	require.Equal(t, []string{"lve-0123abcd-sb-1"}, ms.tornDown)
	got, err := Load(state, "lve-0123abcd-gh-9")
	require.NoError(t, err)
	require.Nil(t, got)

	// Killed between the claim and the record's VM: the job's mapping
	// names the claimed machine.
	s = &Share{Machine: "lve-0123abcd-gh-10", RunnerPID: gone.Process.Pid, RunnerStart: st, At: time.Now()}
	require.NoError(t, save(state, s))
	ms = &fakeMachines{have: map[string]bool{"lve-0123abcd-sb-2": true}, serving: map[string]string{"lve-0123abcd-gh-10": "lve-0123abcd-sb-2"}}
	removed, err = SweepRecords(context.Background(), state, ms, time.Now(), false)
	require.NoError(t, err)
	require.Equal(t, []string{"lve-0123abcd-sb-2"}, removed)
	require.Equal(t, []string{"lve-0123abcd-sb-2"}, ms.tornDown)
}

func nosuid(t *testing.T, dir string) bool {
	t.Helper()
	var st syscall.Statfs_t
	require.NoError(t, syscall.Statfs(dir, &st))
	return st.Flags&stNoSuid != 0
}
