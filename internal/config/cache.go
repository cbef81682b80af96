package config

import (
	"path/filepath"
	"slices"
	"time"
)

// Cache configures the host cache: a directory on the host that keeps each
// project's CI cache (what the runner archives under cache_dir) from one
// job to the next of the same project, without a distributed cache (S3).
// docs/caching.md.
type Cache struct {
	// Dir is where the caches live, one directory per project of each
	// GitLab instance. Setting it turns the host cache on; empty: off.
	Dir string `toml:"dir"`
	// ProjectLimitMiB bounds one project's cache: a save that would take
	// more is not kept (the job log says so), and older archives of the
	// project go first when an accepted one takes it over. Default 1024.
	ProjectLimitMiB int `toml:"project_limit_mib"`
	// TotalLimitMiB bounds all caches together: whole projects, least
	// recently used first, go when a save takes it over. Default 10240.
	TotalLimitMiB int `toml:"total_limit_mib"`
	// MaxAge: gc removes the cache of a project no job has used for this
	// long. Default 720h (30 days).
	MaxAge Duration `toml:"max_age"`
	// Images that get the host cache; empty: all.
	Images []string `toml:"images"`
	// DiskMinMiB: a cache smaller than this goes into and out of the
	// guest over SSH even where the image's cache_via is "disk" (a hot plug
	// costs a guest under TCG about 2 s, more than SSH takes for a few
	// MiB). Default 16; 0: always the disks.
	DiskMinMiB *int `toml:"disk_min_mib"`
}

// DiskMin is DiskMinMiB in bytes.
func (c Cache) DiskMin() int64 {
	if c.DiskMinMiB == nil {
		return 16 << 20
	}
	return int64(*c.DiskMinMiB) << 20
}

// How the host cache goes into and out of a guest (Image.CacheVia).
const (
	CacheViaDisk = "disk"
	CacheViaSSH  = "ssh"
)

// Enabled reports whether the host cache is on.
func (c Cache) Enabled() bool { return c.Dir != "" }

// For reports whether jobs on img get the host cache.
func (c Cache) For(img *Image) bool {
	return c.Enabled() && img != nil && (len(c.Images) == 0 || slices.Contains(c.Images, img.Name))
}

// ProjectLimit and TotalLimit are the limits in bytes.
func (c Cache) ProjectLimit() int64 { return int64(c.ProjectLimitMiB) << 20 }
func (c Cache) TotalLimit() int64   { return int64(c.TotalLimitMiB) << 20 }

func (c *Cache) applyDefaults() {
	if c.ProjectLimitMiB == 0 {
		c.ProjectLimitMiB = 1024
	}
	if c.TotalLimitMiB == 0 {
		c.TotalLimitMiB = 10240
	}
	if c.MaxAge == 0 {
		c.MaxAge = Duration(30 * 24 * time.Hour)
	}
}

// validate checks [cache]; its images must be configured in cfg.
func (c Cache) validate(p *problems, cfg *Config) {
	if c.Dir != "" && (!filepath.IsAbs(c.Dir) || filepath.Clean(c.Dir) != c.Dir || c.Dir == "/") {
		p.bad("cache.dir", "%q must be a clean absolute path of a directory of its own (e.g. \"/var/cache/libvirt-executor/jobs\")", c.Dir)
	}
	p.inRange("cache.project_limit_mib", c.ProjectLimitMiB, 1, 1<<20)
	p.inRange("cache.total_limit_mib", c.TotalLimitMiB, 1, 16<<20)
	if c.ProjectLimitMiB > c.TotalLimitMiB {
		p.bad("cache.project_limit_mib", "%d is above cache.total_limit_mib (%d)", c.ProjectLimitMiB, c.TotalLimitMiB)
	}
	p.positive("cache.max_age", c.MaxAge)
	if c.DiskMinMiB != nil {
		p.inRange("cache.disk_min_mib", *c.DiskMinMiB, 0, 1<<20)
	}
	for _, name := range c.Images {
		if _, ok := cfg.Images[name]; !ok {
			p.bad("cache.images", "%q is not a configured image; use one of %s", name, quoteList(cfg.ImageNames()))
		}
	}
}
