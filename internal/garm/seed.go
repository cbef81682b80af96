package garm

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// SeedDoneMarker is the line the guest's bootstrap (bootstrap.py) writes
// on the serial console as its last act, once it has reported to garm (or
// given up) and scrubbed cloud-init's copies of the token: the host keeps
// the console in the machine's console.log, and the provider, seeing the
// line there, takes the seed (the last copy of the token the guest can
// read) away. A guest that writes it early only loses its own seed early.
const SeedDoneMarker = "lve-garm-bootstrap: done, the seed is no longer needed"

// consoleTail is how much of the end of the console log is searched for
// the marker: the guest writes the log, so it is never read whole.
const consoleTail = 16 << 10

// seedDropTimeout bounds the removal of one instance's seed (a hot unplug
// waits a few seconds for the guest).
const seedDropTimeout = 30 * time.Second

// bootstrapDone reports whether the last consoleTail bytes of the console
// log at path hold SeedDoneMarker. A link, a FIFO or anything else but a
// plain file is not read.
func bootstrapDone(path string) bool {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return false
	}
	buf := make([]byte, consoleTail)
	n, _ := f.ReadAt(buf, max(0, fi.Size()-consoleTail))
	return bytes.Contains(buf[:n], []byte(SeedDoneMarker))
}

// dropSeeds takes the seed (with garm's instance token) away from each
// instance of all whose bootstrap is done (SeedDoneMarker on its console)
// or that is older than garm.seed_keep: garm asks for its instances again
// and again (Get, List), and the guest cannot detach a disk itself. A
// failure is logged and the next call tries again; an instance busy in
// another process (being deleted) is left to that one.
func (p *Provider) dropSeeds(ctx context.Context, all []lifecycle.Owned) {
	now := time.Now()
	for _, o := range all {
		if !slices.Contains(o.Owner.Volumes, vm.SeedVolume(o.Name)) {
			continue
		}
		old := !o.Owner.Created.IsZero() && now.Sub(o.Owner.Created) >= p.Cfg.Garm.SeedKeep.D()
		// A machine on another host has no console log here: its seed
		// goes at seed_keep (docs/garm.md, "Across hosts").
		if log := p.M.Machine(o.Name).ConsoleLog(); !old && (log == "" || !bootstrapDone(log)) {
			continue
		}
		dctx, cancel := context.WithTimeout(ctx, seedDropTimeout)
		err := p.M.Machine(o.Name).DropSeed(dctx)
		cancel()
		if err != nil && !errors.Is(err, state.ErrBusy) && !errors.Is(err, vm.ErrNotFound) {
			log := p.Log
			if log == nil {
				log = slog.Default()
			}
			log.Warn("cannot remove the seed of a garm instance (it holds garm's instance token); the next call tries again",
				"machine", o.Name, "err", err)
		}
	}
}

// pinAddresses gives the network filter of each running instance of all
// that has an address (its lease) and is not pinned since its last start
// that address (lifecycle.Manager.PinAddress): garm's instances do not
// wait for their address at boot, and what the filter only learnt, libvirt
// forgets when libvirtd restarts. A failure is logged and the next call
// tries again.
func (p *Provider) pinAddresses(ctx context.Context, all []lifecycle.Owned) {
	for _, o := range all {
		if !o.State.Running || o.Address == "" || p.M.Machine(o.Name).Pinned() {
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, seedDropTimeout)
		err := p.M.Machine(o.Name).PinAddress(pctx, o.Address)
		cancel()
		if err != nil && !errors.Is(err, vm.ErrNotFound) {
			log := p.Log
			if log == nil {
				log = slog.Default()
			}
			log.Warn("cannot give a garm instance's network filter its address (a libvirtd restart would cut it off until its lease renews); the next call tries again",
				"machine", o.Name, "address", o.Address, "err", err)
		}
	}
}
