package config

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The branches of Validate that TestValidateMessages does not reach.
func TestValidateMoreMessages(t *testing.T) {
	base := "[images.a]\nbase = \"/a.qcow2\"\n"
	img := "[images.a]\nbase = \"/a\"\n"
	for _, tc := range []struct{ name, toml, want string }{
		{"libvirt uri", "libvirt_uri = \"system\"\n" + base, `libvirt_uri: "system" is not a libvirt URI (example: "qemu:///system")`},
		{"storage pool", "storage_pool = \"a/b\"\n" + base, `storage_pool: "a/b" is not a valid pool name`},
		{"network", "network = \"-n\"\n" + base, `network: "-n" is not a valid network name`},
		{"guest tools", "[guest_tools]\ngitlab_runner = \"bin/gitlab-runner\"\n" + base, `guest_tools.gitlab_runner: "bin/gitlab-runner" is not allowed`},
		{"memory budget below a job", "[capacity]\nmemory_budget_mib = 1024\n" + base, "capacity.memory_budget_mib: 1024 is smaller than one job may ask for (limits.max_memory_mib = 2048)"},
		{"serve interval", "[serve]\ninterval = \"20s\"\n" + base, "serve.interval: 20s is out of range 50ms-10s"},
		{"garm flavor name", "[garm.flavors.Big]\nvcpus = 8\nmemory_mib = 8192\n" + base, `garm.flavors.Big: flavor name "Big" is not allowed`},
		{"garm flavor size", "[garm.flavors.big]\nvcpus = 0\nmemory_mib = 8192\n" + base, "garm.flavors.big.vcpus: 0 is out of range 1-64"},
		{"user", img + "user = \"Root\"\nkey_injection = \"cloud-init\"\n", `images.a.user: "Root" is not a valid user name`},
		{"builds dir", img + "builds_dir = \"/\"\n", `images.a.builds_dir: "/" must be an absolute guest path other than /`},
		{"cache dir", img + "cache_dir = \"cache\"\n", `images.a.cache_dir: "cache" must be an absolute guest path other than /`},
		{"initrd", img + "boot = \"kernel\"\nkernel = \"/k\"\ninitrd = \"i\"\n", `images.a.initrd: "i" must be an absolute path`},
		{"kernel without kernel boot", img + "cmdline = \"console=ttyS0\"\n", `images.a.boot: kernel, initrd and cmdline need boot = "kernel"`},
		{"machine", img + "machine = \"pc q35\"\n", `images.a.machine: "pc q35" is not a valid machine type`},
		{"image vcpus", img + "vcpus = 65\n", "images.a.vcpus: 65 is out of range 1-64"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// Every problem is reported, in the same order every time: the top-level
// keys, the tables, the images (by name), default_image last.
func TestValidateReportsAllInOrder(t *testing.T) {
	text := "default_image = \"z\"\nnetwork = \"-n\"\n[serve]\nevent_spool_mib = -1\n[defaults]\nvcpus = 65\n" +
		"[images.b]\nbase = \"b\"\ncache_dir = \"/\"\nbuilds_dir = \"/\"\n[images.a]\nbase = \"a\"\n"
	want := []string{"network:", "defaults.vcpus:", "limits.max_vcpus:", "serve.event_spool_mib:", "images.a.base:",
		"images.b.base:", "images.b.builds_dir:", "images.b.cache_dir:", "default_image:"}
	for range 20 {
		_, err := Parse([]byte(text))
		require.Error(t, err)
		msg, at := err.Error(), -1
		for _, w := range want {
			i := strings.Index(msg, w)
			require.Greater(t, i, at, "%q out of order in %s", w, msg)
			require.Equal(t, 1, strings.Count(msg, w), "%q once in %s", w, msg)
			at = i
		}
	}
}
