package vm

import (
	"embed"
	"encoding/xml"
	"fmt"
	"net"
	"reflect"
	"strconv"
	"strings"

	"libvirt.org/go/libvirtxml"
)

// The project's network filters (libvirt nwfilter, docs/security.md),
// embedded from nwfilter/*.xml. Every machine's interface names one of them
// when its Spec has a Filter; Engine.Create defines them when libvirt does
// not have them yet. A changed filter gets a new name (the -vN suffix):
// redefining one under its old name would re-instantiate it on every
// running VM, and VMs started with the old one keep it.
const (
	// FilterName is libvirt's clean-traffic (the machine's own MAC, the
	// address its DHCP lease gave it, ARP for that address only) plus the
	// refusal of the host ports in DENY_PORT at DENY_HOST.
	FilterName = "lve-vm-v1"
	// FilterEgressName is FilterName plus an egress allow list: the
	// machine reaches the network's own address (DHCP, DNS and the host
	// services the guard opens), the destinations in EGRESS_NET/EGRESS_MASK
	// (any protocol) and EGRESS_PNET/EGRESS_PMASK/EGRESS_PORT (TCP and UDP
	// to one port), and nothing else.
	FilterEgressName = "lve-vm-egress-v1"
	// FilterBase is libvirt's own filter that FilterName builds on
	// (Debian: libvirt-daemon-config-nwfilter).
	FilterBase = "clean-traffic"
)

// FilterNames are the project's filters, each after those it refers to.
var FilterNames = []string{FilterName, FilterEgressName}

//go:embed nwfilter/*.xml
var filterFiles embed.FS

// NWFilter is one of the project's filters with its definition.
type NWFilter struct {
	Name, XML string
}

// Filters returns the project's filters in FilterNames' order.
func Filters() []NWFilter {
	out := make([]NWFilter, 0, len(FilterNames))
	for _, n := range FilterNames {
		b, err := filterFiles.ReadFile("nwfilter/" + n + ".xml")
		if err != nil {
			panic("vm: embedded network filter " + n + " missing: " + err.Error())
		}
		out = append(out, NWFilter{Name: n, XML: string(b)})
	}
	return out
}

// placeholders for an empty parameter list: libvirt refuses a filter whose
// variable has no value, so an empty list is given one entry that matches
// no packet (no packet is addressed to 0.0.0.0).
const (
	noAddress = "0.0.0.0"
	noPort    = "1"
)

// Filter is the layer-2/3 filter on a machine's interface.
type Filter struct {
	// Gateway is the network's own IPv4 address: its DHCP server, DNS and
	// the host's services. Empty: Engine.Create looks it up (and leaves it
	// empty for a network without one: a host bridge).
	Gateway string
	// Egress, when not nil, is the only destinations the machine reaches
	// besides Gateway (an empty, non-nil list: the gateway only). Nil: no
	// egress limit.
	Egress []EgressRule
	// DenyHostPorts are TCP ports of Gateway the machine may not reach even
	// though the guard opens them for the network (garm's endpoint, opened
	// for garm's guests only).
	DenyHostPorts []int
	// IP, when set, is the machine's address from its static DHCP host
	// entry: the filter carries it from the first packet (nothing is
	// learnt). Empty: learnt from the machine's DHCP exchange.
	IP string
}

// EgressRule is one allowed destination.
type EgressRule struct {
	Net *net.IPNet
	// Port is a TCP and UDP port; 0: any protocol and port.
	Port int
}

// String writes r as configured: CIDR or CIDR:port.
func (r EgressRule) String() string {
	if r.Port == 0 {
		return r.Net.String()
	}
	return r.Net.String() + ":" + strconv.Itoa(r.Port)
}

