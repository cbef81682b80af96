package pool

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/metrics"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"
)

// ErrImageChanged ends Run, when it has no Service.Load, when an image's
// source (oci://) names another image than the one the service was
// started with, now stored and verified: the service is restarted
// (systemd: Restart=on-failure) with it, and the standbys of the old image
// are retired by the next service (their base differs). With Load the
// service reloads instead (Service.Reload). Jobs take the new image from then on: a prepare
// reads the store's record when it starts.
var ErrImageChanged = errors.New("an image's source names a new image: restart the service to boot standbys of it")

// pullTimeout bounds one pull of the service (an image of many GiB over a
// slow link still fits; a stalled transfer ends sooner: transfer.IdleTimeout).
const pullTimeout = 2 * time.Hour

// follower asks the registry, every registry.pull_interval, what each
// image's source names and pulls what is new (docs/fleet.md).
type follower struct {
	cfg *config.Config
	svc *Service

	mu       sync.Mutex
	failures map[string]int    // pulls failed in a row, by image
	lastErr  map[string]string // the last failure, by image (logged when it changes)
	// collecting serializes collect; unnamed is when each stored image no
	// configured source names was first seen so.
	collecting sync.Mutex
	unnamed    map[digest.Digest]time.Time
	now        func() time.Time
}

func newFollower(cfg *config.Config, svc *Service) *follower {
	return &follower{cfg: cfg, svc: svc, failures: map[string]int{}, lastErr: map[string]string{},
		unnamed: map[digest.Digest]time.Time{}, now: time.Now}
}

// collectGrace is how long a stored image must have been named by no
// configured source before it is removed: a prepare that loaded the
// configuration before the tag moved clones the old image seconds later.
const collectGrace = 10 * time.Minute

// collect removes the stored images that no configured source names, that
// no volume of the storage pool is backed by, and that have been so for
// collectGrace (as seen by this service): the old digests of moved tags.
func (f *follower) collect(ctx context.Context) {
	f.collecting.Lock()
	defer f.collecting.Unlock()
	store := f.cfg.Registry.Store()
	named := map[digest.Digest]bool{}
	for _, img := range f.sourced() {
		if src, err := ociimage.ParseSource(img.Source); err == nil {
			if rec, _, err := store.Current(src); err == nil {
				named[rec.Digest] = true
			}
		}
	}
	imgs, _, err := store.List()
	if err != nil {
		f.svc.Log.Warn("image store: cannot list it", "dir", store.Dir, "err", err)
		return
	}
	now, due := f.now(), false
	seen := map[digest.Digest]bool{}
	for _, img := range imgs {
		if named[img.Digest] {
			continue
		}
		seen[img.Digest] = true
		since, ok := f.unnamed[img.Digest]
		if !ok {
			f.unnamed[img.Digest] = now
		} else if now.Sub(since) >= collectGrace {
			due = true
		}
	}
	for d := range f.unnamed {
		if !seen[d] {
			delete(f.unnamed, d)
		}
	}
	if !due {
		return
	}
	inUse, err := f.svc.M.Manager().Volumes().BackingFiles(ctx)
	if err != nil {
		f.svc.Log.Warn("image store: old images kept: cannot list the pool's backing files", "err", err)
		return
	}
	configured := map[string]bool{}
	for _, img := range f.sourced() {
		if src, err := ociimage.ParseSource(img.Source); err == nil {
			configured[src.String()] = true
		}
	}
	removed, err := transfer.Remove(ctx, store, func(img ociimage.Image, recs []ociimage.Record) bool {
		for _, rec := range recs { // read under the store's lock: a pull since the look above
			if configured[rec.Source] {
				return true
			}
		}
		since, ok := f.unnamed[img.Digest]
		return named[img.Digest] || !ok || now.Sub(since) < collectGrace || img.InUse(inUse)
	})
	for _, d := range removed {
		delete(f.unnamed, d)
		f.svc.Log.Info("removed an old image: no configured source names it, no VM uses it", "digest", d.String())
	}
	if err != nil {
		f.svc.Log.Warn("image store: removing old images failed", "err", err)
	}
}

