package vm_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// Only this installation's stale bindings go: one of the project's filters,
// owned by a name of this installation's prefix whose domain does not run.
// A running machine's, another installation's, and another filter's stay;
// a dry run removes nothing.
func TestRemoveStaleFilterBindings(t *testing.T) {
	f := vmtest.New()
	f.Domains["lve-0123abcd-run"] = &vmtest.Domain{Active: true}
	f.Domains["lve-0123abcd-off"] = &vmtest.Domain{}
	f.Bindings = []FilterBinding{
		{PortDev: "vnet1", Filter: FilterName, OwnerName: "lve-0123abcd-gone"},
		{PortDev: "vnet2", Filter: FilterEgressName, OwnerName: "lve-0123abcd-off"},
		{PortDev: "vnet3", Filter: FilterName, OwnerName: "lve-0123abcd-run"},
		{PortDev: "vnet4", Filter: FilterName, OwnerName: "lve-99999999-gone"},
		{PortDev: "vnet5", Filter: "clean-traffic", OwnerName: "lve-0123abcd-gone2"},
	}
	e := &Engine{HV: f, Controller: "c", NamePrefix: "lve-0123abcd-"}
	ctx := context.Background()

	stale, err := e.RemoveStaleFilterBindings(ctx, true)
	require.NoError(t, err)
	require.Equal(t, []string{"vnet1", "vnet2"}, portDevs(stale))
	require.Len(t, f.Bindings, 5, "a dry run removes nothing")

	stale, err = e.RemoveStaleFilterBindings(ctx, false)
	require.NoError(t, err)
	require.Equal(t, []string{"vnet1", "vnet2"}, portDevs(stale))
	require.Equal(t, []string{"vnet3", "vnet4", "vnet5"}, portDevs(f.Bindings))

	// Without a prefix nothing is judged ours.
	f.Bindings = append(f.Bindings, FilterBinding{PortDev: "vnet6", Filter: FilterName, OwnerName: "lve-0123abcd-gone"})
	stale, err = (&Engine{HV: f, Controller: "c"}).RemoveStaleFilterBindings(ctx, false)
	require.NoError(t, err)
	require.Empty(t, stale)
	require.Len(t, f.Bindings, 4)
}

// A start refused because a stale binding holds the tap name libvirt chose
// (what libvirt 9.0 does under its polkit access driver after a client died
// in the middle of a destroy) removes the stale binding and starts again,
// saying so; a start that fails for another reason fails as before, once.
func TestCreateStartsAgainAfterAStaleFilterBinding(t *testing.T) {
	ctx := context.Background()
	f := vmtest.New()
	s := testSpec()
	s.Filter = &Filter{}
	f.Bindings = []FilterBinding{{PortDev: "vnet10", Filter: FilterName, OwnerName: "lve-0123abcd-999"}}
	starts := 0
	f.StartErr = func(string, *libvirtxml.Domain) error {
		starts++
		bs, err := f.FilterBindings(ctx)
		require.NoError(t, err)
		if len(bs) > 0 {
			return errors.New("operation failed: binding 'vnet10' already exists")
		}
		return nil
	}
	var lines []string
	e := &Engine{HV: f, Controller: s.Owner.Controller, NamePrefix: "lve-0123abcd-",
		Progress: func(format string, a ...any) { lines = append(lines, fmt.Sprintf(format, a...)) }}
	_, err := e.Create(ctx, s)
	require.NoError(t, err)
	require.Equal(t, 2, starts)
	require.Empty(t, f.Bindings)
	require.True(t, f.Domains[s.Name].Active)
	require.Contains(t, strings.Join(lines, "\n"), "removed 1 stale network filter binding(s) left by machines libvirt could not release (vnet10 (lve-vm-v1 of lve-0123abcd-999)); starting again")

	f = vmtest.New()
	starts = 0
	f.StartErr = func(string, *libvirtxml.Domain) error { starts++; return errors.New("qemu: failed to set MSR") }
	e.HV = f
	_, err = e.Create(ctx, s)
	require.ErrorContains(t, err, "failed to set MSR")
	require.Equal(t, 1, starts, "nothing stale: no second start")
	require.Empty(t, f.Domains, "undone")
}

func portDevs(bs []FilterBinding) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = b.PortDev
	}
	return out
}

