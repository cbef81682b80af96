package gitlab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// The host cache (docs/caching.md): the runner keeps a job's cache archives
// under cache_dir in the guest (no distributed cache configured). Before the
// runner's restore_cache sub-stage extracts them, the project's archives go
// from the host into the guest's cache_dir; after archive_cache (or
// archive_cache_on_failure) made them, the guest's cache_dir comes back to
// the host. Both over a connection of their own to the job's machine; the
// stream the guest sends is checked and bounded by hostcache.Store. A cache
// that cannot be restored or kept never fails the job: the job log says why.

// guestCacheDir is cache_dir in the guest (the config stage says so).
const guestCacheDir = "/cache"

// The guest's side of the copies: fixed commands, nothing of the job in
// them. tar in the guest: busybox, GNU and BSD tar all take these.
const (
	restoreCommand = "mkdir -p " + guestCacheDir + " && tar -xf - -C " + guestCacheDir
	saveCommand    = "mkdir -p " + guestCacheDir + " && cd " + guestCacheDir + " && tar -cf - ."
)

// cacheTimeout bounds one copy (restore or save) of a project's cache.
const cacheTimeout = 10 * time.Minute

// cacheOp is what a run stage does for the host cache: nothing, restore
// before the stage's script, or save after it.
type cacheOp int

const (
	cacheNone cacheOp = iota
	cacheRestore
	cacheSave
)

// cacheOpOf is the host cache's part in stage with script: only the
// runner's cache sub-stages, and only when their script calls the runner's
// cache helper (a job without cache:, or with policy pull for a save, has
// none): such jobs pay nothing.
func cacheOpOf(stage string, script []byte) cacheOp {
	switch {
	case stage == "restore_cache" && bytes.Contains(script, []byte("cache-extractor")):
		return cacheRestore
	case (stage == "archive_cache" || stage == "archive_cache_on_failure") && bytes.Contains(script, []byte("cache-archiver")):
		return cacheSave
	}
	return cacheNone
}

// hostCache is the store of j's project, or nil (with the reason for the
// job log, "" when the host cache is simply off for the image).
func hostCache(j *job, img *config.Image) (*hostcache.Store, string, string) {
	c := j.cfg.Cache
	if !c.For(img) {
		return nil, "", ""
	}
	if !j.job.FromPayload || j.job.ProjectID <= 0 || j.job.Server == "" {
		return nil, "", "Host cache: not used: the job's project is not known from the runner's payload (JOB_RESPONSE_FILE)"
	}
	project, err := hostcache.ProjectID(j.job.Server, j.job.ProjectID)
	if err != nil {
		return nil, "", "Host cache: not used: " + err.Error()
	}
	return hostcache.ForConfig(c), project, ""
}

// runCache does op for the job's machine name on image img, saying in the
// job log what happened and how long it took.
func runCache(ctx context.Context, e Env, j *job, name string, img *config.Image, op cacheOp) {
	store, project, why := hostCache(j, img)
	if store == nil {
		if why != "" {
			e.say("%s", why)
		}
		return
	}
	ctx, cancel := context.WithTimeout(ctx, cacheTimeout)
	defer cancel()
	t0 := time.Now()
	_, client, err := j.m.Connect(ctx, name)
	if err != nil {
		e.say("Host cache: no connection to the VM for the cache: %v", err)
		return
	}
	defer client.Close()
	pr, pw := io.Pipe()
	switch op {
	case cacheRestore:
		var res hostcache.RestoreResult
		var serr error
		done := make(chan struct{})
		go func() {
			defer close(done)
			res, serr = store.Restore(ctx, project, pw)
			_ = pw.CloseWithError(serr)
		}()
		gerr := client.Stream(ctx, restoreCommand, pr, io.Discard)
		_ = pr.CloseWithError(errors.New("the guest's tar ended"))
		<-done
		e.Report.Cache("restore", cacheResult(res.Files > 0, errors.Join(serr, gerr)), res.Bytes, 0)
		switch {
		case serr != nil || gerr != nil:
			e.say("Host cache: restore failed after %s, the job goes on without it: %v", vm.Round(time.Since(t0)), errors.Join(serr, gerr))
		case res.Files == 0:
			e.say("Host cache: nothing cached for this project yet (%s)", vm.Round(time.Since(t0)))
		default:
			e.say("Host cache: restored %d file(s), %s, into %s in %s", res.Files, mib(res.Bytes), guestCacheDir, vm.Round(time.Since(t0)))
		}
	case cacheSave:
		var res hostcache.SaveResult
		var serr error
		done := make(chan struct{})
		sctx, stop := context.WithCancel(ctx)
		defer stop()
		go func() {
			defer close(done)
			res, serr = store.Save(sctx, project, pr)
			// The guest's tar is not waited for once the host has what it
			// keeps, or refused it: what it still sends is dropped.
			_ = pr.CloseWithError(errors.New("the host stopped reading the guest's cache"))
			if serr != nil {
				stop()
			}
		}()
		gerr := client.Stream(sctx, saveCommand, bytes.NewReader(nil), pw)
		_ = pw.CloseWithError(gerr)
		<-done
		e.Report.Cache("save", cacheResult(true, serr), res.Bytes, res.Evicted.Bytes)
		took := vm.Round(time.Since(t0))
		switch {
		case errors.Is(serr, hostcache.ErrProjectLimit):
			e.say("Host cache: not kept (%s): %v. The project's earlier cache stays; raise cache.project_limit_mib or cache less", took, serr)
			return
		case serr != nil:
			e.say("Host cache: not kept (%s): %v", took, serr)
			return
		}
		e.say("Host cache: kept %d file(s), %s (%d unchanged) in %s", res.Files, mib(res.Bytes), res.Unchanged, took)
		if gerr != nil {
			e.say("Host cache: (the guest's tar ended with: %v)", gerr)
		}
		if res.SkipCount > 0 {
			e.say("Host cache: left out %d entr(ies) that are not plain files or have names not allowed (first: %s)", res.SkipCount, strings.Join(res.Skipped, "; "))
		}
		if res.Evicted.Files > 0 {
			e.say("Host cache: made room: %d older file(s), %s, removed", res.Evicted.Files, mib(res.Evicted.Bytes))
		}
	}
}

// cacheResult is the metrics' result label.
func cacheResult(hit bool, err error) string {
	switch {
	case errors.Is(err, hostcache.ErrProjectLimit):
		return "over_limit"
	case err != nil:
		return "error"
	case !hit:
		return "miss"
	}
	return "ok"
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
