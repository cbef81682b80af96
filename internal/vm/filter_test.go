package vm

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"
)

func params(ref *libvirtxml.DomainInterfaceFilterRef) [][2]string {
	var out [][2]string
	for _, p := range ref.Parameters {
		out = append(out, [2]string{p.Name, p.Value})
	}
	return out
}

func cidr(t *testing.T, s string) *net.IPNet {
	_, n, err := net.ParseCIDR(s)
	require.NoError(t, err)
	return n
}

func TestFilterRefPlain(t *testing.T) {
	ref, err := filterRef(&Filter{Gateway: "192.168.150.1"})
	require.NoError(t, err)
	require.Equal(t, FilterName, ref.Filter)
	require.Equal(t, [][2]string{{"CTRL_IP_LEARNING", "dhcp"}, {"DHCPSERVER", "192.168.150.1"},
		{"DENY_HOST", "0.0.0.0"}, {"DENY_PORT", "1"}}, params(ref))

	// A host bridge: no gateway, any DHCP server is trusted for learning.
	ref, err = filterRef(&Filter{DenyHostPorts: []int{9997}})
	require.NoError(t, err)
	require.Equal(t, [][2]string{{"CTRL_IP_LEARNING", "dhcp"}, {"DENY_HOST", "0.0.0.0"}, {"DENY_PORT", "1"}}, params(ref))
}

func TestFilterRefDeniesGarmPortsAtTheGateway(t *testing.T) {
	ref, err := filterRef(&Filter{Gateway: "192.168.150.1", DenyHostPorts: []int{9997, 8443}})
	require.NoError(t, err)
	require.Equal(t, [][2]string{{"CTRL_IP_LEARNING", "dhcp"}, {"DHCPSERVER", "192.168.150.1"},
		{"DENY_HOST", "192.168.150.1"}, {"DENY_PORT", "9997"}, {"DENY_PORT", "8443"}}, params(ref))
	_, err = filterRef(&Filter{Gateway: "192.168.150.1", DenyHostPorts: []int{70000}})
	require.Error(t, err)
}

func TestFilterRefEgress(t *testing.T) {
	ref, err := filterRef(&Filter{Gateway: "192.168.150.1", Egress: []EgressRule{
		{Net: cidr(t, "10.1.0.0/16")}, {Net: cidr(t, "10.2.3.4/32"), Port: 443}, {Net: cidr(t, "10.9.0.0/24"), Port: 53},
	}})
	require.NoError(t, err)
	require.Equal(t, FilterEgressName, ref.Filter)
	require.Equal(t, [][2]string{{"CTRL_IP_LEARNING", "dhcp"}, {"DHCPSERVER", "192.168.150.1"},
		{"DENY_HOST", "0.0.0.0"}, {"DENY_PORT", "1"},
		{"EGRESS_NET", "10.1.0.0"}, {"EGRESS_MASK", "16"},
		{"EGRESS_PNET", "10.2.3.4"}, {"EGRESS_PMASK", "32"}, {"EGRESS_PORT", "443"},
		{"EGRESS_PNET", "10.9.0.0"}, {"EGRESS_PMASK", "24"}, {"EGRESS_PORT", "53"}}, params(ref))

	// Empty (not nil): the gateway only; the lists get entries matching nothing.
	ref, err = filterRef(&Filter{Gateway: "192.168.150.1", Egress: []EgressRule{}})
	require.NoError(t, err)
	require.Equal(t, FilterEgressName, ref.Filter)
	require.Equal(t, [][2]string{{"CTRL_IP_LEARNING", "dhcp"}, {"DHCPSERVER", "192.168.150.1"},
		{"DENY_HOST", "0.0.0.0"}, {"DENY_PORT", "1"},
		{"EGRESS_NET", "0.0.0.0"}, {"EGRESS_MASK", "32"},
		{"EGRESS_PNET", "0.0.0.0"}, {"EGRESS_PMASK", "32"}, {"EGRESS_PORT", "1"}}, params(ref))

	_, err = filterRef(&Filter{Egress: []EgressRule{}})
	require.ErrorContains(t, err, "needs the network's own IPv4 address")
	_, err = filterRef(&Filter{Gateway: "fe80::1"})
	require.Error(t, err)
}

// The filter is on the interface in the domain XML; without a Filter there
// is none.
func TestDomainXMLFilterRef(t *testing.T) {
	s := Spec{Name: "lve-filter-1", DomainType: "qemu", VCPUs: 1, MemoryMiB: 256, Network: "ci", MAC: "52:54:00:00:00:01",
		Filter: &Filter{Gateway: "192.168.150.1", DenyHostPorts: []int{9997}}}
	x, err := DomainXML(s, "/pool/d.qcow2", "")
	require.NoError(t, err)
	var d libvirtxml.Domain
	require.NoError(t, d.Unmarshal(x))
	ref := d.Devices.Interfaces[0].FilterRef
	require.NotNil(t, ref)
	require.Equal(t, FilterName, ref.Filter)
	require.Contains(t, x, `<parameter name="DENY_PORT" value="9997"></parameter>`)

	s.Filter = nil
	x, err = DomainXML(s, "/pool/d.qcow2", "")
	require.NoError(t, err)
	require.NotContains(t, x, "filterref")
}

// PinFilterIP replaces what DHCP learning would find with the address, is
// a no-op the second time, and leaves an interface without a filter alone.
func TestPinFilterIP(t *testing.T) {
	ref, err := filterRef(&Filter{Gateway: "192.168.150.1"})
	require.NoError(t, err)
	iface := &libvirtxml.DomainInterface{FilterRef: ref}
	changed, err := PinFilterIP(iface, "192.168.150.23")
	require.NoError(t, err)
	require.True(t, changed)
	got := map[string]string{}
	for _, p := range iface.FilterRef.Parameters {
		got[p.Name] = p.Value
	}
	require.Equal(t, "192.168.150.23", got["IP"])
	require.Equal(t, "192.168.150.1", got["DHCPSERVER"])
	require.NotContains(t, got, "CTRL_IP_LEARNING")

	changed, err = PinFilterIP(iface, "192.168.150.23")
	require.NoError(t, err)
	require.False(t, changed, "already pinned")

	changed, err = PinFilterIP(iface, "192.168.150.24")
	require.NoError(t, err)
	require.True(t, changed)
	n := 0
	for _, p := range iface.FilterRef.Parameters {
		if p.Name == "IP" {
			n++
			require.Equal(t, "192.168.150.24", p.Value)
		}
	}
	require.Equal(t, 1, n, "one address, the new one")

	_, err = PinFilterIP(iface, "fe80::1")
	require.ErrorContains(t, err, "not an IPv4 address")
	changed, err = PinFilterIP(&libvirtxml.DomainInterface{}, "10.0.0.1")
	require.NoError(t, err)
	require.False(t, changed, "no filter: nothing to pin")
}
