package state

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A state directory is tied to the first libvirt that uses it, once, even
// when first users race; another libvirt is refused, naming both and the
// way out; a look (readOnly) creates nothing.
func TestBindHost(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	require.NoError(t, s.BindHost("qemu://kvm2/system", true))
	_, err := os.Stat(filepath.Join(s.Dir, hostFile))
	require.True(t, errors.Is(err, os.ErrNotExist), "a look created the record")

	keys := []string{"qemu:///system", "qemu://kvm2/system"}
	errs := make([]error, 8)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = s.BindHost(keys[i%2], false) }()
	}
	wg.Wait()
	kept, err := readHost(filepath.Join(s.Dir, hostFile))
	require.NoError(t, err)
	for i, err := range errs {
		if keys[i%2] == kept {
			require.NoError(t, err)
			continue
		}
		var he *HostError
		require.ErrorAs(t, err, &he)
		require.Equal(t, kept, he.Kept)
		require.ErrorContains(t, err, "give each host's configuration a state_dir of its own")
	}
	other := keys[0]
	if other == kept {
		other = keys[1]
	}
	require.Error(t, s.BindHost(other, true), "a look at another libvirt's directory is refused too")
	require.NoError(t, s.BindHost(kept, true))
	entries, err := os.ReadDir(s.Dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "temporary files left: %v", entries)

	require.NoError(t, os.WriteFile(filepath.Join(s.Dir, hostFile), []byte("\n"), 0o600))
	require.ErrorContains(t, s.BindHost(kept, false), "not one libvirt host key")
}
