package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Verdicts of an inventory item.
const (
	VerdictKeep    = "keep"    // ours, before its deadline
	VerdictExpired = "expired" // ours, deadline passed: removed by a sweep
	VerdictOrphan  = "orphan"  // volumes or state without a domain: removed by a sweep
	VerdictBusy    = "busy"    // a stage of this installation works on it right now
	VerdictForeign = "foreign" // a domain of our naming that is not ours: never touched
)

// Item is one machine name found on the host.
type Item struct {
	Name    string
	Domain  bool
	Active  bool
	Owner   *vm.Owner
	Volumes []string
	State   bool
	Address string
	Verdict string
	Reason  string
}

// MachinePrefix is how every machine name of this installation starts.
func MachinePrefix(prefix, controller string) string {
	short := controller
	if len(short) > 8 {
		short = short[:8]
	}
	return prefix + "-" + short + "-"
}

func (m *Manager) namePrefix() string { return MachinePrefix(m.Cfg.NamePrefix, m.Controller) }

// Inventory lists every domain, volume, state directory and lock of this
// installation's naming, with what a sweep at time now would do with it.
func (m *Manager) Inventory(now time.Time) ([]Item, error) {
	prefix := m.namePrefix()
	items := map[string]*Item{}
	get := func(name string) *Item {
		if it, ok := items[name]; ok {
			return it
		}
		it := &Item{Name: name}
		items[name] = it
		return it
	}
	doms, err := m.HV.DomainNames()
	if err != nil {
		return nil, fmt.Errorf("list domains: %w", err)
	}
	for _, d := range doms {
		if strings.HasPrefix(d, prefix) && vm.CheckName(d) == nil {
			get(d).Domain = true
		}
	}
	vols, err := m.HV.VolumeNames(m.Cfg.StoragePool)
	if err != nil {
		return nil, fmt.Errorf("list volumes of pool %s: %w", m.Cfg.StoragePool, err)
	}
	for _, v := range vols {
		if !strings.HasPrefix(v, prefix) {
			continue
		}
		name, ok := strings.CutSuffix(v, ".qcow2")
		if !ok {
			name, ok = strings.CutSuffix(v, "-seed.img")
		}
		if ok && vm.CheckName(name) == nil {
			it := get(name)
			it.Volumes = append(it.Volumes, v)
		}
	}
	names, err := m.Store.Names()
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		if strings.HasPrefix(n, prefix) && vm.CheckName(n) == nil {
			get(n).State = true
		}
	}
	locks, err := m.Store.LockNames()
	if err != nil {
		return nil, err
	}
	for _, n := range locks {
		if strings.HasPrefix(n, prefix) && vm.CheckName(n) == nil {
			get(n)
		}
	}
	out := make([]Item, 0, len(items))
	for _, it := range items {
		m.judge(it, now)
		out = append(out, *it)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func (m *Manager) judge(it *Item, now time.Time) {
	if it.State {
		if mach, _, _, err := m.Store.Load(it.Name); err == nil {
			it.Address = mach.Address
		}
	}
	if it.Domain {
		it.Active, _ = m.HV.IsActive(it.Name)
		x, err := m.HV.Owner(it.Name)
		if err != nil {
			it.Verdict, it.Reason = VerdictForeign, "no ownership metadata"
			if !errors.Is(err, vm.ErrNoOwner) {
				it.Reason = err.Error()
			}
			return
		}
		o, err := vm.ParseOwner(x)
		if err != nil || o.Controller != m.Controller {
			it.Verdict, it.Reason = VerdictForeign, "owned by another controller"
			return
		}
		it.Owner = &o
		if now.After(o.Deadline) {
			it.Verdict, it.Reason = VerdictExpired, fmt.Sprintf("deadline passed %s ago", now.Sub(o.Deadline).Round(time.Second))
		} else {
			it.Verdict, it.Reason = VerdictKeep, fmt.Sprintf("deadline in %s", o.Deadline.Sub(now).Round(time.Second))
		}
		return
	}
	it.Verdict, it.Reason = VerdictOrphan, "no domain"
}

// SweepReport says what a sweep did.
type SweepReport struct {
	Items   []Item
	Removed []string
	Errors  []error
}

// Sweep removes this installation's expired machines and orphaned volumes,
// state and locks. It never touches a foreign domain, and skips a machine
// whose lock another process holds (a prepare or cleanup in progress). With
// dryRun it only reports.
func (m *Manager) Sweep(ctx context.Context, now time.Time, dryRun bool) (*SweepReport, error) {
	items, err := m.Inventory(now)
	if err != nil {
		return nil, err
	}
	rep := &SweepReport{}
	for _, it := range items {
		if it.Verdict != VerdictExpired && it.Verdict != VerdictOrphan {
			rep.Items = append(rep.Items, it)
			continue
		}
		unlock, err := m.Store.TryLock(it.Name)
		if errors.Is(err, state.ErrBusy) {
			it.Verdict, it.Reason = VerdictBusy, "a stage is working on it"
			rep.Items = append(rep.Items, it)
			continue
		}
		if err != nil {
			rep.Errors = append(rep.Errors, err)
			continue
		}
		rep.Items = append(rep.Items, it)
		if !dryRun {
			if err := m.teardown(ctx, it.Name); err != nil {
				rep.Errors = append(rep.Errors, fmt.Errorf("%s: %w", it.Name, err))
			} else {
				m.Store.RemoveLock(it.Name)
				rep.Removed = append(rep.Removed, it.Name)
			}
		}
		unlock()
	}
	return rep, errors.Join(rep.Errors...)
}

// Removable reports whether a sweep would remove the item.
func (it Item) Removable() bool {
	return slices.Contains([]string{VerdictExpired, VerdictOrphan}, it.Verdict)
}
