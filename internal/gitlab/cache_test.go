package gitlab

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// Only the runner's cache sub-stages whose scripts call its cache helper
// copy anything: jobs without cache: (and saves with policy pull) pay
// nothing.
func TestCacheOpOf(t *testing.T) {
	for _, tc := range []struct {
		stage, script string
		want          cacheOp
	}{
		{"restore_cache", "gitlab-runner cache-extractor --file ../cache.zip", cacheRestore},
		{"restore_cache", "echo nothing to restore", cacheNone},
		{"archive_cache", "gitlab-runner cache-archiver --file ../cache.zip", cacheSave},
		{"archive_cache_on_failure", "gitlab-runner cache-archiver --file x", cacheSave},
		{"archive_cache", "", cacheNone},
		{"build_script", "gitlab-runner cache-archiver", cacheNone},
		{"step_script", "gitlab-runner cache-extractor", cacheNone},
	} {
		require.Equal(t, tc.want, cacheOpOf(tc.stage, []byte(tc.script)), "%s: %q", tc.stage, tc.script)
	}
}

// The project comes from the payload (GitLab's job_info.project_id and its
// own CI_SERVER_URL, the first entry), never from a variable the job sets;
// without a payload, or with the host cache off for the image, there is
// no store.
func TestHostCacheIdentity(t *testing.T) {
	dir := t.TempDir()
	payload := `{"id":5,"job_info":{"project_id":42},"variables":[` +
		`{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"},` +
		`{"key":"CI_PROJECT_ID","value":"42"},` +
		// the job's own definitions come after GitLab's and lose
		`{"key":"CI_SERVER_URL","value":"https://evil.example.com"},{"key":"CI_PROJECT_ID","value":"7"}]}`
	path := filepath.Join(dir, "response.json")
	require.NoError(t, os.WriteFile(path, []byte(payload), 0o600))
	j, err := ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": path}), false, func(string) {})
	require.NoError(t, err)
	require.Equal(t, int64(42), j.ProjectID)
	require.Equal(t, "https://gitlab.example.com", j.Server)
	require.Equal(t, "https://gitlab.example.com", j.ServerURL)
	require.False(t, j.Protected)

	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(dir, "c") + "\"\nimages = [\"a\"]\n[images.a]\nbase = \"/a\"\n[images.b]\nbase = \"/b\"\n"))
	require.NoError(t, err)
	jb := &job{cfg: cfg, job: j}
	store, project, why := storeOf(jb, cfg.Images["a"])
	require.NotNil(t, store, why)
	require.Equal(t, cfg.Cache.ProjectLimit(), store.ProjectLimit)

	// the same project of another instance, and another project: other directories
	other := *j
	other.ServerURL = "https://evil.example.com"
	_, p2, _ := storeOf(&job{cfg: cfg, job: &other}, cfg.Images["a"])
	other = *j
	other.ProjectID = 7
	_, p3, _ := storeOf(&job{cfg: cfg, job: &other}, cfg.Images["a"])
	require.NotEqual(t, project, p2)
	require.NotEqual(t, project, p3)
	// the same project's protected refs: another directory
	other = *j
	other.Protected = true
	_, p4, _ := storeOf(&job{cfg: cfg, job: &other}, cfg.Images["a"])
	require.NotEqual(t, project, p4)

	// image b is not in cache.images: nothing, and nothing said
	store, _, why = storeOf(jb, cfg.Images["b"])
	require.Nil(t, store)
	require.Empty(t, why)

	// no payload: the project is not known, the job log says so
	env := *j
	env.FromPayload = false
	store, _, why = storeOf(&job{cfg: cfg, job: &env}, cfg.Images["a"])
	require.Nil(t, store)
	require.Contains(t, why, "not known from the runner's payload")
}

// recordedScript is the script GitLab Runner 17.9.3 hands the run stage for
// stage (restore_cache or archive_cache: testdata/README.md), of a job
// whose cache key is key (the recording's deps-protected replaced).
func recordedScript(t *testing.T, stage, key string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "gitlab-runner-17.9.3-"+stage+".script"))
	require.NoError(t, err)
	require.Contains(t, string(b), "deps-protected/cache.zip")
	return bytes.ReplaceAll(b, []byte("deps-protected"), []byte(key))
}

