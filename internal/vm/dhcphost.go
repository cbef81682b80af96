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

// reserveAddress is Create's step that gives the machine its static DHCP
// host entry (Spec.StaticAddress): a free address of the network's
// subnet, tried until libvirt takes one (a reservation at once may take
// the same: libvirt refuses the second). Its undo removes the entry.
func (c *creation) reserveAddress(ctx context.Context) error {
	s := c.s
	info, err := c.e.HV.NetworkDHCP(ctx, s.Network)
	if err != nil {
		return fmt.Errorf("network %s: its DHCP, for the machine's static address: %w", s.Network, err)
	}
	if !info.Enabled {
		return nil // not libvirt's DHCP: the guest's address is learnt as before
	}
	cands := info.Candidates(maxAddressTries)
	if len(cands) == 0 {
		return fmt.Errorf("network %s: no free address in %s for a static DHCP host entry (%d entries, %d leases): make the subnet larger or fewer VMs at once",
			s.Network, info.Subnet, len(info.Hosts), len(info.Leased))
	}
	for _, ip := range cands {
		h := DHCPHost{MAC: s.MAC, Name: s.Name, IP: ip.String()}
		err := change(ctx, func(ctx context.Context) error { return c.e.HV.AddDHCPHost(ctx, s.Network, h) })
		if errors.Is(err, ErrAddressTaken) {
			// Ours already, when a call cut by a lost connection was
			// repeated on a new one after libvirt had made it.
			if now, err := c.e.HV.NetworkDHCP(ctx, s.Network); err == nil {
				for _, have := range now.Hosts {
					if have.Name == s.Name && equalMAC(have.MAC, s.MAC) {
						c.m.IP = have.IP
						return nil
					}
				}
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("network %s: static DHCP host entry %s: %w", s.Network, ip, err)
		}
		c.m.IP = h.IP
		return nil
	}
	return fmt.Errorf("network %s: the %d addresses tried for a static DHCP host entry were all taken meanwhile", s.Network, len(cands))
}

// releaseAddress is reserveAddress's undo.
func (c *creation) releaseAddress(ctx context.Context) error {
	if c.m.IP == "" {
		return nil
	}
	return c.e.removeDHCPHost(ctx, c.s.Network, c.s.Name)
}

// removeDHCPHost removes the static host entry named name from network,
// if there is one.
func (e *Engine) removeDHCPHost(ctx context.Context, network, name string) error {
	if network == "" {
		return nil
	}
	err := change(ctx, func(ctx context.Context) error { return e.HV.DeleteDHCPHost(ctx, network, name) })
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
