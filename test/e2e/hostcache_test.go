//go:build e2e

package e2e

import (
	"archive/zip"
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// hostCacheRunner is a real runner without a distributed cache, its driver
// configured with a host cache in a directory of the test's (extra: more
// [cache] keys).
func hostCacheRunner(t *testing.T, extra string) (*realRunner, string) {
	t.Helper()
	rr, dir, _ := hostCacheRig(t, extra, 0)
	return rr, dir
}

// hostCacheChain is hostCacheRunner for jobs that run one after another:
// with a standby pool of idle tiny VMs (one for each job after the first),
// served, the next jobs' VMs boot while the first job runs (the other
// core), and the jobs claim them. The host cache is the run stage's
// either way (prepare never touches it), so the jobs take the same paths
// as cold ones; a job that finds no idle VM starts cold.
func hostCacheChain(t *testing.T, extra string, idle int) (*realRunner, string) {
	t.Helper()
	rr, dir, r := hostCacheRig(t, extra, idle)
	r.serve(t)
	return rr, dir
}

// hostCacheRig is hostCacheRunner with, for idle > 0, a standby pool of
// that many tiny VMs in the configuration (the caller starts the service),
// and the configuration edited by edits.
func hostCacheRig(t *testing.T, extra string, idle int, edits ...func(string) string) (*realRunner, string, *rig) {
	t.Helper()
	rr := newRealRunner(t)
	dir := filepath.Join(rr.r.userDir(t), "host-cache")
	r := rr.r.withConfig(t, func(s string) string {
		s += fmt.Sprintf("\n[cache]\ndir = %q\n%s", dir, extra)
		if idle > 0 {
			s = poolsvc.WithPool(s, "tiny", idle)
		}
		for _, edit := range edits {
			s = edit(s)
		}
		return s
	})
	rr.cfgPath, rr.noDistributedCache = r.cfgPath, true
	return rr, dir, r
}

// hostCacheFiles lists what the host cache keeps: regular files by path
// relative to dir, and anything else found (which must never be there).
func hostCacheFiles(t *testing.T, dir string) (files map[string]int64, other []string) {
	t.Helper()
	files = map[string]int64{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		switch {
		case d.IsDir():
		case d.Type().IsRegular():
			fi, err := d.Info()
			if err != nil {
				return err
			}
			files[rel] = fi.Size()
		default:
			other = append(other, rel+" ("+d.Type().String()+")")
		}
		return nil
	})
	if os.IsNotExist(err) {
		return files, nil
	}
	require.NoError(t, err)
	return files, other
}

// cacheZips are the cache archives among files (what the runner made).
func cacheZips(files map[string]int64) []string {
	var out []string
	for f := range files {
		if strings.HasSuffix(f, "/cache.zip") {
			out = append(out, f)
		}
	}
	return out
}

