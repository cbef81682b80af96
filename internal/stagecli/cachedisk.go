package stagecli

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// cacheDiskWait bounds the admin tool's attach (it writes up to a
// project's cache limit into a volume) and drop; the stage's own deadline
// for a cache copy is shorter or equal.
const cacheDiskWait = 10 * time.Minute

// adminCacheDisk is cachexfer.Disk through the admin tool
// (jobvm.CacheDiskCommand), for the run stage, built without libvirt.
type adminCacheDisk struct{ a *adminTool }

// Attach implements cachexfer.Disk.
func (c adminCacheDisk) Attach(ctx context.Context, name, project string, want []string) (hostcache.RestoreResult, error) {
	out, err := c.run(ctx, append([]string{jobvm.CacheDiskAttach, "--", name, project}, want...)...)
	if err != nil {
		return hostcache.RestoreResult{}, err
	}
	return parseAttached(out)
}

// AttachScratch implements cachexfer.Disk.
func (c adminCacheDisk) AttachScratch(ctx context.Context, name string) error {
	_, err := c.run(ctx, jobvm.CacheDiskScratch, "--", name)
	return err
}

// Keep implements cachexfer.Disk.
func (c adminCacheDisk) Keep(ctx context.Context, name, project string, keep []string) jobvm.Kept {
	out, err := c.run(ctx, append([]string{jobvm.CacheDiskKeep, "--", name, project}, keep...)...)
	if err != nil {
		return jobvm.Kept{DropErr: err, Err: err}
	}
	var a jobvm.KeepAnswer
	if err := json.Unmarshal([]byte(out), &a); err != nil {
		err = fmt.Errorf("%s %s %s: answer %q: %w", jobvm.AdminExecutable, jobvm.CacheDiskCommand, jobvm.CacheDiskKeep, strings.TrimSpace(out), err)
		return jobvm.Kept{DropErr: err, Err: err}
	}
	return a.Kept()
}

// Drop implements cachexfer.Disk.
func (c adminCacheDisk) Drop(ctx context.Context, name string) error {
	_, err := c.run(ctx, jobvm.CacheDiskDrop, "--", name)
	return err
}

func (c adminCacheDisk) run(ctx context.Context, args ...string) (string, error) {
	path, err := c.a.find()
	if err != nil {
		return "", fmt.Errorf("the admin tool %s, which asks libvirt for the disk, was not found: %w", jobvm.AdminExecutable, err)
	}
	out, err := c.a.run(ctx, path, cacheDiskWait, append([]string{jobvm.CacheDiskCommand}, args...)...)
	if err != nil {
		return "", fmt.Errorf("%s %s: %w", jobvm.AdminExecutable, jobvm.CacheDiskCommand, err)
	}
	return out, nil
}

// parseAttached reads the attach command's "FILES BYTES".
func parseAttached(out string) (hostcache.RestoreResult, error) {
	f := strings.Fields(out)
	if len(f) == 2 {
		files, ferr := strconv.ParseInt(f[0], 10, 64)
		bytes, berr := strconv.ParseInt(f[1], 10, 64)
		if ferr == nil && berr == nil && files >= 0 && bytes >= 0 {
			return hostcache.RestoreResult{Files: files, Bytes: bytes}, nil
		}
	}
	return hostcache.RestoreResult{}, fmt.Errorf("%s %s %s: answer %q, want \"FILES BYTES\"", jobvm.AdminExecutable, jobvm.CacheDiskCommand, jobvm.CacheDiskAttach, strings.TrimSpace(out))
}
