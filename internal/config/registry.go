package config

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"path/filepath"
	"strconv"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/imagecheck"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Registry is [registry]: where the images with a source
// ("oci://HOST/REPO:TAG" or "...@sha256:...") come from and where this
// host keeps them. docs/fleet.md.
type Registry struct {
	// Dir is the host's content-addressed image store (ociimage.Store).
	// Default "/var/cache/libvirt-executor/oci".
	Dir string `toml:"dir"`
	// Credentials is a docker-style config.json ("auths") with the
	// registries' logins, readable by the driver's user only. Empty:
	// anonymous pulls. Credential helpers are not run.
	Credentials string `toml:"credentials"`
	// PlainHTTP lists registries ("HOST:PORT") reached over plain HTTP
	// (a registry on a private network); every other one over HTTPS.
	PlainHTTP []string `toml:"plain_http"`
	// PullInterval is how often the pool service asks the registry what
	// each tag names now. Default 5m.
	PullInterval Duration `toml:"pull_interval"`
	// MaxImageGiB bounds each file of an image pulled. Default 64.
	MaxImageGiB int `toml:"max_image_gib"`

	// maxVirtual bounds a stored disk's virtual size (limits.max_disk_gib,
	// set by Parse; 0: imagecheck's default).
	maxVirtual uint64
}

func (r *Registry) applyDefaults() {
	if r.Dir == "" {
		r.Dir = "/var/cache/libvirt-executor/oci"
	}
	if r.PullInterval == 0 {
		r.PullInterval = Duration(5 * time.Minute)
	}
	if r.MaxImageGiB == 0 {
		r.MaxImageGiB = 64
	}
}

func (r Registry) validate(p *problems) {
	if !filepath.IsAbs(r.Dir) || filepath.Clean(r.Dir) != r.Dir || r.Dir == "/" {
		p.bad("registry.dir", "%q must be a clean absolute path of a directory of its own (e.g. \"/var/cache/libvirt-executor/oci\")", r.Dir)
	}
	if r.Credentials != "" && !filepath.IsAbs(r.Credentials) {
		p.bad("registry.credentials", "%q must be an absolute path (a docker-style config.json)", r.Credentials)
	}
	for i, h := range r.PlainHTTP {
		host, port, err := net.SplitHostPort(h)
		if n, perr := strconv.Atoi(port); err != nil || host == "" || perr != nil || n < 1 || n > 65535 {
			p.bad(fmt.Sprintf("registry.plain_http[%d]", i), "%q: want HOST:PORT", h)
		}
	}
	if r.PullInterval.D() < 10*time.Second {
		p.bad("registry.pull_interval", "%s is too short: at least 10s", r.PullInterval.D())
	}
	p.inRange("registry.max_image_gib", r.MaxImageGiB, 1, 4096)
}

// Store is the host's image store.
func (r Registry) Store() *ociimage.Store {
	return &ociimage.Store{Dir: r.Dir, MaxFileBytes: int64(r.MaxImageGiB) << 30, MaxVirtualBytes: r.maxVirtual}
}

// LocalLibvirt reports whether libvirt_uri names a libvirt on this host
// (no host part: qemu:///system, or a UNIX socket), as opposed to a remote
// one (qemu+ssh://HOST/system, qemu+tls://HOST/system).
func (c *Config) LocalLibvirt() bool { return vm.LocalURI(c.LibvirtURI) }

// validateSource checks an image with a source: no base, kernel or initrd
// of its own (they come from the artifact), a qcow2 disk.
func (img *Image) validateSource(p *problems, key string, local bool, uri string) {
	if !local {
		p.bad(key+".source", "needs a libvirt on this host (libvirt_uri %q is another host's): the image store is on this host and that libvirt cannot open its files; put the image in a storage pool of that host and set base", uri)
	}
	if _, err := ociimage.ParseSource(img.Source); err != nil {
		p.bad(key+".source", "%v", err)
	}
	if img.Base != "" {
		p.bad(key+".base", "set base (a file on this host) or source (an image in a registry), not both")
	}
	if img.Kernel != "" || img.Initrd != "" {
		p.bad(key+".kernel", "an image with a source gets its kernel and initrd from the registry's artifact: remove kernel and initrd")
	}
	if img.Format != "qcow2" {
		p.bad(key+".format", "an image with a source is a qcow2 disk, got %q", img.Format)
	}
}