// TestHostCacheBetweenJobs: with [cache] dir set and no distributed cache,
// a cache archived by one job is restored in the next jobs of the same
// project, each in a fresh VM, and saved again by them: on hot-plugged
// disks (cache_via = "disk", the default, with cache.disk_min_mib = 0 for
// this small cache: a read-only one to restore, an
// empty one the guest writes its cache on to save) on every other image
// the rig configured (the Debian guest as root, the cloud-init guest as
// its user "debian", who uses the disks through sudo; the podman image,
// the Debian one plus a container runtime, only without the Debian one),
// and over SSH on the
// default image, configured with cache_via = "ssh". A job of another project
// on the same GitLab finds nothing of it; nothing goes to the S3 endpoint;
// no restore disk's volume outlives its job. The restoring jobs run at
// the same time, one runner each. The runners reach the fake GitLab, and
// the restoring jobs clone, by name over HTTPS (byNameOverHTTPS): on
// every image the guest resolves the name through the DHCP-given server
// and trusts the CA the runner hands its git and helper (what
// TestGitLabByNameOverHTTPS checks on the default image), in the same VM.
func TestHostCacheBetweenJobs(t *testing.T) {
	var def string
	rr, dir, _ := hostCacheRig(t, "disk_min_mib = 0\n", 0, func(s string) string {
		def = regexp.MustCompile(`(?m)^default_image = "([a-z0-9-]+)"`).FindStringSubmatch(s)[1]
		return strings.Replace(s, "[images."+def+"]\n", "[images."+def+"]\ncache_via = \"ssh\"\n", 1)
	})
	gitURL := byNameOverHTTPS(t, rr)
	cache := &jobapi.Cache{Key: "deps-v1", Paths: []string{"vendor/"}}
	// The jobs of project 1 clone the same repository: the runner derives
	// the project's cache directory from its URL.
	res := rr.runJobs(t, jobapi.Job{Name: "fill", Cache: cache, GitURL: gitURL, SHA: rr.sha,
		Script: []string{"mkdir -p vendor", "echo cached-$CI_JOB_ID > vendor/dep.txt", "head -c 3145728 /dev/urandom > vendor/blob"}})
	require.Equal(t, jobapi.StateSuccess, res[0].State, res[0].Trace)
	require.Contains(t, res[0].Trace, "Created cache")
	require.Regexp(t, `Host cache: kept 1 file\(s\), [0-9.]+ MiB \(0 unchanged\) over SSH`, res[0].Trace)

	// On the default image the job succeeds; on the others it is also
	// what TestRealRunnerImages was: the guest's git answers, keys arrive
	// the image's way, the script fails with 2 and still its cache is
	// archived and its artifacts uploaded by the guest's gitlab-runner.
	use := func(img string) jobapi.Job {
		j := jobapi.Job{Name: "use-" + img, Image: img, Cache: cache, GitURL: gitURL, SHA: rr.sha,
			Script: append(slices.Clone(httpsScript), `echo "restored: $(cat vendor/dep.txt) $(wc -c < vendor/blob)"`)}
		if img != def {
			ic, _ := rr.r.cfg.Image(img)
			j.Script = append(j.Script, "head -n1 /etc/os-release", "git --version", "echo key-injection-"+ic.KeyInjection+"-ok",
				"mkdir -p out", "echo built-on-"+img+" > out/r.txt", "exit 2")
			j.Artifacts = &jobapi.Artifacts{Paths: []string{"out/"}, When: "always"}
			j.Cache = &jobapi.Cache{Key: cache.Key, Paths: cache.Paths, When: "always"}
		}
		return j
	}
	other := &jobapi.Project{ID: 2, Namespace: "lve", Name: "other"}
	jobs := []jobapi.Job{use(def), {Name: "stranger", Cache: cache, Project: other,
		Script: []string{`if [ -e vendor/dep.txt ]; then echo "LEAKED: $(cat vendor/dep.txt)"; else echo "no-cache-here"; fi`}}}
	// The other images but the podman one when the Debian one is there:
	// the podman image is the Debian image (its recipe's base) plus a
	// container runtime, with the same user (root) and key injection
	// (smbios), so its job here took the Debian job's paths again, and a
	// third systemd guest booting beside the others slowed all of them
	// (each was ready after ~80 s instead of ~25 s on 2 cores).
	var others []string
	all := otherImages(t, rr.r)
	for _, img := range all {
		if img == "podman" && slices.Contains(all, "debian") {
			continue
		}
		others = append(others, img)
	}
	for _, img := range others {
		jobs = append(jobs, use(img))
	}
	byName := map[string]jobapi.Result{}
	for i, x := range rr.runJobsAtOnce(t, jobs...) {
		byName[jobs[i].Name] = x
	}
	for _, img := range append([]string{def}, others...) {
		x := byName["use-"+img]
		require.Regexp(t, `restored: cached-\d+ 3145728`, x.Trace, img)
		require.Contains(t, x.Trace, agentSaid, "%s: the guest agent runs the stages on every image", img)
		requireClonedByName(t, rr, x, img)
		if img == def {
			require.Equal(t, jobapi.StateSuccess, x.State, x.Trace)
		} else {
			require.Equal(t, jobapi.StateFailed, x.State, x.Trace)
			require.Equal(t, 2, x.ExitCode)
			ic, _ := rr.r.cfg.Image(img)
			require.Contains(t, x.Trace, "VM lve-", img)
			require.Contains(t, x.Trace, "gitlab-runner for the guest:", img)
			require.NotContains(t, x.Trace, "gitlab-runner is not on the guest's PATH", img)
			require.Contains(t, x.Trace, "SSH ready as "+ic.User+"@", img)
			require.Regexp(t, `(?m)^key-injection-`+ic.KeyInjection+`-ok`, x.Trace, img)
			require.Regexp(t, `(?m)^git version \d`, x.Trace, img)
			require.Contains(t, x.Trace, "Created cache", img)
			require.Equal(t, "built-on-"+img+"\n", zipFiles(t, x.Artifacts)["out/r.txt"], img)
		}
		how := "from a restore disk"
		if img == def {
			how = "over SSH"
		}
		require.Regexp(t, `Host cache: restored \d+ file\(s\), [0-9.]+ MiB, into /cache `+how, x.Trace, img)
		// Each saves again (pull-push).
		// Attached while the runner made its archive (disk_min_mib = 0),
		// and written in the direct layout by the guest agent from the
		// tools disk (one process, O_DIRECT; "by the guest in" where the
		// shell's way wrote it, "as a tar stream" where the layout could
		// not carry it), through sudo where the image's user is not root.
		// The host reads the volume's file (made readable to the
		// stages' group), not libvirt's stream.
		how = `from a scratch disk \(made during the script in [^)]*, written by the guest agent in [^,]*, read from the volume's file and deleted in `
		if img == def {
			how = "over SSH"
		}
		// Something came back: a file kept, or one the host already had
		// (same size and sha256: the disk carried the archive itself).
		require.Regexp(t, `Host cache: kept (?:[1-9]\d* file\(s\), [0-9.]+ MiB \(\d+|\d+ file\(s\), [0-9.]+ MiB \([1-9]\d*) unchanged\) `+how, x.Trace, img)
	}
	x := byName["stranger"]
	require.Equal(t, jobapi.StateSuccess, x.State, x.Trace)
	require.Contains(t, x.Trace, "Host cache: nothing cached for this project yet")
	require.Contains(t, x.Trace, "no-cache-here")
	require.NotContains(t, x.Trace, "LEAKED: cached", "the script's output, not its echoed command")
	require.Zero(t, rr.api.CacheObjects(), "no distributed cache: nothing went to S3")

	files, odd := hostCacheFiles(t, dir)
	require.Empty(t, odd)
	zips := cacheZips(files)
	require.NotEmpty(t, zips, "the archives are on the host: %v", files)
	projects := map[string]bool{}
	for _, z := range zips {
		parts := strings.Split(z, string(filepath.Separator))
		require.Equal(t, "projects", parts[0], z)
		projects[parts[1]] = true
	}
	require.Len(t, projects, 2, "one directory per project: %v", zips)
}

