package admin

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// CacheStore is the host cache of cfg, or an error saying it is off. It
// refuses, as gc, rm and serve do, a process other than the state
// directory's owner (root's cache list, prune or rm): the store makes its
// directory, and files in it, which would be that process's, and no job
// of the stages' user could use the cache any more.
func CacheStore(cfg *config.Config) (*hostcache.Store, error) {
	if !cfg.Cache.Enabled() {
		return nil, fmt.Errorf("the host cache is off: set [cache] dir in %s (docs/caching.md)", cfg.Path)
	}
	if err := (state.Store{Dir: cfg.StateDir}).CheckOwner(); err != nil {
		return nil, fmt.Errorf("host cache %s: %w", cfg.Cache.Dir, err)
	}
	return hostcache.ForConfig(cfg.Cache), nil
}

// CacheList prints the host cache's projects, least recently used first,
// with their files, directories, charged size and last use, and the
// total (staging and reserved scratch disks included) against the limit.
func CacheList(w io.Writer, cfg *config.Config, s *hostcache.Store, now time.Time) error {
	us, err := s.List()
	if err != nil {
		return err
	}
	if len(us) == 0 {
		_, err := fmt.Fprintf(w, "no caches in %s\n", s.Dir)
		return err
	}
	staged, err := s.Staged()
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PROJECT\tFILES\tDIRS\tSIZE\tLAST USE")
	total := staged
	for _, u := range us {
		last := "never"
		if !u.LastUse.IsZero() {
			last = now.Sub(u.LastUse).Round(time.Second).String() + " ago"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f MiB\t%s\n", u.Project, u.Files, u.Dirs, float64(u.Bytes)/(1<<20), last)
		total += u.Bytes
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "total %.1f MiB of %d MiB (cache.total_limit_mib), %.1f MiB of it saves in flight and their scratch disks; a project at most %d MiB and %d files and directories\n"+
		"(SIZE is charged: each file in whole %d-byte blocks, at least one, and each directory one block)\n",
		float64(total)/(1<<20), cfg.Cache.TotalLimitMiB, float64(staged)/(1<<20), cfg.Cache.ProjectLimitMiB, hostcache.DefaultEntryLimit, hostcache.Block)
	return err
}

// CachePrune removes the caches no job used for olderThan (and what a
// killed save left in staging), and says which.
func CachePrune(ctx context.Context, w io.Writer, s *hostcache.Store, olderThan time.Duration) error {
	removed, err := s.Prune(ctx, olderThan)
	for _, p := range removed {
		fmt.Fprintf(w, "removed cache %s (unused for %s or more)\n", p, olderThan)
	}
	return err
}
