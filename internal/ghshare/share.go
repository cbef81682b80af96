// Package ghshare is the share of a GitHub hook job (libvirt-executor-hooks,
// internal/ghjob): the virtiofsd that serves the runner's _work directory
// into the job's VM, its record in the state directory, and the sweep of
// the jobs whose runner is gone without a cleanup_job.
package ghshare

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detach"
)

// The runner's work directory goes into the job's VM through a virtiofsd
// of the job's own, started here (libvirt 9.0 would run its own as root):
// as the share user, root only in a user namespace of its own whose other
// ids are that user's subordinate ids, so what the guest writes is the
// share user's (or a subordinate id's), never root's. Its vhost-user
// socket is made here and handed over as a descriptor (--fd), in a
// directory only QEMU's group may enter.

// shareDir is the state directory's subdirectory of the hook jobs' records.
const shareDir = "github-hooks"

// Share is the record of a job's share: its virtiofsd and socket, and the
// runner's worker that asked for the job (the sweep's question: is it
// still there?). It is kept in the state directory
// (github-hooks/MACHINE.json) from before virtiofsd starts until cleanup.
type Share struct {
	// Machine is the name the job knows its machine by (jobvm.Job.Name:
	// the record's and the socket directory's name); VM, once acquired,
	// the machine that serves the job (a claimed standby machine's own
	// name, else the same).
	Machine string `json:"machine"`
	VM      string `json:"vm,omitempty"`
	// JobID is the job's id (its jobvm.JobRef.ID).
	JobID int64 `json:"job_id"`
	// SocketDir is the directory of the socket (removed with the share).
	SocketDir string `json:"socket_dir"`
	// PID and Start (clock ticks since boot, /proc/PID/stat) identify
	// virtiofsd; 0 before it started.
	PID   int    `json:"pid,omitempty"`
	Start uint64 `json:"start,omitempty"`
	// RunnerPID and RunnerStart identify the process that ran prepare_job's
	// hook (the runner's worker).
	RunnerPID   int    `json:"runner_pid,omitempty"`
	RunnerStart uint64 `json:"runner_start,omitempty"`
	// ExtPID and ExtStart identify the virtiofsd of the runner's
	// externals directory (StartExternals); 0 for none.
	ExtPID   int       `json:"ext_pid,omitempty"`
	ExtStart uint64    `json:"ext_start,omitempty"`
	At       time.Time `json:"at"`
}

// Socket is the share's vhost-user socket.
func (s *Share) Socket() string { return filepath.Join(s.SocketDir, "fs.sock") }

// ExtSocket is the vhost-user socket of the externals' virtiofsd.
func (s *Share) ExtSocket() string { return filepath.Join(s.SocketDir, "ext.sock") }

func recordPath(stateDir, machine string) string {
	return filepath.Join(stateDir, shareDir, machine+".json")
}

func logPath(stateDir, machine string) string {
	return filepath.Join(stateDir, shareDir, machine+".log")
}

func extLogPath(stateDir, machine string) string {
	return filepath.Join(stateDir, shareDir, machine+".ext.log")
}

