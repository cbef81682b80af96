package jobvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// PullFunc pulls src into cfg's image store (transfer.Pull).
type PullFunc func(ctx context.Context, cfg *config.Config, src ociimage.Source) (PullReport, error)

// PullReport is what a pull did: the digest stored, the bytes received
// (0: stored already) and stored.
type PullReport struct {
	Digest           string
	Received, Stored int64
}

// staleChecks is how many pull intervals may pass without the registry
// answering before a job's log warns that it runs the last verified image.
const staleChecks = 3

// ensureImage makes sure an image with a source (oci://) is on this
// host (every error it returns is the host's, not the job's): a job on an image not pulled yet pulls it (the first job on a
// new host, or after a new source was configured), under the store's
// lock so that jobs at once pull it once. A stored image is used as it
// is: the pool service follows the tag (registry.pull_interval); when
// the registry has not answered for a while, the job log says the job
// runs the last verified image.
func ensureImage(ctx context.Context, cfg *config.Config, img *config.Image, pull PullFunc, refresh func(string) error, say func(string, ...any), log *slog.Logger) error {
	if img.Source == "" {
		return nil
	}
	src, err := ociimage.ParseSource(img.Source)
	if err != nil {
		return err
	}
	if img.Pulled() {
		rec, _, err := cfg.Registry.Store().Current(src)
		if err == nil {
			say("Image %s: %s from %s", img.Name, rec.Digest, src)
			age := time.Since(rec.Checked)
			if !src.Pinned() && age > staleChecks*cfg.Registry.PullInterval.D() {
				say("Warning: the registry has not confirmed %s for %s (last at %s): this job runs the last verified image",
					src, vm.Round(age), rec.Checked.Format(time.RFC3339))
			}
			// Without the pool service (which asks every pull_interval), the
			// tag is followed from here: one background pull per interval,
			// for the jobs after this one.
			if !src.Pinned() && age > cfg.Registry.PullInterval.D() && refresh != nil &&
				(state.Store{Dir: cfg.StateDir}).Due("image-refresh-"+img.Name, cfg.Registry.PullInterval.D()) {
				if err := refresh(img.Name); err != nil {
					log.Warn("could not start a background pull", "image", img.Name, "err", err)
				} else {
					say("The registry was last asked %s ago: asking it again in the background (the jobs after this one get what it names once stored)", vm.Round(age))
				}
			}
		}
		return nil
	}
	if pull == nil {
		return fmt.Errorf("image %s (%s) is not on this host, and this executable does not pull: run libvirt-executor image pull %s", img.Name, src, img.Name)
	}
	say("Image %s is not on this host yet: pulling %s", img.Name, src)
	t0 := time.Now()
	res, err := pull(ctx, cfg, src)
	if err != nil {
		log.Error("image pull failed", "image", img.Name, "source", src.String(), "err", err)
		if errors.Is(err, ociimage.ErrRefused) {
			return fmt.Errorf("image %s: the registry's image was refused: %w", img.Name, err)
		}
		return fmt.Errorf("image %s: pull %s: %w", img.Name, src, err)
	}
	say("Pulled %s (%s, %.1f MiB received, %.1f MiB stored) in %s", src, res.Digest,
		float64(res.Received)/(1<<20), float64(res.Stored)/(1<<20), vm.Round(time.Since(t0)))
	if err := cfg.ResolveSource(img); err != nil {
		return fmt.Errorf("image %s: %w", img.Name, err)
	}
	return nil
}

// Round is how a job's log shows a duration (vm.Round): milliseconds below
// a second, tenths above.
func Round(d time.Duration) time.Duration { return vm.Round(d) }