// The archives a script names are its cache helper's --file paths under
// cache_dir, however the runner quotes them; nothing else in it (the
// job's variables, other paths under /cache, a name that does not end in
// the runner's archive file) is one.
func TestNamedArchives(t *testing.T) {
	for _, stage := range []string{"restore_cache", "archive_cache"} {
		require.Equal(t, []string{"lve/selftest/deps-protected/cache.zip"}, namedArchives(recordedScript(t, stage, "deps-protected")), stage)
		require.Equal(t, []string{"lve/selftest/deps-non_protected/cache.zip"}, namedArchives(recordedScript(t, stage, "deps-non_protected")), stage)
	}
	for _, tc := range []struct {
		script string
		want   []string
	}{
		// older runners' quoting, fallback keys, an absolute path
		{`'/opt/lve-tools/bin/gitlab-runner' 'cache-extractor' '--file' '../../../../cache/lve/demo/deps-v1-protected/cache.zip' '--timeout' '10'
'/opt/lve-tools/bin/gitlab-runner' 'cache-extractor' '--file' '../../../../cache/lve/demo/fallback-protected/cache.zip' '--timeout' '10'`,
			[]string{"lve/demo/deps-v1-protected/cache.zip", "lve/demo/fallback-protected/cache.zip"}},
		{`: | eval $'$\'gitlab-runner\' cache-archiver --file $\'../../cache/ns/p/k 1/cache.zip\' --timeout 10\n'`, nil},
		{`: | eval $'gitlab-runner cache-archiver --file $\'/cache/ns/p/k-protected/cache.zip\'\n'`, []string{"ns/p/k-protected/cache.zip"}},
		{"mkdir -p /cache/lve/p/k && head -c 9 /dev/urandom > /cache/lve/p/k/cache.zip\n", []string{"lve/p/k/cache.zip"}},
		{"gitlab-runner cache-extractor --file elsewhere.zip", nil},
		{"export X=/cache/ns/p/evil.txt\ncp a /cache/cache.zip\n", nil},
		{"--file ../cache/cache/ns/k/cache.zip", []string{"cache/ns/k/cache.zip"}},
	} {
		require.Equal(t, tc.want, namedArchives([]byte(tc.script)), "%q", tc.script)
	}
}

// readPayload is the job of a payload (JSON) as the stages read it.
func readPayload(t *testing.T, payload string) *Job {
	t.Helper()
	path := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(path, []byte(payload), 0o600))
	j, err := ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": path}), false, func(string) {})
	require.NoError(t, err)
	return j
}

// A job is protected when GitLab says so: a cache key with its
// "-protected" suffix, or its own CI_COMMIT_REF_PROTECTED (the first
// entry: a job's own definition after it does not count). The instance
// is CI_SERVER_URL with its path: two GitLabs under one host are two.
func TestJobProtectedAndInstance(t *testing.T) {
	for _, tc := range []struct {
		cache, vars string
		want        bool
	}{
		{`[{"key":"deps-protected"}]`, ``, true},
		{`[{"key":"deps-non_protected"}]`, ``, false},
		{`[{"key":"deps"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"true"}`, true},
		{`[]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"false"},{"key":"CI_COMMIT_REF_PROTECTED","value":"true"}`, false},
		{`[{"key":"deps-non_protected"},{"key":"other-non_protected"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"false"}`, false},
		{`null`, ``, false},
		// A key is the job's to choose: it never grants protection GitLab
		// does not (separate caches off, an unprotected ref).
		{`[{"key":"mine-protected"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"false"}`, false},
		{`[{"key":"deps-non_protected"}]`, `,{"key":"CI_COMMIT_REF_PROTECTED","value":"true"}`, false},
	} {
		j := readPayload(t, `{"id":5,"job_info":{"project_id":42},"cache":`+tc.cache+`,"variables":[{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"}`+tc.vars+`]}`)
		require.Equal(t, tc.want, j.Protected, "cache %s, variables %s", tc.cache, tc.vars)
	}

	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(t.TempDir(), "c") + "\"\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	projects := map[string]bool{}
	for _, u := range []string{"https://example.com/gitlab-a", "https://example.com/gitlab-b/", "https://user@example.com"} {
		j := readPayload(t, `{"id":5,"job_info":{"project_id":42},"variables":[{"key":"CI_SERVER_URL","value":"`+u+`"}]}`)
		require.Equal(t, "https://example.com", j.Server, "the logs' server: scheme and host")
		_, p, why := storeOf(&job{cfg: cfg, job: j}, cfg.Images["a"])
		require.NotEmpty(t, p, why)
		projects[p] = true
	}
	require.Len(t, projects, 3, "each instance's path is part of its identity (the third has none)")
	j := readPayload(t, `{"id":5,"job_info":{"project_id":42},"variables":[{"key":"CI_SERVER_URL","value":"https://example.com/gitlab-b/?x#y"}]}`)
	require.Equal(t, "https://example.com/gitlab-b", j.ServerURL, "no query, fragment or trailing slash")
}