// TestHostCacheProtectedApart: GitLab keeps the caches of protected refs
// apart from the others' (a -protected or -non_protected suffix on each
// key, CI_COMMIT_REF_PROTECTED); so does the host cache, through the
// scratch disk (cache.disk_min_mib = 0: the admin tool's keep). A
// protected job saves; an unprotected job of the same project finds
// nothing of it, though its script looks for the protected key's archive,
// and what it then leaves in cache_dir (that archive, its bytes replaced,
// and a file of its own) never reaches the host: only its own key's
// archive is kept, in a cache of its own. The protected job's next run
// restores its archive, byte for byte as the first run kept it.
func TestHostCacheProtectedApart(t *testing.T) {
	rr, dir := hostCacheChain(t, "disk_min_mib = 0\n", 2)
	protected := func(on string) []jobapi.Variable {
		return []jobapi.Variable{{Key: "CI_COMMIT_REF_PROTECTED", Value: on, Public: true}}
	}
	paths := []string{"vendor/"}
	const archive = `/cache/$CI_PROJECT_PATH/deps-protected/cache.zip`
	res := rr.runJobs(t, jobapi.Job{Name: "protected-fill", Variables: protected("true"),
		Cache:  &jobapi.Cache{Key: "deps-protected", Paths: paths},
		Script: []string{"mkdir -p vendor", "echo protected-$CI_JOB_ID > vendor/dep.txt"}})
	require.Equal(t, jobapi.StateSuccess, res[0].State, res[0].Trace)
	require.Regexp(t, `Host cache: kept 1 file\(s\)`, res[0].Trace)
	files, odd := hostCacheFiles(t, dir)
	require.Empty(t, odd)
	zips := cacheZips(files)
	require.Len(t, zips, 1, "%v", files)
	require.Contains(t, zips[0], "/deps-protected/cache.zip")
	protPath := filepath.Join(dir, zips[0])
	kept, err := os.ReadFile(protPath)
	require.NoError(t, err)
	sum := fmt.Sprintf("%x", sha256.Sum256(kept))

	res = rr.runJobs(t, jobapi.Job{Name: "unprotected", Variables: protected("false"),
		Cache: &jobapi.Cache{Key: "deps-non_protected", Paths: paths},
		Script: []string{
			// "FOUND""-PROTECTED": the echoed command does not match.
			`if [ -e vendor/dep.txt ] || [ -e "` + archive + `" ]; then echo "FOUND""-PROTECTED"; ls -lR /cache; else echo "no-protected-cache-here"; fi`,
			"mkdir -p vendor && echo poison > vendor/dep.txt",
			`mkdir -p "$(dirname "` + archive + `")" && head -c 4096 /dev/urandom > "` + archive + `"`,
			"echo planted > /cache/planted.txt",
		}})
	require.Equal(t, jobapi.StateSuccess, res[0].State, res[0].Trace)
	require.Contains(t, res[0].Trace, "no-protected-cache-here")
	require.NotContains(t, res[0].Trace, "FOUND-PROTECTED")
	require.Contains(t, res[0].Trace, "Host cache: nothing cached for this project yet")
	require.Regexp(t, `Host cache: kept 1 file\(s\), [0-9.]+ MiB \(0 unchanged\) from a scratch disk`, res[0].Trace)
	require.Regexp(t, `Host cache: left out 2 entr\(ies\) that are not archives the runner's script names`, res[0].Trace)
	require.Regexp(t, `deps-protected/cache\.zip": not an archive the runner's script names`, res[0].Trace, "the protected key's name, left out")

	files, odd = hostCacheFiles(t, dir)
	require.Empty(t, odd)
	zips = cacheZips(files)
	require.Len(t, zips, 2, "the protected archive, and the unprotected job's own: %v", files)
	projects := map[string]string{}
	for _, z := range zips {
		parts := strings.Split(z, string(filepath.Separator))
		projects[parts[1]] = z
		require.NotContains(t, z, "planted")
	}
	require.Len(t, projects, 2, "two caches of the one project: %v", zips)
	for p, z := range projects {
		require.Equal(t, strings.HasSuffix(p, "-p"), strings.HasSuffix(z, "/deps-protected/cache.zip"), "%s", z)
	}
	after, err := os.ReadFile(protPath)
	require.NoError(t, err)
	require.True(t, bytes.Equal(kept, after), "the protected archive is untouched")

	res = rr.runJobs(t, jobapi.Job{Name: "protected-use", Variables: protected("true"),
		Cache:  &jobapi.Cache{Key: "deps-protected", Paths: paths, Policy: "pull"},
		Script: []string{`echo "restored: $(cat vendor/dep.txt)"`, `sha256sum "` + archive + `"`}})
	require.Equal(t, jobapi.StateSuccess, res[0].State, res[0].Trace)
	require.Regexp(t, `Host cache: restored 1 file\(s\)`, res[0].Trace)
	require.Regexp(t, `(?m)^restored: protected-\d+`, res[0].Trace)
	require.NotContains(t, res[0].Trace, "restored: poison")
	require.Regexp(t, `(?m)^`+sum+`\s`, res[0].Trace, "the archive the guest extracted is the one kept")
}