// save writes the record whole (a file beside it, renamed).
func save(stateDir string, s *Share) error {
	dir := filepath.Join(stateDir, shareDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	p := recordPath(stateDir, s.Machine)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// SetVM records the machine that serves the job (Share.VM).
func SetVM(stateDir string, s *Share, vm string) error {
	s.VM = vm
	return save(stateDir, s)
}

// vm is the machine that serves the job.
func (s *Share) vm() string {
	if s.VM != "" {
		return s.VM
	}
	return s.Machine
}

// Load reads a job's record; nil and no error when there is none.
func Load(stateDir, machine string) (*Share, error) {
	b, err := os.ReadFile(recordPath(stateDir, machine))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var s Share
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("the share record of %s: %w", machine, err)
	}
	return &s, nil
}

// User is who virtiofsd runs as and the group QEMU runs with.
type User struct {
	uid, gid, qemuGID int
	Name              string
	// asOther: the hook runs as root and starts virtiofsd as uid.
	asOther bool
}

// ResolveUser finds the share user (g.ShareUser, else the hook's own
// user, which must not be root) and QEMU's group.
func ResolveUser(g config.GitHubHooks, euid int) (*User, error) {
	var su User
	if g.ShareUser == "" {
		if euid == 0 {
			return nil, errors.New("github_hooks.share_user is not set and the hook runs as root: virtiofsd never runs as root " +
				"(a root guest could make setuid-root files on the host); run the runner as its own user, or set share_user " +
				"to a user with /etc/subuid and /etc/subgid entries")
		}
		u, err := user.LookupId(strconv.Itoa(euid))
		if err != nil {
			return nil, fmt.Errorf("the hook's user %d: %w", euid, err)
		}
		su.Name = u.Username
		su.uid = euid
		su.gid, _ = strconv.Atoi(u.Gid)
	} else {
		u, err := user.Lookup(g.ShareUser)
		if err != nil {
			return nil, fmt.Errorf("github_hooks.share_user %q: %w", g.ShareUser, err)
		}
		su.Name = u.Username
		su.uid, _ = strconv.Atoi(u.Uid)
		su.gid, _ = strconv.Atoi(u.Gid)
		if su.uid == 0 {
			return nil, errors.New("github_hooks.share_user is root: virtiofsd never runs as root (a root guest could make setuid-root files on the host)")
		}
		switch {
		case euid == 0:
			su.asOther = true
		case euid != su.uid:
			return nil, fmt.Errorf("the hook runs as user %d, not root: it starts virtiofsd only as itself; leave github_hooks.share_user unset, or set it to this user", euid)
		}
	}
	g2, err := user.LookupGroup(g.QEMUGroup)
	if err != nil {
		return nil, fmt.Errorf("github_hooks.qemu_group %q: %w", g.QEMUGroup, err)
	}
	su.qemuGID, _ = strconv.Atoi(g2.Gid)
	return &su, nil
}

// Start starts the job's virtiofsd for g.WorkDir and records it: the
// socket directory (QEMU's group, 0710) and the listening socket are made
// here, virtiofsd gets the socket as descriptor 3, runs as the share user
// under unshare (a user namespace mapping that user to root and its
// subordinate ids to the rest) and logs to the state directory. On an
// error nothing of it is left.
func Start(ctx context.Context, g config.GitHubHooks, stateDir string, s *Share, su *User) (err error) {
	s.SocketDir = filepath.Join(g.RuntimeDir, s.Machine)
	if err := save(stateDir, s); err != nil {
		return fmt.Errorf("record the job's share: %w", err)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, Stop(stateDir, s))
		}
	}()
	if err := os.MkdirAll(g.RuntimeDir, 0o711); err != nil { //nolint:gosec // G301: QEMU's user passes through to the job's own directory, which is 0710
		return fmt.Errorf("github_hooks.runtime_dir: %w", err)
	}
	_ = os.RemoveAll(s.SocketDir) // a stale one of an earlier attempt
	if err := os.Mkdir(s.SocketDir, 0o710); err != nil {
		return fmt.Errorf("the job's socket directory: %w", err)
	}
	if err := os.Chown(s.SocketDir, -1, su.qemuGID); err != nil {
		return fmt.Errorf("the job's socket directory %s to group %s (github_hooks.qemu_group; the hook's user must be in it): %w", s.SocketDir, g.QEMUGroup, err)
	}
	if err := os.Chmod(s.SocketDir, 0o710); err != nil { //nolint:gosec // G302: QEMU's group enters it, no one else
		return err
	}
	args := []string{"--user", "--map-user=0", "--map-group=0", "--map-users=auto", "--map-groups=auto", "--",
		g.Virtiofsd, "--fd=3", "-o", "source=" + g.WorkDir, "-o", "cache=none", "-o", "no_posix_lock", "-o", "no_xattr"}
	return startDaemon(ctx, g, s.Socket(), args, logPath(stateDir, s.Machine), su.Name, su, func(pid int, start uint64) error {
		s.PID, s.Start = pid, start
		return save(stateDir, s)
	})
}

