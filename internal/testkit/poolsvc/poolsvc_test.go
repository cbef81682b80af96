package poolsvc

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

func TestWithPool(t *testing.T) {
	base, err := os.ReadFile("../../config/testdata/valid.toml")
	require.NoError(t, err)
	text := WithPool(string(base), "tiny", 1)
	require.True(t, strings.HasPrefix(text, string(base)), "the given configuration, unchanged, then the pool")
	require.Contains(t, text, "\n[images.tiny.pool]\nidle_count = 1\n")
	require.Contains(t, text, "\n[serve]\nhealth_interval = \"1s\"\n")
	cfg, err := config.Parse([]byte(text))
	require.NoError(t, err)
	pooled := cfg.Pooled()
	require.Len(t, pooled, 1)
	require.Equal(t, "tiny", pooled[0].Name)
	require.Equal(t, 1, pooled[0].Pool.IdleCount)
	require.Equal(t, time.Second, cfg.Serve.HealthInterval.D())

	// A configuration with its own [serve] table keeps it, and gets no second one.
	own := string(base) + "\n[serve]\nboot_parallelism = 1\n"
	text = WithPool(own, "debian-12", 1)
	require.Equal(t, 1, strings.Count(text, "[serve]"))
	require.Contains(t, text, "[images.debian-12.pool]")
	cfg, err = config.Parse([]byte(text))
	require.NoError(t, err)
	require.Equal(t, 1, cfg.Serve.BootParallelism)
	require.Equal(t, "debian-12", cfg.Pooled()[0].Name)

	require.Contains(t, WithPool("", "odd.name", 1), `[images."odd.name".pool]`)
	require.Equal(t, "tiny_1-x", tomlKey("tiny_1-x"))
	require.Equal(t, `"a\"b"`, tomlKey(`a"b`))
	require.True(t, serveTable.MatchString("x = 1\n  [ serve ]  # the service\n"))
	require.False(t, serveTable.MatchString("[serve.x]\n# [serve]\n[images.serve]\n"))
}

func TestDescribe(t *testing.T) {
	require.Equal(t, "no standby VM", Describe(nil))
	rec := &state.Machine{Standby: &state.Standby{Image: "tiny"}}
	got := Describe([]lifecycle.Standby{
		{Name: "a", Record: rec},
		{Name: "b"},
		{Name: "c", Record: rec, Claim: &state.Claim{Job: "lve-x-1"}},
		{Name: "d", Record: rec, Claim: &state.Claim{Retire: true, Reason: "too old"}},
	})
	require.Equal(t, "a idle (tiny), b booting, c claimed by lve-x-1, d retiring (too old)", got)
}

func TestTail(t *testing.T) {
	require.Equal(t, "c\nd", tail("a\nb\nc\nd\n", 2))
	require.Equal(t, "a", tail("a", 5))
}
