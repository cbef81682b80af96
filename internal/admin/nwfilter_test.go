package admin

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

func TestNWFilterCheck(t *testing.T) {
	c := nwfilterCheck(func(string) (bool, error) { return true, nil })
	require.True(t, c.OK, c.Info)
	require.False(t, c.Warn)

	// the project's own filters come with the first VM: a warning only
	c = nwfilterCheck(func(n string) (bool, error) { return n != vm.FilterEgressName, nil })
	require.True(t, c.OK)
	require.True(t, c.Warn)
	require.Contains(t, c.Info, vm.FilterEgressName+" not yet")

	// libvirt's clean-traffic missing: no VM can start
	c = nwfilterCheck(func(n string) (bool, error) { return n != "clean-traffic", nil })
	require.False(t, c.OK)
	require.Contains(t, c.Info, "no network filter clean-traffic")
	require.Contains(t, c.Fix, "libvirt-daemon-config-nwfilter")

	c = nwfilterCheck(func(n string) (bool, error) {
		if n == "clean-traffic" {
			return false, errors.New("boom")
		}
		return true, nil
	})
	require.False(t, c.OK)
	require.Equal(t, "clean-traffic: boom", c.Info)
}
