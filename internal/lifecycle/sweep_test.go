package lifecycle

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func owned(t *testing.T, ctrl string, deadline time.Time) string {
	x, err := vm.MarshalOwner(vm.Owner{Controller: ctrl, Job: "1", Deadline: deadline})
	require.NoError(t, err)
	return x
}

func TestSweep(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, _ := manager(t, hv, g)
	now := time.Now()
	p := MachinePrefix("lve", controller)
	require.Equal(t, "lve-0123abcd-", p)
	// Ours, expired: domain + volume + state.
	hv.Domains[p+"1"] = &vmtest.Domain{OwnerXML: owned(t, controller, now.Add(-time.Minute)), Active: true}
	hv.Volumes["jobs/"+p+"1.qcow2"] = nil
	// ... with the host cache's disks a killed run stage left.
	hv.Volumes["jobs/"+p+"1-data.img"] = nil
	hv.Volumes["jobs/"+p+"1-scratch.img"] = nil
	_, err := m.Store.Create(p + "1")
	require.NoError(t, err)
	// Ours, running within its deadline.
	hv.Domains[p+"2"] = &vmtest.Domain{OwnerXML: owned(t, controller, now.Add(time.Hour)), Active: true}
	hv.Volumes["jobs/"+p+"2.qcow2"] = nil
	// Look-alike without metadata, and one owned by another controller.
	hv.Domains[p+"3"] = &vmtest.Domain{Active: true}
	hv.Volumes["jobs/"+p+"3.qcow2"] = nil
	hv.Domains[p+"4"] = &vmtest.Domain{OwnerXML: owned(t, "ffffffff-0000-4000-8000-000000000000", now.Add(-time.Hour)), Active: true}
	// Orphans: a volume and a seed without a domain, with the state
	// directory that prepare makes first (prepare SIGKILLed before define).
	hv.Volumes["jobs/"+p+"5.qcow2"] = nil
	hv.Volumes["jobs/"+p+"5-seed.img"] = nil
	hv.Volumes["jobs/"+p+"5-scratch.img"] = nil
	_, err = m.Store.Create(p + "5")
	require.NoError(t, err)
	// An orphan whose prepare is still running (holds the lock).
	hv.Volumes["jobs/"+p+"6.qcow2"] = nil
	_, err = m.Store.Create(p + "6")
	require.NoError(t, err)
	unlock6, err := m.Store.TryLock(p + "6")
	require.NoError(t, err)
	defer unlock6()
	// Volumes of our naming with neither a domain nor a state directory:
	// nothing proves they are ours.
	hv.Volumes["jobs/"+p+"8.qcow2"] = nil
	hv.Volumes["jobs/"+p+"9-data.img"] = nil
	// Other installations' and unrelated names are not even listed.
	hv.Domains["lve-ffffffff-7"] = &vmtest.Domain{Active: true}
	hv.Volumes["jobs/base.qcow2"] = nil
	// Network filter bindings: one a machine libvirt could not release left
	// (its owner gone), a running machine's, another installation's.
	hv.Bindings = []vm.FilterBinding{
		{PortDev: "vnet1", Filter: vm.FilterName, OwnerName: p + "gone"},
		{PortDev: "vnet2", Filter: vm.FilterName, OwnerName: p + "2"},
		{PortDev: "vnet3", Filter: vm.FilterName, OwnerName: "lve-ffffffff-gone"},
	}

	verdicts := func(items []Item) map[string]string {
		out := map[string]string{}
		for _, it := range items {
			out[it.Name] = it.Verdict
		}
		return out
	}
	items, err := m.Inventory(context.Background(), now)
	require.NoError(t, err)
	require.Equal(t, map[string]string{
		p + "1": VerdictExpired, p + "2": VerdictKeep, p + "3": VerdictForeign,
		p + "4": VerdictForeign, p + "5": VerdictOrphan, p + "6": VerdictOrphan,
		p + "8": VerdictUnproven, p + "9": VerdictUnproven,
	}, verdicts(items))

	// Dry run: reports, touches nothing.
	rep, err := m.Sweep(context.Background(), now, true)
	require.NoError(t, err)
	require.Empty(t, rep.Removed)
	require.Len(t, hv.Domains, 5)
	require.Equal(t, VerdictBusy, verdicts(rep.Items)[p+"6"])
	require.Equal(t, []vm.FilterBinding{hv.Bindings[0]}, rep.Bindings)
	require.Len(t, hv.Bindings, 3)

	rep, err = m.Sweep(context.Background(), now, false)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{p + "1", p + "5"}, rep.Removed)
	require.Len(t, rep.Bindings, 1)
	require.Equal(t, "vnet1", rep.Bindings[0].PortDev)
	require.Equal(t, []string{"vnet2", "vnet3"}, []string{hv.Bindings[0].PortDev, hv.Bindings[1].PortDev})
	require.NotContains(t, hv.Domains, p+"1")
	require.NotContains(t, hv.Volumes, "jobs/"+p+"1.qcow2")
	require.NoDirExists(t, m.Store.MachineDir(p+"1"))
	require.NotContains(t, hv.Volumes, "jobs/"+p+"5.qcow2")
	require.NotContains(t, hv.Volumes, "jobs/"+p+"5-seed.img")
	for _, gone := range []string{p + "1-data.img", p + "1-scratch.img", p + "5-scratch.img"} {
		require.NotContains(t, hv.Volumes, "jobs/"+gone)
	}
	for _, keep := range []string{p + "2", p + "3", p + "4", "lve-ffffffff-7"} {
		require.True(t, hv.Domains[keep].Active, "%s untouched", keep)
	}
	for _, keep := range []string{p + "2.qcow2", p + "3.qcow2", p + "6.qcow2", p + "8.qcow2", p + "9-data.img", "base.qcow2"} {
		require.Contains(t, hv.Volumes, "jobs/"+keep)
	}

	// Once the prepare holding the lock is gone, its orphan goes too.
	unlock6()
	rep, err = m.Sweep(context.Background(), now, false)
	require.NoError(t, err)
	require.Equal(t, []string{p + "6"}, rep.Removed)
	require.Contains(t, hv.Volumes, "jobs/"+p+"8.qcow2", "unproven volumes are never removed")
	require.Equal(t, VerdictUnproven, verdicts(rep.Items)[p+"8"])
}