// TestHostCacheLimitAndHostileGuest: a job whose cache is above
// cache.project_limit_mib succeeds, its archive is not kept (the job log
// says why) and the project's earlier cache stays; links and FIFOs a job
// plants in cache_dir never reach the host. Both saves go through the
// scratch disk (cache.disk_min_mib = 0): what the guest wrote on it is
// checked as any stream of its.
func TestHostCacheLimitAndHostileGuest(t *testing.T) {
	rr, dir := hostCacheChain(t, "project_limit_mib = 1\ndisk_min_mib = 0\n", 1)
	small := &jobapi.Cache{Key: "small", Paths: []string{"vendor/"}}
	big := &jobapi.Cache{Key: "big", Paths: []string{"blob/"}}
	res := rr.runJobs(t,
		jobapi.Job{Name: "small", Cache: small, Script: []string{
			"mkdir -p vendor", "echo small > vendor/a.txt",
			// planted next to the runner's archives; the name with a
			// newline makes the guest write a tar stream (its direct
			// layout lists names by line), which carries the links and
			// the FIFO to the host's checks
			"ln -s /etc/passwd /cache/evil-link", "mkfifo /cache/evil-fifo", "mkdir -p /cache/d && ln -s / /cache/d/root",
			`touch "$(printf '/cache/evil\nname')"`,
		}},
		jobapi.Job{Name: "big", Cache: big, Script: []string{"mkdir -p blob", "head -c 3145728 /dev/urandom > blob/r.bin"}},
	)
	for i := range res {
		require.Equal(t, jobapi.StateSuccess, res[i].State, "a cache that is not kept never fails the job: %s", res[i].Trace)
	}
	require.Regexp(t, `Host cache: kept [1-9]\d* file.* from a scratch disk \(made during the script in [^)]*, written by the guest as a tar stream, in `, res[0].Trace, "the guest's tar on the scratch disk, attached while the runner made its archive")
	require.Regexp(t, `Host cache: left out [4-9] entr`, res[0].Trace, "two links, a FIFO, a name with a newline")
	require.Regexp(t, regexp.MustCompile(`Host cache: not kept .*project_limit_mib`), res[1].Trace)

	files, odd := hostCacheFiles(t, dir)
	require.Empty(t, odd, "no link, FIFO or device on the host")
	zips := cacheZips(files)
	require.Len(t, zips, 1, "only the small archive is kept: %v", files)
	require.Contains(t, zips[0], "small")
	for f := range files {
		require.NotContains(t, f, "evil")
	}
}

