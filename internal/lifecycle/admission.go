package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// admissionLock serialises capacity checks; no machine name starts with '_'.
const admissionLock = "_admission"

// ErrNoRoom means the host is full (capacity.*) and the request would not
// wait (Request.NoWait).
var ErrNoRoom = errors.New("no room on the host")

// pressureKey is the store file a job touches while it waits for room:
// the pool service boots no standby machine while it is fresh (jobs first).
const pressureKey = "pool-pressure"

// PressureHold is how long after a job last waited for room the pool
// service holds back its refills.
const PressureHold = 15 * time.Second

// UnderPressure reports whether a job waited for room within PressureHold.
func (ch Capacity) UnderPressure() bool {
	m := ch.m
	age, ok := m.Store.Age(pressureKey)
	return ok && age < PressureHold
}

// admit reserves the host capacity for one machine by creating its state
// directory with a reservation, under the admission lock. When the host is
// full, a job's machine first retires idle standby machines (jobs first),
// then sweeps leftovers once, then waits (polling) until room frees up, ctx
// ends or capacity.wait passes, telling the job log why it waits. A
// NoWait request fails with ErrNoRoom instead: a standby machine at once,
// one that serves a job (MakeRoom: garm's) once idle standbys could not
// make the room.
func (m *Manager) admit(ctx context.Context, req request) (string, error) {
	want := state.Reservation{VCPUs: req.VCPUs, MemoryMiB: req.MemoryMiB}
	if req.NoWait {
		for {
			dir, why, short, err := m.tryAdmit(ctx, req.Name, want)
			if err == nil && why != "" {
				// A machine that serves a job takes the room of idle
				// standby machines first, as a job that waits does.
				if mk := m.hooks.MakeRoom; req.MakeRoom && mk != nil && ctx.Err() == nil {
					// The pool holds its refills meanwhile, as for a job
					// that waits (a lost touch costs one refill too early).
					_ = m.Store.Touch(pressureKey)
					if n := mk(ctx, m, short, "room for job "+req.Name); n != "" {
						continue
					}
				}
				err = fmt.Errorf("%w: %s", ErrNoRoom, why)
			}
			return dir, err
		}
	}
	capCfg := m.Cfg.Capacity
	ctx, cancel := context.WithTimeoutCause(ctx, capCfg.Wait.D(),
		fmt.Errorf("no room on the host within capacity.wait (%s)", capCfg.Wait.D()))
	defer cancel()
	start := time.Now()
	swept := false
	lastSay := time.Time{}
	for {
		dir, why, short, err := m.tryAdmit(ctx, req.Name, want)
		if err != nil || why == "" {
			if err == nil && !lastSay.IsZero() {
				m.say("Room on the host after %s", vm.Round(time.Since(start)))
			}
			return dir, err
		}
		_ = m.Store.Touch(pressureKey) // a lost touch costs one refill too early
		// What is cheaper to lose than this wait goes first (idle standby
		// machines, Hooks.MakeRoom).
		if mk := m.hooks.MakeRoom; mk != nil {
			if n := mk(ctx, m, short, "room for job "+req.Name); n != "" {
				continue
			}
		}
		if !swept {
			swept = true
			rep, err := m.Sweep(ctx, time.Now(), false)
			m.RecordSweep(nil, SweepByRoom, rep)
			if err == nil && len(rep.Removed) > 0 {
				m.say("Removed %d leftover machine(s) to make room", len(rep.Removed))
				continue
			}
		}
		if time.Since(lastSay) >= 30*time.Second {
			m.say("Waiting for room on the host: %s", why)
			lastSay = time.Now()
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("%s: %w", why, context.Cause(ctx))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// HoldAdmission holds the admission lock until unlock: no machine is
// admitted meanwhile (a sweep of shared volumes decides and deletes under
// it). Admission holds it only for its short look at the capacity.
func (ch Capacity) Hold(ctx context.Context) (unlock func(), err error) {
	m := ch.m
	return m.Store.Lock(ctx, admissionLock)
}

// tryAdmit returns the new directory, or why there is no room and what is
// short.
func (m *Manager) tryAdmit(ctx context.Context, name string, want state.Reservation) (dir, why string, short Shortfall, err error) {
	unlock, err := m.Store.Lock(ctx, admissionLock)
	if err != nil {
		return "", "", short, err
	}
	defer unlock()
	capCfg := m.Cfg.Capacity
	if capCfg.MaxVMs > 0 || capCfg.MemoryBudgetMiB > 0 {
		held, err := m.Capacity().Reservations()
		if err != nil {
			return "", "", short, err
		}
		delete(held, name)
		mem := 0
		for _, r := range held {
			mem += r.MemoryMiB
		}
		if capCfg.MaxVMs > 0 {
			short.VMs = max(len(held)+1-capCfg.MaxVMs, 0)
		}
		if capCfg.MemoryBudgetMiB > 0 {
			short.MemoryMiB = max(mem+want.MemoryMiB-capCfg.MemoryBudgetMiB, 0)
		}
		switch {
		case short.VMs > 0:
			return "", fmt.Sprintf("%d of %d VMs in use (capacity.max_vms)", len(held), capCfg.MaxVMs), short, nil
		case short.MemoryMiB > 0:
			return "", fmt.Sprintf("%d MiB of %d MiB in use, this job needs %d MiB (capacity.memory_budget_mib)",
				mem, capCfg.MemoryBudgetMiB, want.MemoryMiB), short, nil
		}
	}
	dir, err = m.Store.Reserve(name, want)
	return dir, "", short, err
}

// Reservations are the capacity each machine of this installation holds,
// by name, as admission counts it.
func (ch Capacity) Reservations() (map[string]state.Reservation, error) {
	m := ch.m
	return m.Store.Reservations(state.Reservation{VCPUs: m.Cfg.Defaults.VCPUs, MemoryMiB: m.Cfg.Defaults.MemoryMiB})
}

// CapacityUsed is what the machines of this installation hold of the
// host now: VMs and memory (MiB) by their reservations, as admission
// counts them.
func (ch Capacity) Used() (vms, memoryMiB int, err error) {
	m := ch.m
	held, err := m.Capacity().Reservations()
	if err != nil {
		return 0, 0, err
	}
	for _, r := range held {
		memoryMiB += r.MemoryMiB
	}
	return len(held), memoryMiB, nil
}

// ErrBootTimeout means a machine had no address or no SSH within
// timeouts.boot.
var ErrBootTimeout = errors.New("boot timeout")