// StartExternals starts a second virtiofsd for the runner's externals
// directory (g.ExternalsDir: the node of JavaScript actions, mounted
// read-only into every job container) and records it in s. Read-only:
// libvirt 9.0 and this virtiofsd have no read-only share, so this one runs
// as root of a user namespace that maps only the share user's subordinate
// ids: on the host it is a subordinate id, which may read the runner's
// files but not change them (they belong to the runner's user, who is not
// in the namespace), whatever a root guest asks of it. It needs the
// share's socket directory (Start first). On an error the caller's Stop
// removes what was started.
func StartExternals(ctx context.Context, g config.GitHubHooks, stateDir string, s *Share, su *User) error {
	if s.SocketDir == "" {
		return errors.New("the externals' virtiofsd needs the job's share started first")
	}
	fi, err := os.Stat(g.ExternalsDir)
	if err != nil {
		return fmt.Errorf("github_hooks.externals_dir: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("github_hooks.externals_dir %s is not a directory", g.ExternalsDir)
	}
	if fi.Mode().Perm()&0o002 != 0 {
		return fmt.Errorf("github_hooks.externals_dir %s is writable by every user (mode %s): the job's VM would get it writable; chmod o-w %s", g.ExternalsDir, fi.Mode().Perm(), g.ExternalsDir)
	}
	uids, err := subIDs("/etc/subuid", su)
	if err != nil {
		return err
	}
	gids, err := subIDs("/etc/subgid", su)
	if err != nil {
		return err
	}
	args := []string{"--user", "--map-users=" + uids, "--map-groups=" + gids, "--setuid=0", "--setgid=0", "--",
		g.Virtiofsd, "--fd=3", "-o", "source=" + g.ExternalsDir, "-o", "cache=auto", "-o", "no_posix_lock", "-o", "no_xattr"}
	sub, _, _ := strings.Cut(uids, ",")
	err = startDaemon(ctx, g, s.ExtSocket(), args, extLogPath(stateDir, s.Machine), "uid "+sub+", a subordinate id of "+su.Name, su, func(pid int, start uint64) error {
		s.ExtPID, s.ExtStart = pid, start
		return save(stateDir, s)
	})
	if err != nil {
		// The likeliest cause: that id may not pass a directory above the
		// externals (a home directory 0700); it needs search there and
		// read and search on the externals, by ACL or by mode.
		if herr := othersCanReach(g.ExternalsDir); herr != nil {
			err = fmt.Errorf("%w; unless uid %s has an ACL entry there, it cannot reach the externals: %v; give that id alone passage: setfacl -m u:%s:x on each directory above it, -m u:%s:rx on it", err, sub, herr, sub, sub)
		}
	}
	return err
}

// SetuidReachable says whether other local users can reach dir (every
// directory above it lets them pass, it lets them in) on a filesystem
// that honours setuid bits: a root guest can leave a setuid file of the
// share user in a share, and such a user could run it.
func SetuidReachable(dir string) bool {
	if othersCanReach(dir) != nil {
		return false
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return true
	}
	return st.Flags&stNoSuid == 0
}

// stNoSuid is statfs's ST_NOSUID flag.
const stNoSuid = 0x2

// othersCanReach checks that a user outside dir's owner and group (the
// externals' virtiofsd: a subordinate id) can reach dir: search
// permission for others on each directory above it, read and search on
// dir itself.
func othersCanReach(dir string) error {
	for d := filepath.Dir(dir); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("github_hooks.externals_dir %s: %s (mode %s) does not let other users pass", dir, d, fi.Mode().Perm())
		}
		if d == "/" {
			break
		}
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if fi.Mode().Perm()&0o005 != 0o005 {
		return fmt.Errorf("github_hooks.externals_dir %s (mode %s) is not readable by other users", dir, fi.Mode().Perm())
	}
	return nil
}

// maxSubIDs is how many subordinate ids a namespace of a share maps.
const maxSubIDs = 65536

// subIDs is unshare's --map-users (or --map-groups) value mapping the
// first range of su's subordinate ids in file (/etc/subuid, /etc/subgid)
// to 0 and up: "OUTER,0,COUNT", util-linux 2.38's order (Debian 12's
// unshare: outer id, inner id, count; later versions also take
// "INNER:OUTER:COUNT", with colons).
func subIDs(file string, su *User) (string, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("the share user's subordinate ids: %w", err)
	}
	return parseSubIDs(string(b), file, su.Name, su.uid)
}

func parseSubIDs(content, file, name string, uid int) (string, error) {
	for _, line := range strings.Split(content, "\n") {
		f := strings.Split(strings.TrimSpace(line), ":")
		if len(f) != 3 || (f[0] != name && f[0] != strconv.Itoa(uid)) {
			continue
		}
		start, err1 := strconv.ParseUint(f[1], 10, 32)
		count, err2 := strconv.ParseUint(f[2], 10, 32)
		if err1 != nil || err2 != nil || count == 0 || start == 0 {
			continue
		}
		return fmt.Sprintf("%d,0,%d", start, min(count, maxSubIDs)), nil
	}
	return "", fmt.Errorf("%s has no range for the share user %s (usermod --add-subuids/--add-subgids)", file, name)
}

