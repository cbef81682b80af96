package lifecycle

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// A spare entry is held by one machine at a time; the hold ends when the
// machine gives it back or its state directory goes (teardown's last step).
func TestAddressBookHoldsOneMachinePerSpare(t *testing.T) {
	st := state.Store{Dir: t.TempDir()}
	b := AddressBook{Store: st}
	ctx := context.Background()
	spares := []vm.DHCPHost{{MAC: "52:54:00:00:00:05", Name: "s5", IP: "10.9.8.5"}, {MAC: "52:54:00:00:00:06", Name: "s6", IP: "10.9.8.6"}}
	for _, n := range []string{"m1", "m2", "m3"} {
		_, err := st.Reserve(n, state.Reservation{VCPUs: 1, MemoryMiB: 64})
		require.NoError(t, err)
	}
	h1, ok, err := b.Take(ctx, "m1", spares)
	require.NoError(t, err)
	require.True(t, ok)
	h2, ok, err := b.Take(ctx, "m2", spares)
	require.NoError(t, err)
	require.True(t, ok)
	require.NotEqual(t, h1.IP, h2.IP)
	_, ok, err = b.Take(ctx, "m3", spares)
	require.NoError(t, err)
	require.False(t, ok, "both spares are held")

	require.NoError(t, b.Give("m1"))
	h3, ok, err := b.Take(ctx, "m3", spares)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, h1, h3, "m1's spare, given back")

	require.NoError(t, st.Remove("m2"))
	held, err := st.AddressHolds()
	require.NoError(t, err)
	require.Equal(t, map[string]string{"10.9.8.5": "m3"}, held, "m2's hold went with its directory")

	_, _, err = b.Take(ctx, "gone", spares)
	require.ErrorContains(t, err, "no state directory", "no hold without the machine's directory")
}
