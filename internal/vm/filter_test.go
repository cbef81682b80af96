package vm

import (
	"net"
	"strings"
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

// libvirtEgress is lve-vm-egress-v1 as libvirt 9 hands it back (virsh
// nwfilter-dumpxml on the rig): comments gone, attributes re-ordered.
const libvirtEgress = `<filter name='lve-vm-egress-v1' chain='root'>
  <uuid>6F1F7A52-3C1E-4D55-9B0E-2A7C51D0E112</uuid>
  <filterref filter='lve-vm-v1'/>
  <rule action='accept' direction='out' priority='100'>
    <udp srcipaddr='0.0.0.0' dstipaddr='255.255.255.255' srcportstart='0x44' dstportstart='67'/>
  </rule>
  <rule action='accept' direction='in' priority='100'>
    <udp srcportstart='67' dstportstart='68' srcipaddr='$DHCPSERVER'/>
  </rule>
  <rule action='accept' direction='out' priority='110'>
    <all dstipaddr='$DHCPSERVER'/>
  </rule>
  <rule action='accept' direction='in' priority='110'>
    <all srcipaddr='$DHCPSERVER'/>
  </rule>
  <rule action='accept' direction='out' priority='200'>
    <all dstipaddr='$EGRESS_NET[@1]' dstipmask='$EGRESS_MASK[@1]'/>
  </rule>
  <rule action='accept' direction='out' priority='210'>
    <tcp dstipaddr='$EGRESS_PNET[@2]' dstipmask='$EGRESS_PMASK[@2]' dstportstart='$EGRESS_PORT[@2]'/>
  </rule>
  <rule action='accept' direction='out' priority='210'>
    <udp dstipaddr='$EGRESS_PNET[@2]' dstipmask='$EGRESS_PMASK[@2]' dstportstart='$EGRESS_PORT[@2]'/>
  </rule>
  <rule action='reject' direction='out' priority='1000'>
    <all/>
  </rule>
  <rule action='drop' direction='in' priority='1000'>
    <all/>
  </rule>
</filter>
`

func TestCheckFilter(t *testing.T) {
	defs := Filters()
	for _, d := range defs {
		require.NoError(t, CheckFilter(d, d.XML), "our own definition, as written")
	}
	egress := defs[1]
	require.Equal(t, FilterEgressName, egress.Name)
	require.NoError(t, CheckFilter(egress, libvirtEgress), "as libvirt re-serialises it")

	base := defs[0]
	for what, have := range map[string]string{
		"no rules":            `<filter name='lve-vm-v1' chain='root'><uuid>6f1f7a52-3c1e-4d55-9b0e-2a7c51d0e111</uuid></filter>`,
		"another base filter": strings.Replace(base.XML, "filter='clean-traffic'", "filter='allow-all'", 1),
		"a rule accepting":    strings.Replace(base.XML, "action='reject'", "action='accept'", 1),
		"another chain":       strings.Replace(base.XML, "chain='root'", "chain='ipv4'", 1),
		"another UUID":        strings.Replace(base.XML, "0e111", "0e999", 1),
		"another port":        strings.Replace(base.XML, "dstportstart='$DENY_PORT'", "dstportstart='22'", 1),
		"a rule more": strings.Replace(base.XML, "</filter>",
			"<rule action='accept' direction='inout' priority='-1000'><all/></rule></filter>", 1),
		"not XML": "<filter",
	} {
		err := CheckFilter(base, have)
		require.Error(t, err, what)
		require.ErrorContains(t, err, "network filter named lve-vm-v1 that is not this project's", what)
		require.ErrorContains(t, err, "virsh nwfilter-undefine lve-vm-v1", what)
	}
	err := CheckFilter(base, strings.Replace(base.XML, "action='reject'", "action='accept'", 1))
	require.ErrorContains(t, err, `action="accept"`, "the error shows the rule that differs")

	// The egress filter's rules, one number changed.
	require.Error(t, CheckFilter(egress, strings.Replace(libvirtEgress, "priority='1000'", "priority='999'", 1)))
}
