package admin

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// TestImageCommands: image push, pull, list and prune as an admin runs
// them: pull names what is new, list shows which configured image uses
// which digest, prune keeps what a VM's disk is backed by and removes the
// rest; pull refuses to write a store another user owns.
func TestImageCommands(t *testing.T) {
	reg := registrytest.Start(t)
	dir := t.TempDir()
	text := []byte(`
state_dir = "` + filepath.Join(dir, "state") + `"
[registry]
dir = "` + filepath.Join(dir, "oci") + `"
plain_http = ["` + reg.Host + `"]
[images.tiny]
source = "oci://` + reg.Host + `/vm/tiny:stable"
`)
	load := func() *config.Config {
		cfg, err := config.Parse(text)
		require.NoError(t, err)
		return cfg
	}
	cfg := load()
	ctx := context.Background()
	push := func(content string) string {
		p := filepath.Join(t.TempDir(), "disk.qcow2")
		require.NoError(t, os.WriteFile(p, registrytest.Qcow2(1<<30, []byte(content)), 0o644))
		var out bytes.Buffer
		require.NoError(t, ImagePush(ctx, &out, cfg, "oci://"+reg.Host+"/vm/tiny:stable", []transfer.PushFile{{Name: ociimage.DiskFile, Path: p}}))
		d := regexp.MustCompile(`sha256:[0-9a-f]{64}`).FindString(out.String())
		require.NotEmpty(t, d, out.String())
		return d
	}
	v1 := push("one")
	var out bytes.Buffer
	require.NoError(t, ImagePull(ctx, &out, cfg, nil))
	require.Contains(t, out.String(), "tiny: new "+v1)
	out.Reset()
	require.NoError(t, ImagePull(ctx, &out, cfg, []string{"tiny"}))
	require.Contains(t, out.String(), "tiny: unchanged "+v1)

	v2 := push("two")
	out.Reset()
	require.NoError(t, ImagePull(ctx, &out, cfg, []string{"oci://" + reg.Host + "/vm/tiny:stable"}))
	require.Contains(t, out.String(), "new "+v2)
	cfg = load()
	out.Reset()
	require.NoError(t, ImageList(&out, cfg, time.Now()))
	require.Regexp(t, `(?m)^`+v2+`\s+0\.0 MiB\s+disk\.qcow2\s+tiny\s+oci://`, out.String())
	require.Regexp(t, `(?m)^`+v1+`\s+0\.0 MiB\s+disk\.qcow2\s+-\s+-`, out.String())

	// v1 backs a VM's disk: kept; then no longer: removed.
	v1Dir := cfg.Registry.Store().ImageDir(mustDigest(t, v1))
	out.Reset()
	require.NoError(t, ImagePrune(ctx, &out, cfg, []string{filepath.Join(v1Dir, ociimage.DiskFile)}, false))
	require.Empty(t, out.String())
	out.Reset()
	require.NoError(t, ImagePrune(ctx, &out, cfg, nil, true))
	require.Contains(t, out.String(), "would remove "+v1)
	require.DirExists(t, v1Dir, "a dry run removes nothing")
	out.Reset()
	require.NoError(t, ImagePrune(ctx, &out, cfg, nil, false))
	require.Contains(t, out.String(), "removed "+v1)
	require.NotContains(t, out.String(), v2, "the configured image's digest stays")
	require.NoDirExists(t, v1Dir)

	// Another user's store: refused, naming the owner (root can make one).
	if os.Geteuid() != 0 {
		return
	}
	require.NoError(t, os.Chown(cfg.Registry.Dir, 65534, 65534))
	err := ImagePull(ctx, &out, cfg, nil)
	var oe *state.OwnerError
	require.True(t, errors.As(err, &oe), "%v", err)
	require.ErrorContains(t, err, "image store: state dir "+cfg.Registry.Dir+" belongs to")
}

func mustDigest(t *testing.T, s string) digest.Digest {
	t.Helper()
	d := digest.Digest(s)
	require.NoError(t, d.Validate())
	return d
}

// TestImageStoreCheck: doctor's look at the store and the credentials.
func TestImageStoreCheck(t *testing.T) {
	dir := t.TempDir()
	creds := filepath.Join(dir, "auth.json")
	require.NoError(t, os.WriteFile(creds, []byte(`{"auths":{}}`), 0o600))
	parse := func(extra string) *config.Config {
		cfg, err := config.Parse([]byte(`
state_dir = "` + filepath.Join(dir, "state") + `"
[registry]
dir = "` + filepath.Join(dir, "oci") + `"
credentials = "` + creds + `"
[images.tiny]
` + extra))
		require.NoError(t, err)
		return cfg
	}
	_, ok := imageStoreCheck(parse(`base = "/img/tiny.qcow2"` + "\n"))
	require.False(t, ok, "no image with a source: no check")

	cfg := parse(`source = "oci://r.example/vm/tiny:v1"` + "\n")
	c, ok := imageStoreCheck(cfg)
	require.True(t, ok)
	require.True(t, c.OK, "%+v", c)

	require.NoError(t, os.Chmod(creds, 0o644))
	c, _ = imageStoreCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "is readable by every user")
	require.Contains(t, c.Fix, "chmod 0600 "+creds)

	require.NoError(t, os.Remove(creds))
	c, _ = imageStoreCheck(cfg)
	require.False(t, c.OK)
	require.Contains(t, c.Info, "registry.credentials: ")
}
