package admin

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/metrics"
)

func TestCacheListAndPrune(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cache")
	cfg, err := config.Parse([]byte("[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	_, err = CacheStore(cfg)
	require.ErrorContains(t, err, "the host cache is off: set [cache] dir")

	cfg, err = config.Parse([]byte("state_dir = \"" + t.TempDir() + "\"\n[cache]\ndir = \"" + dir + "\"\nproject_limit_mib = 2\ntotal_limit_mib = 8\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	store, err := CacheStore(cfg)
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, CacheList(&out, cfg, store, time.Now()))
	require.Contains(t, out.String(), "no caches in "+dir)

	project, err := hostcache.ProjectID("https://gitlab.example.com", 42, true)
	require.NoError(t, err)
	saveOne(t, store, project, "lve/p/key/cache.zip", 1<<20)

	out.Reset()
	require.NoError(t, CacheList(&out, cfg, store, time.Now()))
	require.Regexp(t, project+`\s+1\s+3\s+1\.0 MiB\s+\S+ ago`, out.String())
	require.Contains(t, out.String(), "of 8 MiB (cache.total_limit_mib), 0.0 MiB of it saves in flight and their scratch disks; a project at most 2 MiB and 20000 files and directories")

	// used just now: an hour's prune keeps it, a zero one removes it
	out.Reset()
	require.NoError(t, CachePrune(context.Background(), &out, store, time.Hour))
	require.Empty(t, out.String())
	require.NoError(t, CachePrune(context.Background(), &out, store, 0))
	require.Contains(t, out.String(), "removed cache "+project)
	us, err := store.List()
	require.NoError(t, err)
	require.Empty(t, us)
}

func TestCacheDirCheck(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cache")
	c := config.Cache{Dir: dir, ProjectLimitMiB: 1, TotalLimitMiB: 1}
	ch := cacheDirCheck(c, "")
	require.True(t, ch.OK, ch.Info)
	require.Contains(t, ch.Info, "will be created")

	c.TotalLimitMiB = 16 << 20 // 16 TiB: more than this disk has
	ch = cacheDirCheck(c, "")
	require.True(t, ch.OK)
	require.True(t, ch.Warn)
	require.Contains(t, ch.Info, "less than cache.total_limit_mib")

	real := t.TempDir()
	require.NoError(t, os.Symlink(real, dir))
	ch = cacheDirCheck(c, "")
	require.False(t, ch.OK)
	require.Contains(t, ch.Info, "is a symlink")
}

// A cache dir that is not the stages' user's (state_dir's owner) fails
// doctor, run as root too (before, root's doctor passed a root-owned one:
// its own), and so does one that user cannot make; root's cache commands
// are refused on that user's state_dir, before they make anything (#42).
func TestCacheDirOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give directories to another user")
	}
	const runner = 65534 // nobody: the stages' user here
	top := t.TempDir()
	stateDir, parent := filepath.Join(top, "state"), filepath.Join(top, "cache")
	require.NoError(t, os.Mkdir(stateDir, 0o700))
	require.NoError(t, os.Chown(stateDir, runner, runner))
	require.NoError(t, os.Mkdir(parent, 0o755)) // root's, as /var/cache/libvirt-executor
	dir := filepath.Join(parent, "jobs")
	c := config.Cache{Dir: dir, ProjectLimitMiB: 1, TotalLimitMiB: 1}

	ch := cacheDirCheck(c, stateDir)
	require.False(t, ch.OK, "the stages' user cannot make it: %s", ch.Info)
	require.Contains(t, ch.Info, "cannot make it in "+parent)
	require.Contains(t, ch.Fix, "install -d -m 0700 -o ")

	require.NoError(t, os.Mkdir(dir, 0o700)) // root's, as root's cache list made it
	ch = cacheDirCheck(c, stateDir)
	require.False(t, ch.OK, "a root-owned cache dir: %s", ch.Info)
	require.Contains(t, ch.Info, dir+" belongs to root, but state_dir "+stateDir)
	require.Contains(t, ch.Fix, "chown -R ")

	require.NoError(t, os.Chown(dir, runner, runner))
	ch = cacheDirCheck(c, stateDir)
	require.True(t, ch.OK, "the stages' user's: %s", ch.Info)

	require.NoError(t, os.Remove(dir))
	require.NoError(t, os.Chown(parent, runner, runner))
	ch = cacheDirCheck(c, stateDir)
	require.True(t, ch.OK, "the stages' user can make it: %s", ch.Info)
	require.Contains(t, ch.Info, "will be created")

	// root's cache list on the stages' user's state_dir: refused, nothing made.
	cfg, err := config.Parse([]byte("state_dir = \"" + stateDir + "\"\n[cache]\ndir = \"" + dir + "\"\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	_, err = CacheStore(cfg)
	require.ErrorContains(t, err, "host cache "+dir+": state dir "+stateDir+" belongs to")
	require.NoDirExists(t, dir)
}

// A cache dir in memory is gone after a reboot: doctor warns.
func TestCacheDirCheckTmpfs(t *testing.T) {
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil || int64(st.Type) != unix.TMPFS_MAGIC {
		t.Skip("no tmpfs at /dev/shm on this machine")
	}
	dir, err := os.MkdirTemp("/dev/shm", "lve-cache-test-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	ch := cacheDirCheck(config.Cache{Dir: dir, ProjectLimitMiB: 1, TotalLimitMiB: 1}, "")
	require.True(t, ch.OK)
	require.True(t, ch.Warn)
	require.Contains(t, ch.Info, "gone after a reboot")

	disk := t.TempDir()
	if unix.Statfs(disk, &st) == nil && int64(st.Type) != unix.TMPFS_MAGIC {
		ch = cacheDirCheck(config.Cache{Dir: filepath.Join(disk, "cache"), ProjectLimitMiB: 1, TotalLimitMiB: 1}, "")
		require.NotContains(t, ch.Info, "gone after a reboot")
	}
}

// The service's cache gauge: the store's size, measured at most once per
// interval.
func TestCacheGauge(t *testing.T) {
	store := &hostcache.Store{Dir: filepath.Join(t.TempDir(), "cache"), ProjectLimit: 4 << 20, TotalLimit: 8 << 20}
	now := time.Unix(1_800_000_000, 0)
	gauge := cacheGauge(store, 30*time.Second, func() time.Time { return now })
	g, err := gauge()
	require.NoError(t, err)
	require.Equal(t, metrics.CacheGauge{Limit: 8 << 20}, g)
	require.NoDirExists(t, store.Dir, "the gauge makes nothing (the service's sandbox may keep cache.dir read-only)")

	project, err := hostcache.ProjectID("https://gitlab.example.com", 7, false)
	require.NoError(t, err)
	saveOne(t, store, project, "k/cache.zip", 3000)

	g, err = gauge()
	require.NoError(t, err)
	require.Zero(t, g.Bytes, "within the interval: the last measure")
	now = now.Add(31 * time.Second)
	g, err = gauge()
	require.NoError(t, err)
	// Charged as the limit counts it: 3000 bytes in a block, and k/'s.
	require.Equal(t, metrics.CacheGauge{Projects: 1, Bytes: 2 * hostcache.Block, Limit: 8 << 20}, g)
}

// saveOne keeps one file of size bytes as the project's cache.
func saveOne(t *testing.T, store *hostcache.Store, project, name string, size int) {
	t.Helper()
	var stream bytes.Buffer
	tw := tar.NewWriter(&stream)
	body := bytes.Repeat([]byte("x"), size)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(size), Typeflag: tar.TypeReg}))
	_, err := tw.Write(body)
	require.NoError(t, err)
	require.NoError(t, tw.Close())
	_, err = store.Save(context.Background(), project, &stream, hostcache.All)
	require.NoError(t, err)
}

// Empty files in deep directories take inodes and blocks: cache list
// shows them charged, with the directories counted (#42 item 3).
func TestCacheListChargesEntries(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cache")
	cfg, err := config.Parse([]byte("state_dir = \"" + t.TempDir() + "\"\n[cache]\ndir = \"" + dir + "\"\nproject_limit_mib = 64\ntotal_limit_mib = 128\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	store, err := CacheStore(cfg)
	require.NoError(t, err)
	project, err := hostcache.ProjectID("https://gitlab.example.com", 42, false)
	require.NoError(t, err)
	var stream bytes.Buffer
	tw := tar.NewWriter(&stream)
	for i := range 1000 {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("a/b/c/d/%d/e", i%10), Typeflag: tar.TypeDir, Mode: 0o755}))
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("a/b/c/d/%d/e/f%d", i%10, i), Typeflag: tar.TypeReg, Mode: 0o644}))
	}
	require.NoError(t, tw.Close())
	_, err = store.Save(context.Background(), project, &stream, hostcache.All)
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, CacheList(&out, cfg, store, time.Now()))
	// 1000 files and 4+10+10 directories, 4 KiB each: 4.0 MiB.
	require.Regexp(t, project+`\s+1000\s+24\s+4\.0 MiB\s+\S+ ago`, out.String())
	require.Contains(t, out.String(), "total 4.0 MiB of 128 MiB")
}
