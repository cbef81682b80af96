package lifecycle

import (
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// Garm's endpoint ports are refused to every VM but garm's; egress_allow
// selects the egress filter; l2_filter = false puts no filter on.
func TestMachineFilter(t *testing.T) {
	cfg, err := config.Parse([]byte("default_image = \"a\"\n[garm]\nendpoints = [\"http://192.168.150.1:9997\"]\n" +
		"[images.a]\nbase = \"/a.qcow2\"\n[images.b]\nbase = \"/b.qcow2\"\negress_allow = [\"10.1.0.0/16\", \"10.2.3.4:443\"]\n"))
	require.NoError(t, err)
	a, b := cfg.Images["a"], cfg.Images["b"]

	f := MachineFilter(cfg, a, false)
	require.Equal(t, []int{9997}, f.DenyHostPorts)
	require.Nil(t, f.Egress)
	require.Empty(t, MachineFilter(cfg, a, true).DenyHostPorts, "garm's guests reach garm (ReachServicePorts)")

	f = MachineFilter(cfg, b, false)
	require.Len(t, f.Egress, 2)
	require.Equal(t, "10.2.3.4/32:443", f.Egress[1].String())

	require.NotEqual(t, SpecFingerprint(cfg, a), SpecFingerprint(cfg, b))
	before := SpecFingerprint(cfg, a)
	off := false
	cfg.L2Filter = &off
	require.Nil(t, MachineFilter(cfg, a, false))
	require.NotEqual(t, before, SpecFingerprint(cfg, a), "standbys built without the filter are not handed out")
}
