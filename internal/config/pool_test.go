package config

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A pool table with only idle_count gets max_idle = idle_count, idle_time
// 10m and max_age 1h; [serve] gets its defaults; an image without a pool
// table has none.
func TestPoolAndServeDefaults(t *testing.T) {
	c, err := Parse([]byte(`
default_image = "a"
[images.a]
base = "/a.qcow2"
[images.a.pool]
idle_count = 3
[images.b]
base = "/b.qcow2"
`))
	require.NoError(t, err)
	a, _ := c.Image("a")
	require.NotNil(t, a.Pool)
	require.Equal(t, 3, a.Pool.IdleCount)
	require.Equal(t, 3, a.Pool.MaxIdle, "max_idle defaults to idle_count")
	require.Equal(t, 10*time.Minute, a.Pool.IdleTime.D())
	require.Equal(t, time.Hour, a.Pool.MaxAge.D())
	b, _ := c.Image("b")
	require.Nil(t, b.Pool, "no pool unless asked for")

	require.Equal(t, 2, c.Serve.BootParallelism)
	require.Equal(t, 250*time.Millisecond, c.Serve.Interval.D())
	require.Equal(t, 5*time.Second, c.Serve.HealthInterval.D())

	pooled := c.Pooled()
	require.Len(t, pooled, 1)
	require.Equal(t, "a", pooled[0].Name)
}

// Values that are set are kept as written.
func TestPoolAndServeExplicitValues(t *testing.T) {
	c, err := Parse([]byte(`
[serve]
boot_parallelism = 5
interval = "1s"
health_interval = "30s"
metrics_listen = "[::1]:9999"
event_spool_mib = 3
[images.a]
base = "/a.qcow2"
[images.a.pool]
idle_count = 1
max_idle = 6
idle_time = "2m"
max_age = "3h"
`))
	require.NoError(t, err)
	a, _ := c.Image("a")
	require.Equal(t, Pool{IdleCount: 1, MaxIdle: 6, IdleTime: Duration(2 * time.Minute), MaxAge: Duration(3 * time.Hour)}, *a.Pool)
	require.Equal(t, PoolService{BootParallelism: 5, Interval: Duration(time.Second), HealthInterval: Duration(30 * time.Second),
		MetricsListen: "[::1]:9999", EventSpoolMiB: 3}, c.Serve)
}

// Pooled lists only the images with a pool table, sorted by name.
func TestPooledSorted(t *testing.T) {
	c, err := Parse([]byte(`
default_image = "m"
[images.z]
base = "/z"
[images.z.pool]
idle_count = 1
[images.m]
base = "/m"
[images.c]
base = "/c"
[images.c.pool]
idle_count = 2
`))
	require.NoError(t, err)
	var names []string
	for _, img := range c.Pooled() {
		names = append(names, img.Name)
	}
	require.Equal(t, []string{"c", "z"}, names)
}

// ImageSize is the image's own values where set, else the defaults.
func TestImageSize(t *testing.T) {
	c, err := Parse([]byte(`
default_image = "plain"
[defaults]
vcpus = 3
memory_mib = 1024
disk_gib = 10
[images.plain]
base = "/p"
[images.big]
base = "/b"
vcpus = 8
memory_mib = 8192
[images.disk]
base = "/d"
disk_gib = 40
`))
	require.NoError(t, err)
	size := func(name string) Size {
		img, ok := c.Image(name)
		require.True(t, ok)
		return c.ImageSize(img)
	}
	require.Equal(t, Size{VCPUs: 3, MemoryMiB: 1024, DiskGiB: 10}, size("plain"))
	require.Equal(t, Size{VCPUs: 8, MemoryMiB: 8192, DiskGiB: 10}, size("big"))
	require.Equal(t, Size{VCPUs: 3, MemoryMiB: 1024, DiskGiB: 40}, size("disk"))
}