// filterRef is the interface's filterref for f.
func filterRef(f *Filter) (*libvirtxml.DomainInterfaceFilterRef, error) {
	ref := &libvirtxml.DomainInterfaceFilterRef{Filter: FilterName}
	add := func(name, value string) {
		ref.Parameters = append(ref.Parameters, libvirtxml.DomainInterfaceFilterParam{Name: name, Value: value})
	}
	gw := ""
	if f.Gateway != "" {
		ip := net.ParseIP(f.Gateway)
		if ip == nil || ip.To4() == nil {
			return nil, fmt.Errorf("filter: gateway %q is not an IPv4 address", f.Gateway)
		}
		gw = ip.To4().String()
	}
	// The address of the machine's static DHCP host entry, or libvirt
	// learns it from the machine's DHCP exchange, trusting only the
	// network's DHCP server when it is known.
	if f.IP != "" {
		ip := net.ParseIP(f.IP)
		if ip == nil || ip.To4() == nil {
			return nil, fmt.Errorf("filter: address %q is not an IPv4 address", f.IP)
		}
		add("IP", ip.To4().String())
	} else {
		add("CTRL_IP_LEARNING", "dhcp")
	}
	if gw != "" {
		add("DHCPSERVER", gw)
	}
	if gw != "" && len(f.DenyHostPorts) > 0 {
		add("DENY_HOST", gw)
		for _, p := range f.DenyHostPorts {
			if p < 1 || p > 65535 {
				return nil, fmt.Errorf("filter: host port %d out of range", p)
			}
			add("DENY_PORT", strconv.Itoa(p))
		}
	} else {
		add("DENY_HOST", noAddress)
		add("DENY_PORT", noPort)
	}
	if f.Egress == nil {
		return ref, nil
	}
	if gw == "" {
		return nil, fmt.Errorf("filter: an egress allow list needs the network's own IPv4 address (a libvirt network with <ip address=...>), and this network has none")
	}
	ref.Filter = FilterEgressName
	var nets, pnets []EgressRule
	for _, r := range f.Egress {
		if r.Net == nil || r.Net.IP.To4() == nil || r.Port < 0 || r.Port > 65535 {
			return nil, fmt.Errorf("filter: bad egress rule %v", r)
		}
		if r.Port == 0 {
			nets = append(nets, r)
		} else {
			pnets = append(pnets, r)
		}
	}
	if len(nets) == 0 {
		add("EGRESS_NET", noAddress)
		add("EGRESS_MASK", "32")
	}
	for _, r := range nets {
		ones, _ := r.Net.Mask.Size()
		add("EGRESS_NET", r.Net.IP.To4().String())
		add("EGRESS_MASK", strconv.Itoa(ones))
	}
	if len(pnets) == 0 {
		add("EGRESS_PNET", noAddress)
		add("EGRESS_PMASK", "32")
		add("EGRESS_PORT", noPort)
	}
	for _, r := range pnets {
		ones, _ := r.Net.Mask.Size()
		add("EGRESS_PNET", r.Net.IP.To4().String())
		add("EGRESS_PMASK", strconv.Itoa(ones))
		add("EGRESS_PORT", strconv.Itoa(r.Port))
	}
	return ref, nil
}

// PinFilterIP sets the interface's filter parameter IP to ip (and drops
// CTRL_IP_LEARNING): the filter then needs nothing learnt, which libvirt
// forgets when libvirtd restarts (a VM with a learnt-only address could
// send nothing but DHCP until its lease is renewed). It reports whether
// anything changed; an interface without a filter is left alone.
func PinFilterIP(iface *libvirtxml.DomainInterface, ip string) (bool, error) {
	a := net.ParseIP(ip)
	if a == nil || a.To4() == nil {
		return false, fmt.Errorf("filter: %q is not an IPv4 address", ip)
	}
	ref := iface.FilterRef
	if ref == nil {
		return false, nil
	}
	want := a.To4().String()
	var kept []libvirtxml.DomainInterfaceFilterParam
	have := false
	for _, p := range ref.Parameters {
		switch p.Name {
		case "IP":
			if p.Value == want && !have {
				have = true
				kept = append(kept, p)
			}
			continue
		case "CTRL_IP_LEARNING":
			continue
		}
		kept = append(kept, p)
	}
	if have && len(kept) == len(ref.Parameters) {
		return false, nil
	}
	if !have {
		kept = append(kept, libvirtxml.DomainInterfaceFilterParam{Name: "IP", Value: want})
	}
	ref.Parameters = kept
	return true, nil
}

// PinDomainFilterIP finds the interface of MAC mac in the domain dx and
// pins its filter to ip (PinFilterIP). It returns that interface and
// whether it changed; ErrNotFound when dx has no interface of mac.
func PinDomainFilterIP(dx *libvirtxml.Domain, mac, ip string) (*libvirtxml.DomainInterface, bool, error) {
	if dx.Devices != nil {
		for i := range dx.Devices.Interfaces {
			iface := &dx.Devices.Interfaces[i]
			if iface.MAC == nil || !strings.EqualFold(iface.MAC.Address, mac) {
				continue
			}
			changed, err := PinFilterIP(iface, ip)
			return iface, changed, err
		}
	}
	return nil, false, fmt.Errorf("%w: %s has no interface with MAC %s", ErrNotFound, dx.Name, mac)
}

// ruleDefaultPriority is the priority libvirt gives a rule without one.
const ruleDefaultPriority = 500

