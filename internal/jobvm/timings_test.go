package jobvm

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// An acquired machine's timing record is the claim's when warm, the
// provisioning's when cold; it is written only where the runner host's
// LIBVIRT_EXECUTOR_TIMINGS names a file, one JSON line each.
func TestAcquiredTimings(t *testing.T) {
	began := time.Now().Add(-time.Second)
	warm := &Acquired{Warm: true, Claimed: &Claimed{Machine: &state.Machine{Name: "w", Image: "tiny"}, Took: 30 * time.Millisecond, At: began}}
	cold := &Acquired{Ready: &lifecycle.Ready{Machine: &state.Machine{Name: "c", Image: "debian"}}}
	path := filepath.Join(t.TempDir(), "timings.jsonl")
	getenv := func(k string) string {
		if k == lifecycle.TimingsEnv {
			return path
		}
		return ""
	}
	require.NoError(t, WriteTimings(func(string) string { return "" }, warm.Timings(began)), "not asked: nothing written")
	require.NoFileExists(t, path)
	require.NoError(t, WriteTimings(getenv, warm.Timings(began)))
	require.NoError(t, WriteTimings(getenv, cold.Timings(began)))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	require.Len(t, lines, 2)
	var w, c lifecycle.TimingRecord
	require.NoError(t, json.Unmarshal([]byte(lines[0]), &w))
	require.NoError(t, json.Unmarshal([]byte(lines[1]), &c))
	require.True(t, w.Warm)
	require.Equal(t, "w", w.Machine)
	require.InDelta(t, 30, w.ClaimMs, 0.001)
	require.False(t, c.Warm)
	require.Equal(t, "c", c.Machine)
	require.Equal(t, "debian", c.Image)
}
