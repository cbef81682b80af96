package vm_test

import (
	"context"
	"errors"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func rigDHCP(ranges ...[2]string) *DHCPInfo {
	_, sub, _ := net.ParseCIDR("10.9.8.0/24")
	d := &DHCPInfo{Enabled: true, Gateway: net.ParseIP("10.9.8.1").To4(), Subnet: sub}
	for _, r := range ranges {
		d.Ranges = append(d.Ranges, [2]net.IP{net.ParseIP(r[0]).To4(), net.ParseIP(r[1]).To4()})
	}
	return d
}

// Candidates never offer the network's, its gateway's, its broadcast's, a
// host entry's or a leased address, and offer those outside the dynamic
// range before those inside it.
func TestAddressCandidates(t *testing.T) {
	d := rigDHCP([2]string{"10.9.8.10", "10.9.8.250"})
	d.Hosts = []DHCPHost{{MAC: "52:54:00:00:00:01", Name: "x", IP: "10.9.8.2"}}
	d.Leased = []net.IP{net.ParseIP("10.9.8.3")}
	all := d.Candidates(300)
	require.Len(t, all, 254-3, "every host address but the gateway's, the entry's and the lease's")
	seen := map[string]bool{}
	for i, ip := range all {
		s := ip.String()
		require.False(t, seen[s], "once each")
		seen[s] = true
		require.NotContains(t, []string{"10.9.8.0", "10.9.8.1", "10.9.8.2", "10.9.8.3", "10.9.8.255"}, s)
		if i < 254-3-241 {
			require.False(t, d.InRange(ip), "outside the range first: %s at %d", s, i)
		} else {
			require.True(t, d.InRange(ip), "then inside: %s at %d", s, i)
		}
	}
	require.Len(t, d.Candidates(5), 5)
	_, tiny, _ := net.ParseCIDR("10.9.8.0/31")
	require.Empty(t, DHCPInfo{Enabled: true, Subnet: tiny}.Candidates(5))
}

// With static_addresses, Create gives the machine a DHCP host entry of
// its own before the domain is defined, the filter carries its address
// from the first packet (nothing learnt), and Remove takes the entry
// away with the machine, also when no domain was ever defined.
func TestCreateReservesAStaticAddress(t *testing.T) {
	f := vmtest.New()
	f.DHCP = rigDHCP([2]string{"10.9.8.10", "10.9.8.250"})
	s := testSpec()
	s.StaticAddress, s.Filter = true, &Filter{}
	e := &Engine{HV: f, Controller: s.Owner.Controller, Network: s.Network}
	m, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	require.Len(t, f.DHCP.Hosts, 1)
	h := f.DHCP.Hosts[0]
	require.Equal(t, DHCPHost{MAC: s.MAC, Name: s.Name, IP: m.IP}, h)
	require.False(t, f.DHCP.InRange(net.ParseIP(m.IP)), "outside the dynamic range: %s", m.IP)
	x := f.Domains[s.Name].XML
	require.Contains(t, x, `<parameter name="IP" value="`+m.IP+`">`)
	require.NotContains(t, x, "CTRL_IP_LEARNING")

	require.NoError(t, e.Remove(context.Background(), s.Name, s.Pool, false))
	require.Empty(t, f.DHCP.Hosts, "the entry goes with the machine")

	// A network without libvirt's DHCP: no entry, the address is learnt.
	f = vmtest.New()
	e.HV = f
	m, err = e.Create(context.Background(), s)
	require.NoError(t, err)
	require.Empty(t, m.IP)
	require.Contains(t, f.Domains[s.Name].XML, "CTRL_IP_LEARNING")
}

// A reservation at once that took the address first makes Create try the
// next; a failure after the reservation removes the entry again.
func TestReserveAddressTakenAndUndone(t *testing.T) {
	f := vmtest.New()
	f.DHCP = rigDHCP() // no dynamic range: the whole subnet is candidates
	s := testSpec()
	s.StaticAddress = true
	e := &Engine{HV: f, Controller: s.Owner.Controller, Network: s.Network}
	// Other machines' reservations take the first two addresses tried.
	tries := 0
	f.BeforeCall = func(method string) {
		if method == "AddDHCPHost" {
			if tries++; tries <= 2 {
				f.FailOn["AddDHCPHost"] = ErrAddressTaken
			} else {
				delete(f.FailOn, "AddDHCPHost")
			}
		}
	}
	m, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	require.Equal(t, 3, tries)
	require.Len(t, f.DHCP.Hosts, 1)
	require.Equal(t, m.IP, f.DHCP.Hosts[0].IP)
	require.NoError(t, e.Remove(context.Background(), s.Name, s.Pool, false))

	// Every address tried taken: Create fails, leaving nothing.
	f.BeforeCall = nil
	f.FailOn["AddDHCPHost"] = ErrAddressTaken
	_, err = e.Create(context.Background(), s)
	require.ErrorContains(t, err, "were all taken meanwhile")
	require.Empty(t, f.Domains)
	require.Empty(t, f.Volumes)

	delete(f.FailOn, "AddDHCPHost")
	f.FailOn["Define"] = errors.New("injected")
	_, err = e.Create(context.Background(), s)
	require.ErrorContains(t, err, "injected")
	require.Empty(t, f.DHCP.Hosts, "the reservation is undone with the rest")
	require.Empty(t, f.Volumes)
}
