package gitlab

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// The host cache (docs/caching.md), the runner's side of it: the runner
// keeps a job's cache archives under cache_dir in the guest (no
// distributed cache configured). Before the runner's restore_cache
// sub-stage extracts them, the project's archives the script names go
// from the host into the guest's cache_dir; after archive_cache (or
// archive_cache_on_failure) made them, those of the guest's cache_dir come
// back to the host. Which stage is a cache stage, which archives the
// runner's script names and what the job log says are decided here; the
// copies themselves are internal/cachexfer's. A cache that cannot be
// restored or kept never fails the job: the job log says why.

// guestCacheDir is cache_dir in the guest (the config stage says so).
const guestCacheDir = cachexfer.GuestCacheDir

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
// job log, "" when the host cache is simply off for the image). The
// project's cache is that of its protected refs or of its other refs, as

// hostCache is the transfer of j's project's cache to and from machine
// name, reached through dial, or nil (with the reason for the job log, ""
// when the host cache is simply off for the image). The project comes
// from the runner's payload.
func hostCache(e Env, j *job, name string, img *config.Image, dial cachexfer.Dialer) (*cachexfer.Transfer, string) {
	if !cachexfer.On(j.cfg.Cache, img) {
		return nil, ""
	}
	if !j.job.FromPayload || j.job.ProjectID <= 0 || j.job.ServerURL == "" {
		return nil, "Host cache: not used: the job's project is not known from the runner's payload (JOB_RESPONSE_FILE)"
	}
	disk := e.CacheDisk
	if disk == nil {
		disk = cachexfer.LocalDisk(j.jobs, j.cfg.Cache)
	}
	t, err := cachexfer.New(cachexfer.Setup{
		Cache: j.cfg.Cache, Image: img, Machine: name,
		ServerURL: j.job.ServerURL, ProjectID: j.job.ProjectID, Protected: j.job.Protected,
		Disk: disk, Dial: dial, Log: j.log,
	})
	if err != nil {
		return nil, "Host cache: not used: " + err.Error()
	}
	return t, ""
}

// dialer is the job's way to its machine for the cache's copies (its
// session), or nil when the job has no machine handle.
func (j *job) dialer() cachexfer.Dialer {
	if j.vm == nil {
		return nil
	}
	return j.vm.Session()
}

// startScratch has the scratch disk for the save of archive_cache's script
// attached while the script runs, where that pays (cachexfer.Transfer.Early);
// nil if not. The caller drops it when the stage ends.
func startScratch(ctx context.Context, e Env, j *job, name string, img *config.Image, script []byte) *cachexfer.Early {
	t, _ := hostCache(e, j, name, img, j.dialer())
	return t.Early(ctx, namedArchives(script))
}

// runCache does op for the job's machine name on image img, saying in the
// job log what happened and how long it took.
// script is the stage's script (the runner's); early is the save's disk
// attached during it, or nil.
func runCache(ctx context.Context, e Env, j *job, name string, img *config.Image, op cacheOp, script []byte, early *cachexfer.Early) {
	t, why := hostCache(e, j, name, img, j.dialer())
	if t == nil {
		if why != "" {
			e.say("%s", why)
		}
		return
	}
	named := namedArchives(script)
	if len(named) == 0 {
		// Nothing named, nothing copied: never the project's whole cache.
		if op == cacheRestore {
			e.Report.Cache("restore", cachexfer.Result(false, nil), 0, 0)
			e.say("Host cache: nothing restored: the runner's restore_cache script names no cache archive under %s", guestCacheDir)
		} else {
			e.say("Host cache: nothing kept: the runner's archive_cache script names no cache archive under %s", guestCacheDir)
		}
		return
	}
	switch op {
	case cacheRestore:
		sayRestored(e, t.Restore(ctx, named))
	case cacheSave:
		saySaved(e, t.Save(ctx, named, early))
	}
}