// Remove takes away the filter bindings libvirt left for the machine
// itself (a prepare killed mid-start): the job's cleanup leaves none. Other
// machines' bindings and other filters' stay. A binding whose tap name went
// to another domain since it was listed is not touched.
func TestRemoveTakesTheMachinesOwnBindings(t *testing.T) {
	f := vmtest.New()
	s := testSpec()
	e := &Engine{HV: f, Controller: s.Owner.Controller, NamePrefix: "lve-0123abcd-"}
	ctx := context.Background()
	_, err := e.Create(ctx, s)
	require.NoError(t, err)
	f.Bindings = []FilterBinding{
		{PortDev: "vnet1", Filter: FilterName, OwnerName: s.Name},
		{PortDev: "vnet2", Filter: FilterName, OwnerName: "lve-0123abcd-other"},
		{PortDev: "vnet3", Filter: "clean-traffic", OwnerName: s.Name},
		{PortDev: "vnet4", Filter: FilterEgressName, OwnerName: s.Name},
	}
	// vnet4 goes to another domain between the list and the delete.
	f.BeforeCall = func(method string) {
		if method == "DeleteFilterBinding" {
			for i := range f.Bindings {
				if f.Bindings[i].PortDev == "vnet4" {
					f.Bindings[i].OwnerName = "lve-0123abcd-new"
				}
			}
		}
	}
	require.NoError(t, e.Remove(ctx, s.Name, s.Pool, false))
	require.Equal(t, []string{"vnet2", "vnet3", "vnet4"}, portDevs(f.Bindings))
	require.Equal(t, "lve-0123abcd-new", f.Bindings[2].OwnerName)
}

// A standby machine that a hook job may claim boots with shared memory and
// no share; the job's shares are hot-plugged, each checked first.
func TestSharedMemoryThenAttachDirs(t *testing.T) {
	s := testSpec()
	s.SharedMemory = true
	x, err := DomainXML(s, "/pool/d.qcow2", "")
	require.NoError(t, err)
	var d libvirtxml.Domain
	require.NoError(t, d.Unmarshal(x))
	require.Equal(t, "memfd", d.MemoryBacking.MemorySource.Type)
	require.Equal(t, "shared", d.MemoryBacking.MemoryAccess.Mode)
	require.Empty(t, d.Devices.Filesystems)

	f := vmtest.New()
	f.Domains["lve-0123abcd-sb-1"] = &vmtest.Domain{Active: true, XML: x}
	e := &Engine{HV: f, Controller: "c", NamePrefix: "lve-0123abcd-"}
	ctx := context.Background()
	for _, bad := range []SharedDir{{Socket: "/run/x.sock", Tag: "Work"}, {Socket: "run/x.sock", Tag: "w"}} {
		require.Error(t, e.AttachDirs(ctx, "lve-0123abcd-sb-1", []SharedDir{bad}), "%+v", bad)
	}
	require.Error(t, e.AttachDirs(ctx, "lve-0123abcd-sb-1", []SharedDir{{Socket: "/run/w.sock", Tag: "w"}, {Socket: "/run/x.sock", Tag: "w"}}), "a tag twice")
	require.Error(t, e.AttachDirs(ctx, "lve-0123abcd-sb-1", []SharedDir{{Socket: "/run/w.sock", Tag: "w"}, {Socket: "x.sock", Tag: "x"}}), "a bad second entry")
	require.NotContains(t, f.Calls, "AttachFilesystem", "nothing unchecked reaches libvirt, not even a good first entry")
	plain, err := DomainXML(testSpec(), "/pool/d.qcow2", "")
	require.NoError(t, err)
	f.Domains["lve-0123abcd-plain"] = &vmtest.Domain{Active: true, XML: plain}
	require.ErrorContains(t, e.AttachDirs(ctx, "lve-0123abcd-plain", []SharedDir{{Socket: "/run/w.sock", Tag: "w"}}), "needs shared memory", "the hypervisor refuses a share without shared memory (the fake as QEMU): AttachDirs passes the refusal on")
	require.NoError(t, e.AttachDirs(ctx, "lve-0123abcd-sb-1", []SharedDir{{Socket: "/run/w.sock", Tag: "lve-work"}, {Socket: "/run/e.sock", Tag: "lve-ext"}}))
	require.NoError(t, d.Unmarshal(f.Domains["lve-0123abcd-sb-1"].XML))
	require.Len(t, d.Devices.Filesystems, 2)
	require.Equal(t, "/run/e.sock", d.Devices.Filesystems[1].Source.Mount.Socket)
	require.ErrorIs(t, e.AttachDirs(ctx, "lve-0123abcd-gone", []SharedDir{{Socket: "/run/w.sock", Tag: "w"}}), ErrNotFound)
}
