//go:build linux

package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"
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
	mu  sync.Mutex // one frame at a time on out
	out io.Writer
}

func (s *server) send(typ byte, payload []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_ = writeFrame(s.out, typ, payload) // a channel that is gone: the reader's end decides
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
	s := &server{out: out}
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
			s.send(frameError, []byte(cut(err.Error(), maxControl)))
			continue
		}
		// Until it ends: a cancel, or the channel's end, stops it.
		var gone error
		for stage.running() {
			select {
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

func cut(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
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
// stdout and stderr one pipe, the script on a pipe the shell opens by
// name through /proc (so that nothing the script starts inherits it).
func (s *server) start(req Start, script []byte) (*stage, error) {
	if req.Shell == "" {
		return nil, errors.New("no shell named")
	}
	scriptR, scriptW, err := os.Pipe() // close-on-exec: the shell opens it by name
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		scriptR.Close()
		scriptW.Close()
		return nil, err
	}
	path := "/proc/" + strconv.Itoa(os.Getpid()) + "/fd/" + strconv.Itoa(int(scriptR.Fd()))
	cmd := exec.Command(req.Shell, path)
	cmd.Stdout, cmd.Stderr = outW, outW // stdin: nil is /dev/null
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		for _, f := range []*os.File{scriptR, scriptW, outR, outW} {
			f.Close()
		}
		return nil, fmt.Errorf("start %s: %w", req.Shell, err)
	}
	outW.Close()
	st := &stage{s: s, cmd: cmd, pgid: cmd.Process.Pid, done: make(chan struct{}), shellDone: make(chan struct{})}
	go func() {
		// A shell that ends before reading it all gets EPIPE here.
		_, _ = scriptW.Write(script)
		scriptW.Close()
	}()
	relay := newRelay(s, outR)
	go func() {
		err := cmd.Wait()
		close(st.shellDone)
		scriptR.Close()
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
		if syscall.Kill(-st.pgid, 0) != nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	if syscall.Kill(-st.pgid, syscall.SIGKILL) == nil {
		st.s.note("libvirt-executor: they ignored SIGTERM for %s: killed", grace)
	}
}

// relay copies the stage's output into output frames until the pipe's
// end, or until drain gives up on it; then it reads on and drops what it
// reads (a detached writer does not die of SIGPIPE), until the pipe ends.
type relay struct {
	s       *server
	eof     chan struct{}
	mu      sync.Mutex
	drop    bool
	dropped bool // some output was dropped
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
					rl.s.send(frameOutput, buf[:n])
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

// drain waits up to grace for the output's end; false: it did not come,
// and from now on the output is dropped.
func (rl *relay) drain(grace time.Duration) bool {
	select {
	case <-rl.eof:
		return true
	case <-time.After(grace):
	}
	rl.mu.Lock()
	rl.drop = true
	rl.mu.Unlock()
	select {
	case <-rl.eof: // it came meanwhile
		rl.mu.Lock()
		defer rl.mu.Unlock()
		return !rl.dropped
	default:
		return false
	}
}
