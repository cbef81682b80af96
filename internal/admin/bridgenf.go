package admin

import (
	"errors"
	"io/fs"
	"os"
	"strings"
)

// bridgeNFPath is the sysctl br_netfilter adds: whether bridged IPv4 traffic
// passes iptables (a variable for the tests).
var bridgeNFPath = "/proc/sys/net/bridge/bridge-nf-call-iptables"

// bridgeNFCheck checks that bridged traffic passes iptables, as the network
// filters' IP rules need (l2_filter: garm's port closed to job VMs,
// egress_allow, the address pin). At 0, or without br_netfilter, only their
// MAC and ARP rules (ebtables) hold and the rest silently does nothing.
func bridgeNFCheck(path string) Check {
	c := Check{Name: "bridged traffic to iptables",
		Fix: "modprobe br_netfilter && sysctl -w net.bridge.bridge-nf-call-iptables=1; to keep both across reboots: " +
			"echo br_netfilter > /etc/modules-load.d/libvirt-executor.conf && " +
			"echo 'net.bridge.bridge-nf-call-iptables = 1' > /etc/sysctl.d/90-libvirt-executor.conf (docs/install.md)"}
	b, err := os.ReadFile(path)
	v := strings.TrimSpace(string(b))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		c.Info = "br_netfilter is not loaded (no " + path + "): the network filters' IP rules (garm's port, egress_allow) do nothing on bridged traffic"
	case err != nil:
		c.Info = err.Error()
	case v == "1":
		c.OK = true
		c.Info = "net.bridge.bridge-nf-call-iptables = 1: the network filters' IP rules see bridged traffic"
	default:
		c.Info = "net.bridge.bridge-nf-call-iptables = " + v + ": the network filters' IP rules (garm's port, egress_allow) do nothing on bridged traffic"
	}
	return c
}
