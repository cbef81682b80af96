// Package detach starts the driver's own helper processes (a job's
// connection holder, a reaper) so that they outlive their starter: a
// session of their own (signals to the starter's process group do not reach
// them), an environment of PATH only (the starter's may hold a job's
// variables), input given as bytes through a pipe (nothing on the command
// line), their stderr appended to a log file, and never waited for.
package detach

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// Env is the whole environment a detached process gets.
var Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// Spec is one process to start.
type Spec struct {
	Exe  string
	Args []string
	// Stdin is written to the process's standard input, which is then
	// closed (nil: /dev/null).
	Stdin []byte
	// Extra files become descriptors 3, 4, ... in the process.
	Extra []*os.File
	// Log is the file (created 0600, appended to) that receives its
	// stderr; stdout goes to /dev/null.
	Log string
	// EnvExtra is added to Env ("NAME=value": the host's proxy settings
	// for a process that reaches a registry; never a job's variables).
	EnvExtra []string
	// Credential, if set, runs the process as another user (the starter
	// must be root): a GitHub hook job's virtiofsd runs as the share
	// user, never as root.
	Credential *syscall.Credential
}

// stdinWait bounds writing Stdin (the process reads it at its start).
const stdinWait = 10 * time.Second

// Start starts the process and returns its pid; the caller does not wait
// for it (it is released). If Stdin cannot be written whole, the process is
// killed and an error returned.
func Start(s Spec) (int, error) {
	logf, err := os.OpenFile(s.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return 0, err
	}
	defer logf.Close()
	cmd := exec.Command(s.Exe, s.Args...) //nolint:gosec // G204: the driver's own executable with arguments it chose
	cmd.Env = append(append([]string{}, Env...), s.EnvExtra...)
	cmd.Stderr = logf
	cmd.ExtraFiles = s.Extra
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: s.Credential}
	var w *os.File
	if s.Stdin != nil {
		r, pw, err := os.Pipe()
		if err != nil {
			return 0, err
		}
		defer r.Close()
		defer pw.Close()
		cmd.Stdin, w = r, pw
	}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	pid := cmd.Process.Pid
	if w != nil {
		_ = w.SetWriteDeadline(time.Now().Add(stdinWait))
		_, werr := w.Write(s.Stdin)
		if cerr := w.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			_ = cmd.Process.Kill()
			_, _ = cmd.Process.Wait()
			return 0, fmt.Errorf("give %s its input: %w", s.Exe, werr)
		}
	}
	return pid, cmd.Process.Release()
}
