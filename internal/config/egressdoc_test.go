package config

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// egress_allow is not a wall around the VM: the network's own address stays
// open to it, and through it DHCP, DNS (dnsmasq forwards any name to the
// host's resolvers: a tunnel to the outside) and the guard's service ports.
// The key's row in docs/configuration.md and docs/security.md say so, and
// how to close the DNS path (#42).
func TestEgressAllowDocSaysWhatRemains(t *testing.T) {
	docs, err := docKeys("../../docs/configuration.md")
	require.NoError(t, err)
	row, ok := docs["images."+MapKey+".egress_allow"]
	require.True(t, ok, "egress_allow's row in docs/configuration.md")
	sec, err := os.ReadFile("../../docs/security.md")
	require.NoError(t, err)
	for _, doc := range []struct{ name, text string }{{"configuration.md's egress_allow row", row}, {"security.md", string(sec)}} {
		for _, want := range []string{
			"network's own address",
			"DHCP",
			"DNS tunnel",            // a path to the outside, not only name lookups
			"<dns enable='no'/>",    // how to close it
			"ports the guard opens", // the guard's configured TCP ports at that address
		} {
			require.Contains(t, doc.text, want, "%s says what an egress_allow VM still reaches", doc.name)
		}
	}
}
