package jobvm

import (
	"context"
	"log/slog"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// A cold job's machine boots without the filter pin (DeferFilterPin): its
// holder pins it while the stages run, once; a standby is pinned at boot.
func TestHolderPinsTheFilterLater(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	req := testRequest(img)
	req.DeferFilterPin = true
	ready, err := m.Manager().Provision(context.Background(), req)
	require.NoError(t, err)
	defer ready.Client.Close()
	hv.Lock()
	require.NotContains(t, hv.Calls, "PinFilterAddress", "not on prepare's path")
	require.Contains(t, hv.Domains[req.Name].XML, "CTRL_IP_LEARNING")
	hv.Unlock()
	require.False(t, m.Manager().Machine(req.Name).Pinned())

	m.pinForHolder(context.Background(), req.Name, slog.New(slog.DiscardHandler))
	require.True(t, m.Manager().Machine(req.Name).Pinned())
	hv.Lock()
	require.Contains(t, hv.Domains[req.Name].XML, `<parameter name="IP" value="127.0.0.1">`)
	n := len(hv.Calls)
	hv.Unlock()

	m.pinForHolder(context.Background(), req.Name, slog.New(slog.DiscardHandler))
	hv.Lock()
	require.False(t, slices.Contains(hv.Calls[n:], "PinFilterAddress"), "pinned once")
	hv.Unlock()
	require.NoError(t, m.Manager().Machine(req.Name).Teardown(context.Background()))

	// without DeferFilterPin (a standby's boot): pinned at boot
	req = testRequest(img)
	req.Name = "lve-0123abcd-8"
	ready2, err := m.Manager().Provision(context.Background(), req)
	require.NoError(t, err)
	defer ready2.Client.Close()
	require.True(t, m.Manager().Machine(req.Name).Pinned())
	require.NoError(t, m.Manager().Machine(req.Name).Teardown(context.Background()))
	requireNothingLeft(t, hv, m)
}
