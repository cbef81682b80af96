package services

import (
	"context"
	"fmt"
	"io"
	"time"
)

// Prepull pulls images (the admin's names from a pool's prepull, resolved
// as a job's would be) into a VM that no job has yet: an idle VM of a
// standby pool, so that the job that claims it finds them there (pull
// policy if-not-present). The registry mirrors of o are written first.
// Anonymous pulls only: the VM holds no job's credentials. Progress goes
// to log; the first failure is returned, naming the image.
func Prepull(ctx context.Context, g Guest, images []string, o Options, log io.Writer) error {
	if len(images) == 0 {
		return nil
	}
	d := &driver{g: g, o: o, log: log}
	t0 := time.Now()
	if err := d.checkRuntime(ctx); err != nil {
		return err
	}
	if err := d.writeMirrors(ctx); err != nil {
		return err
	}
	for _, name := range images {
		ref, err := ParseRef(name)
		if err != nil {
			return fmt.Errorf("services: pre-pull %q: %w", name, err)
		}
		if err := d.pullImage(ctx, "the pool's pre-pull", ref, ref.String(), printable, []string{PullIfNotPresent}); err != nil {
			return err
		}
	}
	d.say("Pre-pulled %d image(s) in %s", len(images), since(t0))
	return nil
}
