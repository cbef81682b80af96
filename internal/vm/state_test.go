package vm_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func TestExplain(t *testing.T) {
	hv := vmtest.New()
	e := &vm.Engine{HV: hv}
	require.Equal(t, "VM a no longer exists", e.Explain(context.Background(), "a", "jobs"))
	hv.Domains["a"] = &vmtest.Domain{Active: true}
	require.Empty(t, e.Explain(context.Background(), "a", "jobs"), "a running guest: nothing to explain")
	hv.Domains["a"].State = &vm.DomainState{Code: vm.StatePaused, Summary: "paused (I/O error)", IOError: true}
	require.Contains(t, e.Explain(context.Background(), "a", "jobs"), "storage pool jobs is probably full")
	hv.Domains["a"].State = &vm.DomainState{Code: vm.StateShutOff, Summary: "shut off (destroyed)"}
	require.Equal(t, "VM a is shut off (destroyed)", e.Explain(context.Background(), "a", "jobs"))
}

// Each state's String is how its Summary begins; the zero value is
// StateUnknown.
func TestStateCodeString(t *testing.T) {
	var zero vm.StateCode
	require.Equal(t, vm.StateUnknown, zero)
	for c, want := range map[vm.StateCode]string{
		vm.StateUnknown: "unknown", vm.StateRunning: "running", vm.StatePaused: "paused",
		vm.StateShuttingDown: "shutting down", vm.StateShutOff: "shut off", vm.StateCrashed: "crashed",
		vm.StateSuspended: "suspended by the guest", vm.StateCode(99): "unknown",
	} {
		require.Equal(t, want, c.String())
	}
}

// The fake reports a domain without a set State by its Active flag.
func TestFakeStateCode(t *testing.T) {
	hv := vmtest.New()
	hv.Domains["a"] = &vmtest.Domain{Active: true}
	hv.Domains["b"] = &vmtest.Domain{}
	st, err := hv.State(context.Background(), "a")
	require.NoError(t, err)
	require.Equal(t, vm.DomainState{Code: vm.StateRunning, Running: true, Summary: "running"}, st)
	st, err = hv.State(context.Background(), "b")
	require.NoError(t, err)
	require.Equal(t, vm.DomainState{Code: vm.StateShutOff, Summary: "shut off"}, st)
}
