//go:build linux

package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Defaults of a Start or Cancel that leaves a grace out, and of a stage
// stopped because the channel ended.
const (
	defaultLeftoverGrace = 2 * time.Second
	defaultDrainGrace    = time.Second
	defaultKillGrace     = 5 * time.Second
)

// server is the agent's side: one stage at a time.
type server struct {
	mu     sync.Mutex // one frame at a time on out
	out    io.Writer
	failed bool
	broken chan struct{} // closed when a write to out failed: the channel is gone
}

// send writes a frame; once a write failed (the channel is gone) nothing
// more is written and broken is closed.
func (s *server) send(typ byte, payload []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failed {
		return
	}
	if err := writeFrame(s.out, typ, payload); err != nil {
		s.failed = true
		close(s.broken)
	}
}

func (s *server) sendJSON(typ byte, v any) {
	b, _ := json.Marshal(v)
	s.send(typ, b)
}

func (s *server) note(format string, args ...any) {
	s.send(frameNote, []byte(fmt.Sprintf(format, args...)))
}

// inFrame is one frame from the host, or the end of the channel.
type inFrame struct {
	typ     byte
	payload []byte
	err     error
}

// Serve is the agent: it says Hello on out (having marked what it
// inherited above stderr close-on-exec), then runs the stages the host
// asks for on in, one at a time, until in ends; a stage running then is
// stopped as by a cancel first. It returns nil when in ended cleanly, the
// protocol error otherwise (after stopping the stage).
func Serve(in io.Reader, out io.Writer, version string) error {
	keepInherited()
	// A write to a closed channel (sshd closed the agent's stdout) is an
	// error to handle, not the SIGPIPE that would end the agent before it
	// stops the stage. Handled, not ignored: the scripts get the default.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	// As the wrapper's "setsid shell &" (an asynchronous command of a
	// non-interactive shell), the scripts start with SIGINT and SIGQUIT
	// ignored: ignored dispositions are inherited across exec.
	signal.Ignore(syscall.SIGINT, syscall.SIGQUIT)
	s := &server{out: out, broken: make(chan struct{})}
	s.sendJSON(frameHello, Hello{Protocol: Protocol, Version: version, PID: os.Getpid()})
	frames := make(chan inFrame)
	go func() {
		for {
			typ, b, err := readFrame(in, agentLimit)
			frames <- inFrame{typ, b, err}
			if err != nil {
				return
			}
		}
	}()
	end := func(err error) error {
		if errors.Is(err, io.EOF) {
			return nil
		}
		return err
	}
	for {
		f := <-frames
		if f.err != nil {
			return end(f.err)
		}
		switch f.typ {
		case frameCancel:
			continue // the stage it was meant for has ended already
		case frameStart:
		default:
			return fmt.Errorf("%w: frame %q before a stage's start", ErrProtocol, f.typ)
		}
		var st Start
		if err := json.Unmarshal(f.payload, &st); err != nil {
			return fmt.Errorf("%w: start: %v", ErrProtocol, err)
		}
		if st.ScriptSize < 0 || st.ScriptSize > MaxScript {
			return fmt.Errorf("%w: a script of %d bytes (at most %d)", ErrProtocol, st.ScriptSize, MaxScript)
		}
		// The script runs only once it has arrived whole.
		script := make([]byte, 0, st.ScriptSize)
		for len(script) < st.ScriptSize {
			f = <-frames
			if f.err != nil {
				return end(f.err) // half a script never runs
			}
			if f.typ != frameScript || len(script)+len(f.payload) > st.ScriptSize {
				return fmt.Errorf("%w: frame %q of %d bytes inside a script of %d", ErrProtocol, f.typ, len(f.payload), st.ScriptSize)
			}
			script = append(script, f.payload...)
		}
		stage, err := s.start(st, script)
		if err != nil {
			s.sendJSON(frameError, Refusal{Seq: st.Seq, Reason: cut(err.Error(), 1000)})
			continue
		}
		s.sendJSON(frameGroup, Group{Seq: st.Seq, PGID: stage.pgid})
		// Until it ends: a cancel, or the channel's end, stops it.
		var gone error
		broken := s.broken
		for stage.running() {
			select {
			case <-broken:
				broken = nil
				gone = errors.New("the channel is gone (a write failed)")
				stage.cancel(defaultKillGrace)
				stage.wait()
			case f = <-frames:
				switch {
				case f.err != nil:
					gone = f.err
					stage.cancel(defaultKillGrace)
					stage.wait()
				case f.typ == frameCancel:
					var c Cancel
					_ = json.Unmarshal(f.payload, &c)
					stage.cancel(ms(c.GraceMS, defaultKillGrace))
				default:
					gone = fmt.Errorf("%w: frame %q while a stage runs", ErrProtocol, f.typ)
					stage.cancel(defaultKillGrace)
					stage.wait()
				}
			case <-stage.done:
			}
		}
		stage.exit.Seq = st.Seq
		s.sendJSON(frameExit, stage.exit)
		if gone != nil {
			return end(gone)
		}
	}
}

