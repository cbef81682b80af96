package pool

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// TestServiceFollowsImageSource: the pool of an image with a source
// (oci://) boots nothing before the first pull; the service pulls at its
// start and, with the image stored, stops to be restarted with it; the
// restarted service boots standbys on the stored disk; when the tag moves,
// the next service pulls the new image and stops again, and the one after
// it retires the old standby and boots one on the new disk. A registry
// that does not answer changes nothing and is counted in the gauges.
func TestServiceFollowsImageSource(t *testing.T) {
	reg := registrytest.Start(t)
	dir := t.TempDir()
	text := []byte(`
domain_type = "qemu"
state_dir = "` + filepath.Join(dir, "state") + `"
storage_pool = "jobs"
[serve]
boot_parallelism = 1
interval = "50ms"
[registry]
dir = "` + filepath.Join(dir, "oci") + `"
plain_http = ["` + reg.Host + `"]
[timeouts]
boot = "20s"
[defaults]
vcpus = 1
memory_mib = 256
[images.tiny]
source = "oci://` + reg.Host + `/vm/tiny:stable"
[images.tiny.pool]
idle_count = 1
`)
	push := func(content string) string {
		p := filepath.Join(t.TempDir(), "disk.qcow2")
		require.NoError(t, os.WriteFile(p, registrytest.Qcow2(1<<30, []byte(content)), 0o644))
		src, err := ociimage.ParseSource("oci://" + reg.Host + "/vm/tiny:stable")
		require.NoError(t, err)
		res, err := transfer.Push(context.Background(), transfer.Remote{PlainHTTP: []string{reg.Host}}, src,
			[]transfer.PushFile{{Name: ociimage.DiskFile, Path: p}}, t.TempDir(), "")
		require.NoError(t, err)
		return res.Descriptor.Digest.String()
	}
	v1 := push("one")

	hv := vmtest.New()
	g := newGuest(t, hv)
	log := &sshtest.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("service log:\n%s", log.String())
		}
	})
	// start loads the configuration as a restarted service does and runs
	// a service until it ends or ctx does.
	start := func(ctx context.Context) (*Service, *config.Image, chan error) {
		cfg, err := config.Parse(text)
		require.NoError(t, err)
		s := newService(t, cfg, hv, g, log)
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx); _ = s.M.Close() }()
		img, _ := cfg.Image("tiny")
		return s, img, done
	}
	wait := func(done chan error) error {
		select {
		case err := <-done:
			return err
		case <-time.After(30 * time.Second):
			t.Fatal("the service did not stop")
			return nil
		}
	}
	backings := func() []string {
		hv.Lock()
		defer hv.Unlock()
		var out []string
		for _, b := range hv.Backing {
			out = append(out, b)
		}
		return out
	}

	// Nothing stored: no boot; the first round pulls v1 and stops.
	_, img, done := start(context.Background())
	require.False(t, img.Pulled())
	require.ErrorIs(t, wait(done), ErrImageChanged)
	require.Empty(t, backings(), "no standby of an image not pulled")
	require.Contains(t, log.String(), "no standbys of this image until its first pull")

	// Restarted with v1: a standby on v1's stored disk.
	ctx, cancel := context.WithCancel(context.Background())
	s, img, done := start(ctx)
	require.Equal(t, v1, img.Digest)
	require.Eventually(t, func() bool { return len(backings()) == 1 }, 20*time.Second, 20*time.Millisecond)
	require.Equal(t, img.Base, backings()[0])
	require.True(t, strings.HasPrefix(img.Base, filepath.Join(dir, "oci", "images")), img.Base)
	gauges, err := s.ImageGauges()
	require.NoError(t, err)
	require.Equal(t, v1, gauges[0].Digest)
	require.Zero(t, gauges[0].Failures)
	cancel()
	require.NoError(t, wait(done))

	// The tag moves: the next service pulls v2 and stops; the one after
	// it retires v1's standby and boots one on v2.
	v2 := push("two")
	require.NotEqual(t, v1, v2)
	_, img, done = start(context.Background())
	require.Equal(t, v1, img.Digest)
	require.ErrorIs(t, wait(done), ErrImageChanged)
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	started := time.Now()
	s, img, done = start(ctx)
	require.Equal(t, v2, img.Digest)
	// Its first round (at its start) has asked the registry.
	require.Eventually(t, func() bool {
		g, err := s.ImageGauges()
		return err == nil && len(g) == 1 && g[0].LastCheck.After(started)
	}, 20*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { b := backings(); return len(b) == 1 && b[0] == img.Base }, 20*time.Second, 20*time.Millisecond,
		"v1's standby retired, one on v2 booted")

	// v1 is named by no source now and its standby is gone: collected once
	// it has been so for collectGrace, v2 kept.
	store := s.M.Manager().Cfg.Registry.Store()
	v1Dir, v2Dir := store.ImageDir(digest.Digest(v1)), store.ImageDir(digest.Digest(v2))
	require.DirExists(t, v1Dir)
	s.followerForTest().collect(context.Background())
	require.DirExists(t, v1Dir, "not before its grace")
	f := s.followerForTest()
	f.collecting.Lock()
	f.now = func() time.Time { return time.Now().Add(collectGrace + time.Minute) }
	f.collecting.Unlock()
	s.followerForTest().collect(context.Background())
	require.NoDirExists(t, v1Dir)
	require.DirExists(t, v2Dir)
	backed, err := s.M.Manager().Volumes().BackingFiles(context.Background())
	require.NoError(t, err)
	require.Equal(t, []string{img.Base}, backed, "v2's standby is what the pool's volumes are backed by")
	require.Contains(t, log.String(), "removed an old image: no configured source names it, no VM uses it")

	// The registry gone: the service keeps running on v2, counting.
	reg.Stop()
	for range 2 {
		require.Empty(t, s.followerForTest().round(context.Background()))
	}
	gauges, err = s.ImageGauges()
	require.NoError(t, err)
	require.Equal(t, v2, gauges[0].Digest, "the last verified image keeps serving")
	require.Equal(t, 2, gauges[0].Failures, "two rounds failed in a row")
	require.Equal(t, 1, strings.Count(log.String(), "image pull failed"), "the same failure is logged once")
	require.Contains(t, log.String(), "image pull failed: the last verified image keeps serving")
	cancel()
	require.NoError(t, wait(done))
}

func (s *Service) followerForTest() *follower {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.images
}
