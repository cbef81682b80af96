package gitlab

import (
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

func limitsConfig(t *testing.T, allow bool) *config.Config {
	t.Helper()
	a := "false"
	if allow {
		a = "true"
	}
	cfg, err := config.Parse([]byte(`
default_image = "a"
[defaults]
vcpus = 2
memory_mib = 2048
disk_gib = 10
[limits]
allow_job_overrides = ` + a + `
max_vcpus = 4
max_memory_mib = 8192
max_disk_gib = 100
[images.a]
base = "/a.qcow2"
[images.big]
base = "/b.qcow2"
memory_mib = 4096
`))
	require.NoError(t, err)
	return cfg
}

func TestChooseResourcesDefaults(t *testing.T) {
	cfg := limitsConfig(t, false)
	img, _ := cfg.Image("a")
	r, err := ChooseResources(cfg, img, envOf(nil))
	require.NoError(t, err)
	require.Equal(t, Resources{VCPUs: 2, MemoryMiB: 2048, DiskGiB: 10}, r)
	big, _ := cfg.Image("big")
	r, err = ChooseResources(cfg, big, envOf(nil))
	require.NoError(t, err)
	require.Equal(t, 4096, r.MemoryMiB, "image override")
}

func TestChooseResourcesRefusedWithoutPermission(t *testing.T) {
	cfg := limitsConfig(t, false)
	img, _ := cfg.Image("a")
	_, err := ChooseResources(cfg, img, envOf(map[string]string{"CUSTOM_ENV_LIBVIRT_EXECUTOR_VCPUS": "2"}))
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, "does not let jobs choose their VM size (limits.allow_job_overrides = false)")
}

func TestChooseResourcesRequests(t *testing.T) {
	cfg := limitsConfig(t, true)
	img, _ := cfg.Image("a")
	good := []struct {
		env  map[string]string
		want Resources
	}{
		{map[string]string{"CUSTOM_ENV_LIBVIRT_EXECUTOR_VCPUS": "4"}, Resources{VCPUs: 4, MemoryMiB: 2048, DiskGiB: 10}},
		{map[string]string{"CUSTOM_ENV_LIBVIRT_EXECUTOR_MEMORY": "4G"}, Resources{VCPUs: 2, MemoryMiB: 4096, DiskGiB: 10}},
		{map[string]string{"CUSTOM_ENV_LIBVIRT_EXECUTOR_MEMORY": "3000MiB"}, Resources{VCPUs: 2, MemoryMiB: 3000, DiskGiB: 10}},
		{map[string]string{"CUSTOM_ENV_LIBVIRT_EXECUTOR_MEMORY": "512"}, Resources{VCPUs: 2, MemoryMiB: 512, DiskGiB: 10}},
		{map[string]string{"CUSTOM_ENV_LIBVIRT_EXECUTOR_DISK": "40g"}, Resources{VCPUs: 2, MemoryMiB: 2048, DiskGiB: 40}},
	}
	for _, tc := range good {
		r, err := ChooseResources(cfg, img, envOf(tc.env))
		require.NoError(t, err, "%v", tc.env)
		require.Equal(t, tc.want, r)
	}
	bad := []struct {
		key, value, msg string
	}{
		{"LIBVIRT_EXECUTOR_DISK", "10T", "asks for 10240 GiB; this runner allows 1 to 100 GiB"},
		{"LIBVIRT_EXECUTOR_VCPUS", "-1", "not a size"},
		{"LIBVIRT_EXECUTOR_VCPUS", "0", "allows 1 to 4 vCPUs"},
		{"LIBVIRT_EXECUTOR_VCPUS", "5", "allows 1 to 4 vCPUs"},
		{"LIBVIRT_EXECUTOR_VCPUS", "2G", `unknown unit "G"`},
		{"LIBVIRT_EXECUTOR_MEMORY", "1e9", "not a size"},
		{"LIBVIRT_EXECUTOR_MEMORY", "2T", `unknown unit "T"`},
		{"LIBVIRT_EXECUTOR_MEMORY", "lots", "not a size"},
		{"LIBVIRT_EXECUTOR_MEMORY", "99999999999999999999", "not a size"},
		{"LIBVIRT_EXECUTOR_MEMORY", "16G", "allows 128 to 8192 MiB"},
		{"LIBVIRT_EXECUTOR_MEMORY", "64", "allows 128 to 8192 MiB"},
		{"LIBVIRT_EXECUTOR_MEMORY", "2048\x00", "not a size"},
		{"LIBVIRT_EXECUTOR_MEMORY", "2048\n", "not a size"},
		{"LIBVIRT_EXECUTOR_MEMORY", " 2048", "not a size"},
		{"LIBVIRT_EXECUTOR_MEMORY", "1.5G", "not a size"},
		{"LIBVIRT_EXECUTOR_MEMORY", "<memory>", "not a size"},
		{"LIBVIRT_EXECUTOR_DISK", "$(reboot)", "not a size"},
	}
	for _, tc := range bad {
		_, err := ChooseResources(cfg, img, envOf(map[string]string{"CUSTOM_ENV_" + tc.key: tc.value}))
		require.Error(t, err, "%s=%q", tc.key, tc.value)
		require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
		require.ErrorContains(t, err, tc.msg)
		require.ErrorContains(t, err, tc.key)
		require.NotContains(t, err.Error(), "\x00")
		require.NotContains(t, err.Error(), "\n")
	}
}