// sayRestored writes a restore's lines in the job log and its metrics.
func sayRestored(e Env, r cachexfer.Restored) {
	if r.DialErr != nil {
		e.say("Host cache: no connection to the VM for the cache: %v", r.DialErr)
		return
	}
	for _, n := range r.Notes {
		e.say("Host cache: %s", n)
	}
	took := jobvm.Round(r.Took)
	switch {
	case r.NoneWanted && r.ProjectEmpty:
		e.Report.Cache("restore", cachexfer.Result(false, nil), 0, 0)
		e.say("Host cache: nothing cached for this project yet (%s)", took)
		return
	case r.NoneWanted:
		e.Report.Cache("restore", cachexfer.Result(false, nil), 0, 0)
		e.say("Host cache: nothing cached yet for the archive(s) the runner's script names (%s)", took)
		return
	}
	e.Report.Cache("restore", cachexfer.Result(r.Files > 0, r.Err), r.Bytes, 0)
	switch {
	case r.Err != nil:
		e.say("Host cache: restore failed after %s, the job goes on without it: %v", took, r.Err)
	case r.Files == 0:
		e.say("Host cache: nothing cached for this project yet (%s)", took)
	default:
		e.say("Host cache: restored %d file(s), %s, into %s %s in %s", r.Files, mib(r.Bytes), guestCacheDir, r.How, took)
	}
}

// saySaved writes a save's lines in the job log and its metrics.
func saySaved(e Env, s cachexfer.Saved) {
	if s.DialErr != nil {
		e.say("Host cache: no connection to the VM for the cache: %v", s.DialErr)
		return
	}
	for _, n := range s.Notes {
		e.say("Host cache: %s", n)
	}
	res := s.Result
	e.Report.Cache("save", cachexfer.Result(true, s.StoreErr), res.Bytes, res.Evicted.Bytes)
	took := jobvm.Round(s.Took)
	switch {
	case cachexfer.OverLimit(s.StoreErr):
		e.say("Host cache: not kept (%s): %v. The project's earlier cache stays; raise cache.project_limit_mib or cache less", took, s.StoreErr)
		return
	case s.StoreErr != nil:
		e.say("Host cache: not kept (%s): %v", took, s.StoreErr)
		return
	}
	e.say("Host cache: kept %d file(s), %s (%d unchanged)%s in %s", res.Files, mib(res.Bytes), res.Unchanged, s.How, took)
	if s.GuestErr != nil {
		e.say("Host cache: (the guest's tar ended with: %v)", s.GuestErr)
	}
	if res.SkipCount > 0 {
		e.say("Host cache: left out %d entr(ies) that are not archives the runner's script names, not plain files, or have names not allowed (first: %s)", res.SkipCount, strings.Join(res.Skipped, "; "))
	}
	if res.Evicted.Files > 0 {
		e.say("Host cache: made room: %d older file(s), %s, removed", res.Evicted.Files, mib(res.Evicted.Bytes))
	}
}

// archiveFile is the file the runner keeps a cache key's archive in
// (cache_dir/<project path>/<key>/cache.zip).
const archiveFile = "cache.zip"

// maxNamed bounds the archives taken from one script (the runner names
// one per cache: entry and fallback key).
const maxNamed = 64

// namedArchives are the cache archives the runner's script names, as
// paths relative to cache_dir: its cache-extractor's and cache-archiver's
// --file, a path through cache_dir (../../cache/<project>/<key>/cache.zip
// from the build directory, or absolute), however the runner quotes it.
// The script is searched, never run or parsed as a shell: each
// "/cache/" followed by a name up to a quote, a backslash, a blank or a
// shell operator, ending in "/cache.zip". A name quoted in a way this does
// not see is not copied: a cache miss, never someone else's archive.
func namedArchives(script []byte) []string {
	marker := []byte(guestCacheDir + "/")
	var out []string
	for rest := script; len(out) < maxNamed; {
		i := bytes.Index(rest, marker)
		if i < 0 {
			break
		}
		rest = rest[i+len(marker):]
		end := bytes.IndexAny(rest, "'\"\\ \t\r\n;&|()<>`$")
		if end < 0 {
			end = len(rest)
		}
		name := string(rest[:end])
		rest = rest[end:]
		if len(name) > len(archiveFile) && strings.HasSuffix(name, "/"+archiveFile) && len(name) <= 4096 && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