// TestHostCacheWarmVM: standby VMs boot before any project is known; a
// job that claims one still gets its project's cache (restored at its
// restore_cache stage), and keeps what it archives. The cache survives
// what a restart of the host's services does between two jobs (the pool
// service stopped and started, libvirtd restarted, a gc), and gc removes
// it once unused for cache.max_age.
func TestHostCacheWarmVM(t *testing.T) {
	rr, dir, r := hostCacheRig(t, "disk_min_mib = 0\n", 1)
	svc := r.serve(t)
	r.waitIdle(t, 1, 3*time.Minute)
	cache := &jobapi.Cache{Key: "warm-v1", Paths: []string{"vendor/"}}
	res := rr.runJobs(t, jobapi.Job{Name: "fill", Cache: cache, Script: []string{"mkdir -p vendor", "echo warm-$CI_JOB_ID > vendor/dep.txt"}})
	require.Equal(t, jobapi.StateSuccess, res[0].State, res[0].Trace)
	require.Regexp(t, warmRE, res[0].Trace, "a standby VM was claimed")
	require.Regexp(t, `Host cache: kept [1-9]\d* file.* from a scratch disk`, res[0].Trace, "hot-plugged into the claimed standby")

	// The host's services restart between the jobs.
	r.waitIdle(t, 1, 3*time.Minute)
	_, err := svc.Stop(poolsvc.StopWait)
	require.NoError(t, err)
	if os.Getenv("LVE_E2E_ALLOW_LIBVIRTD_RESTART") != "" {
		restartLibvirtd(t)
		r.reconnect(t, rr.r)
	}
	gc := func() string {
		out, err := r.admin("gc").CombinedOutput()
		require.NoError(t, err, "%s", out)
		return string(out)
	}
	r.serve(t)
	r.waitIdle(t, 1, 3*time.Minute)
	gc()

	res = rr.runJobs(t, jobapi.Job{Name: "use", Cache: cache, Script: []string{`echo "restored: $(cat vendor/dep.txt)"`}})
	require.Equal(t, jobapi.StateSuccess, res[0].State, res[0].Trace)
	require.Regexp(t, warmRE, res[0].Trace, "a standby VM was claimed")
	require.Regexp(t, `Host cache: restored \d+ file.* from a restore disk`, res[0].Trace, "hot-plugged into the claimed standby")
	require.Regexp(t, `restored: warm-\d+`, res[0].Trace)

	// Unused for longer than cache.max_age (720h by default): gc removes it.
	project, err := hostcache.ProjectID(strings.TrimSuffix(rr.api.URL(), "/"), 1, false)
	require.NoError(t, err)
	files, _ := hostCacheFiles(t, filepath.Join(dir, "projects", project))
	require.NotEmpty(t, cacheZips(files), "the project's cache: %v", files)
	old := time.Now().Add(-721 * time.Hour)
	require.NoError(t, os.Chtimes(filepath.Join(dir, "projects", project, "last-use"), old, old))
	require.Contains(t, gc(), project)
	_, err = os.Stat(filepath.Join(dir, "projects", project))
	require.ErrorIs(t, err, os.ErrNotExist, "gc removed the cache unused for cache.max_age")
}

