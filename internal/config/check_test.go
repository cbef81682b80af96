package config

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// Check reports every problem with the line of its key, an unknown key
// with what its table allows, and validates the known keys all the same.
func TestCheckProblems(t *testing.T) {
	text := `domain_typo = "kvm"
[limits]
max_disk = 3
[images.a]
base = "/a.qcow2"
boot = "disc"
egress_allow = ["x"]
[images.b]
[garm.flavors.big]
vcpus = 2
`
	var got []string
	for _, p := range Check([]byte(text)) {
		got = append(got, p.String())
	}
	require.Equal(t, []string{
		`1: domain_typo: unknown key "domain_typo" in the top level; it allows libvirt_uri, domain_type, storage_pool, network, name_prefix, state_dir, default_image, isolate_guests, l2_filter, static_addresses, host_key_policy, insecure_job_id_from_env, defaults, limits, capacity, debug, timeouts, ssh, serve, guest_tools, log, garm, gitlab, cache, registry, services, github_hooks, images (docs/configuration.md)`,
		`3: limits.max_disk: unknown key "max_disk" in [limits]; it allows allow_job_overrides, max_vcpus, max_memory_mib, max_disk_gib (docs/configuration.md)`,
		`9: garm.flavors.big.memory_mib (not set in [garm.flavors.big]): 0 is out of range 128-262144`,
		`7: images.a.egress_allow[0]: "x": not an IPv4 address; allowed forms: "10.1.0.0/16", "10.1.2.3", "10.1.0.0/16:443" or "10.1.2.3:443" (IPv4, port 1-65535)`,
		`6: images.a.boot: "disc" is not allowed; use one of "disk", "kernel"`,
		`8: images.b.base (not set in [images.b]): "" must be an absolute path to the base disk image (or set source = "oci://...")`,
		` default_image (not set in the file): must name one of the configured images: "a", "b"`,
	}, got)

	p := Check([]byte("[images.a]\nbase = \"/a\"\n[defaults]\nvcpus = \"two\"\n"))
	require.Len(t, p, 1)
	require.Equal(t, Problem{Key: "defaults.vcpus", Line: 4, Set: true, Message: p[0].Message}, p[0])
	require.Contains(t, p[0].Message, "defaults.vcpus takes a whole number")

	p = Check([]byte("[images.a]\nbase = \"/a\"\n[timeouts]\nboot = [\"5m\"]\n"))
	require.Contains(t, p[0].Message, `timeouts.boot takes a duration string ("90s", "5m", "1h30m")`)

	p = Check([]byte("[images.a\nbase = \"/a\"\n"))
	require.Len(t, p, 1)
	require.Equal(t, "1: toml: expected ']' to close table name", p[0].String())

	require.Empty(t, Check([]byte("[images.a]\nbase = \"/a\"\n")))
	// A dotted key, an inline table and a quoted name are found too.
	p = Check([]byte("images.\"a.b\".base = \"/a\"\nimages.\"a.b\".pool = { idle_count = 99 }\n"))
	require.Len(t, p, 2)
	require.Equal(t, `2: images.a.b.pool.idle_count: 99 is out of range 0-64`, p[0].String())
	require.Equal(t, `2: images.a.b.pool.max_idle (not set in [images.a.b.pool]): 99 is out of range 99-64`, p[1].String())
}

// Settings shows every key with its effective value and where it came
// from; a URL's password is never shown.
func TestSettings(t *testing.T) {
	c, err := Parse([]byte(`libvirt_uri = "qemu:///system"
default_image = "b"
[ssh]
connection_holder = false
[limits]
max_vcpus = 4
[images.b]
base = "/b.qcow2"
egress_allow = []
[images.b.pool]
idle_count = 1
[images.a]
base = "/a.qcow2"
boot = "kernel"
kernel = "/k"
[garm.flavors.big]
vcpus = 8
memory_mib = 8192
`))
	require.NoError(t, err)
	got := map[string]Setting{}
	var order []string
	for _, s := range c.Settings() {
		got[s.Key] = s
		order = append(order, s.Key)
	}
	want := map[string]Setting{
		"libvirt_uri":               {"libvirt_uri", "qemu:///system", SourceFile},
		"domain_type":               {"domain_type", "auto", SourceDefault},
		"default_image":             {"default_image", "b", SourceFile},
		"isolate_guests":            {"isolate_guests", true, SourceDefault},
		"ssh.connection_holder":     {"ssh.connection_holder", false, SourceFile},
		"ssh.keepalive_interval":    {"ssh.keepalive_interval", "3s", SourceDefault},
		"limits.max_vcpus":          {"limits.max_vcpus", 4, SourceFile},
		"limits.max_memory_mib":     {"limits.max_memory_mib", 2048, SourceDefault},
		"cache.disk_min_mib":        {"cache.disk_min_mib", 16, SourceDefault},
		"cache.images":              {"cache.images", nil, SourceDefault},
		"images.a.boot":             {"images.a.boot", "kernel", SourceFile},
		"images.a.format":           {"images.a.format", "qcow2", SourceDefault},
		"images.a.egress_allow":     {"images.a.egress_allow", nil, SourceDefault},
		"images.b.egress_allow":     {"images.b.egress_allow", []string{}, SourceFile},
		"images.b.pool.idle_count":  {"images.b.pool.idle_count", 1, SourceFile},
		"images.b.pool.max_age":     {"images.b.pool.max_age", "1h0m0s", SourceDefault},
		"garm.flavors.big.vcpus":    {"garm.flavors.big.vcpus", 8, SourceFile},
		"garm.flavors.big.disk_gib": {"garm.flavors.big.disk_gib", 0, SourceDefault},
	}
	for k, w := range want {
		require.Equal(t, w, got[k], k)
	}
	require.NotContains(t, got, "images.a.pool.idle_count", "an image without a pool table has no pool keys")
	require.Equal(t, "libvirt_uri", order[0])
	require.Less(t, indexOf(order, "images.a.base"), indexOf(order, "images.b.base"))
	_, err = json.Marshal(c.Settings())
	require.NoError(t, err)

	// An image with a source has its files from the store.
	c.Images["b"].Source, c.Images["b"].Kernel = "oci://registry.example/b:1", "/store/b/kernel"
	for _, s := range c.Settings() {
		if s.Key == "images.b.kernel" {
			require.Equal(t, Setting{"images.b.kernel", "/store/b/kernel", SourceStore}, s)
		}
	}

	// The only image is the default.
	c, err = Parse([]byte("[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	require.Equal(t, Setting{"default_image", "a", SourceDefault}, c.Settings()[6])
}

func indexOf(s []string, v string) int {
	for i, x := range s {
		if x == v {
			return i
		}
	}
	return -1
}

// No password of a URL, and no value of a key named like a secret, is
// shown.
func TestSettingsHideSecrets(t *testing.T) {
	require.Equal(t, "qemu+ssh://ci:"+Redacted+"@kvm1/system?keyfile=/k", hidePassword("qemu+ssh://ci:hunter2@kvm1/system?keyfile=/k"))
	require.Equal(t, "qemu+ssh://ci@kvm1/system", hidePassword("qemu+ssh://ci@kvm1/system"))
	require.Equal(t, "/etc/x@y", hidePassword("/etc/x@y"))
	require.True(t, secretKeyRE.MatchString("api_token"))
	require.False(t, secretKeyRE.MatchString("credentials"), "registry.credentials is a path")
}
