package vm_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// Without a registered Connector (an executable that does not import
// internal/vm/libvirtvm), Connect says why it cannot; with one, it uses it.
func TestConnectThroughTheRegisteredConnector(t *testing.T) {
	ctx := context.Background()
	_, err := Connect(ctx, "qemu:///system")
	require.ErrorIs(t, err, ErrNoConnector)
	require.ErrorContains(t, err, "this executable was built without libvirt")

	hv := vmtest.New()
	var uris []string
	RegisterConnector(func(_ context.Context, uri string) (Hypervisor, error) {
		uris = append(uris, uri)
		return hv, nil
	})
	t.Cleanup(func() { RegisterConnector(nil) })
	got, err := Connect(ctx, "test:///default")
	require.NoError(t, err)
	require.Same(t, hv, got)
	require.Equal(t, []string{"test:///default"}, uris)
}