// TestHostCacheTwoJobsAtOnce: two jobs of one project archive the same key
// at the same time (two runners): both pass, and the host keeps one whole
// archive, of one of the two jobs, never a mix.
func TestHostCacheTwoJobsAtOnce(t *testing.T) {
	rr, dir := hostCacheRunner(t, "")
	cache := &jobapi.Cache{Key: "shared", Paths: []string{"vendor/"}}
	fill := func(tag string) jobapi.Job {
		return jobapi.Job{Name: "fill-" + tag, Cache: cache, Script: []string{
			"mkdir -p vendor", "head -c 2097152 /dev/urandom > vendor/blob", "echo " + tag + " > vendor/who"}}
	}
	ids := []int64{rr.api.Enqueue(fill("a")), rr.api.Enqueue(fill("b"))}
	w1, w2 := rr.start(t, 1), rr.start(t, 1)
	res := append(rr.results(t, w1, ids[:0]), rr.results(t, w2, ids)...)
	for i := range res {
		require.Equal(t, jobapi.StateSuccess, res[i].State, res[i].Trace)
		require.Regexp(t, `Host cache: kept [1-9]\d* file`, res[i].Trace)
	}
	files, odd := hostCacheFiles(t, dir)
	require.Empty(t, odd)
	zips := cacheZips(files)
	require.Len(t, zips, 1, "one archive for the key: %v", files)
	b, err := os.ReadFile(filepath.Join(dir, zips[0]))
	require.NoError(t, err)
	z, err := zip.NewReader(bytes.NewReader(b), int64(len(b)))
	require.NoError(t, err, "the kept archive is whole")
	var who string
	for _, f := range z.File {
		if strings.HasSuffix(f.Name, "vendor/who") {
			rc, err := f.Open()
			require.NoError(t, err)
			w, err := io.ReadAll(rc)
			require.NoError(t, err)
			who = strings.TrimSpace(string(w))
		}
	}
	require.Contains(t, []string{"a", "b"}, who, "one of the two jobs' archive")
}

// TestHostCacheEvictsLeastRecentlyUsed: three projects' caches under a
// total limit that holds two: the third save removes the project used
// longest ago, and the job log says room was made.
func TestHostCacheEvictsLeastRecentlyUsed(t *testing.T) {
	rr, dir := hostCacheChain(t, "project_limit_mib = 1\ntotal_limit_mib = 1\n", 2)
	cache := &jobapi.Cache{Key: "k", Paths: []string{"vendor/"}}
	job := func(id int64, name string) jobapi.Job {
		return jobapi.Job{Name: name, Cache: cache, Project: &jobapi.Project{ID: id, Namespace: "lve", Name: name},
			Script: []string{"mkdir -p vendor", "[ -e vendor/r ] && echo FOUND-CACHE; head -c 409600 /dev/urandom > vendor/r"}}
	}
	res := rr.runJobs(t, job(11, "p-a"), job(12, "p-b"), job(13, "p-c"))
	for i := range res {
		require.Equal(t, jobapi.StateSuccess, res[i].State, res[i].Trace)
	}
	require.Contains(t, res[2].Trace, "Host cache: made room")
	files, _ := hostCacheFiles(t, dir)
	require.Len(t, cacheZips(files), 2, "two projects' caches fit: %v", files)
	a, err := hostcache.ProjectID(strings.TrimSuffix(rr.api.URL(), "/"), 11, false)
	require.NoError(t, err)
	for _, z := range cacheZips(files) {
		require.NotContains(t, z, a, "p-a, used longest ago, was evicted")
	}
}

