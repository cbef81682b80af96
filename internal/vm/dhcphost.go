package vm

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
)

// DHCPHost is a static host entry of a libvirt network's DHCP: MAC to IP,
// named (the machine's name: the entry's owner).
type DHCPHost struct {
	MAC, Name, IP string
}

// DHCPInfo is what a libvirt network's IPv4 DHCP looks like now.
type DHCPInfo struct {
	// Enabled: libvirt serves DHCP on the network's IPv4 subnet (a <dhcp>
	// element, with ranges or hosts). False for a network without one (a
	// bridge of the host's LAN, or no IPv4 address).
	Enabled bool
	// Gateway is the network's own address; Subnet its IPv4 subnet.
	Gateway net.IP
	Subnet  *net.IPNet
	// Ranges are the dynamic ranges (first and last address, inclusive).
	Ranges [][2]net.IP
	// Hosts are the static host entries.
	Hosts []DHCPHost
	// Leased are the addresses that hold a lease now.
	Leased []net.IP
}

// InRange reports whether ip is in one of the dynamic ranges.
func (d DHCPInfo) InRange(ip net.IP) bool {
	v := ip4(ip)
	for _, r := range d.Ranges {
		if ip4(r[0]) <= v && v <= ip4(r[1]) {
			return true
		}
	}
	return false
}

func ip4(ip net.IP) uint32 {
	if v := ip.To4(); v != nil {
		return binary.BigEndian.Uint32(v)
	}
	return 0
}

func fromUint32(v uint32) net.IP {
	ip := make(net.IP, 4)
	binary.BigEndian.PutUint32(ip, v)
	return ip
}

// ErrAddressTaken: a DHCP host entry for that MAC, name or address exists.
var ErrAddressTaken = errors.New("a DHCP host entry for that MAC, name or address exists")

// maxAddressTries bounds how many free-looking addresses a reservation
// tries before it gives up (each may be taken by a concurrent one).
const maxAddressTries = 32

// Candidates lists the addresses a new host entry may take, best first:
// those of the subnet that are not the network's, its broadcast or its
// own, hold no host entry or lease, outside the dynamic ranges first
// (a range's address may be leased to a guest before the entry exists),
// starting at a random place so that reservations at once spread out.
// At most limit.
func (d DHCPInfo) Candidates(limit int) []net.IP {
	if d.Subnet == nil || d.Subnet.IP.To4() == nil {
		return nil
	}
	ones, bits := d.Subnet.Mask.Size()
	if bits != 32 || ones > 30 {
		return nil
	}
	first := ip4(d.Subnet.IP) + 1
	n := uint32(1)<<(32-ones) - 2 // hosts of the subnet
	taken := map[uint32]bool{ip4(d.Gateway): true}
	for _, h := range d.Hosts {
		if ip := net.ParseIP(h.IP); ip != nil {
			taken[ip4(ip)] = true
		}
	}
	for _, ip := range d.Leased {
		taken[ip4(ip)] = true
	}
	var off [4]byte
	_, _ = rand.Read(off[:])
	start := binary.BigEndian.Uint32(off[:]) % n
	var out, inRange []net.IP
	for i := uint32(0); i < n && len(out) < limit; i++ {
		v := first + (start+i)%n
		if taken[v] {
			continue
		}
		ip := fromUint32(v)
		if d.InRange(ip) {
			if len(inRange) < limit {
				inRange = append(inRange, ip)
			}
			continue
		}
		out = append(out, ip)
	}
	return slices.Concat(out, inRange)[:min(limit, len(out)+len(inRange))]
}

// AddressBook records which machine holds which of the network's spare
// static DHCP host entries (SpareName), so that an entry outlives its
// machine and the next machine takes it over, MAC and address, without
// changing the network: libvirt 9.0 removes and re-adds every firewall
// rule of the network on each entry added or removed (~0.4 s, with the
// network's NAT and forwarding rules briefly gone for every other VM).
// The spares grow to the most machines that ever ran at once, within the
// subnet.
type AddressBook interface {
	// Take records one of spares, none of which it holds for another
	// machine, as held by name and returns it; ok is false when every one
	// is held.
	Take(ctx context.Context, name string, spares []DHCPHost) (h DHCPHost, ok bool, err error)
	// Give drops name's hold; none is success.
	Give(name string) error
}

// spareMark is how a spare entry's name goes on after the installation's
// NamePrefix: "ip-" is not hex, so no machine name of
// lifecycle.MachinePrefix's shapes looks like one.
const spareMark = "ip-"

// SpareName is the name of the spare entry for ip of the installation whose
// machine names start with prefix.
func SpareName(prefix string, ip net.IP) string {
	return fmt.Sprintf("%s%s%08x", prefix, spareMark, ip4(ip))
}

// Spares are the entries of d that are spares of prefix's installation:
// named SpareName of their own address.
func (d DHCPInfo) Spares(prefix string) []DHCPHost {
	var out []DHCPHost
	for _, h := range d.Hosts {
		if ip := net.ParseIP(h.IP); ip != nil && ip.To4() != nil && h.Name == SpareName(prefix, ip) {
			out = append(out, h)
		}
	}
	return out
}