// CheckFilter compares have, the XML libvirt holds under def's name, with
// def, the project's own definition: a filter of that name defined by
// someone else (other rules, another chain, another base filter) must not
// be put on a job VM's interface as if it were ours. libvirt re-serialises
// what it is given, so the comparison is structural: the chain, the
// UUID, the filter references with their parameters and the rules in
// order, each field as libvirt means it (a number in decimal or hex, an
// address in any of its spellings, a rule without a priority at
// libvirt's default); comments, attribute order and whitespace do not
// count. The error names the filter, the first difference and the fix.
func CheckFilter(def NWFilter, have string) error {
	var want, got libvirtxml.NWFilter
	if err := want.Unmarshal(def.XML); err != nil {
		return fmt.Errorf("network filter %s: this version's definition does not parse: %w", def.Name, err)
	}
	diff := ""
	if err := got.Unmarshal(have); err != nil {
		diff = "its XML does not parse: " + err.Error()
	} else {
		diff = filterDiff(&want, &got)
	}
	if diff == "" {
		return nil
	}
	return fmt.Errorf("libvirt already has a network filter named %s that is not this project's (%s), so it is not put on a job VM's interface: "+
		"undefine it (virsh nwfilter-undefine %s, once no running VM uses it) and the executor defines its own, "+
		"or set l2_filter = false", def.Name, diff, def.Name)
}

// filterDiff is the first meaningful difference of got from want ("" for
// none).
func filterDiff(want, got *libvirtxml.NWFilter) string {
	chain := func(f *libvirtxml.NWFilter) string {
		if f.Chain == "" {
			return "root"
		}
		return f.Chain
	}
	switch {
	case want.Name != got.Name:
		return fmt.Sprintf("its name is %q", got.Name)
	case chain(want) != chain(got):
		return fmt.Sprintf("chain %q, not %q", chain(got), chain(want))
	case want.Priority != got.Priority:
		return fmt.Sprintf("chain priority %d, not %d", got.Priority, want.Priority)
	case want.UUID != "" && !strings.EqualFold(want.UUID, got.UUID):
		return fmt.Sprintf("UUID %q, not %q", got.UUID, want.UUID)
	case len(want.Entries) != len(got.Entries):
		return fmt.Sprintf("%d rules and filter references, not %d", len(got.Entries), len(want.Entries))
	}
	for i := range want.Entries {
		w, g := normalEntry(want.Entries[i]), normalEntry(got.Entries[i])
		if reflect.DeepEqual(w, g) {
			continue
		}
		return fmt.Sprintf("entry %d is %s, not %s", i+1, entryText(g), entryText(w))
	}
	return ""
}

// normalEntry is e with every field as libvirt means it, ready for
// reflect.DeepEqual.
func normalEntry(e libvirtxml.NWFilterEntry) libvirtxml.NWFilterEntry {
	if e.Ref != nil {
		r := *e.Ref
		r.Parameters = append([]libvirtxml.NWFilterParameter(nil), r.Parameters...)
		if len(r.Parameters) == 0 {
			r.Parameters = nil
		}
		e.Ref = &r
	}
	if e.Rule != nil {
		r := *e.Rule
		if r.Priority == 0 {
			r.Priority = ruleDefaultPriority
		}
		// A copy of every protocol element, its fields normalised.
		v := reflect.ValueOf(&r).Elem()
		for i := 0; i < v.NumField(); i++ {
			f := v.Field(i)
			if f.Kind() != reflect.Pointer || f.IsNil() {
				continue
			}
			c := reflect.New(f.Elem().Type())
			c.Elem().Set(f.Elem())
			normalFields(c.Elem())
			f.Set(c)
		}
		e.Rule = &r
	}
	return e
}

var filterFieldType = reflect.TypeOf(libvirtxml.NWFilterField{})

// normalFields rewrites each NWFilterField in the struct v (and its
// embedded structs) to one spelling: a variable as written, a number in
// decimal, an address in its canonical form.
func normalFields(v reflect.Value) {
	for i := 0; i < v.NumField(); i++ {
		f := v.Field(i)
		switch {
		case f.Type() == filterFieldType:
			f.Set(reflect.ValueOf(normalField(f.Interface().(libvirtxml.NWFilterField))))
		case f.Kind() == reflect.Struct:
			normalFields(f)
		}
	}
}

func normalField(x libvirtxml.NWFilterField) libvirtxml.NWFilterField {
	s := x.Str
	if s == "" && x.Uint != nil {
		s = strconv.FormatUint(uint64(*x.Uint), 10)
	}
	if x.Var == "" && s != "" {
		if n, err := strconv.ParseUint(s, 0, 64); err == nil {
			s = strconv.FormatUint(n, 10)
		} else if ip := net.ParseIP(s); ip != nil {
			s = ip.String()
		} else if mac, err := net.ParseMAC(s); err == nil {
			s = mac.String()
		}
	}
	return libvirtxml.NWFilterField{Var: x.Var, Str: s}
}

// entryText is e as XML, for the error.
func entryText(e libvirtxml.NWFilterEntry) string {
	var v any = e.Rule
	name := "rule"
	if e.Ref != nil {
		v, name = e.Ref, "filterref"
	}
	var b strings.Builder
	if err := xml.NewEncoder(&b).EncodeElement(v, xml.StartElement{Name: xml.Name{Local: name}}); err != nil {
		return fmt.Sprintf("%+v", v)
	}
	s := b.String()
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}
