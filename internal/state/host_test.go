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
	require.NoError(t, s.BindHost("qemu://kvm2/system", true, true))
	_, err := os.Stat(filepath.Join(s.Dir, hostFile))
	require.True(t, errors.Is(err, os.ErrNotExist), "a look created the record")

	keys := []string{"qemu:///system", "qemu://kvm2/system"}
	errs := make([]error, 8)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = s.BindHost(keys[i%2], false, false) }()
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
	require.Error(t, s.BindHost(other, false, true), "a look at another libvirt's directory is refused too")
	require.NoError(t, s.BindHost(kept, false, true))
	entries, err := os.ReadDir(s.Dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "temporary files left: %v", entries)

	require.NoError(t, os.WriteFile(filepath.Join(s.Dir, hostFile), []byte("\n"), 0o600))
	require.ErrorContains(t, s.BindHost(kept, false, false), "not one libvirt host key")

	// an installation from before the record: its machines are this host's
	old := Store{Dir: t.TempDir()}
	require.NoError(t, os.MkdirAll(old.MachineDir("lve-1"), 0o700))
	var he *HostError
	require.ErrorAs(t, old.BindHost("qemu://kvm2/system", true, false), &he)
	require.Contains(t, he.Error(), "keeps the machines of this host's libvirt (its machine records predate")
	_, err = os.Stat(filepath.Join(old.Dir, hostFile))
	require.True(t, errors.Is(err, os.ErrNotExist), "refused, yet recorded")
	require.NoError(t, old.BindHost("qemu:///system", false, false))
}
