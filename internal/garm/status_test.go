package garm

import (
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// garm is told an instance's status from the domain's state code; a
// paused or crashed guest is an error, with libvirt's summary as the
// fault.
func TestInstanceStatusFromStateCode(t *testing.T) {
	for _, tc := range []struct {
		st    vm.DomainState
		want  string
		fault string
	}{
		{vm.DomainState{Code: vm.StateRunning, Running: true, Summary: "running"}, StatusRunning, ""},
		{vm.DomainState{Code: vm.StateShutOff, Summary: "shut off (destroyed)"}, StatusStopped, ""},
		{vm.DomainState{Code: vm.StatePaused, Summary: "paused (I/O error)", IOError: true}, StatusError, "libvirt: paused (I/O error)"},
		{vm.DomainState{Code: vm.StateCrashed, Summary: "crashed (guest kernel panic)"}, StatusError, "libvirt: crashed (guest kernel panic)"},
		{vm.DomainState{Code: vm.StateShuttingDown, Summary: "shutting down"}, StatusUnknown, ""},
		{vm.DomainState{Code: vm.StateSuspended, Summary: "suspended by the guest"}, StatusUnknown, ""},
		{vm.DomainState{Summary: "state 0, reason 0"}, StatusUnknown, ""},
	} {
		in := instanceOf(lifecycle.Owned{Name: "lve-x", State: tc.st})
		require.Equal(t, tc.want, in.Status, tc.st.Summary)
		require.Equal(t, tc.fault, string(in.ProviderFault), tc.st.Summary)
	}
}
