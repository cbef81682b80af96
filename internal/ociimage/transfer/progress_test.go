package transfer

import (
	"bytes"
	"context"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/progress"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// Push and pull tell the reporter in their context each step, with the
// bytes of each file compressed, uploaded and fetched.
func TestPushPullProgress(t *testing.T) {
	reg := registrytest.Start(t)
	r := remoteFor(reg)
	src := mustSource(t, "oci://"+reg.Host+"/images/tiny:v1")
	var out bytes.Buffer
	ctx := progress.With(context.Background(), progress.New(&out, false))
	_, err := Push(ctx, r, src, files(t, map[string]int{ociimage.DiskFile: 1 << 20, ociimage.KernelFile: 4096}), t.TempDir(), "")
	require.NoError(t, err)
	require.Regexp(t, regexp.MustCompile(`^\[1\] compress disk\.qcow2: 1\.0 MiB / 1\.0 MiB, .*/s, .*
\[2\] upload disk\.qcow2: .* / .*, .*
\[3\] compress vmlinuz: 4\.0 KiB / 4\.0 KiB, .*
\[4\] upload vmlinuz: .*
\[5\] push the config and the manifest, tag v1, .*
$`), out.String())

	out.Reset()
	_, err = Pull(ctx, &ociimage.Store{Dir: filepath.Join(t.TempDir(), "oci")}, r, src)
	require.NoError(t, err)
	require.Regexp(t, regexp.MustCompile(`^\[6\] fetch disk\.qcow2: (.*) / (.*), .*
\[7\] fetch vmlinuz: .*
\[8\] check disk\.qcow2 and store the image, .*
$`), out.String())
}
