package config

import "slices"

// The sizes a front end lets a request choose (a GitLab job's variables,
// a garm pool's extra specs) and the images it offers are decided here,
// once, for every front end.

// SizeBound is the range one size of a machine may be chosen in: at least
// Min, at most the limits.* maximum, in Unit.
type SizeBound struct {
	Min, Max int
	Unit     string
}

// Size bounds of a requested machine (limits.max_*; the minimums are what
// a guest needs at all).
func (c *Config) VCPUBound() SizeBound {
	return SizeBound{Min: 1, Max: c.Limits.MaxVCPUs, Unit: "vCPUs"}
}
func (c *Config) MemoryBound() SizeBound {
	return SizeBound{Min: 128, Max: c.Limits.MaxMemoryMiB, Unit: "MiB"}
}
func (c *Config) DiskBound() SizeBound {
	return SizeBound{Min: 1, Max: c.Limits.MaxDiskGiB, Unit: "GiB"}
}

// Contains reports whether n is within the bound.
func (b SizeBound) Contains(n int) bool { return n >= b.Min && n <= b.Max }

// OfferedImage is the configured image name if offered (a front end's
// allowlist of image names) lists it; nil when it does not, or no image of
// that name is configured. The name is only compared, never used as a path.
func (c *Config) OfferedImage(name string, offered []string) (*Image, bool) {
	img, ok := c.Image(name)
	if !ok || !slices.Contains(offered, name) {
		return nil, false
	}
	return img, true
}

// GarmImages are the images garm's pools may use: garm.images, or every
// configured image when that is empty.
func (c *Config) GarmImages() []string {
	if len(c.Garm.Images) > 0 {
		return c.Garm.Images
	}
	return c.ImageNames()
}
