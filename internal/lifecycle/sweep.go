package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Verdicts of an inventory item.
const (
	VerdictKeep    = "keep"    // ours, before its deadline
	VerdictExpired = "expired" // ours, deadline passed: removed by a sweep
	VerdictOrphan  = "orphan"  // state (and its volumes) or a lock without a domain: removed by a sweep
	VerdictBusy    = "busy"    // a stage of this installation works on it right now
	VerdictForeign = "foreign" // a domain of our naming that is not ours: never touched
	// VerdictUnproven: volumes of our naming with neither a domain nor a
	// state directory. Nothing proves they are ours: never touched.
	VerdictUnproven = "unproven"
	// VerdictRetired: an unclaimed standby machine marked for removal
	// (dead, too old, of an old base image, or its room taken by a job).
	VerdictRetired = "retired"
	// VerdictEnded: a machine whose job's cleanup stopped it and left the
	// rest to its reaper, which has not finished (it died, or is about to
	// take the machine's lock).
	VerdictEnded = "ended"
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
	// Standby is set for a machine of a standby pool: its record (nil
	// while booting) and claim.
	Standby *Standby
	// Ended is the machine's ended mark (EndJob), if it has one.
	Ended   *state.Ended
	Verdict string
	Reason  string
}

// Standby is one standby machine as the state directory shows it.
type Standby struct {
	Name string
	// Record is nil while the machine boots (or when a boot was cut off).
	Record *state.Machine
	// Claim is nil while the machine is idle.
	Claim *state.Claim
}

// Idle reports whether the machine is booted and unclaimed.
func (s Standby) Idle() bool { return s.Record != nil && s.Record.Standby != nil && s.Claim == nil }

// Pool says what a standby machine is doing: "booting", "idle",
// "claimed" (by a job) or "retiring"; "" for a job's own machine.
func (it Item) Pool() string {
	switch s := it.Standby; {
	case s == nil:
		return ""
	case s.Claim != nil && s.Claim.Retire:
		return "retiring"
	case s.Claim != nil:
		return "claimed"
	case s.Record == nil:
		return "booting"
	}
	return "idle"
}

func (m *Manager) namePrefix() string { return MachinePrefix(m.Cfg.NamePrefix, m.Controller) }

// Inventory lists every domain, volume, state directory and lock of this
// installation's naming, with what a sweep at time now would do with it.
func (m *Manager) Inventory(ctx context.Context, now time.Time) ([]Item, error) {
	vols, err := m.poolVolumes(ctx)
	if err != nil {
		return nil, err
	}
	names, err := m.machineNames(ctx, vols)
	if err != nil {
		return nil, err
	}
	out := make([]Item, 0, len(names))
	for _, n := range names {
		it, err := m.examine(ctx, n, vols, now)
		if err != nil {
			return nil, err
		}
		out = append(out, it)
	}
	return out, nil
}

// poolVolumes lists the volumes of the configured storage pool.
func (m *Manager) poolVolumes(ctx context.Context) ([]string, error) {
	vols, err := m.hv.VolumeNames(ctx, m.Cfg.StoragePool)
	if err != nil {
		return nil, fmt.Errorf("list volumes of pool %s: %w", m.Cfg.StoragePool, err)
	}
	return vols, nil
}

// BackingFiles lists the backing files of the storage pool's volumes
// (each once): the base images VMs use now, which an image store must
// keep (ociimage.Image.InUse).
func (vh Volumes) BackingFiles(ctx context.Context) ([]string, error) {
	m := vh.m
	vols, err := m.poolVolumes(ctx)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var out []string
	for _, v := range vols {
		b, err := m.hv.VolumeBacking(ctx, m.Cfg.StoragePool, v)
		if errors.Is(err, vm.ErrNotFound) {
			continue // gone since the list
		}
		if err != nil {
			return nil, fmt.Errorf("backing file of volume %s: %w", v, err)
		}
		if b != "" && !seen[b] {
			seen[b] = true
			out = append(out, b)
		}
	}
	return out, nil
}

