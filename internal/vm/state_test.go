package vm_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func TestDescribeState(t *testing.T) {
	for _, tc := range []struct {
		st      libvirt.DomainState
		reason  int
		want    string
		running bool
		ioerr   bool
	}{
		{libvirt.DOMAIN_RUNNING, int(libvirt.DOMAIN_RUNNING_BOOTED), "running", true, false},
		{libvirt.DOMAIN_PAUSED, int(libvirt.DOMAIN_PAUSED_IOERROR), "paused (I/O error)", false, true},
		{libvirt.DOMAIN_PAUSED, int(libvirt.DOMAIN_PAUSED_USER), "paused (by a user)", false, false},
		{libvirt.DOMAIN_SHUTOFF, int(libvirt.DOMAIN_SHUTOFF_DESTROYED), "shut off (destroyed)", false, false},
		{libvirt.DOMAIN_SHUTOFF, int(libvirt.DOMAIN_SHUTOFF_CRASHED), "shut off (crashed)", false, false},
		{libvirt.DOMAIN_CRASHED, int(libvirt.DOMAIN_CRASHED_PANICKED), "crashed (guest kernel panic)", false, false},
		{libvirt.DOMAIN_SHUTOFF, 99, "shut off", false, false},
	} {
		got := vm.DescribeState(tc.st, tc.reason)
		require.Equal(t, tc.want, got.Summary)
		require.Equal(t, tc.running, got.Running, tc.want)
		require.Equal(t, tc.ioerr, got.IOError, tc.want)
	}
}

func TestExplain(t *testing.T) {
	hv := vmtest.New()
	e := &vm.Engine{HV: hv}
	require.Equal(t, "VM a no longer exists", e.Explain(context.Background(), "a", "jobs"))
	hv.Domains["a"] = &vmtest.Domain{Active: true}
	require.Empty(t, e.Explain(context.Background(), "a", "jobs"), "a running guest: nothing to explain")
	hv.Domains["a"].State = &vm.DomainState{Summary: "paused (I/O error)", IOError: true}
	require.Contains(t, e.Explain(context.Background(), "a", "jobs"), "storage pool jobs is probably full")
	hv.Domains["a"].State = &vm.DomainState{Summary: "shut off (destroyed)"}
	require.Equal(t, "VM a is shut off (destroyed)", e.Explain(context.Background(), "a", "jobs"))
}
