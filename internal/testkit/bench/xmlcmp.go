package bench

import (
	"fmt"
	"strings"

	"libvirt.org/go/libvirtxml"
)

// normalizeDomainXML blanks what differs between any two machines of the
// same image and configuration (name, UUID, ownership metadata, MAC, volume
// and log paths, the per-job key in the SMBIOS strings), so that the floor's
// domain can be compared with the one prepare defined.
func normalizeDomainXML(x string) (string, error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(x); err != nil {
		return "", err
	}
	d.Name, d.UUID, d.ID, d.Metadata = "", "", nil, nil
	for i := range d.SysInfo {
		if s := d.SysInfo[i].SMBIOS; s != nil && s.OEMStrings != nil {
			for j := range s.OEMStrings.Entry {
				k, _, _ := strings.Cut(s.OEMStrings.Entry[j], "=")
				s.OEMStrings.Entry[j] = k + "=…"
			}
		}
	}
	if dev := d.Devices; dev != nil {
		for i := range dev.Disks {
			if src := dev.Disks[i].Source; src != nil && src.File != nil {
				src.File.File = ""
			}
		}
		for i := range dev.Interfaces {
			dev.Interfaces[i].MAC, dev.Interfaces[i].Target, dev.Interfaces[i].Alias = nil, nil, nil
		}
		for i := range dev.Serials {
			if l := dev.Serials[i].Log; l != nil {
				l.File = ""
			}
		}
		for i := range dev.Consoles {
			if l := dev.Consoles[i].Log; l != nil {
				l.File = ""
			}
		}
		for i := range dev.Channels {
			if s := dev.Channels[i].Source; s != nil && s.UNIX != nil {
				s.UNIX.Path = ""
			}
		}
	}
	return d.Marshal()
}

// domainDiff compares two domain definitions after normalizeDomainXML and
// returns the lines only one of them has ("- " job, "+ " floor), at most
// max of them; nil when they are alike.
func domainDiff(job, floor string, max int) ([]string, error) {
	a, err := normalizeDomainXML(job)
	if err != nil {
		return nil, fmt.Errorf("job domain XML: %w", err)
	}
	b, err := normalizeDomainXML(floor)
	if err != nil {
		return nil, fmt.Errorf("floor domain XML: %w", err)
	}
	count := func(s string) map[string]int {
		m := map[string]int{}
		for _, l := range strings.Split(s, "\n") {
			m[strings.TrimSpace(l)]++
		}
		return m
	}
	ca, cb := count(a), count(b)
	var out []string
	for _, pass := range []struct {
		lines      string
		mine, them map[string]int
		sign       string
	}{{a, ca, cb, "- "}, {b, cb, ca, "+ "}} {
		seen := map[string]int{}
		for _, l := range strings.Split(pass.lines, "\n") {
			l = strings.TrimSpace(l)
			seen[l]++
			if seen[l] > pass.them[l] && len(out) < max {
				out = append(out, pass.sign+l)
			}
		}
	}
	return out, nil
}
