package holder

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detach"
)

// maxSocketPath is the longest path a unix socket can be bound at on
// Linux (sun_path is 108 bytes with its NUL).
const maxSocketPath = 107

// Socket is the path of the holder's socket in the machine directory dir.
func Socket(dir string) string { return filepath.Join(dir, SocketFile) }

// Start starts a holder for the machine whose 0700 state directory is dir:
// it binds the socket first (a stage can connect from then on; the
// connection waits in the backlog until the holder accepts), then starts
// exe with args in a session of its own (a signal to the caller's process
// group does not reach it), with the listening socket as file descriptor 3,
// stdin as given (the configuration), stdout on /dev/null, stderr on
// LogFile in dir, and an environment of PATH only (package detach). It
// records the process in PidFile and does not wait for it.
func Start(dir, exe string, args []string, stdin []byte) (int, error) {
	sock := Socket(dir)
	if len(sock) > maxSocketPath {
		return 0, fmt.Errorf("socket path %s is %d bytes long, more than the %d a unix socket allows (shorten state_dir)", sock, len(sock), maxSocketPath)
	}
	_ = os.Remove(sock)
	_ = os.Remove(filepath.Join(dir, readyFile))
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return 0, err
	}
	ln.SetUnlinkOnClose(false)
	defer func() { _ = ln.Close() }() // the holder has its own copy
	if err := os.Chmod(sock, 0o600); err != nil {
		_ = os.Remove(sock)
		return 0, err
	}
	lf, err := ln.File()
	if err != nil {
		_ = os.Remove(sock)
		return 0, err
	}
	defer lf.Close()
	pid, err := detach.Start(detach.Spec{Exe: exe, Args: args, Stdin: stdin, Extra: []*os.File{lf}, Log: filepath.Join(dir, LogFile)})
	if err != nil {
		_ = os.Remove(sock)
		return 0, err
	}
	start, _, err := startTime(pid)
	if err == nil {
		err = writePid(dir, pid, start)
	}
	if err != nil {
		// Without its record the holder could not be stopped by pid: stop
		// it now (it ends anyway once the machine directory is gone).
		_ = syscall.Kill(pid, syscall.SIGKILL)
		_ = os.Remove(sock)
		return 0, fmt.Errorf("record the holder process: %w", err)
	}
	return pid, nil
}

// Listener is the listening socket a holder process got from Start.
func Listener() (net.Listener, error) {
	f := os.NewFile(3, SocketFile)
	if f == nil {
		return nil, errors.New("no socket on file descriptor 3 (the holder is started by prepare)")
	}
	defer f.Close()
	return net.FileListener(f)
}

func writePid(dir string, pid int, start uint64) error {
	tmp := filepath.Join(dir, PidFile+".new")
	if err := os.WriteFile(tmp, []byte(fmt.Sprintf("%d %d\n", pid, start)), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, PidFile))
}

// startTime is the process's start time in clock ticks since boot
// (/proc/PID/stat field 22): with the pid it names one process for good.
// zombie is true for a process that has ended but was not yet waited for.
func startTime(pid int) (start uint64, zombie bool, err error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, false, err
	}
	// The command name (field 2) is in parentheses and may hold anything.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false, fmt.Errorf("unreadable /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state); field 22 is f[19].
	if len(f) < 20 {
		return 0, false, fmt.Errorf("short /proc/%d/stat", pid)
	}
	start, err = strconv.ParseUint(f[19], 10, 64)
	return start, f[0] == "Z", err
}

// Running returns the pid of the holder recorded in dir if that very
// process still runs (same pid, same start time), else 0.
func Running(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, PidFile))
	if err != nil {
		return 0
	}
	var pid int
	var start uint64
	if _, err := fmt.Sscanf(string(b), "%d %d", &pid, &start); err != nil || pid <= 1 {
		return 0
	}
	if st, zombie, err := startTime(pid); err != nil || st != start || zombie {
		return 0
	}
	return pid
}

// stopWait is how long Stop gives a holder to end after SIGTERM.
const stopWait = 300 * time.Millisecond

// Stop ends the holder recorded in dir, if that very process still runs
// (it proves the process is the recorded one before it signals it):
// SIGTERM, then SIGKILL if it has not ended within stopWait. It returns
// whether there was one, and removes the socket and the record.
func Stop(dir string) bool {
	pid := Running(dir)
	if pid != 0 {
		_ = syscall.Kill(pid, syscall.SIGTERM)
		deadline := time.Now().Add(stopWait)
		for Running(dir) == pid && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if Running(dir) == pid {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	_ = os.Remove(Socket(dir))
	_ = os.Remove(filepath.Join(dir, PidFile))
	_ = os.Remove(filepath.Join(dir, readyFile))
	return pid != 0
}
