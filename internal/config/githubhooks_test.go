package config

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestGitHubHooksSection(t *testing.T) {
	base := "default_image = \"a\"\n[images.a]\nbase = \"/a.qcow2\"\n[images.podman]\nbase = \"/p.qcow2\"\n"
	c, err := Parse([]byte(base))
	require.NoError(t, err)
	require.False(t, c.GitHubHooks.Enabled(), "off by default")

	c, err = Parse([]byte(base + `[github_hooks]
vm_image = "podman"
allowed_images = ["node:*"]
work_dir = "/home/runner/actions-runner/_work"
share_user = "runner"
`))
	require.NoError(t, err)
	g := c.GitHubHooks
	require.True(t, g.Enabled())
	require.Equal(t, "/home/runner/actions-runner/externals", g.ExternalsDir, "beside _work, as the runner lays them out")
	require.Equal(t, "libvirt-qemu", g.QEMUGroup)
	require.Equal(t, "/usr/lib/qemu/virtiofsd", g.Virtiofsd)
	require.Equal(t, "/run/libvirt-executor-hooks", g.RuntimeDir)
	require.Equal(t, 6*time.Hour, g.JobTimeout.D())
	require.Equal(t, 2*time.Minute, g.HealthTimeout.D())
	require.False(t, c.Images["podman"].SharedMemory, "shared memory only where the image says so: the pool service's configuration may have no [github_hooks]")

	for _, tc := range []struct{ name, toml, want string }{
		{"unknown vm image", "vm_image = \"nope\"\nwork_dir = \"/w\"",
			`github_hooks.vm_image: "nope" is not a configured image; use one of "a", "podman"`},
		{"no work dir", "vm_image = \"podman\"", "github_hooks.work_dir: required with github_hooks.vm_image"},
		{"relative work dir", "vm_image = \"podman\"\nwork_dir = \"_work\"", `github_hooks.work_dir: "_work" must be a clean absolute path`},
		{"work dir with a comma", "vm_image = \"podman\"\nwork_dir = \"/a,b\"", `github_hooks.work_dir: "/a,b" must be a clean absolute path other than / without ','`},
		{"long runtime dir", "runtime_dir = \"/run/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"", "github_hooks.runtime_dir: \"/run/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\" is longer than 40 bytes"},
		{"bad user", "share_user = \"Run ner\"", `github_hooks.share_user: "Run ner" is not a user or group name`},
		{"bad pattern", "allowed_images = [\"no de\"]", `github_hooks.allowed_images: "no de" must be an image name or glob`},
		{"timeout", "job_timeout = \"200h\"", "github_hooks.job_timeout: 200h0m0s must be 1m to 120h"},
		{"health timeout", "health_timeout = \"1h\"", "github_hooks.health_timeout: 1h0m0s must be 1s to 30m"},
		{"externals in work", "vm_image = \"podman\"\nwork_dir = \"/r/_work\"\nexternals_dir = \"/r/_work/ext\"", `github_hooks.externals_dir: "/r/_work/ext" and work_dir "/r/_work" must not contain one another`},
		{"work in externals", "vm_image = \"podman\"\nwork_dir = \"/r/e/_work\"\nexternals_dir = \"/r/e\"", `must not contain one another`},
		{"unknown key", "images = []", `unknown key "github_hooks.images"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(base + "[github_hooks]\n" + tc.toml + "\n"))
			require.ErrorContains(t, err, tc.want)
		})
	}
}
