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

// reservation is a static DHCP host entry being added while the domain
// is defined and started: libvirt's network update (its hosts file
// rewritten, dnsmasq told) takes a third of a second or more, which the
// guest's boot does not need to wait for: the entry must exist only by the
// guest's first DHCP request.
type reservation struct {
	cands []net.IP
	done  chan struct{}
	err   error // the first candidate's add; set before done is closed
}

// reserveAddress is Create's step that gives the machine its static DHCP
// host entry (Spec.StaticAddress): it picks a free address of the
// network's subnet, which the domain's filter will carry, and starts its
// entry's add, which awaitAddress waits for after the start. Its undo
// removes the entry.
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
	r := &reservation{cands: cands, done: make(chan struct{})}
	c.res, c.m.IP = r, cands[0].String()
	go func() {
		defer close(r.done)
		r.err = c.addHost(ctx, cands[0])
	}()
	return nil
}

// addHost adds the machine's entry for ip: ErrAddressTaken when another
// entry has the address (or the MAC or name). An entry of this machine
// already there (a call cut by a lost connection, repeated on a new one
// after libvirt had made it) is success.
func (c *creation) addHost(ctx context.Context, ip net.IP) error {
	s := c.s
	h := DHCPHost{MAC: s.MAC, Name: s.Name, IP: ip.String()}
	err := change(ctx, func(ctx context.Context) error { return c.e.HV.AddDHCPHost(ctx, s.Network, h) })
	if errors.Is(err, ErrAddressTaken) {
		if now, nerr := c.e.HV.NetworkDHCP(ctx, s.Network); nerr == nil {
			for _, have := range now.Hosts {
				if have.Name == s.Name && equalMAC(have.MAC, s.MAC) && have.IP == h.IP {
					return nil
				}
			}
		}
		return err
	}
	if err != nil {
		return fmt.Errorf("network %s: static DHCP host entry %s: %w", s.Network, ip, err)
	}
	return nil
}

// awaitAddress is Create's step after the start: the entry reserveAddress
// started is in place. When another machine's took that address first, it
// adds one for the next free candidate and gives the running domain's
// filter that address (the guest has asked for none yet, or is refused
// until its entry exists: its DHCP client asks again).
func (c *creation) awaitAddress(ctx context.Context) error {
	r := c.res
	if r == nil {
		return nil
	}
	select {
	case <-r.done:
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	if r.err == nil {
		return nil
	}
	if !errors.Is(r.err, ErrAddressTaken) {
		return r.err
	}
	for _, ip := range r.cands[1:] {
		err := c.addHost(ctx, ip)
		if errors.Is(err, ErrAddressTaken) {
			continue
		}
		if err != nil {
			return err
		}
		c.m.IP = ip.String()
		if c.s.Filter != nil {
			if err := change(ctx, func(ctx context.Context) error { return c.e.HV.PinFilterAddress(ctx, c.s.Name, c.s.MAC, c.m.IP) }); err != nil {
				return fmt.Errorf("the filter of %s: its address %s: %w", c.s.Name, c.m.IP, err)
			}
		}
		return nil
	}
	return fmt.Errorf("network %s: the %d addresses tried for a static DHCP host entry were all taken meanwhile", c.s.Network, len(r.cands))
}

// releaseAddress is reserveAddress's undo: once the add in flight has
// ended, the machine's entry goes, if there is one.
func (c *creation) releaseAddress(ctx context.Context) error {
	if c.res == nil {
		return nil
	}
	select {
	case <-c.res.done:
	case <-ctx.Done():
		return context.Cause(ctx)
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
