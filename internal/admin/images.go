package admin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/opencontainers/go-digest"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// userAgent names this client to registries.
func userAgent() string { return "libvirt-executor/" + buildinfo.Version }

// sourceOf is the source of the configured image name, or name itself
// when it is an oci:// source.
func sourceOf(cfg *config.Config, name string) (ociimage.Source, error) {
	if strings.HasPrefix(name, ociimage.Scheme) {
		return ociimage.ParseSource(name)
	}
	img, ok := cfg.Image(name)
	if !ok {
		return ociimage.Source{}, fmt.Errorf("%q is not a configured image (%s) nor an oci:// source", name, strings.Join(cfg.ImageNames(), ", "))
	}
	if img.Source == "" {
		return ociimage.Source{}, fmt.Errorf("image %s has no source (it is the file %s)", name, img.Base)
	}
	return ociimage.ParseSource(img.Source)
}

// CheckStoreOwner refuses (a *state.OwnerError) to write the image store
// as another user than the installation's: files root made there could not
// be replaced by the stages' user, whose prepare pulls on first use.
func CheckStoreOwner(cfg *config.Config) error {
	if err := (state.Store{Dir: cfg.StateDir}).CheckOwner(); err != nil {
		return err
	}
	if err := (state.Store{Dir: cfg.Registry.Dir}).CheckOwner(); err != nil {
		return fmt.Errorf("image store: %w", err)
	}
	return nil
}

// ImagePull pulls the named images (configured names or oci:// sources;
// none: every configured image with a source) into the host's store.
func ImagePull(ctx context.Context, w io.Writer, cfg *config.Config, names []string) error {
	if len(names) == 0 {
		for _, n := range cfg.ImageNames() {
			if cfg.Images[n].Source != "" {
				names = append(names, n)
			}
		}
		if len(names) == 0 {
			return errors.New("no configured image has a source (source = \"oci://...\"): name one to pull")
		}
	}
	if err := CheckStoreOwner(cfg); err != nil {
		return err
	}
	store, remote := cfg.Registry.Store(), transfer.RemoteOf(cfg.Registry, userAgent())
	var errs []error
	for _, n := range names {
		src, err := sourceOf(cfg, n)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		t0 := time.Now()
		res, err := transfer.Pull(ctx, store, remote, src)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n, err))
			continue
		}
		what := "unchanged"
		if res.Changed {
			what = "new"
		}
		fmt.Fprintf(w, "%s: %s %s (%s; %.1f MiB received, %.1f MiB stored, %s)\n", n, what, res.Record.Digest, src,
			float64(res.Fetched)/(1<<20), float64(res.Image.Bytes)/(1<<20), time.Since(t0).Round(time.Millisecond))
	}
	return errors.Join(errs...)
}

// ImagePush pushes an image's files (disk, and kernel and initrd for an
// image that boots a kernel) to dst ("oci://HOST/REPO:TAG").
func ImagePush(ctx context.Context, w io.Writer, cfg *config.Config, dst string, files []transfer.PushFile) error {
	src, err := ociimage.ParseSource(dst)
	if err != nil {
		return err
	}
	t0 := time.Now()
	res, err := transfer.Push(ctx, transfer.RemoteOf(cfg.Registry, userAgent()), src, files, os.TempDir(), "")
	if err != nil {
		return err
	}
	var raw int64
	for _, f := range res.Files {
		raw += f.Size
	}
	count := fmt.Sprintf("%d files", len(res.Files))
	if len(res.Files) == 1 {
		count = "1 file"
	}
	_, err = fmt.Fprintf(w, "pushed %s: %s (%s, %.1f MiB, %.1f MiB compressed, %s)\n", src, res.Descriptor.Digest,
		count, float64(raw)/(1<<20), float64(res.Compressed)/(1<<20), time.Since(t0).Round(time.Millisecond))
	return err
}