// resolveSources points every image with a source at the files of the
// image the host's store has for it now (ociimage.Store.Current): what the
// last verified pull stored. An image without one (not pulled yet, or a
// record that cannot be read) keeps an empty Base (Image.Pulled is false):
// prepare pulls it on first use, and says why it could not.
func (c *Config) resolveSources() {
	for _, name := range c.ImageNames() {
		if img := c.Images[name]; img != nil && img.Source != "" {
			_ = c.ResolveSource(img)
		}
	}
}

// ResolveSource points img at the stored image its source names now.
func (c *Config) ResolveSource(img *Image) error {
	src, err := ociimage.ParseSource(img.Source)
	if err != nil {
		return err
	}
	rec, stored, err := c.Registry.Store().Current(src)
	if err != nil {
		return err
	}
	if stored.Path(ociimage.DiskFile) == "" {
		return fmt.Errorf("image %s (%s) has no %s", src, rec.Digest, ociimage.DiskFile)
	}
	if img.Boot == BootKernel && stored.Path(ociimage.KernelFile) == "" {
		return fmt.Errorf("boot = \"kernel\" but the image %s (%s) has no kernel", src, rec.Digest)
	}
	if err := c.Registry.Store().Verify(stored); err != nil {
		return fmt.Errorf("image %s (%s): %w", src, rec.Digest, err)
	}
	img.Base = stored.Path(ociimage.DiskFile)
	img.Kernel = stored.Path(ociimage.KernelFile)
	img.Initrd = stored.Path(ociimage.InitrdFile)
	img.Digest = rec.Digest.String()
	return nil
}

// Pulled reports whether an image with a source has a stored image (its
// Base is set); an image without a source always has.
func (img *Image) Pulled() bool { return img.Base != "" }

// MaxBaseBytes bounds a base image's virtual size: limits.max_disk_gib
// (every job's disk is at least as large as its base).
func (c *Config) MaxBaseBytes() uint64 {
	return uint64(max(c.Limits.MaxDiskGiB, 0)) << 30 //nolint:gosec // G115: non-negative, at most 4096
}

// CheckBase looks inside img's base disk before a machine is made on it
// (imagecheck.Check: the format it is declared as, no backing or data
// file, no unknown incompatible feature, a virtual size within
// limits.max_disk_gib). A base missing here (another host's libvirt, or a
// file libvirt will report missing) is not checked: nil.
func (c *Config) CheckBase(img *Image) error {
	if img == nil || img.Base == "" || !c.LocalLibvirt() {
		return nil
	}
	if _, err := imagecheck.Check(img.Base, img.Format, c.MaxBaseBytes()); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if errors.Is(err, imagecheck.ErrRefused) {
			return fmt.Errorf("image %s refused: %w", img.Name, err)
		}
		return fmt.Errorf("image %s: the base image cannot be checked (it must be readable by this user): %w", img.Name, err)
	}
	return nil
}

// ResolveFiles is img with its files (base, kernel, initrd) named by the
// paths they have now, links resolved: a base named through a link (image
// build's OUTPUT/NAME -> NAME-HASH) goes into a job disk's header as the file
// it is at the machine's making, so a rebuild that moves the link later
// never changes the backing file (or the kernel) under a machine made
// before. Files in the same directory as the base are resolved through one
// resolution of that directory: a machine never gets the disk of one build
// and the kernel of another. A name that cannot be resolved is kept (the
// check and libvirt then say what is wrong with it). Only for a local
// libvirt: a remote host's paths are not this host's.
func (c *Config) ResolveFiles(img *Image) *Image {
	if img == nil || img.Base == "" || !c.LocalLibvirt() {
		return img
	}
	out := *img
	dir := filepath.Dir(img.Base)
	realDir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		realDir = dir
	}
	resolve := func(p string) string {
		if p == "" {
			return p
		}
		if filepath.Dir(p) == dir {
			p = filepath.Join(realDir, filepath.Base(p))
		}
		if r, err := filepath.EvalSymlinks(p); err == nil {
			return r
		}
		return p
	}
	out.Base, out.Kernel, out.Initrd = resolve(img.Base), resolve(img.Kernel), resolve(img.Initrd)
	return &out
}
