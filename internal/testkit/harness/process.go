package harness

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// Why the harness stops a stage; read back with context.Cause.
var (
	errCanceled           = errors.New("canceled")
	errJobTimeout         = errors.New("job_timeout")
	errScriptTimeout      = errors.New("script_timeout")
	errStageTimeout       = errors.New("stage_timeout")
	errAfterScriptTimeout = errors.New("after_script_timeout")
)

// procSpec is one executable invocation.
type procSpec struct {
	argv   []string
	env    []string
	dir    string
	stdout io.Writer // required
	stderr io.Writer // nil: same as stdout (one pipe, ordering kept)
	cred   *syscall.Credential
}

// procTimes are the runner's kill timeouts, and how often to sample the
// process's peak RSS (0: never).
type procTimes struct {
	graceful, force time.Duration
	sampleRSS       time.Duration
}

// runProc starts spec in its own process group and waits for it. When ctx is
// done it does what the runner's process killer does: SIGTERM to the group,
// SIGKILL to the group after graceful, give up after force. onStart is called
// with the pid once the process runs. res.Stopped is context.Cause(ctx) as a
// string when the harness signalled the group.
func runProc(ctx context.Context, spec procSpec, t procTimes, onStart func(pid int)) (res StageResult) {
	res.ExitCode = -1
	start := time.Now()
	defer func() { res.Duration = time.Since(start) }()

	out := &gate{w: spec.stdout}
	var errOut io.Writer = out
	if spec.stderr != nil {
		errOut = &gate{w: spec.stderr}
	}
	defer out.close()
	if g, ok := errOut.(*gate); ok && g != out {
		defer g.close()
	}

	cmd := exec.Command(spec.argv[0], spec.argv[1:]...)
	cmd.Dir = spec.dir
	cmd.Env = spec.env
	cmd.Stdout = out
	cmd.Stderr = errOut
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: spec.cred}
	// After the process exits, wait at most this long for its stdout/stderr
	// to close (a child it left behind may hold them).
	cmd.WaitDelay = t.force
	if err := cmd.Start(); err != nil {
		res.StartError = err.Error()
		return res
	}
	pid := cmd.Process.Pid
	if onStart != nil {
		onStart(pid)
	}
	var stopSampling func() int64
	if t.sampleRSS > 0 {
		stopSampling = sampleHWM(pid, t.sampleRSS)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()

	finish := func(err error) StageResult {
		if stopSampling != nil {
			res.PeakRSSKiB = stopSampling()
		}
		if errors.Is(err, exec.ErrWaitDelay) {
			res.OutputLeftOpen = true
		}
		if st := cmd.ProcessState; st != nil {
			res.ExitCode = st.ExitCode()
			if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				res.Signaled = true
			}
			if ru, ok := st.SysUsage().(*syscall.Rusage); ok {
				res.MaxRSSKiB = int64(ru.Maxrss) // KiB on Linux
			}
		}
		return res
	}

	select {
	case err := <-done:
		return finish(err)
	case <-ctx.Done():
	}
	// A process that already exited was not stopped: report how it ended,
	// not the signal that came too late to matter.
	select {
	case err := <-done:
		return finish(err)
	default:
	}
	res.Stopped = context.Cause(ctx).Error()
	_ = syscall.Kill(-pid, syscall.SIGTERM)
	graceful := time.NewTimer(t.graceful)
	defer graceful.Stop()
	select {
	case err := <-done:
		return finish(err)
	case <-graceful.C:
	}
	res.SIGKILLed = true
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	force := time.NewTimer(t.force)
	defer force.Stop()
	select {
	case err := <-done:
		return finish(err)
	case <-force.C:
	}
	res.Abandoned = true
	return res
}

// sampleHWM reads VmHWM of /proc/PID/status every interval until the
// returned stop function is called; stop returns the largest value read
// (KiB). VmHWM belongs to the process's own memory, which exec made fresh, so
// unlike ru_maxrss it does not include the parent's. Once the process has
// exited the line is gone (its memory is released before it becomes a
// zombie), so the last reading is at most one interval before the exit.
func sampleHWM(pid int, interval time.Duration) (stop func() int64) {
	path := "/proc/" + strconv.Itoa(pid) + "/status"
	var peak atomic.Int64
	read := func() {
		if kib, ok := readHWM(path); ok && kib > peak.Load() {
			peak.Store(kib)
		}
	}
	quit := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			read()
			select {
			case <-quit:
				return
			case <-t.C:
			}
		}
	}()
	return func() int64 {
		close(quit)
		<-stopped
		return peak.Load()
	}
}

// readHWM returns the VmHWM value (KiB) of a /proc/PID/status file.
func readHWM(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	return parseHWM(string(b))
}

// parseHWM finds "VmHWM:\t   1234 kB" in the text of /proc/PID/status.
func parseHWM(status string) (int64, bool) {
	for _, line := range strings.Split(status, "\n") {
		rest, ok := strings.CutPrefix(line, "VmHWM:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, false
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		return n, err == nil
	}
	return 0, false
}
