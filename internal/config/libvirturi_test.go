package config_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// A libssh URI (qemu+libssh://, qemu+libssh2://) checks the host's key
// against known_hosts only with known_hosts_verify=normal, libvirt's
// default: ignore accepts any host, auto adds an unknown host's key without
// asking. The configuration refuses any other value, read as libvirt reads
// the query (names in any case, the last one given wins, ';' separates when
// no '&' does), and refuses no_verify the same way.
func TestLibsshKnownHostsVerify(t *testing.T) {
	own := "state_dir = \"/var/lib/lve-kvm2\"\n[images.a]\nbase = \"/a.qcow2\"\n"
	for uri, want := range map[string]string{
		"qemu+libssh://kvm2/system?known_hosts_verify=ignore":                         `libvirt_uri: known_hosts_verify "ignore" is not allowed (allowed: normal, libvirt's default)`,
		"qemu+libssh2://kvm2/system?known_hosts_verify=auto":                          `libvirt_uri: known_hosts_verify "auto" is not allowed (allowed: normal, libvirt's default)`,
		"qemu+libssh://kvm2/system?known_hosts_verify=":                               `libvirt_uri: known_hosts_verify "" is not allowed`,
		"qemu+libssh://kvm2/system?known_hosts_verify=normal&known_hosts_verify=auto": `known_hosts_verify "auto" is not allowed`,
		"qemu+libssh://kvm2/system?KNOWN_HOSTS_VERIFY=ignore":                         `known_hosts_verify "ignore" is not allowed`,
		"qemu+libssh://kvm2/system?known%5Fhosts%5Fverify=ignore":                     `known_hosts_verify "ignore" is not allowed`,
		"qemu+libssh://kvm2/system?keyfile=/k;known_hosts_verify=ignore":              `known_hosts_verify "ignore" is not allowed`,
		"qemu+libssh://localhost/system?known_hosts_verify=ignore":                    `known_hosts_verify "ignore" is not allowed`,
		"qemu+ssh://kvm2/system?NO_VERIFY=1":                                          "libvirt_uri: no_verify=1 accepts any host as kvm2",
		"qemu+tls://kvm2/system?pkipath=/p;no_verify=1":                               "libvirt_uri: no_verify=1 accepts any host as kvm2",
	} {
		_, err := config.Parse([]byte("libvirt_uri = \"" + uri + "\"\n" + own))
		require.ErrorContains(t, err, want, uri)
	}
	for _, uri := range []string{
		"qemu+libssh://kvm2/system",
		"qemu+libssh2://garm@kvm2/system?keyfile=/etc/garm/k&known_hosts=/etc/garm/known_hosts",
		"qemu+libssh://kvm2/system?known_hosts_verify=normal",
		"qemu+libssh2://kvm2/system?known_hosts_verify=auto&known_hosts_verify=normal",
		"qemu+ssh://kvm2/system?no_verify=0",
	} {
		_, err := config.Parse([]byte("libvirt_uri = \"" + uri + "\"\n" + own))
		require.NoError(t, err, uri)
	}
}