// machineNames lists, sorted, the names of this installation's naming that
// have a domain, a volume among vols, a state directory or a lock file.
func (m *Manager) machineNames(ctx context.Context, vols []string) ([]string, error) {
	prefix := m.namePrefix()
	found := map[string]bool{}
	add := func(name string) {
		if strings.HasPrefix(name, prefix) && vm.CheckName(name) == nil {
			found[name] = true
		}
	}
	doms, err := m.hv.DomainNames(ctx)
	if err != nil {
		return nil, fmt.Errorf("list domains: %w", err)
	}
	for _, d := range doms {
		add(d)
	}
	for _, v := range vols {
		if name, ok := MachineOfVolume(v); ok {
			add(name)
		}
	}
	states, err := m.Store.Names()
	if err != nil {
		return nil, err
	}
	locks, err := m.Store.LockNames()
	if err != nil {
		return nil, err
	}
	for _, n := range slices.Concat(states, locks) {
		add(n)
	}
	return slices.Sorted(maps.Keys(found)), nil
}

// MachineOfVolume returns the machine whose disk or seed volume v would be
// (false: v is no machine's volume).
func MachineOfVolume(v string) (string, bool) {
	if name, ok := strings.CutSuffix(v, ".qcow2"); ok {
		return name, true
	}
	for _, suffix := range []string{"-seed.img", "-data.img", "-scratch.img", ".save"} {
		if name, ok := strings.CutSuffix(v, suffix); ok {
			return name, true
		}
	}
	return "", false
}

// examine gathers what the host holds under one machine name right now (the
// domain with its ownership record, the machine's volumes among poolVolumes,
// its state directory and recorded address) and judges it as a sweep at now
// would.
func (m *Manager) examine(ctx context.Context, name string, poolVolumes []string, now time.Time) (Item, error) {
	it := Item{Name: name}
	for _, v := range vm.Volumes(name) {
		if slices.Contains(poolVolumes, v) {
			it.Volumes = append(it.Volumes, v)
		}
	}
	var err error
	if it.State, err = m.Store.Has(name); err != nil {
		return Item{}, err
	}
	if it.State {
		if mach, err := m.Store.Record(name); err == nil {
			it.Address = mach.Address
		}
		it.Ended, _ = m.Store.EndedOf(name)
		if m.Machine(name).IsStandby() {
			sb := &Standby{Name: name}
			sb.Record, _ = m.Store.Record(name)
			sb.Claim, _ = m.Store.ClaimOf(name)
			it.Standby = sb
		}
	}
	ownerXML, ownerErr := m.hv.Owner(ctx, name)
	if !errors.Is(ownerErr, vm.ErrNotFound) {
		it.Domain = true
		it.Active, _ = m.hv.IsActive(ctx, name)
	}
	m.judge(&it, ownerXML, ownerErr, now)
	if it.Verdict == VerdictKeep && it.Pool() == "retiring" {
		it.Verdict, it.Reason = VerdictRetired, "standby VM marked for removal: "+it.Standby.Claim.Reason
	}
	if (it.Verdict == VerdictKeep || it.Verdict == VerdictOrphan) && m.Machine(name).IsSnapshotTemplate() {
		// A saved template has no domain (Build undefines it): its record
		// keeps it, not a deadline.
		SnapshotsOf(m).judgeTemplate(ctx, &it, now)
	}
	if it.Verdict == VerdictKeep && it.Ended != nil {
		it.Verdict, it.Reason = VerdictEnded, "its job ended ("+it.Ended.Reason+"); its reaper did not remove it"
	}
	return it, nil
}

// examineNow is examine with a fresh look at the pool.
func (m *Manager) examineNow(ctx context.Context, name string, now time.Time) (Item, error) {
	vols, err := m.poolVolumes(ctx)
	if err != nil {
		return Item{}, err
	}
	return m.examine(ctx, name, vols, now)
}

