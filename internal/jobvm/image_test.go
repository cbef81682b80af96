package jobvm

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// TestEnsurePulled: prepare pulls an image with a source that is not on
// the host yet and says so in the job log, with what it received and how
// long it took; a stored image is used without asking the registry, with
// a warning once the registry has not confirmed it for three pull
// intervals; a registry that does not answer is a system failure naming
// the source when nothing is stored.
func TestEnsurePulled(t *testing.T) {
	reg := registrytest.Start(t)
	text := []byte(`
state_dir = "` + t.TempDir() + `"
default_image = "tiny"
[registry]
dir = "` + filepath.Join(t.TempDir(), "oci") + `"
plain_http = ["` + reg.Host + `"]
pull_interval = "1m"
[images.tiny]
source = "oci://` + reg.Host + `/vm/tiny:v1"
[images.gone]
source = "oci://127.0.0.1:1/vm/gone:v1"
`)
	cfg, err := config.Parse(text)
	require.NoError(t, err)
	disk := filepath.Join(t.TempDir(), "disk.qcow2")
	require.NoError(t, os.WriteFile(disk, registrytest.Qcow2(1<<30, []byte("disk")), 0o644))
	src, _ := ociimage.ParseSource("oci://" + reg.Host + "/vm/tiny:v1")
	_, err = transfer.Push(context.Background(), transfer.RemoteOf(cfg.Registry, "test"), src, []transfer.PushFile{{Name: ociimage.DiskFile, Path: disk}}, t.TempDir(), "")
	require.NoError(t, err)

	var lines []string
	say := func(f string, a ...any) { lines = append(lines, fmt.Sprintf(f, a...)) }
	log := slog.New(slog.NewTextHandler(&discard{}, nil))
	img, _ := cfg.Image("tiny")
	require.NoError(t, ensureImage(context.Background(), cfg, img, testPull, nil, say, log))
	require.True(t, img.Pulled())
	require.FileExists(t, img.Base)
	require.Contains(t, lines[0], "Image tiny is not on this host yet: pulling oci://"+reg.Host+"/vm/tiny:v1")
	require.Regexp(t, `^Pulled oci://\S+ \(sha256:[0-9a-f]{64}, [0-9.]+ MiB received, [0-9.]+ MiB stored\) in `, lines[1])

	// Stored: no pull (the registry is gone), the digest in the log.
	reg.Stop()
	cfg, err = config.Parse(text)
	require.NoError(t, err)
	img, _ = cfg.Image("tiny")
	lines = nil
	require.NoError(t, ensureImage(context.Background(), cfg, img, testPull, nil, say, log))
	require.Equal(t, []string{"Image tiny: " + img.Digest + " from " + src.String()}, lines)

	// Not confirmed for three intervals: the job log says so.
	recs, _ := filepath.Glob(filepath.Join(cfg.Registry.Dir, "refs", "*.json"))
	require.Len(t, recs, 1)
	var rec ociimage.Record
	b, _ := os.ReadFile(recs[0])
	require.NoError(t, json.Unmarshal(b, &rec))
	rec.Checked = time.Now().Add(-4 * time.Minute)
	b, _ = json.Marshal(rec)
	require.NoError(t, os.WriteFile(recs[0], b, 0o644))
	lines = nil
	var refreshed []string
	refresh := func(name string) error { refreshed = append(refreshed, name); return nil }
	require.NoError(t, ensureImage(context.Background(), cfg, img, testPull, refresh, say, log))
	require.Len(t, lines, 3)
	require.Contains(t, lines[1], "Warning: the registry has not confirmed "+src.String()+" for 4m")
	require.Contains(t, lines[1], "this job runs the last verified image")
	// Without the pool service, the tag is followed from prepare: one
	// background pull per pull_interval.
	require.Equal(t, []string{"tiny"}, refreshed)
	require.Contains(t, lines[2], "asking it again in the background")
	lines = nil
	require.NoError(t, ensureImage(context.Background(), cfg, img, testPull, refresh, say, log))
	require.Equal(t, []string{"tiny"}, refreshed, "not again within the interval")
	require.Len(t, lines, 2)

	// An executable that does not pull (run, cleanup) says what to do.
	gone, _ := cfg.Image("gone")
	err = ensureImage(context.Background(), cfg, gone, nil, nil, say, log)
	require.Error(t, err)
	require.ErrorContains(t, err, "this executable does not pull: run libvirt-executor image pull gone")

	// Nothing stored and no registry: a system failure naming the source.
	err = ensureImage(context.Background(), cfg, gone, testPull, nil, say, log)
	require.Error(t, err)
	require.ErrorContains(t, err, "image gone: pull oci://127.0.0.1:1/vm/gone:v1")
	require.False(t, gone.Pulled())
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// testPull is cmd/prepare's pull.
func testPull(ctx context.Context, cfg *config.Config, src ociimage.Source) (PullReport, error) {
	res, err := transfer.Pull(ctx, cfg.Registry.Store(), transfer.RemoteOf(cfg.Registry, "test"), src)
	return PullReport{Digest: res.Record.Digest.String(), Received: res.Fetched, Stored: res.Image.Bytes}, err
}
