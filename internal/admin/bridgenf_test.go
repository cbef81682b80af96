package admin

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// With the network filters on (l2_filter), their IP rules (garm's port,
// egress_allow) act on bridged traffic only when br_netfilter passes it to
// iptables: doctor fails when bridge-nf-call-iptables is 0 or missing (the
// module not loaded), and passes at 1.
func TestBridgeNFCheck(t *testing.T) {
	p := filepath.Join(t.TempDir(), "bridge-nf-call-iptables")

	require.NoError(t, os.WriteFile(p, []byte("1\n"), 0o644))
	c := bridgeNFCheck(p)
	require.True(t, c.OK, c.Info)
	require.False(t, c.Warn)
	require.Contains(t, c.Info, "net.bridge.bridge-nf-call-iptables = 1")

	require.NoError(t, os.WriteFile(p, []byte("0\n"), 0o644))
	c = bridgeNFCheck(p)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "net.bridge.bridge-nf-call-iptables = 0")
	require.Contains(t, c.Fix, "sysctl -w net.bridge.bridge-nf-call-iptables=1")
	require.Contains(t, c.Fix, "/etc/sysctl.d/")

	require.NoError(t, os.Remove(p))
	c = bridgeNFCheck(p)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "br_netfilter is not loaded")
	require.Contains(t, c.Fix, "modprobe br_netfilter")
	require.Contains(t, c.Fix, "/etc/modules-load.d/")

	require.NoError(t, os.WriteFile(p, []byte("2\n"), 0o644))
	c = bridgeNFCheck(p)
	require.False(t, c.OK, "only 1 passes")
}

// Doctor runs the check only when the filters are on.
func TestDoctorChecksBridgeNF(t *testing.T) {
	bridgeNFAt(t, "0")
	find := func(checks []Check) (Check, bool) {
		for _, c := range checks {
			if c.Name == "bridged traffic to iptables" {
				return c, true
			}
		}
		return Check{}, false
	}
	cfg := testConfig(t, "")
	c, ok := find(Doctor(t.Context(), cfg, testDriver))
	require.True(t, ok, "l2_filter is on by default")
	require.False(t, c.OK)

	off := false
	cfg.L2Filter = &off
	_, ok = find(Doctor(t.Context(), cfg, testDriver))
	require.False(t, ok, "no filters, nothing for br_netfilter to do")
}

// bridgeNFAt points doctor at a bridge-nf-call-iptables of value v for the
// test, whatever this host's is.
func bridgeNFAt(t *testing.T, v string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "bridge-nf-call-iptables")
	require.NoError(t, os.WriteFile(p, []byte(v+"\n"), 0o644))
	was := bridgeNFPath
	bridgeNFPath = p
	t.Cleanup(func() { bridgeNFPath = was })
}