// TestFaultSIGKILLDuringCacheSave: a run stage, the job's connection holder
// or a cleanup (a cancelled job's, which destroys the VM) killed while the
// run stage keeps a job's cache leaves no part of it visible: the project
// has its whole new archive or none, and the next save works and clears
// what a killed one staged. The save goes through a scratch disk (the
// default cache_via): the kill lands while the guest writes the disk or
// the host stages what is on it. (prepare never touches the host cache:
// the run stage restores and saves.)
func TestFaultSIGKILLDuringCacheSave(t *testing.T) {
	base := setup(t)
	dir := filepath.Join(base.userDir(t), "host-cache")
	r := base.withConfig(t, func(s string) string { return s + fmt.Sprintf("\n[cache]\ndir = %q\n", dir) })
	const size = 64 << 20
	// The runner's archive_cache stage makes an archive (64 MiB: long
	// enough a copy to be killed in).
	archive := fmt.Sprintf("#!/usr/bin/env bash\n# gitlab-runner cache-archiver (stand-in)\nmkdir -p /cache/lve/p/k && head -c %d /dev/urandom > /cache/lve/p/k/cache.zip\n", size)
	// The three subtests' jobs (projects 77, 78 and 79), prepared at the
	// same time up front (one vCPU each, the host has two cores; prepare
	// never touches the host cache).
	jobs := map[int]*stageRunner{}
	for _, projectID := range []int{77, 78, 79} {
		s := newStageRunner(t, r)
		// A payload with a project, as GitLab sends it.
		id := nextJobID()
		payload := fmt.Sprintf(`{"id":%d,"token":"glcbt-e2e-secret","runner_info":{"timeout":3600},"image":{"name":""},`+
			`"job_info":{"project_id":%d},"variables":[{"key":"CI_SERVER_URL","value":"http://gitlab.example"}]}`, id, projectID)
		require.NoError(t, os.WriteFile(filepath.Join(s.dir, "response.json"), []byte(payload), 0o600))
		for i, e := range s.env {
			if strings.HasPrefix(e, "CUSTOM_ENV_CI_JOB_ID=") {
				s.env[i] = fmt.Sprintf("CUSTOM_ENV_CI_JOB_ID=%d", id)
			}
		}
		jobs[projectID] = s
		// Whatever a subtest got to, its job is cleaned up (again: a
		// cleanup of a cleaned-up job does nothing).
		t.Cleanup(func() { s.run(t, "cleanup") })
	}
	prepareTogether(t, jobs[77], jobs[78], jobs[79])
	saving := func(t *testing.T, projectID int) (*stageRunner, *running) {
		s := jobs[projectID]
		rn := s.start(t, "run", writeScript(t, s, archive), "archive_cache")
		scratch := vm.ScratchVolume(s.name(t))
		waitFor(t, 2*time.Minute, "the save under way: the guest writing its scratch disk, or the host staging", func() bool {
			// Written to, not only there: the disk may be attached while
			// the runner still makes its archive.
			if r.volumeAllocated(scratch) > 0 {
				return true
			}
			entries, _ := os.ReadDir(filepath.Join(dir, "stage"))
			for _, e := range entries {
				if f, _ := os.ReadDir(filepath.Join(dir, "stage", e.Name())); len(f) > 1 {
					return true // its lock and a staged file
				}
			}
			return false
		})
		return s, rn
	}
	// wholeOrNone: what the host keeps of the project is the whole new
	// archive, or nothing; the stage's log says it was kept only when it
	// was, and, unless the stage itself was killed (the admin tool's save
	// from the scratch disk may still finish then), says so when it was.
	wholeOrNone := func(t *testing.T, projectID int, log string, stageKilled bool) {
		project, err := hostcache.ProjectID("http://gitlab.example", int64(projectID), false)
		require.NoError(t, err)
		files, odd := hostCacheFiles(t, filepath.Join(dir, "projects", project))
		require.Empty(t, odd)
		zips := cacheZips(files)
		for _, z := range zips {
			require.Equal(t, int64(size), files[z], "no half archive is visible: %v", files)
		}
		switch {
		case len(zips) == 0:
			require.NotContains(t, log, "Host cache: kept")
		case !stageKilled:
			require.Contains(t, log, "Host cache: kept 1 file")
		}
	}

	t.Run("run stage", func(t *testing.T) {
		s, rn := saving(t, 77)
		require.NoError(t, syscall.Kill(-rn.cmd.Process.Pid, syscall.SIGKILL))
		<-rn.done
		figures.fault()
		wholeOrNone(t, 77, rn.out.String(), true)

		// The next save (a small archive) is kept, and clears the killed one's staging.
		small := "#!/usr/bin/env bash\n# gitlab-runner cache-archiver (stand-in)\nrm -rf /cache/lve && mkdir -p /cache/lve/p/k && echo small > /cache/lve/p/k/cache.zip\n"
		res := s.runScript(t, "archive_cache", small)
		require.Equal(t, 0, res.code, res.stderr)
		require.Regexp(t, `Host cache: kept 1 file.* over SSH`, res.stdout, "below cache.disk_min_mib (16 MiB): no disk")
		files, _ := hostCacheFiles(t, filepath.Join(dir, "projects"))
		require.Len(t, cacheZips(files), 1)
		for f, size := range files {
			if strings.HasSuffix(f, "cache.zip") {
				require.Equal(t, int64(6), size, "the small archive, whole")
			}
		}
		// What is left in staging is at most the reservation of the killed
		// save's scratch disk, whose volume lives as long as the VM.
		reserved := "reserve-" + s.name(t)
		staged, _ := os.ReadDir(filepath.Join(dir, "stage"))
		for _, e := range staged {
			require.Equal(t, reserved, e.Name(), "the killed save's staging is gone")
		}
		require.Equal(t, 0, s.run(t, "cleanup").code)
		waitFor(t, 2*time.Minute, "the scratch disk's reservation goes with the VM", func() bool {
			_, err := os.Stat(filepath.Join(dir, "stage", reserved))
			return errors.Is(err, os.ErrNotExist)
		})
	})

	t.Run("connection holder", func(t *testing.T) {
		s, rn := saving(t, 78)
		require.NoError(t, syscall.Kill(s.holderPID(t), syscall.SIGKILL))
		res := rn.wait(t, 3*time.Minute)
		figures.fault()
		// The stage's script had ended (the save follows it): its exit
		// stands; the save has a connection of its own and goes on.
		figures.class(res.code, 0)
		require.Equal(t, 0, res.code, res.stderr)
		require.Contains(t, res.stdout, "Host cache: kept 1 file", "the save does not use the holder's connection")
		wholeOrNone(t, 78, res.stdout, false)
		require.Equal(t, 0, s.run(t, "cleanup").code)
	})

	t.Run("cleanup", func(t *testing.T) {
		s, rn := saving(t, 79)
		name := s.name(t)
		// A cleanup SIGKILLed at its start (it takes milliseconds: the
		// kill lands before, during or after its work), then a whole one:
		// the VM goes while the cache is copied out of it.
		cl := s.start(t, "cleanup")
		if err := syscall.Kill(-cl.cmd.Process.Pid, syscall.SIGKILL); err != nil {
			require.ErrorIs(t, err, syscall.ESRCH)
		}
		<-cl.done
		require.Equal(t, 0, s.run(t, "cleanup").code, "a second cleanup finishes the killed one's work")
		waitFor(t, time.Minute, "the VM gone", func() bool { _, active := r.domainState(name); return !active })
		select {
		case <-rn.done:
			t.Log("the copy ended before the VM did")
		default:
		}
		res := rn.wait(t, 3*time.Minute)
		figures.fault()
		// The script had ended with 0 before its VM went: the stage's
		// exit stands, and the cache is not kept (unless the copy ended
		// before the VM did, as on a fast host).
		figures.class(res.code, 0)
		require.Equal(t, 0, res.code, res.stderr)
		wholeOrNone(t, 79, res.stdout, false)
	})
}
