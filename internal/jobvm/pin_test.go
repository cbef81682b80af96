package jobvm

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// A machine's filter is given its address before the machine is handed
// out (while libvirt sets the filter up again its rules are not all in
// place, so no job code may run then): Provision returns a pinned machine.
func TestFilterPinnedBeforeHandOut(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	req := testRequest(img)
	ready, err := m.Provision(context.Background(), req)
	require.NoError(t, err)
	defer ready.Client.Close()
	require.True(t, m.Pinned(req.Name))
	hv.Lock()
	require.Contains(t, hv.Calls, "PinFilterAddress")
	require.Contains(t, hv.Domains[req.Name].XML, `<parameter name="IP" value="127.0.0.1">`)
	hv.Unlock()
	require.NoError(t, m.Teardown(context.Background(), req.Name))
	requireNothingLeft(t, hv, m)
}
