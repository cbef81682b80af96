package config

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Egress is one parsed entry of an image's egress_allow.
type Egress struct {
	// Net is the destination network (a single address is a /32).
	Net *net.IPNet
	// Port is the TCP and UDP port; 0: any protocol and port.
	Port int
}

// maxEgress bounds an image's egress_allow: each entry becomes firewall
// rules on every VM's interface.
const maxEgress = 64

// egressForms names the forms an egress_allow entry may take.
const egressForms = `"10.1.0.0/16", "10.1.2.3", "10.1.0.0/16:443" or "10.1.2.3:443" (IPv4, port 1-65535)`

// ParseEgress parses an egress_allow entry: "CIDR", "IP", "CIDR:PORT" or
// "IP:PORT", IPv4 only. A CIDR must name its network (no host bits set).
func ParseEgress(entry string) (Egress, error) {
	bad := func(why string) (Egress, error) {
		return Egress{}, fmt.Errorf("%q: %s; allowed forms: %s", entry, why, egressForms)
	}
	addr, port := entry, 0
	if i := strings.LastIndexByte(entry, ':'); i >= 0 {
		addr = entry[:i]
		p, err := strconv.Atoi(entry[i+1:])
		if err != nil || p < 1 || p > 65535 || entry[i+1] == '+' || entry[i+1] == '0' {
			return bad("the port must be a number 1-65535")
		}
		port = p
	}
	if addr == "" {
		return bad("no address")
	}
	var n *net.IPNet
	if strings.Contains(addr, "/") {
		ip, nw, err := net.ParseCIDR(addr)
		if err != nil || ip.To4() == nil || strings.Contains(addr, ":") {
			return bad("not an IPv4 CIDR")
		}
		if !ip.Equal(nw.IP) {
			return bad(fmt.Sprintf("host bits set (the network is %s)", nw))
		}
		n = &net.IPNet{IP: nw.IP.To4(), Mask: nw.Mask}
	} else {
		ip := net.ParseIP(addr)
		if ip == nil || ip.To4() == nil || strings.Contains(addr, ":") {
			return bad("not an IPv4 address")
		}
		n = &net.IPNet{IP: ip.To4(), Mask: net.CIDRMask(32, 32)}
	}
	return Egress{Net: n, Port: port}, nil
}

// Egress returns the image's parsed egress_allow, nil when unset (no
// limit). The configuration is valid (Parse checked every entry).
func (img *Image) Egress() []Egress {
	if img.EgressAllow == nil {
		return nil
	}
	out := make([]Egress, 0, len(img.EgressAllow))
	for _, e := range img.EgressAllow {
		if r, err := ParseEgress(e); err == nil {
			out = append(out, r)
		}
	}
	return out
}

// GarmPorts returns the TCP ports of garm.endpoints: opened for garm's
// guests, refused to every other VM at the network's own address.
func (c *Config) GarmPorts() []int {
	var ports []int
	for _, e := range c.Garm.Endpoints {
		o, err := Origin(e)
		if err != nil {
			continue
		}
		i := strings.LastIndexByte(o, ':')
		if p, err := strconv.Atoi(o[i+1:]); err == nil && p > 0 && !containsInt(ports, p) {
			ports = append(ports, p)
		}
	}
	return ports
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}