// sourced lists the images with a source.
func (f *follower) sourced() []*config.Image {
	var out []*config.Image
	for _, name := range f.cfg.ImageNames() {
		if img := f.cfg.Images[name]; img != nil && img.Source != "" {
			out = append(out, img)
		}
	}
	return out
}

// run pulls after wait (0: at once) and then every interval until ctx
// ends; it sends on changed when an image now names another digest than
// the service's.
func (f *follower) run(ctx context.Context, changed chan<- string, wait time.Duration) {
	if len(f.sourced()) == 0 {
		return
	}
	if wait > 0 {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
	t := time.NewTicker(f.cfg.Registry.PullInterval.D())
	defer t.Stop()
	for {
		if name := f.round(ctx); name != "" {
			select {
			case changed <- name:
			default:
			}
			return
		}
		f.collect(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// round pulls every sourced image once; it returns the name of one whose
// stored image is not the one the service runs with.
func (f *follower) round(ctx context.Context) string {
	remote := transfer.RemoteOf(f.cfg.Registry, "libvirt-executor/"+buildinfo.Version)
	store := f.cfg.Registry.Store()
	changed := ""
	for _, img := range f.sourced() {
		src, err := ociimage.ParseSource(img.Source)
		if err != nil {
			continue // refused when the configuration was loaded
		}
		t0 := time.Now()
		pctx, cancel := context.WithTimeout(ctx, pullTimeout)
		res, err := transfer.Pull(pctx, store, remote, src)
		cancel()
		if ctx.Err() != nil {
			return ""
		}
		f.mu.Lock()
		if err != nil {
			f.failures[img.Name]++
			n := f.failures[img.Name]
			if f.lastErr[img.Name] != err.Error() {
				f.lastErr[img.Name] = err.Error()
				f.svc.Log.Warn("image pull failed: the last verified image keeps serving", "image", img.Name, "source", img.Source,
					"failures_in_a_row", n, "err", err)
			}
			f.mu.Unlock()
			continue
		}
		if f.failures[img.Name] > 0 {
			f.svc.Log.Info("image source answers again", "image", img.Name, "source", img.Source, "after_failures", f.failures[img.Name])
		}
		f.failures[img.Name], f.lastErr[img.Name] = 0, ""
		f.mu.Unlock()
		if res.Fetched > 0 {
			f.svc.Log.Info("image pulled", "image", img.Name, "source", img.Source, "digest", res.Record.Digest.String(),
				"received_bytes", res.Fetched, "stored_bytes", res.Image.Bytes, "took", time.Since(t0).Round(time.Millisecond).String())
		}
		if res.Record.Digest.String() == img.Digest || changed != "" {
			continue
		}
		// Restart only for an image this configuration can run: one it
		// cannot (boot = "kernel" and no kernel in the artifact) would
		// restart the service every round.
		probe := *img
		if err := f.cfg.ResolveSource(&probe); err != nil {
			f.mu.Lock()
			if f.lastErr[img.Name] != err.Error() {
				f.lastErr[img.Name] = err.Error()
				f.svc.Log.Error("image source names an image this configuration cannot use: kept the last one", "image", img.Name,
					"source", img.Source, "digest", res.Record.Digest.String(), "err", err)
			}
			f.mu.Unlock()
			continue
		}
		f.svc.Log.Info("image source names a new image", "image", img.Name, "source", img.Source,
			"was", img.Digest, "now", res.Record.Digest.String())
		changed = img.Name
	}
	return changed
}

// gauges is the sourced images' state for the metrics endpoint.
func (f *follower) gauges() ([]metrics.ImageGauge, error) {
	store := f.cfg.Registry.Store()
	var out []metrics.ImageGauge
	for _, img := range f.sourced() {
		g := metrics.ImageGauge{Image: img.Name}
		if src, err := ociimage.ParseSource(img.Source); err == nil {
			if rec, _, err := store.Current(src); err == nil {
				g.Digest, g.LastCheck = rec.Digest.String(), rec.Checked
			}
		}
		f.mu.Lock()
		g.Failures = f.failures[img.Name]
		f.mu.Unlock()
		out = append(out, g)
	}
	return out, nil
}