// keepInherited marks every descriptor the agent inherited above stderr
// close-on-exec: a script gets stdin, stdout and stderr, and nothing of
// whatever started the agent.
func keepInherited() {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return
	}
	for _, e := range entries {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
			syscall.CloseOnExec(fd)
		}
	}
}

func ms(n int, def time.Duration) time.Duration {
	if n <= 0 {
		return def
	}
	return time.Duration(n) * time.Millisecond
}

// stage is one running script.
type stage struct {
	s    *server
	cmd  *exec.Cmd
	pgid int
	done chan struct{} // closed once exit is set (the group stopped, the output drained)
	exit Exit

	mu        sync.Mutex
	cancelled bool
	killTimer *time.Timer
	shellDone chan struct{} // the shell has ended
}

func (st *stage) running() bool {
	select {
	case <-st.done:
		return false
	default:
		return true
	}
}

func (st *stage) wait() { <-st.done }

// cancel sends SIGTERM to the group, and SIGKILL after grace if the
// script's shell is still there.
func (st *stage) cancel(grace time.Duration) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.cancelled {
		return
	}
	st.cancelled = true
	_ = syscall.Kill(-st.pgid, syscall.SIGTERM)
	st.killTimer = time.AfterFunc(grace, func() {
		select {
		case <-st.shellDone:
		default:
			_ = syscall.Kill(-st.pgid, syscall.SIGKILL)
		}
	})
}

// start starts the script's shell in a session of its own: stdin closed,
// stdout and stderr one pipe, the script in a sealed memory file (memfd;
// a pipe on kernels without it) that the shell opens by name through
// /proc, so that nothing the script starts inherits it, and a child that
// reads "$0" gets a file of its own offset, not the rest of the script.
func (s *server) start(req Start, script []byte) (*stage, error) {
	if req.Shell == "" {
		return nil, errors.New("no shell named")
	}
	src, err := scriptFile(script)
	if err != nil {
		return nil, err
	}
	path := "/proc/" + strconv.Itoa(os.Getpid()) + "/fd/" + strconv.Itoa(int(src.Fd()))
	if _, err := os.Stat(path); err != nil {
		// No /proc here: the shell could not open the script, and that
		// would look like the script's failure.
		src.Close()
		return nil, fmt.Errorf("the script cannot be passed through /proc (is it mounted?): %w", err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		src.Close()
		return nil, err
	}
	cmd := exec.Command(req.Shell, path)
	cmd.Stdout, cmd.Stderr = outW, outW // stdin: nil is /dev/null
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		for _, f := range []*os.File{src, outR, outW} {
			f.Close()
		}
		return nil, fmt.Errorf("start %s: %w", req.Shell, err)
	}
	outW.Close()
	st := &stage{s: s, cmd: cmd, pgid: cmd.Process.Pid, done: make(chan struct{}), shellDone: make(chan struct{})}
	relay := newRelay(s, outR)
	go func() {
		err := cmd.Wait()
		close(st.shellDone)
		src.Close()
		st.mu.Lock()
		if st.killTimer != nil {
			st.killTimer.Stop()
		}
		cancelled := st.cancelled
		st.mu.Unlock()
		st.exit = exitOf(cmd.ProcessState, err)
		st.exit.Cancelled = cancelled
		st.stopLeftovers(ms(req.LeftoverGraceMS, defaultLeftoverGrace))
		if !relay.drain(ms(req.DrainGraceMS, defaultDrainGrace)) {
			st.exit.Detached = true
			s.note("libvirt-executor: a detached process still writes to the stage's output; the stage ends without it")
		}
		close(st.done)
	}()
	return st, nil
}

