package config

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestServicesSection(t *testing.T) {
	base := "[images.a]\nbase = \"/a.qcow2\"\n"
	c, err := Parse([]byte(base))
	require.NoError(t, err)
	require.False(t, c.Services.Enabled)
	require.Equal(t, 30*time.Second, c.Services.WaitTimeout.D())
	require.Equal(t, "if-not-present", c.Services.PullPolicy)

	c, err = Parse([]byte(`[services]
enabled = true
wait_timeout = "2m"
allowed_images = ["postgres:*", "registry.example:5000/**"]
pull_policy = "always"
allowed_pull_policies = ["always", "if-not-present"]
plain_http = ["10.213.7.1:5000"]
[services.mirrors]
"docker.io" = ["10.213.7.1:5000", "mirror.example/dockerhub"]
"registry.example:5000" = ["10.213.7.1:5001"]
` + base))
	require.NoError(t, err)
	require.True(t, c.Services.Enabled)
	require.Equal(t, 2*time.Minute, c.Services.WaitTimeout.D())
	require.Equal(t, []string{"10.213.7.1:5000", "mirror.example/dockerhub"}, c.Services.Mirrors["docker.io"])

	for _, tc := range []struct{ name, toml, want string }{
		{"timeout", "wait_timeout = \"11m\"", "services.wait_timeout: 11m0s must be 1s to 10m"},
		{"pattern", "allowed_images = [\"\"]", `services.allowed_images: "" must be an image name or glob`},
		{"policy", "pull_policy = \"sometimes\"", `services.pull_policy: "sometimes" must be one of always, if-not-present, never`},
		{"allowed policy", "allowed_pull_policies = [\"rarely\"]", `services.allowed_pull_policies: "rarely" must be one of`},
		{"default not allowed", "allowed_pull_policies = [\"always\"]", `services.pull_policy: "if-not-present" is not among services.allowed_pull_policies (always)`},
		{"registry", "[services.mirrors]\n\"https://docker.io\" = [\"m:5000\"]", `services.mirrors: registry "https://docker.io" must be a host name`},
		{"mirror scheme", "[services.mirrors]\n\"docker.io\" = [\"http://m:5000\"]", `services.mirrors: mirror "http://m:5000" of "docker.io" must be HOST[:PORT][/PATH] without a scheme`},
		{"mirror port", "[services.mirrors]\n\"docker.io\" = [\"m:99999\"]", `mirror "m:99999"`},
		{"no mirrors", "[services.mirrors]\n\"docker.io\" = []", `registry "docker.io": give 1 to 8 mirrors`},
		{"plain http", "plain_http = [\"elsewhere:5000\"]", `services.plain_http: "elsewhere:5000" is none of the mirrors`},
		{"unknown key", "wait = \"1s\"", `unknown key "services.wait"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte("[services]\n" + tc.toml + "\n" + base))
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// [services.container_jobs]: a default VM image and per-pattern ones, each
// a configured image; bad values name the key and what is allowed.
func TestContainerJobsSection(t *testing.T) {
	base := "default_image = \"a\"\n[images.a]\nbase = \"/a.qcow2\"\n[images.podman]\nbase = \"/p.qcow2\"\n[images.big]\nbase = \"/b.qcow2\"\n"
	c, err := Parse([]byte(base))
	require.NoError(t, err)
	require.Empty(t, c.Services.ContainerJobs.AllowedImages, "off by default")

	c, err = Parse([]byte(base + `[services]
enabled = true
[services.container_jobs]
allowed_images = ["alpine:*", "registry.example:5000/ci/**"]
vm_image = "podman"
[services.container_jobs.vm_images]
"registry.example:5000/ci/**" = "big"
`))
	require.NoError(t, err)
	cj := c.Services.ContainerJobs
	require.Equal(t, []string{"alpine:*", "registry.example:5000/ci/**"}, cj.AllowedImages)
	require.Equal(t, "podman", cj.VMImage)
	require.Equal(t, "big", cj.VMImages["registry.example:5000/ci/**"])

	for _, tc := range []struct{ name, toml, want string }{
		{"services off", "[services.container_jobs]\nallowed_images = [\"alpine:*\"]\nvm_image = \"podman\"",
			"services.container_jobs.allowed_images: container jobs need services.enabled = true"},
		{"no vm image", "[services]\nenabled = true\n[services.container_jobs]\nallowed_images = [\"alpine:*\"]",
			`services.container_jobs.vm_image: required with services.container_jobs.allowed_images: the VM image (with podman) that hosts container jobs; use one of "a", "big", "podman"`},
		{"unknown vm image", "[services]\nenabled = true\n[services.container_jobs]\nallowed_images = [\"alpine:*\"]\nvm_image = \"nope\"",
			`services.container_jobs.vm_image: "nope" is not a configured image; use one of "a", "big", "podman"`},
		{"bad pattern", "[services]\nenabled = true\n[services.container_jobs]\nallowed_images = [\"al pine\"]\nvm_image = \"podman\"",
			`services.container_jobs.allowed_images: "al pine" must be an image name or glob`},
		{"override of no pattern", "[services]\nenabled = true\n[services.container_jobs]\nallowed_images = [\"alpine:*\"]\nvm_image = \"podman\"\n[services.container_jobs.vm_images]\n\"debian:*\" = \"big\"",
			`services.container_jobs.vm_images: "debian:*" is not one of services.container_jobs.allowed_images ("alpine:*")`},
		{"override to no image", "[services]\nenabled = true\n[services.container_jobs]\nallowed_images = [\"alpine:*\"]\nvm_image = \"podman\"\n[services.container_jobs.vm_images]\n\"alpine:*\" = \"huge\"",
			`services.container_jobs.vm_images: "alpine:*" = "huge": not a configured image; use one of "a", "big", "podman"`},
		{"overrides without patterns", "[services.container_jobs.vm_images]\n\"alpine:*\" = \"big\"",
			"services.container_jobs.vm_images: set without services.container_jobs.allowed_images"},
		{"unknown key", "[services.container_jobs]\nimages = []", `unknown key "services.container_jobs.images"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(base + tc.toml + "\n"))
			require.ErrorContains(t, err, tc.want)
		})
	}
}
