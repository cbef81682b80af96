package services

import (
	"bytes"
	"net/netip"
)

// The delimiters of the driver's block in the guest's /etc/hosts.
const (
	hostsBegin = "# BEGIN libvirt-executor services (this job's service aliases)"
	hostsEnd   = "# END libvirt-executor services"
)

// HostEntry maps one alias to a service container's address.
type HostEntry struct {
	Addr  netip.Addr
	Alias string
}

// RewriteHosts is the guest's hosts file old with the driver's block
// replaced by one for entries (one alias a line, in order), or removed
// when there are none. Lines outside the block are kept as they are; a
// block left by an earlier start (a retried prepare) is replaced, not
// added to. The job, which runs on the VM's own OS and not on the podman
// network, resolves each alias through it.
func RewriteHosts(old []byte, entries []HostEntry) []byte {
	var out bytes.Buffer
	in := false
	for _, line := range bytes.SplitAfter(old, []byte("\n")) {
		t := bytes.TrimRight(line, "\r\n")
		switch {
		case string(t) == hostsBegin:
			in = true
			continue
		case in && string(t) == hostsEnd:
			in = false
			continue
		case in:
			continue
		}
		out.Write(line)
	}
	if len(entries) == 0 {
		return out.Bytes()
	}
	if out.Len() > 0 && !bytes.HasSuffix(out.Bytes(), []byte("\n")) {
		out.WriteByte('\n')
	}
	out.WriteString(hostsBegin + "\n")
	for _, e := range entries {
		out.WriteString(e.Addr.String() + "\t" + e.Alias + "\n")
	}
	out.WriteString(hostsEnd + "\n")
	return out.Bytes()
}
