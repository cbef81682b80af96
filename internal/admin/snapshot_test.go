package admin

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// doctor's snapshot line: none made, current, stale.
func TestSnapshotCheck(t *testing.T) {
	dir := t.TempDir()
	base, kernel := filepath.Join(dir, "disk.qcow2"), filepath.Join(dir, "vmlinuz")
	require.NoError(t, os.WriteFile(base, []byte("disk"), 0o600))
	require.NoError(t, os.WriteFile(kernel, []byte("kernel"), 0o600))
	cfg, err := config.Parse([]byte(`
domain_type = "qemu"
state_dir = "` + filepath.Join(dir, "state") + `"
[images.tiny]
base = "` + base + `"
boot = "kernel"
kernel = "` + kernel + `"
snapshot = true
`))
	require.NoError(t, err)
	img, _ := cfg.Image("tiny")
	now := time.Now()
	const host = "libvirt 9000000, hypervisor 7002000"
	c := snapshotCheck(cfg, img, host, now)
	require.True(t, c.OK && c.Warn, "%+v", c)
	require.Contains(t, c.Info, "none made yet")

	store := state.Store{Dir: cfg.StateDir}
	rec := state.Snapshot{Image: "tiny", Template: "lve-x-snap-1", DomainType: "qemu", VCPUs: 1, MemoryMiB: 1024,
		Fingerprint: lifecycle.SnapshotFingerprint(lifecycle.SnapshotInputs(cfg, cfg.ResolveFiles(img), "qemu", cfg.ImageSize(img), host)),
		Started:     now.Add(-time.Minute), Saved: now.Add(-time.Minute)}
	require.NoError(t, store.PutSnapshot(context.Background(), rec))
	_, err = store.Create(rec.Template) // its state directory
	require.NoError(t, err)
	c = snapshotCheck(cfg, img, host, now)
	require.True(t, c.OK && !c.Warn, "%+v", c)
	require.Contains(t, c.Info, "made 1m0s ago")

	require.Empty(t, unusedSnapshotChecks(cfg))
	img.Snapshot = false
	u := unusedSnapshotChecks(cfg)
	require.Len(t, u, 1)
	require.Contains(t, u[0].Fix, "image snapshot --remove tiny")
	img.Snapshot = true

	later := now.Add(time.Hour)
	require.NoError(t, os.Chtimes(kernel, later, later))
	c = snapshotCheck(cfg, img, host, now)
	require.True(t, c.OK && c.Warn, "%+v", c)
	require.Contains(t, c.Info, "stale")
}
