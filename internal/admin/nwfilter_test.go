package admin

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNWFilterCheck(t *testing.T) {
	c := nwfilterCheck(func(string) (bool, error) { return true, nil })
	require.True(t, c.OK, c.Info)

	c = nwfilterCheck(func(n string) (bool, error) { return n != "lve-vm-egress", nil })
	require.False(t, c.OK)
	require.Contains(t, c.Info, "not defined: lve-vm-egress")
	require.Contains(t, c.Fix, "virsh nwfilter-define deploy/nwfilter/lve-vm-egress.xml")

	c = nwfilterCheck(func(n string) (bool, error) {
		if n == "clean-traffic" {
			return false, errors.New("boom")
		}
		return true, nil
	})
	require.False(t, c.OK)
	require.Equal(t, "clean-traffic: boom", c.Info)
}
