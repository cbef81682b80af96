package admin

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
)

// ImageSnapshot makes the memory snapshot of the configured image name
// (issue #48, docs/pool.md) in place of the one it has, or with remove
// removes it; one line on w says what it did.
func ImageSnapshot(ctx context.Context, w io.Writer, m *jobvm.Host, name string, remove bool) error {
	cfg := m.Manager().Cfg
	snaps := lifecycle.SnapshotsOf(m.Manager())
	if remove {
		// Also for an image no longer configured: its snapshot still
		// holds disk.
		kept, err := snaps.Remove(ctx, name)
		if err != nil {
			return err
		}
		if kept != "" {
			fmt.Fprintf(w, "memory snapshot of image %s removed: no job starts from it; its template stays until a sweep can remove it (%s; libvirt-executor gc)\n", name, kept)
			return nil
		}
		fmt.Fprintf(w, "memory snapshot of image %s removed\n", name)
		return nil
	}
	img, ok := cfg.Images[name]
	if !ok {
		return fmt.Errorf("image %q: not in the configuration (it has %s)", name, strings.Join(cfg.ImageNames(), ", "))
	}
	t0 := time.Now()
	rec, err := snaps.Build(ctx, img)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "memory snapshot of image %s made in %s: template %s, %d vCPU, %d MiB, %d GiB disk, %s\n",
		name, jobvm.Round(time.Since(t0)), rec.Template, rec.VCPUs, rec.MemoryMiB, rec.DiskBytes>>30, rec.DomainType)
	return nil
}

// SnapshotList prints every image's memory snapshot: its template, size,
// age, and whether jobs start from it now (current) or why not.
func SnapshotList(ctx context.Context, w io.Writer, m *jobvm.Host, now time.Time) error {
	snaps := lifecycle.SnapshotsOf(m.Manager())
	recs, err := snaps.List()
	if err != nil {
		return err
	}
	cfg := m.Manager().Cfg
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "IMAGE\tTEMPLATE\tSIZE\tAGE\tSTATE")
	for _, r := range recs {
		age, st := "-", "building or cut off"
		if r.Ready() {
			age = now.Sub(r.Saved).Round(time.Second).String()
			st = "current"
			if img, ok := cfg.Images[r.Image]; !ok {
				st = "not used: the image is no longer configured"
			} else if !img.Snapshot {
				st = "not used: snapshot = false"
			} else if cur, why := snaps.Current(ctx, img); cur == nil || cur.Template != r.Template {
				st = "not used: " + why
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%d vCPU, %d MiB, %d GiB\t%s\t%s\n", r.Image, r.Template, r.VCPUs, r.MemoryMiB, r.DiskBytes>>30, age, st)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(recs) == 0 {
		fmt.Fprintln(w, "no memory snapshots (docs/pool.md: [images.NAME] snapshot = true, then libvirt-executor image snapshot NAME or the pool service)")
	}
	return nil
}