// A prepare that finishes between the sweep's inventory and its action: the
// inventory saw an orphan (lock and state directory, no domain yet), but once
// the sweep gets the lock the machine is a live job's. The sweep judges it
// again from fresh facts and leaves it.
func TestSweepJudgesAgainAfterLocking(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, _ := manager(t, hv, g)
	now := time.Now()
	name := MachinePrefix("lve", controller) + "1"
	// The prepare in flight: it holds the lock and has reserved its state
	// directory, and defined nothing yet.
	unlock, err := m.Store.TryLock(name)
	require.NoError(t, err)
	_, err = m.Store.Reserve(name, state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	items, err := m.Inventory(context.Background(), now)
	require.NoError(t, err)
	require.Len(t, items, 1)
	require.Equal(t, VerdictOrphan, items[0].Verdict, "what the sweep sees first")

	m.afterInventory = func() {
		// The prepare completes: domain with a deadline ahead, record
		// saved, lock released.
		hv.Lock()
		hv.Domains[name] = &vmtest.Domain{OwnerXML: owned(t, controller, now.Add(time.Hour)), Active: true}
		hv.Volumes["jobs/"+vm.DiskVolume(name)] = nil
		hv.Unlock()
		require.NoError(t, m.Store.Save(state.Machine{Name: name, Address: "192.0.2.9"}))
		unlock()
	}
	rep, err := m.Sweep(context.Background(), now, false)
	require.NoError(t, err)
	require.Empty(t, rep.Removed)
	require.Contains(t, hv.Domains, name, "the live job's domain is still defined")
	require.True(t, hv.Domains[name].Active)
	require.Contains(t, hv.Volumes, "jobs/"+vm.DiskVolume(name))
	require.DirExists(t, m.Store.MachineDir(name), "its state is still there")
	require.Len(t, rep.Items, 1)
	require.Equal(t, VerdictKeep, rep.Items[0].Verdict, "reported with the fresh verdict")
	require.True(t, rep.Items[0].Domain)
	require.True(t, rep.Items[0].State)
}