// judge sets the item's verdict from its facts; ownerXML and ownerErr are
// what the hypervisor answered when asked for the domain's ownership record.
func (m *Manager) judge(it *Item, ownerXML string, ownerErr error, now time.Time) {
	if !it.Domain {
		it.Verdict, it.Reason = orphanVerdict(it)
		return
	}
	if ownerErr != nil {
		it.Verdict, it.Reason = VerdictForeign, "no ownership metadata"
		if !errors.Is(ownerErr, vm.ErrNoOwner) {
			it.Reason = ownerErr.Error()
		}
		return
	}
	o, err := vm.ParseOwner(ownerXML)
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
}

// orphanVerdict judges what is left of a machine without a domain. Volumes
// are provably ours only with the state directory that prepare makes before
// any of them and teardown removes after all of them.
func orphanVerdict(it *Item) (verdict, reason string) {
	if len(it.Volumes) > 0 && !it.State {
		return VerdictUnproven, "volumes without a domain or a state record: not provably ours; remove by hand"
	}
	return VerdictOrphan, "no domain"
}

// SweepReport says what a sweep did.
type SweepReport struct {
	Items   []Item
	Removed []string
	Errors  []error
	// SharedVolumes are shared disks' volumes no machine uses any more
	// (Hooks.Sweepers: the guest tools of earlier binaries): removed, or
	// with dryRun, removable.
	SharedVolumes []string
	// Bindings are this installation's stale network filter bindings
	// (vm.Engine.RemoveStaleFilterBindings): removed, or with dryRun,
	// removable.
	Bindings []vm.FilterBinding
}

// Sweep removes this installation's expired machines and orphaned volumes,
// state and locks. It never touches a foreign domain or volumes it cannot
// prove are its own (VerdictUnproven), and skips a machine whose lock
// another process holds (a prepare or cleanup in progress). Once
// it holds a machine's lock it judges the machine again from fresh facts and
// acts only if that verdict still says remove. With dryRun it only reports.
func (m *Manager) Sweep(ctx context.Context, now time.Time, dryRun bool) (*SweepReport, error) {
	items, err := m.Inventory(ctx, now)
	if err != nil {
		return nil, err
	}
	if m.afterInventory != nil {
		m.afterInventory()
	}
	rep := &SweepReport{}
	for _, it := range items {
		if !it.Removable() {
			rep.Items = append(rep.Items, it)
			continue
		}
		m.sweepOne(ctx, rep, it, now, dryRun)
	}
	for _, sw := range m.hooks.Sweepers {
		if err := sw(ctx, m, rep, dryRun); err != nil {
			rep.Errors = append(rep.Errors, err)
		}
	}
	stale, err := m.engine().RemoveStaleFilterBindings(ctx, dryRun)
	rep.Bindings = stale
	if err != nil {
		rep.Errors = append(rep.Errors, err)
	}
	return rep, errors.Join(rep.Errors...)
}

// sweepOne handles one machine the inventory judged removable (seen). That
// verdict came before its lock was ours: a stage may have changed the machine
// since (a prepare in flight finished it), so it judges again under the lock
// and records in rep what it found and did.
func (m *Manager) sweepOne(ctx context.Context, rep *SweepReport, seen Item, now time.Time, dryRun bool) {
	name := seen.Name
	unlock, err := m.Store.TryLock(name)
	if errors.Is(err, state.ErrBusy) {
		seen.Verdict, seen.Reason = VerdictBusy, "a stage is working on it"
		rep.Items = append(rep.Items, seen)
		return
	}
	if err != nil {
		rep.Errors = append(rep.Errors, err)
		return
	}
	defer unlock()
	it, err := m.examineNow(ctx, name, now)
	if err != nil {
		rep.Errors = append(rep.Errors, fmt.Errorf("%s: %w", name, err))
		return
	}
	rep.Items = append(rep.Items, it)
	if dryRun || !it.Removable() {
		return
	}
	if err := m.teardown(ctx, name); err != nil {
		rep.Errors = append(rep.Errors, fmt.Errorf("%s: %w", name, err))
		return
	}
	m.Store.RemoveLock(name)
	rep.Removed = append(rep.Removed, name)
}

// Removable reports whether a sweep would remove the item.
func (it Item) Removable() bool {
	return slices.Contains([]string{VerdictExpired, VerdictOrphan, VerdictRetired, VerdictEnded}, it.Verdict)
}
