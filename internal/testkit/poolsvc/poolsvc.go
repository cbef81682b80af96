// Package poolsvc runs the standby pool service (libvirt-executor serve) for
// the project's tools: the demo, the benchmark and the end-to-end tests
// start it with a configuration that keeps a pool, wait for its idle VMs,
// and stop it and remove what it left, so that they leave nothing behind.
package poolsvc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"
)

// StopWait is how long the service gets to stop after SIGTERM (it undoes
// the boots in progress) before its process group is killed.
const StopWait = 3 * time.Minute

// WithPool is configuration text with a standby pool of idle VMs of image
// added and, unless the text configures the service itself, health checks
// every second (so that tests and tools notice faults quickly).
func WithPool(text, image string, idle int) string {
	out := text + fmt.Sprintf("\n[images.%s.pool]\nidle_count = %d\n", tomlKey(image), idle)
	if !serveTable.MatchString(text) {
		out += "\n[serve]\nhealth_interval = \"1s\"\n"
	}
	return out
}

// serveTable matches a [serve] table header.
var serveTable = regexp.MustCompile(`(?m)^[ \t]*\[[ \t]*"?serve"?[ \t]*\]`)

var bareKey = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

// tomlKey writes a key as TOML wants it: bare when it can be.
func tomlKey(k string) string {
	if bareKey.MatchString(k) {
		return k
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(k) + `"`
}

// Service is a libvirt-executor serve process, in its own process group.
type Service struct {
	cmd  *exec.Cmd
	log  syncbuf.Buffer
	done chan struct{}
	err  error // Wait's, once done is closed
}

// Start starts exe (libvirt-executor) serve with the configuration file at
// configPath; its output is kept (Log).
func Start(exe, configPath string) (*Service, error) {
	return StartAs(exe, configPath, nil)
}

// StartAs is Start with the service running as cred (nil: this process's
// user), as systemd's User= runs it.
func StartAs(exe, configPath string, cred *syscall.Credential) (*Service, error) {
	if _, err := os.Stat(exe); err != nil {
		return nil, fmt.Errorf("pool service: %w (build it first: make build)", err)
	}
	s := &Service{done: make(chan struct{})}
	s.cmd = exec.Command(exe, "--config", configPath, "serve")
	s.cmd.Stdout, s.cmd.Stderr = &s.log, &s.log
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: cred}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("pool service: %w", err)
	}
	go func() {
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	return s, nil
}

// Pid is the service's process id.
func (s *Service) Pid() int { return s.cmd.Process.Pid }

// Done is closed when the service has ended.
func (s *Service) Done() <-chan struct{} { return s.done }

// Log is what the service wrote so far.
func (s *Service) Log() string { return s.log.String() }

// ExitedError describes a service that ended by itself.
func (s *Service) ExitedError() error {
	why := "exit status 0"
	if s.err != nil {
		why = s.err.Error()
	}
	return fmt.Errorf("the pool service exited (%s): %s", why, tail(s.Log(), 10))
}

// Stop ends the service with SIGTERM (as systemd does) and waits for it;
// after wait it kills its process group. It returns how long the stop took;
// the error says if the service had ended already, ended badly, or had to
// be killed.
func (s *Service) Stop(wait time.Duration) (time.Duration, error) {
	select {
	case <-s.done:
		return 0, s.ExitedError()
	default:
	}
	t0 := time.Now()
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
		if s.err != nil {
			return time.Since(t0), fmt.Errorf("the pool service ended with %v after SIGTERM: %s", s.err, tail(s.Log(), 10))
		}
		return time.Since(t0), nil
	case <-time.After(wait):
		_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.done
		return time.Since(t0), fmt.Errorf("the pool service did not stop within %s of SIGTERM: killed: %s", wait, tail(s.Log(), 10))
	}
}

// Kill ends the service's process group with SIGKILL and waits for it:
// nothing of it runs afterwards.
func (s *Service) Kill() {
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	<-s.done
}

// WaitIdle waits until exactly n standby VMs are idle and none boots,
// is claimed or retires, and returns the idle ones; it gives up when
// within passes, ctx ends or the service ends.
func (s *Service) WaitIdle(ctx context.Context, m *jobvm.Host, n int, within time.Duration) ([]string, error) {
	deadline := time.Now().Add(within)
	for {
		all, err := m.Standbys()
		if err == nil {
			var idle []string
			for _, sb := range all {
				if sb.Idle() {
					idle = append(idle, sb.Name)
				}
			}
			if len(idle) == n && len(all) == n {
				return idle, nil
			}
		}
		if time.Now().After(deadline) {
			now := Describe(all)
			if err != nil {
				now = err.Error()
			}
			return nil, fmt.Errorf("no %d idle standby VM(s) within %s: %s; service log: %s", n, within, now, tail(s.Log(), 5))
		}
		select {
		case <-s.done:
			return nil, s.ExitedError()
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Describe says what each standby VM is doing, sorted by name.
func Describe(all []lifecycle.Standby) string {
	if len(all) == 0 {
		return "no standby VM"
	}
	var out []string
	for _, s := range all {
		what := "idle"
		switch {
		case s.Claim != nil && s.Claim.Retire:
			what = "retiring (" + s.Claim.Reason + ")"
		case s.Claim != nil:
			what = "claimed by " + s.Claim.Job
		case s.Record == nil:
			what = "booting"
		case s.Record.Standby == nil:
			what = "no standby record"
		default:
			what += " (" + s.Record.Standby.Image + ")"
		}
		out = append(out, s.Name+" "+what)
	}
	slices.Sort(out)
	return strings.Join(out, ", ")
}

// RemoveStandbys removes every standby VM of the installation once the
// service has stopped, each within each; one a job claimed and its cleanup
// left is removed as `libvirt-executor rm` would.
func RemoveStandbys(ctx context.Context, m *jobvm.Host, each time.Duration, reason string) (removed []string, errs []error) {
	all, err := m.Standbys()
	if err != nil {
		return nil, []error{fmt.Errorf("standby VMs: %w", err)}
	}
	for _, s := range all {
		rctx, cancel := context.WithTimeout(ctx, each)
		var err error
		if e, _ := m.Manager().Store.EndedOf(s.Name); e != nil {
			// Its job ended: its reaper removes it. Wait for that under
			// the VM's lock, or do it if the reaper is gone.
			err = m.Reap(rctx, []string{s.Name})
		} else {
			err = m.Retire(rctx, s.Name, reason)
		}
		if errors.Is(err, state.ErrClaimed) {
			if err = m.Manager().Machine(s.Name).Teardown(rctx); err == nil && s.Claim != nil {
				_ = m.Manager().Store.UnmapJob(s.Claim.Job)
			}
		}
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("removing standby VM %s: %w", s.Name, err))
			continue
		}
		removed = append(removed, s.Name)
	}
	return removed, errs
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
