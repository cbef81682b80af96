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
	hv.Domains["a"].State = &vm.DomainState{Summary: "paused (I/O error)", IOError: true}
	require.Contains(t, e.Explain(context.Background(), "a", "jobs"), "storage pool jobs is probably full")
	hv.Domains["a"].State = &vm.DomainState{Summary: "shut off (destroyed)"}
	require.Equal(t, "VM a is shut off (destroyed)", e.Explain(context.Background(), "a", "jobs"))
}
