package jobvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// HolderCommand is the first argument that makes the run executable a
// connection holder (HolderArgs).
const HolderCommand = "hold-connection"

// HolderExecutable is the executable that serves as connection holder:
// the run stage's, found next to the running executable.
const HolderExecutable = "libvirt-executor-run"

// siblingExe is the driver's executable name next to the running one (the
// holder's and the reaper's are the run and cleanup stages' own).
func siblingExe(name string) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	exe := filepath.Join(filepath.Dir(self), name)
	if _, err := os.Stat(exe); err != nil {
		return "", fmt.Errorf("%s not found next to %s: %w", name, self, err)
	}
	return exe, nil
}

// StartHolder starts the connection holder of a ready machine (package
// holder): one SSH connection that every stage of the job uses. It ends by
// until at the latest, when the machine is torn down, or when its state
// directory disappears. It does not wait for the holder's connection:
// the first stage does, if it comes before the connection is made.
func (h *Host) StartHolder(name string, until time.Time) error {
	exe := h.HolderExe
	if exe == "" {
		var err error
		if exe, err = siblingExe(HolderExecutable); err != nil {
			return err
		}
	}
	args := []string{HolderCommand, "--config", h.m.Cfg.Path, "--config-stdin", "--until", strconv.FormatInt(until.Unix(), 10), name}
	_, err := holder.Start(h.m.Store.MachineDir(name), exe, args, h.m.Cfg.Text)
	return err
}

// HolderSocket is where the machine's holder listens.
func (h *Host) HolderSocket(name string) string { return holder.Socket(h.m.Store.MachineDir(name)) }

// Hold is the connection holder's body (HolderCommand): it connects to the
// machine name and serves stages on the socket StartHolder passed, until
// ctx ends, the machine's state directory is gone, or until passes.
func (h *Host) Hold(ctx context.Context, name string, until time.Time, log *slog.Logger) error {
	ln, err := holder.Listener()
	if err != nil {
		return err
	}
	dir := h.m.Store.MachineDir(name)
	go h.pinForHolder(ctx, name, log)
	// The stages go through the guest agent when the machine's tools
	// disk has one (a fixed path: never job input); a guest that does not
	// mount the disk keeps the wrapper, and the first stage says so.
	agentCmd := ""
	if rec, err := h.m.Store.Record(name); err == nil && rec.Tools != nil && rec.Tools.Agent != nil {
		agentCmd = "exec " + guestinit.GuestAgentPath // the login shell does not wait for it
	}
	s := &holder.Server{
		AgentCommand: agentCmd,
		Dial: func(ctx context.Context) (*sshexec.Client, error) {
			_, c, err := h.connect(ctx, name)
			return c, err
		},
		Alive: func() bool {
			_, err := os.Stat(dir)
			return !errors.Is(err, os.ErrNotExist)
		},
		Until:     until,
		UntilFile: holder.UntilFile(dir),
		Connected: func(ok bool) {
			if err := holder.MarkReady(dir, ok); err != nil && !errors.Is(err, os.ErrNotExist) { // the machine gone
				log.Warn("could not record whether the connection is up", "err", err)
			}
		},
		Log: log,
	}
	return s.Serve(ctx, ln)
}

// stopHolder ends the machine's holder, if it runs: a
// lifecycle.Hooks.Release of every machine (its user is done with it).
func stopHolder(m *lifecycle.Manager, name string) { holder.Stop(m.Store.MachineDir(name)) }

// pinForHolder gives the machine's network filter its recorded address
// when prepare left that to the holder (lifecycle.Request.DeferFilterPin),
// while the job's stages run: a few tries, then the learnt address stays
// (only a libvirtd restart would cut the VM off; the holder's log says so).
func (h *Host) pinForHolder(ctx context.Context, name string, log *slog.Logger) {
	if h.m.Cfg.L2Filter != nil && !*h.m.Cfg.L2Filter || h.m.Machine(name).Pinned() {
		return
	}
	mach, err := h.m.Store.Record(name)
	if err != nil || mach.Address == "" {
		return
	}
	for try := 1; ; try++ {
		t0 := time.Now()
		pctx, cancel := context.WithTimeout(ctx, time.Minute)
		err = h.m.Machine(name).PinAddress(pctx, mach.Address)
		cancel()
		if err == nil {
			log.Info("network filter given the address", "address", mach.Address, "took", time.Since(t0))
			return
		}
		if try == 3 || ctx.Err() != nil {
			log.Warn("network filter not given the address: a libvirtd restart would cut the VM off until its lease renews", "address", mach.Address, "err", err)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(try) * 2 * time.Second):
		}
	}
}