// Every bad pool or serve value is refused with a message that names its
// key and what is allowed.
func TestPoolValidationMessages(t *testing.T) {
	img := "[images.a]\nbase = \"/a.qcow2\"\n[images.a.pool]\n"
	tests := []struct {
		name, toml, want string
	}{
		{"idle_count negative", img + "idle_count = -1\nmax_idle = 2\n", "images.a.pool.idle_count: -1 is out of range 0-64"},
		{"idle_count too big", img + "idle_count = 65\n", "images.a.pool.idle_count: 65 is out of range 0-64"},
		{"max_idle below idle_count", img + "idle_count = 4\nmax_idle = 2\n", "images.a.pool.max_idle: 2 is out of range 4-64"},
		{"max_idle too big", img + "idle_count = 4\nmax_idle = 65\n", "images.a.pool.max_idle: 65 is out of range 4-64"},
		{"nothing to keep", img + "idle_count = 0\n", "images.a.pool.max_idle: 0 is out of range 1-64"},
		{"idle_time negative", img + "idle_count = 1\nidle_time = \"-1m\"\n", "images.a.pool.idle_time: must be a positive duration"},
		{"max_age too short", img + "idle_count = 1\nmax_age = \"30s\"\n", "images.a.pool.max_age: 30s is too short: at least 1m"},
		{"max_age negative", img + "idle_count = 1\nmax_age = \"-2h\"\n", "images.a.pool.max_age: -2h0m0s is too short"},
		{"max_age not a duration", img + "idle_count = 1\nmax_age = \"forever\"\n", `"forever" is not a duration`},
		{"unknown pool key", img + "idle_count = 1\nidle = 3\n", `unknown key "images.a.pool.idle"`},
		{"prepull without services", img + "idle_count = 1\nprepull = [\"postgres:15\"]\n", "images.a.pool.prepull: pulls container images for [services], which is off"},
		{"prepull with a variable", "[services]\nenabled = true\n" + img + "idle_count = 1\nprepull = [\"$IMAGE\"]\n", `images.a.pool.prepull: "$IMAGE" must be a container image name`},
		{"prepull too many", "[services]\nenabled = true\n" + img + "idle_count = 1\nprepull = [" + strings.Repeat(`"a",`, 17) + "]\n", "images.a.pool.prepull: 17 images: at most 16"},
		{"boot_parallelism zero is default, too big is not", "[serve]\nboot_parallelism = 33\n" + img + "idle_count = 1\n", "serve.boot_parallelism: 33 is out of range 1-32"},
		{"boot_parallelism negative", "[serve]\nboot_parallelism = -1\n" + img + "idle_count = 1\n", "serve.boot_parallelism: -1 is out of range 1-32"},
		{"interval too short", "[serve]\ninterval = \"10ms\"\n" + img + "idle_count = 1\n", "serve.interval: 10ms is out of range 50ms-10s"},
		{"interval too long", "[serve]\ninterval = \"11s\"\n" + img + "idle_count = 1\n", "serve.interval: 11s is out of range 50ms-10s"},
		{"health_interval negative", "[serve]\nhealth_interval = \"-5s\"\n" + img + "idle_count = 1\n", "serve.health_interval: must be a positive duration"},
		{"unknown serve key", "[serve]\nparallelism = 2\n" + img + "idle_count = 1\n", `unknown key "serve.parallelism"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			require.Error(t, err)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// The limits themselves are allowed: interval 50ms and 10s, max_age 1m,
// idle_count 0 with a max_idle, idle_count 64.
func TestPoolValidationBounds(t *testing.T) {
	for _, tc := range []string{
		"[serve]\ninterval = \"50ms\"\nboot_parallelism = 1\n[images.a]\nbase = \"/a\"\n[images.a.pool]\nidle_count = 1\nmax_age = \"1m\"\n",
		"[serve]\ninterval = \"10s\"\nboot_parallelism = 32\n[images.a]\nbase = \"/a\"\n[images.a.pool]\nidle_count = 64\n",
		"[images.a]\nbase = \"/a\"\n[images.a.pool]\nidle_count = 0\nmax_idle = 3\n",
	} {
		_, err := Parse([]byte(tc))
		require.NoError(t, err, tc)
	}
}

// All problems are reported at once, pool ones among the others.
func TestPoolValidationReportsAll(t *testing.T) {
	_, err := Parse([]byte(`
[serve]
interval = "1ms"
[images.a]
base = "/a"
[images.a.pool]
idle_count = 5
max_idle = 1
max_age = "1s"
`))
	require.Error(t, err)
	for _, key := range []string{"serve.interval:", "images.a.pool.max_idle:", "images.a.pool.max_age:"} {
		require.True(t, strings.Contains(err.Error(), key), "%s missing from %q", key, err)
	}
}