// ImageList prints the host's stored images, what names each and which
// configured image uses it.
func ImageList(w io.Writer, cfg *config.Config, now time.Time) error {
	imgs, refs, err := cfg.Registry.Store().List()
	if err != nil {
		return err
	}
	if len(imgs) == 0 {
		_, err := fmt.Fprintf(w, "no images in %s\n", cfg.Registry.Dir)
		return err
	}
	current := map[digest.Digest][]string{}
	for _, n := range cfg.ImageNames() {
		if img := cfg.Images[n]; img.Digest != "" {
			current[digest.Digest(img.Digest)] = append(current[digest.Digest(img.Digest)], n)
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "DIGEST\tSIZE\tFILES\tCONFIGURED AS\tSOURCES (LAST CONFIRMED)")
	for _, img := range imgs {
		var files, srcs []string
		for _, f := range img.Files {
			files = append(files, f.Name)
		}
		for _, rec := range refs[img.Digest] {
			srcs = append(srcs, fmt.Sprintf("%s (%s ago)", rec.Source, now.Sub(rec.Checked).Round(time.Second)))
		}
		conf := strings.Join(current[img.Digest], ",")
		if conf == "" {
			conf = "-"
		}
		if len(srcs) == 0 {
			srcs = []string{"-"}
		}
		fmt.Fprintf(tw, "%s\t%.1f MiB\t%s\t%s\t%s\n", img.Digest, float64(img.Bytes)/(1<<20), strings.Join(files, ","), conf, strings.Join(srcs, ", "))
	}
	return tw.Flush()
}

// ImagePrune removes stored images that no configured image's source
// names now and no volume of the storage pool is backed by (inUse: the
// pool's backing files, lifecycle.Manager.BackingFiles).
func ImagePrune(ctx context.Context, w io.Writer, cfg *config.Config, inUse []string, dryRun bool) error {
	named := map[digest.Digest]bool{}
	configured := map[string]bool{}
	for _, n := range cfg.ImageNames() {
		img := cfg.Images[n]
		if img.Digest != "" {
			named[digest.Digest(img.Digest)] = true
		}
		if src, err := ociimage.ParseSource(img.Source); err == nil {
			configured[src.String()] = true
		}
	}
	keep := func(img ociimage.Image, recs []ociimage.Record) bool {
		k := named[img.Digest] || img.InUse(inUse)
		for _, rec := range recs { // read under the store's lock: a pull since the configuration was loaded
			k = k || configured[rec.Source]
		}
		if !k && dryRun {
			fmt.Fprintf(w, "would remove %s (%.1f MiB)\n", img.Digest, float64(img.Bytes)/(1<<20))
		}
		return k || dryRun
	}
	if err := CheckStoreOwner(cfg); err != nil {
		return err
	}
	removed, err := transfer.Remove(ctx, cfg.Registry.Store(), keep)
	for _, d := range removed {
		fmt.Fprintf(w, "removed %s (no configured source names it, no VM uses it)\n", d)
	}
	return err
}

// imageStoreCheck is doctor's look at the image store and the registry
// credentials, when an image has a source (false otherwise): the store is
// this user's (the stages pull into it) and the credentials file is not
// readable by others.
func imageStoreCheck(cfg *config.Config) (Check, bool) {
	sourced := false
	for _, n := range cfg.ImageNames() {
		sourced = sourced || cfg.Images[n].Source != ""
	}
	if !sourced {
		return Check{}, false
	}
	name := "image store " + cfg.Registry.Dir
	if err := CheckStoreOwner(cfg); err != nil {
		return Check{Name: name, Info: err.Error(), Fix: "run as the stages' user, or chown -R that user " + cfg.Registry.Dir}, true
	}
	if cfg.Registry.Credentials != "" {
		st, err := os.Stat(cfg.Registry.Credentials)
		if err != nil {
			return Check{Name: name, Info: "registry.credentials: " + err.Error(), Fix: "write a docker-style config.json there, or remove registry.credentials"}, true
		}
		if st.Mode().Perm()&0o004 != 0 {
			return Check{Name: name, Info: fmt.Sprintf("registry.credentials %s is readable by every user (%v)", cfg.Registry.Credentials, st.Mode().Perm()),
				Fix: "chmod 0600 " + cfg.Registry.Credentials + " (owned by the stages' user)"}, true
		}
	}
	return Check{Name: name, OK: true, Info: "this user's; images with a source pull into it"}, true
}