// cacheGuest is an SSH server whose "guest" runs the host cache's fixed
// commands with cache_dir at a directory of the test's (the login shell
// puts dir where the commands say /cache); files are what cache_dir holds
// at first.
func cacheGuest(t *testing.T, files map[string]string) (*sshexec.Client, string) {
	t.Helper()
	dir := t.TempDir()
	for name, body := range files {
		p := filepath.Join(dir, "cache", name)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
	}
	login := filepath.Join(dir, "login")
	// The test's own commands (restoreCommand, saveCommand): fixed text
	// with /cache in it.
	require.NoError(t, os.WriteFile(login, []byte("#!/bin/sh\n[ \"$1\" = -c ] || exit 2\nc=$(printf '%s' \"$2\" | sed \"s#"+guestCacheDir+"#"+dir+"/cache#g\")\nexec sh -c \"$c\"\n"), 0o755))
	srv := sshtest.Start(t)
	srv.SetLogin(login)
	c, err := sshexec.Dial(context.Background(), sshexec.Target{Addr: srv.Addr(), User: "root", Signer: srv.ClientSigner(), HostKey: srv.HostKey()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c, filepath.Join(dir, "cache")
}

// The host cache keeps a project's protected and unprotected caches
// apart, over the real save and restore paths (SSH here; the scratch
// disk's keep takes the same filter), with the scripts GitLab Runner
// 17.9.3 writes: a protected job's archive is kept; a job of an
// unprotected branch of the same project finds nothing of it, and what it
// leaves in cache_dir (the protected key's archive with its own bytes
// among it) never replaces it: only its own key's archive is kept, in its
// own cache; the protected job's next run restores its archive as it was.
func TestHostCacheKeepsProtectedApart(t *testing.T) {
	ctx := context.Background()
	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(t.TempDir(), "c") + "\"\n[images.a]\nbase = \"/a\"\ncache_via = \"ssh\"\n"))
	require.NoError(t, err)
	jobOf := func(key, protected string) *job {
		return &job{cfg: cfg, job: readPayload(t, `{"id":5,"job_info":{"project_id":42},"cache":[{"key":"`+key+`"}],"variables":[`+
			`{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"},{"key":"CI_COMMIT_REF_PROTECTED","value":"`+protected+`"}]}`)}
	}
	xfer := func(j *job, c *sshexec.Client) *cachexfer.Transfer {
		tr, why := hostCache(Env{}, j, "vm-1", cfg.Images["a"], clientDialer{c})
		require.NotNil(t, tr, why)
		return tr
	}
	protJob, unprotJob := jobOf("deps-protected", "true"), jobOf("deps-non_protected", "false")
	const protArchive = "lve/selftest/deps-protected/cache.zip"
	const unprotArchive = "lve/selftest/deps-non_protected/cache.zip"
	protBytes := "PK protected archive " + strings.Repeat("p", 1000)

	// The protected job saves; a file the guest put beside its archive is
	// left out.
	c, _ := cacheGuest(t, map[string]string{protArchive: protBytes, "planted.txt": "x"})
	s := xfer(protJob, c).Save(ctx, namedArchives(recordedScript(t, "archive_cache", "deps-protected")), nil)
	require.NoError(t, s.DialErr)
	require.NoError(t, s.GuestErr)
	require.NoError(t, s.StoreErr)
	require.Equal(t, " over SSH", s.How)
	require.EqualValues(t, 1, s.Result.Files)
	require.EqualValues(t, 1, s.Result.SkipCount, "%v", s.Result.Skipped)
	require.Contains(t, s.Result.Skipped[0], "planted.txt")

	// The unprotected job: another cache; its restore finds nothing, even
	// where its script names the protected key's archive.
	require.NotEqual(t, xfer(protJob, nil).Project(), xfer(unprotJob, nil).Project())
	restoreScript := append(recordedScript(t, "restore_cache", "deps-non_protected"), recordedScript(t, "restore_cache", "deps-protected")...)
	c, guestDir := cacheGuest(t, nil)
	r := xfer(unprotJob, c).Restore(ctx, namedArchives(restoreScript))
	require.NoError(t, r.Err)
	require.True(t, r.NoneWanted && r.ProjectEmpty, "%+v", r)
	_, err = os.Stat(filepath.Join(guestDir, protArchive))
	require.ErrorIs(t, err, os.ErrNotExist)
	// It leaves the protected key's archive, poisoned, in its cache_dir,
	// beside its own.
	c, _ = cacheGuest(t, map[string]string{protArchive: "poison", unprotArchive: "its own", "lve/selftest/x/cache.zip": "other"})
	s = xfer(unprotJob, c).Save(ctx, namedArchives(recordedScript(t, "archive_cache", "deps-non_protected")), nil)
	require.NoError(t, s.GuestErr)
	require.NoError(t, s.StoreErr)
	require.EqualValues(t, 1, s.Result.Files, "its own archive only")
	require.EqualValues(t, 2, s.Result.SkipCount, "%v", s.Result.Skipped)

	// The protected job's next run restores its own archive, untouched.
	c, guestDir = cacheGuest(t, nil)
	r = xfer(protJob, c).Restore(ctx, namedArchives(recordedScript(t, "restore_cache", "deps-protected")))
	require.NoError(t, r.Err)
	require.EqualValues(t, 1, r.Files)
	require.EqualValues(t, len(protBytes), r.Bytes)
	require.Equal(t, "over SSH", r.How)
	got, err := os.ReadFile(filepath.Join(guestDir, protArchive))
	require.NoError(t, err)
	require.Equal(t, protBytes, string(got))
	entries, err := os.ReadDir(filepath.Join(guestDir, "lve", "selftest"))
	require.NoError(t, err)
	require.Len(t, entries, 1, "nothing else of the project's caches reaches the guest")
}