// startDaemon makes a listening socket at sock (QEMU's group, 0660) and
// starts a virtiofsd under unshare (args) with it as descriptor 3, as
// the share user, logging to logp; started is called with the process as
// soon as it runs (to record it). It returns once the process is
// virtiofsd itself (unshare has made the namespace and exec'd it).
func startDaemon(ctx context.Context, g config.GitHubHooks, sock string, args []string, logp, who string, su *User, started func(int, uint64) error) error {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return fmt.Errorf("the job's virtiofsd socket: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	defer func() { _ = ln.Close() }() // virtiofsd has its own copy
	if err := os.Chown(sock, -1, su.qemuGID); err != nil {
		return err
	}
	if err := os.Chmod(sock, 0o660); err != nil { //nolint:gosec // G302: QEMU's group connects to it
		return err
	}
	f, err := ln.File()
	if err != nil {
		return err
	}
	defer f.Close()
	spec := detach.Spec{Exe: "/usr/bin/unshare", Args: args, Extra: []*os.File{f}, Log: logp}
	if su.asOther {
		spec.Credential = &syscall.Credential{Uid: uint32(su.uid), Gid: uint32(su.gid), Groups: []uint32{}} //nolint:gosec // G115: ids from the user database
	}
	pid, err := detach.Start(spec)
	if err != nil {
		return fmt.Errorf("start virtiofsd (as %s, under unshare): %w", who, err)
	}
	start, err := procStart(pid)
	if err != nil {
		// Without its start time the process cannot be told from a later
		// one of the same pid: end it now, by pid, while it is ours.
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		return fmt.Errorf("virtiofsd (as %s, under unshare) ended at its start: %s", who, logTail(logp))
	}
	if err := started(pid, start); err != nil {
		return fmt.Errorf("record the job's virtiofsd: %w", err)
	}
	// Running once unshare has made the namespace and exec'd virtiofsd
	// (the same process); gone means it failed (its log says why).
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
		if err == nil && exe == g.Virtiofsd {
			return nil
		}
		if !alive(pid, start) {
			return fmt.Errorf("virtiofsd (as %s, under unshare) ended at its start: %s", who, logTail(logp))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("virtiofsd did not start: %w (%s)", context.Cause(ctx), logTail(logp))
		case <-tick.C:
		}
	}
}

// Stop ends the share's virtiofsd (SIGTERM, SIGKILL after 5 s; only
// the process the record names, by its start time) and removes its socket
// directory and record. Safe to call again: what is gone is skipped.
func Stop(stateDir string, s *Share) error {
	var errs []error
	if err := stopDaemon(s.PID, s.Start); err != nil {
		errs = append(errs, err)
	} else {
		s.PID, s.Start = 0, 0
	}
	if err := stopDaemon(s.ExtPID, s.ExtStart); err != nil {
		errs = append(errs, err)
	} else {
		s.ExtPID, s.ExtStart = 0, 0
	}
	if s.SocketDir != "" {
		if err := os.RemoveAll(s.SocketDir); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		for _, p := range []string{recordPath(stateDir, s.Machine), logPath(stateDir, s.Machine), extLogPath(stateDir, s.Machine)} {
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// stopDaemon ends one virtiofsd (SIGTERM to its session, SIGKILL after
// 5 s), only the process that started at start; 0 is none.
func stopDaemon(pid int, start uint64) error {
	if pid <= 0 || !alive(pid, start) {
		return nil
	}
	// Its own session (detach.Start): the group holds virtiofsd's
	// sandboxed child too.
	_ = syscall.Kill(-pid, syscall.SIGTERM)
	deadline := time.Now().Add(5 * time.Second)
	for alive(pid, start) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if alive(pid, start) {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		for i := 0; i < 100 && alive(pid, start); i++ {
			time.Sleep(20 * time.Millisecond)
		}
		if alive(pid, start) {
			return fmt.Errorf("virtiofsd (pid %d) does not end", pid)
		}
	}
	return nil
}

// procStart is the start time of process pid (clock ticks after boot,
// /proc/PID/stat's 22nd field): with the pid, it tells the process from a
// later one given the same pid.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command field", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	if f[0] == "Z" || f[0] == "X" {
		return 0, fmt.Errorf("process %d has ended", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// alive says whether process pid runs and is the one that started at
// start (0: any).
func alive(pid int, start uint64) bool {
	st, err := procStart(pid)
	return err == nil && (start == 0 || st == start)
}

// logTail is the end of a log file, for a message.
func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return "no log (" + path + ")"
	}
	if len(b) > 600 {
		b = b[len(b)-600:]
	}
	return strings.TrimSpace(strings.ToValidUTF8(string(b), "?"))
}
