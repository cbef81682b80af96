package jobvm

import (
	"bytes"
	"context"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// KeepCache keeps what the guest wrote on its scratch disk and deletes the
// disk's volume in the same call, whatever the save's outcome; a machine
// of another installation is refused before anything is read or deleted.
func TestKeepCacheDropsTheDisk(t *testing.T) {
	ctx := context.Background()
	hv, m, name := provisioned(t)
	store := &hostcache.Store{Dir: filepath.Join(t.TempDir(), "cache"), ProjectLimit: 1 << 20, TotalLimit: 4 << 20}
	project, err := hostcache.ProjectID("https://gitlab.example.com", 7, true)
	require.NoError(t, err)
	vol := m.Manager().Cfg.StoragePool + "/" + vm.ScratchVolume(name)

	// The direct layout: a manifest, then the file at its offset.
	data := []byte("the archive")
	disk := make([]byte, hostcache.DirectManifestMax+4096)
	copy(disk, hostcache.DirectMagic+"\n"+strconv.Itoa(hostcache.DirectManifestMax)+" "+strconv.Itoa(len(data))+" ./k/cache.zip\n"+hostcache.DirectEnd+"\n")
	copy(disk[hostcache.DirectManifestMax:], data)
	for _, tc := range []struct {
		name  string
		disk  []byte
		saved bool
	}{
		{"a save", disk, true},
		{"a disk the host refuses", bytes.Repeat([]byte{'x'}, 4096), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, m.AttachScratch(ctx, name, ScratchCapacity(store.ProjectLimit)))
			hv.Lock()
			hv.Volumes[vol] = tc.disk
			hv.Unlock()
			k := m.KeepCache(ctx, store, name, project, []string{"k/cache.zip"})
			require.NoError(t, k.DropErr)
			if tc.saved {
				require.NoError(t, k.Err)
				require.Equal(t, int64(1), k.Result.Files)
				require.Equal(t, int64(len(data)), k.Result.Bytes)
			} else {
				require.Error(t, k.Err)
			}
			require.False(t, k.FromFile, "the fake has no file for the volume: libvirt's stream")
			hv.Lock()
			_, left := hv.Volumes[vol]
			hv.Unlock()
			require.False(t, left, "the scratch volume is deleted by the keep")
			// The guest still has the disk (no unplug): a later attach in
			// this test needs it gone, as a new job's machine would be.
			require.NoError(t, hv.DetachDisk(ctx, name, "/pool/"+vol))
		})
	}

	k := m.KeepCache(ctx, store, "lve-ffffffff-7", project, []string{"k/cache.zip"})
	require.Error(t, k.Err)
	require.Error(t, k.DropErr, "nothing of another installation is touched")
}

// The scratch disk counts against the host cache's total while it exists:
// attaching it reserves its size in the configured store (making room),
// deleting its volume releases it (#42 item 3).
func TestScratchReserved(t *testing.T) {
	ctx := context.Background()
	hv, m, name := provisioned(t)
	m.Manager().Cfg.Cache = config.Cache{Dir: filepath.Join(t.TempDir(), "cache"), ProjectLimitMiB: 1, TotalLimitMiB: 64}
	store := hostcache.ForConfig(m.Manager().Cfg.Cache)
	project, err := hostcache.ProjectID("https://gitlab.example.com", 7, true)
	require.NoError(t, err)

	require.NoError(t, m.AttachScratch(ctx, name, ScratchCapacity(store.ProjectLimit)))
	staged, err := store.Staged()
	require.NoError(t, err)
	require.Equal(t, ScratchCapacity(store.ProjectLimit), staged, "the scratch disk's size is reserved")

	hv.Lock()
	hv.Volumes[m.Manager().Cfg.StoragePool+"/"+vm.ScratchVolume(name)] = bytes.Repeat([]byte{'x'}, 4096)
	hv.Unlock()
	k := m.KeepCache(ctx, store, name, project, []string{"k/cache.zip"})
	require.NoError(t, k.DropErr)
	staged, err = store.Staged()
	require.NoError(t, err)
	require.Zero(t, staged, "released with the volume")

	// A disk larger than the whole total is refused before it is made.
	require.NoError(t, hv.DetachDisk(ctx, name, "/pool/"+m.Manager().Cfg.StoragePool+"/"+vm.ScratchVolume(name)))
	require.Error(t, m.AttachScratch(ctx, name, 65<<20))
	hv.Lock()
	_, made := hv.Volumes[m.Manager().Cfg.StoragePool+"/"+vm.ScratchVolume(name)]
	hv.Unlock()
	require.False(t, made)
}