// scriptFile is the script in a sealed memory file read from its start,
// or, where the kernel has no memfd, the read end of a pipe it is being
// written into.
func scriptFile(script []byte) (*os.File, error) {
	fd, err := unix.MemfdCreate("lve-script", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		r, w, perr := os.Pipe()
		if perr != nil {
			return nil, perr
		}
		go func() {
			// A shell that ends before reading it all gets EPIPE here.
			_, _ = w.Write(script)
			w.Close()
		}()
		return r, nil
	}
	f := os.NewFile(uintptr(fd), "lve-script")
	if _, err := f.Write(script); err != nil {
		f.Close()
		return nil, fmt.Errorf("write the script into memory: %w", err)
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SEAL|unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE); err != nil {
		f.Close()
		return nil, fmt.Errorf("seal the script: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// exitOf is the exit status the way a shell's wait reports it.
func exitOf(ps *os.ProcessState, err error) Exit {
	if ps == nil {
		return Exit{Code: 255, Signal: cut(fmt.Sprint(err), 100)}
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		sig := ws.Signal()
		return Exit{Code: 128 + int(sig), Signal: signalName(sig)}
	}
	return Exit{Code: ps.ExitCode()}
}

func signalName(sig syscall.Signal) string {
	names := map[syscall.Signal]string{
		syscall.SIGHUP: "HUP", syscall.SIGINT: "INT", syscall.SIGQUIT: "QUIT", syscall.SIGILL: "ILL",
		syscall.SIGABRT: "ABRT", syscall.SIGFPE: "FPE", syscall.SIGKILL: "KILL", syscall.SIGSEGV: "SEGV",
		syscall.SIGPIPE: "PIPE", syscall.SIGALRM: "ALRM", syscall.SIGTERM: "TERM", syscall.SIGUSR1: "USR1",
		syscall.SIGUSR2: "USR2",
	}
	if n, ok := names[sig]; ok {
		return n
	}
	return strconv.Itoa(int(sig))
}

// stopLeftovers stops what the script left in its process group:
// SIGTERM, then SIGKILL once grace has passed. A process in a session of
// its own is not in the group and lives on.
func (st *stage) stopLeftovers(grace time.Duration) {
	if syscall.Kill(-st.pgid, syscall.SIGTERM) != nil {
		return // nothing left
	}
	st.s.note("libvirt-executor: the script has ended; stopping the processes it left running")
	deadline := time.Now().Add(grace)
	for time.Now().Before(deadline) {
		if !groupAlive(st.pgid) {
			awaitReaped(st.pgid)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	if groupAlive(st.pgid) && syscall.Kill(-st.pgid, syscall.SIGKILL) == nil {
		st.s.note("libvirt-executor: they ignored SIGTERM for %s: killed", grace)
	}
	awaitReaped(st.pgid)
}

// reapWait bounds awaitReaped.
const reapWait = 1500 * time.Millisecond

// awaitReaped gives the guest's init a moment to reap what the stage left
// (orphans are its children, and some inits reap once a second): until
// then a process that ended is still there for the next stage's `kill -0`.
// An init that never reaps costs a stage that left processes this bound
// (the wrapper waits out its whole grace then).
func awaitReaped(pgid int) {
	deadline := time.Now().Add(reapWait)
	for syscall.Kill(-pgid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
}

// groupAlive reports whether process group pgid has a member that is not
// a zombie (a guest whose init does not reap keeps zombies in the group).
func groupAlive(pgid int) bool {
	if syscall.Kill(-pgid, 0) != nil {
		return false
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return true // cannot tell: as kill says
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...: comm may hold anything but ')'
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 2 && f[0] != "Z" && f[2] == strconv.Itoa(pgid) {
			return true
		}
	}
	return false
}

// relay copies the stage's output into output frames until the pipe's
// end, or until drain gives up on it; then it reads on and drops what it
// reads (a detached writer does not die of SIGPIPE), until the pipe ends.
type relay struct {
	s       *server
	eof     chan struct{}
	mu      sync.Mutex
	drop    bool
	dropped bool          // some output was dropped
	sending time.Duration // time spent handing output to the host (its backpressure)
}

func newRelay(s *server, r *os.File) *relay {
	rl := &relay{s: s, eof: make(chan struct{})}
	go func() {
		defer r.Close()
		defer close(rl.eof)
		buf := make([]byte, 32<<10)
		for {
			n, err := r.Read(buf)
			if n > 0 {
				rl.mu.Lock()
				if rl.drop {
					rl.dropped = true
				} else {
					t0 := time.Now()
					rl.s.send(frameOutput, buf[:n])
					rl.sending += time.Since(t0)
				}
				rl.mu.Unlock()
			}
			if err != nil {
				return
			}
		}
	}()
	return rl
}

// drain waits for the output's end for grace, not counting the time the
// host took to take the output (a slow host is no detached writer); false:
// it did not come, and from now on the output is dropped.
func (rl *relay) drain(grace time.Duration) bool {
	start := time.Now()
	rl.mu.Lock()
	sent0 := rl.sending
	rl.mu.Unlock()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-rl.eof:
			return true
		case <-tick.C:
		}
		rl.mu.Lock()
		waited := time.Since(start) - (rl.sending - sent0)
		if waited >= grace {
			rl.drop = true
		}
		rl.mu.Unlock()
		if waited >= grace {
			break
		}
	}
	select {
	case <-rl.eof: // it came meanwhile
		rl.mu.Lock()
		defer rl.mu.Unlock()
		return !rl.dropped
	default:
		return false
	}
}
