package stagecli

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// cacheDiskWait bounds the admin tool's attach (it writes up to a
// project's cache limit into a volume) and drop; the stage's own deadline
// for a cache copy is shorter or equal.
const cacheDiskWait = 10 * time.Minute

// adminCacheDisk is cachexfer.Disk through the admin tool
// (cachexfer.AdminCommand), for the run stage, built without libvirt: one
// typed request as JSON on its stdin, one typed answer from its stdout.
func adminCacheDisk(a *adminTool) cachexfer.Disk {
	return cachexfer.AdminDisk(func(ctx context.Context, request []byte) ([]byte, error) {
		path, err := a.find()
		if err != nil {
			return nil, fmt.Errorf("the admin tool %s, which asks libvirt for the disk, was not found: %w", jobvm.AdminExecutable, err)
		}
		out, err := a.run(ctx, path, cacheDiskWait, bytes.NewReader(request), cachexfer.MaxAdminAnswer+1, cachexfer.AdminCommand)
		if err != nil {
			return nil, fmt.Errorf("%s %s: %w", jobvm.AdminExecutable, cachexfer.AdminCommand, err)
		}
		return []byte(out), nil
	})
}
