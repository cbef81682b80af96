package lifecycle

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// CountMachines sorts the domains by their state code: running, paused,
// shut off, and any other state (crashed, shutting down ...) as "other".
func TestCountMachinesByState(t *testing.T) {
	hv := vmtest.New()
	m, _ := manager(t, hv, newGuest(t, hv))
	x, err := vm.MarshalOwner(vm.Owner{Controller: controller, Frontend: "test", Job: "7"})
	require.NoError(t, err)
	add := func(name string, active bool, st *vm.DomainState) {
		hv.Domains[name] = &vmtest.Domain{XML: "<domain/>", OwnerXML: x, Active: active, State: st}
	}
	add("lve-0123abcd-1", true, nil)
	add("lve-0123abcd-2", false, nil)
	add("lve-0123abcd-3", true, &vm.DomainState{Code: vm.StatePaused, Summary: "paused (I/O error)", IOError: true})
	add("lve-0123abcd-4", true, &vm.DomainState{Code: vm.StatePaused, Summary: "paused (by a user)"})
	add("lve-0123abcd-5", true, &vm.DomainState{Code: vm.StateCrashed, Summary: "crashed (guest kernel panic)"})
	got, err := m.CountMachines(context.Background(), func(string) string { return "job" })
	require.NoError(t, err)
	require.Equal(t, map[[2]string]int{{"job", "running"}: 1, {"job", "shutoff"}: 1, {"job", "paused"}: 2, {"job", "other"}: 1}, got)
}