// clientDialer hands out one connection (cacheGuest's).
type clientDialer struct{ c *sshexec.Client }

func (d clientDialer) Take(context.Context) (*state.Machine, *sshexec.Client, error) {
	if d.c == nil {
		return nil, nil, errors.New("no connection in this test")
	}
	return nil, d.c, nil
}

// storeOf is the host cache's store and project hostCache names for j on
// img (nil: none), and why not.
func storeOf(j *job, img *config.Image) (*hostcache.Store, string, string) {
	tr, why := hostCache(Env{}, j, "vm-1", img, nil)
	if tr == nil {
		return nil, "", why
	}
	return tr.Store(), tr.Project(), why
}

// A restore_cache or archive_cache script that names no archive copies
// nothing (never the project's whole cache), and says so in the job log,
// before any connection to the guest is made.
func TestRunCacheNamesNothing(t *testing.T) {
	cfg, err := config.Parse([]byte("default_image = \"a\"\n[cache]\ndir = \"" + filepath.Join(t.TempDir(), "c") + "\"\n[images.a]\nbase = \"/a\"\n"))
	require.NoError(t, err)
	j := &job{cfg: cfg, job: readPayload(t, `{"id":5,"job_info":{"project_id":42},"variables":[{"key":"CI_SERVER_URL","value":"https://gitlab.example.com"}]}`)}
	store, project, _ := storeOf(j, cfg.Images["a"])
	_, err = store.Save(context.Background(), project, bytes.NewReader(tarOf(t, map[string]string{"lve/selftest/k/cache.zip": "z"})), hostcache.All)
	require.NoError(t, err)
	var out bytes.Buffer
	e := Env{Stdout: &out}
	// j.m is nil: a connection attempt would panic.
	runCache(context.Background(), e, j, "vm-1", cfg.Images["a"], cacheRestore, []byte("gitlab-runner cache-extractor --file elsewhere.zip"), nil)
	require.Contains(t, out.String(), "Host cache: nothing restored: the runner's restore_cache script names no cache archive")
	out.Reset()
	runCache(context.Background(), e, j, "vm-1", cfg.Images["a"], cacheSave, []byte("gitlab-runner cache-archiver --file elsewhere.zip"), nil)
	require.Contains(t, out.String(), "Host cache: nothing kept: the runner's archive_cache script names no cache archive")
}

// tarOf is a tar stream of files.
func tarOf(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, body := range files {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))}))
		_, err := tw.Write([]byte(body))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}