// reserveAddress is Create's step that gives the machine its static DHCP
// host entry (Spec.StaticAddress). With an AddressBook it takes over a
// spare entry that no machine holds (the machine takes its MAC), and adds
// a new spare only when every one is held; without one it adds an entry
// named after the machine. A free address of the network's subnet is tried
// until libvirt takes one (a reservation at once may take the same:
// libvirt refuses the second). Its undo gives the spare back, or removes
// the machine's own entry.
func (c *creation) reserveAddress(ctx context.Context) error {
	s := c.s
	book := c.e.Addresses
	if c.e.NamePrefix == "" {
		book = nil
	}
	for range maxAddressTries {
		info, err := c.e.HV.NetworkDHCP(ctx, s.Network)
		if err != nil {
			return fmt.Errorf("network %s: its DHCP, for the machine's static address: %w", s.Network, err)
		}
		if !info.Enabled {
			return nil // not libvirt's DHCP: the guest's address is learnt as before
		}
		if book != nil {
			h, ok, err := book.Take(ctx, s.Name, info.Spares(c.e.NamePrefix))
			if err != nil {
				return fmt.Errorf("network %s: take a spare DHCP host entry: %w", s.Network, err)
			}
			if ok {
				c.took, c.m.IP, c.m.MAC, c.s.MAC = true, h.IP, h.MAC, h.MAC
				c.e.progress("took spare DHCP host entry %s (%s, MAC %s)", h.Name, h.IP, h.MAC)
				return nil
			}
		}
		added, err := c.addEntry(ctx, info, book != nil)
		if err != nil || added == nil || book == nil {
			return err
		}
		// Another machine's reservation may take the new spare first:
		// then look again.
		h, ok, err := book.Take(ctx, s.Name, []DHCPHost{*added})
		if err != nil {
			return fmt.Errorf("network %s: take the new spare DHCP host entry: %w", s.Network, err)
		}
		if ok {
			c.took, c.m.IP, c.m.MAC, c.s.MAC = true, h.IP, h.MAC, h.MAC
			return nil
		}
		// The next spare needs a MAC of its own: the lost one carries
		// this one (libvirt refuses a second entry with a MAC).
		if c.s.MAC, err = NewMAC(); err != nil {
			return err
		}
	}
	return fmt.Errorf("network %s: every spare DHCP host entry made for this machine was taken by another at once (%d tries)", s.Network, maxAddressTries)
}

// addEntry adds a static host entry with the machine's MAC at a free
// address of info's subnet: a spare (SpareName) or, when spare is false,
// the machine's own (named after it, and c.m.IP set: nil returned).
func (c *creation) addEntry(ctx context.Context, info DHCPInfo, spare bool) (*DHCPHost, error) {
	s := c.s
	cands := info.Candidates(maxAddressTries)
	if len(cands) == 0 {
		return nil, fmt.Errorf("network %s: no free address in %s for a static DHCP host entry (%d entries, %d leases): make the subnet larger or fewer VMs at once",
			s.Network, info.Subnet, len(info.Hosts), len(info.Leased))
	}
	for _, ip := range cands {
		h := DHCPHost{MAC: s.MAC, Name: s.Name, IP: ip.String()}
		if spare {
			h.Name = SpareName(c.e.NamePrefix, ip)
		}
		err := change(ctx, func(ctx context.Context) error { return c.e.HV.AddDHCPHost(ctx, s.Network, h) })
		if errors.Is(err, ErrAddressTaken) {
			// Ours already, when a call cut by a lost connection was
			// repeated on a new one after libvirt had made it.
			if now, err := c.e.HV.NetworkDHCP(ctx, s.Network); err == nil {
				for _, have := range now.Hosts {
					if have.Name == h.Name && equalMAC(have.MAC, s.MAC) {
						return c.added(have, spare), nil
					}
				}
			}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("network %s: static DHCP host entry %s: %w", s.Network, ip, err)
		}
		c.e.progress("added DHCP host entry %s (%s)", h.Name, h.IP)
		return c.added(h, spare), nil
	}
	return nil, fmt.Errorf("network %s: the %d addresses tried for a static DHCP host entry were all taken meanwhile", s.Network, len(cands))
}

func (c *creation) added(h DHCPHost, spare bool) *DHCPHost {
	if spare {
		return &h
	}
	c.m.IP = h.IP
	return nil
}

// releaseAddress is reserveAddress's undo.
func (c *creation) releaseAddress(ctx context.Context) error {
	if c.took {
		return c.e.Addresses.Give(c.s.Name)
	}
	if c.m.IP == "" {
		return nil
	}
	return c.e.removeDHCPHost(ctx, c.s.Network, c.s.Name)
}

// removeDHCPHost removes the static host entry named name from network,
// if there is one. It asks first: libvirt rewrites the network's firewall
// rules for a delete too, also one that finds nothing.
func (e *Engine) removeDHCPHost(ctx context.Context, network, name string) error {
	if network == "" {
		return nil
	}
	info, err := e.HV.NetworkDHCP(ctx, network)
	if errors.Is(err, ErrNotFound) {
		return nil // no network, no entry
	}
	if err != nil {
		return fmt.Errorf("network %s: its DHCP host entries: %w", network, err)
	}
	if !slices.ContainsFunc(info.Hosts, func(h DHCPHost) bool { return h.Name == name }) {
		return nil
	}
	err = change(ctx, func(ctx context.Context) error { return e.HV.DeleteDHCPHost(ctx, network, name) })
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("network %s: remove the DHCP host entry %s: %w", network, name, err)
	}
	return nil
}

func equalMAC(a, b string) bool {
	x, err1 := net.ParseMAC(a)
	y, err2 := net.ParseMAC(b)
	return err1 == nil && err2 == nil && x.String() == y.String()
}
