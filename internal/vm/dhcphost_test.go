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

// memBook is an AddressBook in memory: address -> holder.
type memBook struct{ held map[string]string }

func (b *memBook) Take(_ context.Context, name string, spares []DHCPHost) (DHCPHost, bool, error) {
	for _, h := range spares {
		if o, ok := b.held[h.IP]; !ok || o == name {
			b.held[h.IP] = name
			return h, true, nil
		}
	}
	return DHCPHost{}, false, nil
}

func (b *memBook) Give(name string) error {
	for ip, o := range b.held {
		if o == name {
			delete(b.held, ip)
		}
	}
	return nil
}

// With an AddressBook, a machine's entry is a spare that outlives it: the
// next machine takes it over, MAC and address, and the network is changed
// (libvirt's ~0.4 s firewall rewrite) only when every spare is held, never
// by a Remove. A failed Create gives its spare back.
func TestSpareEntriesOutliveTheirMachines(t *testing.T) {
	const prefix = "lve-0123abcd-"
	f := vmtest.New()
	f.DHCP = rigDHCP()
	changes := map[string]int{}
	f.BeforeCall = func(method string) {
		if method == "AddDHCPHost" || method == "DeleteDHCPHost" {
			changes[method]++
		}
	}
	book := &memBook{held: map[string]string{}}
	e := &Engine{HV: f, Controller: testSpec().Owner.Controller, Network: "ci", NamePrefix: prefix, Addresses: book}
	spec := func(n, mac string) Spec {
		s := testSpec()
		s.Name, s.MAC, s.StaticAddress, s.Filter = prefix+n, mac, true, &Filter{}
		return s
	}
	a, err := e.Create(context.Background(), spec("a1", "52:54:00:00:0a:01"))
	require.NoError(t, err)
	require.Equal(t, 1, changes["AddDHCPHost"], "the first machine adds a spare")
	require.Len(t, f.DHCP.Hosts, 1)
	spare := f.DHCP.Hosts[0]
	require.Equal(t, SpareName(prefix, net.ParseIP(a.IP)), spare.Name)
	require.Equal(t, DHCPHost{MAC: "52:54:00:00:0a:01", Name: spare.Name, IP: a.IP}, spare)
	require.Equal(t, prefix+"a1", book.held[a.IP])
	require.NoError(t, e.Remove(context.Background(), prefix+"a1", "jobs", false))
	require.Equal(t, []DHCPHost{spare}, f.DHCP.Hosts, "the spare outlives its machine")
	require.Empty(t, book.held, "and is free again")
	require.Zero(t, changes["DeleteDHCPHost"], "Remove does not change the network")

	b, err := e.Create(context.Background(), spec("b2", "52:54:00:00:0b:02"))
	require.NoError(t, err)
	require.Equal(t, 1, changes["AddDHCPHost"], "the next machine takes the spare over: no change")
	require.Equal(t, spare.IP, b.IP)
	require.Equal(t, spare.MAC, b.MAC, "with its MAC")
	x := f.Domains[prefix+"b2"].XML
	require.Contains(t, x, `<mac address="`+spare.MAC+`">`)
	require.Contains(t, x, `<parameter name="IP" value="`+spare.IP+`">`)

	// b2 holds the only spare: c3 adds a second one.
	c, err := e.Create(context.Background(), spec("c3", "52:54:00:00:0c:03"))
	require.NoError(t, err)
	require.Equal(t, 2, changes["AddDHCPHost"])
	require.NotEqual(t, b.IP, c.IP)
	require.Equal(t, "52:54:00:00:0c:03", c.MAC)

	// A Create that fails after taking a spare gives it back.
	require.NoError(t, e.Remove(context.Background(), prefix+"c3", "jobs", false))
	f.FailOn["Define"] = errors.New("injected")
	_, err = e.Create(context.Background(), spec("d4", "52:54:00:00:0d:04"))
	require.ErrorContains(t, err, "injected")
	require.Equal(t, map[string]string{b.IP: prefix + "b2"}, book.held, "d4's spare is free again")
	require.Len(t, f.DHCP.Hosts, 2)
	require.Zero(t, changes["DeleteDHCPHost"])

	// Another installation's entry, or an entry named otherwise, is no spare.
	d := DHCPInfo{Hosts: []DHCPHost{
		{MAC: "52:54:00:00:00:01", Name: "lve-ffffffff-ip-0a090805", IP: "10.9.8.5"},
		{MAC: "52:54:00:00:00:02", Name: prefix + "ip-0a090806", IP: "10.9.8.7"},
		{MAC: "52:54:00:00:00:03", Name: prefix + "1000", IP: "10.9.8.8"},
		spare,
	}}
	require.Equal(t, []DHCPHost{spare}, d.Spares(prefix))
}

// racingBook lets another machine take the first spare the machine added
// before it can: the machine adds another, with a MAC of its own.
type racingBook struct {
	memBook
	stolen bool
}

func (b *racingBook) Take(ctx context.Context, name string, spares []DHCPHost) (DHCPHost, bool, error) {
	if !b.stolen && len(spares) == 1 {
		b.stolen = true
		b.held[spares[0].IP] = "lve-0123abcd-other"
	}
	return b.memBook.Take(ctx, name, spares)
}

func TestLostSpareRaceAddsAnotherWithItsOwnMAC(t *testing.T) {
	const prefix = "lve-0123abcd-"
	f := vmtest.New()
	f.DHCP = rigDHCP()
	book := &racingBook{memBook: memBook{held: map[string]string{}}}
	e := &Engine{HV: f, Controller: testSpec().Owner.Controller, Network: "ci", NamePrefix: prefix, Addresses: book}
	s := testSpec()
	s.Name, s.StaticAddress = prefix+"r1", true
	m, err := e.Create(context.Background(), s)
	require.NoError(t, err)
	require.Len(t, f.DHCP.Hosts, 2, "the stolen spare and its own")
	require.NotEqual(t, f.DHCP.Hosts[0].MAC, f.DHCP.Hosts[1].MAC)
	require.Equal(t, prefix+"r1", book.held[m.IP])
	require.Equal(t, f.DHCP.Hosts[1].MAC, m.MAC)
}
