// Package cachetest reads back, in tests, what a guest wrote on a host
// cache scratch disk.
package cachetest

import (
	"archive/tar"
	"io"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
)

// Kept is what the host takes from the scratch disk in the file disk
// (hostcache.FromDisk: the direct layout or a tar stream, files up to
// limit bytes), as name -> bytes.
func Kept(t testing.TB, disk string, limit int64) map[string][]byte {
	t.Helper()
	f, err := os.Open(disk)
	require.NoError(t, err)
	defer f.Close()
	r, err := hostcache.FromDisk(f, limit)
	require.NoError(t, err)
	defer r.Close()
	got := map[string][]byte{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return got
		}
		require.NoError(t, err)
		b, err := io.ReadAll(tr)
		require.NoError(t, err)
		got[h.Name] = b
	}
}
