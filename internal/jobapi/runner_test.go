package jobapi

import (
	"archive/zip"
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// These tests run jobs with a real, unmodified gitlab-runner (shell and
// Custom executors) against the fake API: $LVE_E2E_GITLAB_RUNNER or
// gitlab-runner on PATH; skipped without one unless LVE_E2E_REQUIRED is set.

func requireRunnerBinary(t *testing.T) string {
	t.Helper()
	bin, why := RunnerBinary()
	if bin == "" {
		if os.Getenv("LVE_E2E_REQUIRED") != "" {
			t.Fatalf("LVE_E2E_REQUIRED is set but %s", why)
		}
		t.Skip(why)
	}
	return bin
}

type rig struct {
	t        *testing.T
	srv      *Server
	bin      string
	home     string
	cacheDir string
	out      *sshtest.Buffer
}

func newRig(t *testing.T) *rig { return newRigWith(t, "") }

func newRigWith(t *testing.T, cacheBucket string) *rig {
	t.Helper()
	bin := requireRunnerBinary(t)
	// Not t.Context(): it ends before the cleanups, and the server must
	// outlive the runner, whose cleanup (registered later) runs first.
	srv, err := Start(context.Background(), Options{
		Listen: "127.0.0.1:0", CacheBucket: cacheBucket,
		Logger: slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, srv.Close()) })
	r := &rig{t: t, srv: srv, bin: bin, home: t.TempDir(), cacheDir: t.TempDir(), out: &sshtest.Buffer{}}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("gitlab-runner output:\n%s", r.out.String())
		}
	})
	return r
}

// runner starts run-single (shell executor) for maxBuilds jobs with a fresh
// builds directory; the test's end waits for it to exit.
func (r *rig) runner(maxBuilds int) { r.runnerWith(maxBuilds, nil) }

func (r *rig) runnerWith(maxBuilds int, custom *CustomConfig) {
	t := r.t
	o := RunSingleOptions{
		Binary: r.bin, URL: r.srv.URL(), Token: r.srv.RunnerToken(),
		Executor: "shell", BuildsDir: t.TempDir(), CacheDir: r.cacheDir,
		MaxBuilds: maxBuilds, WaitTimeout: 20 * time.Second,
		Env:    append([]string{"HOME=" + r.home, "PATH=" + os.Getenv("PATH"), "TMPDIR=" + t.TempDir()}, r.srv.CacheEnv()...),
		Stdout: r.out, Stderr: r.out,
	}
	if custom != nil {
		o.Executor, o.Custom = "custom", custom
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	done := make(chan error, 1)
	go func() { done <- RunSingle(ctx, o) }()
	t.Cleanup(func() {
		defer cancel()
		failed := t.Failed()
		if failed {
			cancel() // do not wait for jobs nobody waits for
		}
		select {
		case err := <-done:
			if !failed {
				assert.NoError(t, err, "gitlab-runner run-single")
			}
		case <-time.After(30 * time.Second):
			t.Error("gitlab-runner run-single did not exit")
		}
	})
}

func (r *rig) wait(id int64) Result {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(r.t.Context(), 45*time.Second)
	defer cancel()
	res, err := r.srv.Wait(ctx, id)
	require.NoError(r.t, err)
	r.srv.mu.Lock()
	mismatches := r.srv.jobs[id].mismatches
	r.srv.mu.Unlock()
	assert.Zero(r.t, mismatches, "the log received matches the runner's size and checksum")
	return res
}

func TestRealRunnerScriptsAndVariables(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	const secret = "s3cr3t-Value-9f2c"
	pass := r.srv.Enqueue(Job{Name: "pass", Stage: "test", Script: []string{"echo hello-from-job", `echo "job id $CI_JOB_ID"`}})
	fail := r.srv.Enqueue(Job{
		Name: "fail3", Stage: "test",
		Script:      []string{"echo about to exit 3", "exit 3"},
		AfterScript: []string{`echo "after_script ran, status=$CI_JOB_STATUS"`},
	})
	masked := r.srv.Enqueue(Job{
		Name: "masked", Stage: "test",
		Variables: []Variable{{Key: "MY_SECRET", Value: secret, Masked: true}},
		Script: []string{
			`echo "secret is $MY_SECRET"`, `echo "token is $CI_JOB_TOKEN"`,
		},
	})
	file := r.srv.Enqueue(Job{
		Name: "filevar", Stage: "test",
		Variables: []Variable{{Key: "MY_FILE", Value: "file-content-4711\n", File: true}},
		Script:    []string{`test -f "$MY_FILE"`, `echo "path $MY_FILE"`, `cat "$MY_FILE"`},
	})
	r.runner(4)

	t.Run("pass", func(t *testing.T) {
		res := r.wait(pass)
		assert.Equal(t, StateSuccess, res.State)
		assert.Equal(t, 0, res.ExitCode)
		assert.Contains(t, res.Trace, "hello-from-job")
		assert.Contains(t, res.Trace, "job id "+strconv.FormatInt(pass, 10))
		assert.Contains(t, res.Trace, "Job succeeded")
		assert.Positive(t, res.Duration)
		assert.Nil(t, res.Artifacts)
	})
	t.Run("exit 3", func(t *testing.T) {
		res := r.wait(fail)
		assert.Equal(t, StateFailed, res.State)
		assert.Equal(t, "script_failure", res.FailureReason)
		assert.Equal(t, 3, res.ExitCode)
		assert.Contains(t, res.Trace, "about to exit 3")
		assert.Contains(t, res.Trace, "after_script ran, status=failed")
	})
	t.Run("masked", func(t *testing.T) {
		res := r.wait(masked)
		assert.Equal(t, StateSuccess, res.State)
		assert.Contains(t, res.Trace, "secret is [MASKED]")
		assert.NotContains(t, res.Trace, secret)
		r.srv.mu.Lock()
		token := r.srv.jobs[masked].token
		r.srv.mu.Unlock()
		assert.NotContains(t, res.Trace, token, "the job token is masked")
		assert.Contains(t, res.Trace, "token is [MASKED]")
	})
	t.Run("file variable", func(t *testing.T) {
		res := r.wait(file)
		assert.Equal(t, StateSuccess, res.State, res.Trace)
		assert.Contains(t, res.Trace, "file-content-4711")
		assert.NotContains(t, lineWith(res.Trace, "path "), "file-content", "the variable holds a path")
	})
}

// Job 1 uploads artifacts and saves a cache; job 2 runs in another builds
// directory (a second runner sharing the cache directory), so what it reads
// must come from the artifacts download and the cache restore.
func TestRealRunnerArtifactsAndCache(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	producer := r.srv.Enqueue(Job{
		Name: "producer", Stage: "build",
		Script: []string{
			"mkdir -p out vendor",
			"echo artifact-payload-42 > out/a.txt",
			"echo cached-payload-7 > vendor/c.txt",
		},
		Artifacts: &Artifacts{Paths: []string{"out/"}, ExpireIn: "1 hour"},
		Cache:     &Cache{Key: "deps", Paths: []string{"vendor/"}},
	})
	r.runner(1)
	res := r.wait(producer)
	require.Equal(t, StateSuccess, res.State, res.Trace)
	require.NotNil(t, res.Artifacts)
	zr, err := zip.NewReader(bytes.NewReader(res.Artifacts), int64(len(res.Artifacts)))
	require.NoError(t, err, "the artifacts are a zip")
	f, err := zr.Open("out/a.txt")
	require.NoError(t, err)
	content, err := io.ReadAll(f)
	require.NoError(t, err)
	assert.Equal(t, "artifact-payload-42\n", string(content))

	consumer := r.srv.Enqueue(Job{
		Name: "consumer", Stage: "test",
		Dependencies: []int64{producer},
		Cache:        &Cache{Key: "deps", Paths: []string{"vendor/"}, Policy: "pull"},
		Script:       []string{"cat out/a.txt", "cat vendor/c.txt"},
	})
	r.runner(1)
	res = r.wait(consumer)
	assert.Equal(t, StateSuccess, res.State, res.Trace)
	assert.Contains(t, res.Trace, "artifact-payload-42")
	assert.Contains(t, res.Trace, "cached-payload-7")
}

// The distributed cache: two runners with cache directories of their own
// share a cache through the server's S3 endpoint (as job VMs do, whose
// cache directories die with them).
func TestRealRunnerDistributedCache(t *testing.T) {
	t.Parallel()
	r := newRigWith(t, "lve-cache")
	cache := &Cache{Key: "deps", Paths: []string{"vendor/"}}
	fill := r.srv.Enqueue(Job{Name: "fill", Cache: cache, Script: []string{"mkdir -p vendor", "echo from-s3-cache > vendor/c.txt"}})
	r.runner(1)
	res := r.wait(fill)
	require.Equal(t, StateSuccess, res.State, res.Trace)
	require.Equal(t, 1, r.srv.CacheObjects(), "the archive was uploaded to the cache server")

	r.cacheDir = t.TempDir() // nothing local to restore from
	use := r.srv.Enqueue(Job{Name: "use", Cache: cache, Script: []string{"cat vendor/c.txt"}})
	r.runner(1)
	res = r.wait(use)
	require.Equal(t, StateSuccess, res.State, res.Trace)
	require.Contains(t, res.Trace, "from-s3-cache")
}

func TestCacheEndpointRefusesUnsignedRequests(t *testing.T) {
	srv, err := Start(context.Background(), Options{CacheBucket: "b"})
	require.NoError(t, err)
	defer func() { _ = srv.Close() }()
	put := func(query string) int {
		req, err := http.NewRequest(http.MethodPut, srv.URL()+"b/k/cache.zip"+query, strings.NewReader("x"))
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusForbidden, put(""))
	require.Equal(t, http.StatusForbidden, put("?X-Amz-Credential=OTHER/20260101/us-east-1/s3/aws4_request"))
	require.Zero(t, srv.CacheObjects())
	var key string
	for _, e := range srv.CacheEnv() {
		if v, ok := strings.CutPrefix(e, "CACHE_S3_ACCESS_KEY="); ok {
			key = v
		}
	}
	require.NotEmpty(t, key)
	require.Equal(t, http.StatusOK, put("?X-Amz-Credential="+key+"/20260101/us-east-1/s3/aws4_request"))
	require.Equal(t, 1, srv.CacheObjects())
}

func TestRealRunnerCancelAndTimeout(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	canceled := r.srv.Enqueue(Job{
		Name: "cancel-me", Stage: "test",
		Script:      []string{"for i in $(seq 1 120); do echo tick $i; sleep 0.5; done"},
		AfterScript: []string{"echo after_script after cancel"},
	})
	timedOut := r.srv.Enqueue(Job{
		Name: "too-slow", Stage: "test", TimeoutSeconds: 3,
		Script: []string{"echo going to sleep", "sleep 60"},
	})
	r.runner(2)

	t.Run("cancel", func(t *testing.T) {
		require.Eventually(t, func() bool { return strings.Contains(r.srv.Trace(canceled), "tick 2") },
			30*time.Second, 100*time.Millisecond, "the job's log never showed progress")
		asked := time.Now()
		r.srv.Cancel(canceled)
		res := r.wait(canceled)
		t.Logf("canceled %v after the cancel; runner reported failure_reason=%q exit_code=%d",
			time.Since(asked).Round(time.Millisecond), res.FailureReason, res.ExitCode)
		assert.Equal(t, StateCanceled, res.State)
		assert.Contains(t, res.Trace, "after_script after cancel", "a cancel still runs after_script")
		assert.NotContains(t, res.Trace, "tick 100")
		assert.Less(t, time.Since(asked), 15*time.Second)
	})
	t.Run("timeout", func(t *testing.T) {
		res := r.wait(timedOut)
		assert.Equal(t, StateFailed, res.State)
		assert.Equal(t, "job_execution_timeout", res.FailureReason)
		assert.Contains(t, res.Trace, "going to sleep")
		assert.Less(t, res.Duration, 20*time.Second)
	})
}

func TestRealRunnerGitClone(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git is not on PATH")
	}
	repo := t.TempDir()
	gitEnv := append(os.Environ(), "HOME="+r.home, "GIT_CONFIG_NOSYSTEM=1",
		"GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@example.com")
	git := func(args ...string) string {
		cmd := exec.Command("git", args...)
		cmd.Dir, cmd.Env = repo, gitEnv
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "git %v: %s", args, out)
		return strings.TrimSpace(string(out))
	}
	git("init", "-q", "-b", "main")
	require.NoError(t, os.WriteFile(filepath.Join(repo, "hello.txt"), []byte("hello-from-repo\n"), 0o644))
	git("add", "hello.txt")
	git("commit", "-q", "-m", "first")
	sha := git("rev-parse", "HEAD")

	id := r.srv.Enqueue(Job{Name: "clone", Stage: "test", GitURL: repo, SHA: sha, Ref: "main",
		Script: []string{"cat hello.txt", "git rev-parse HEAD"}})
	r.runner(1)
	res := r.wait(id)
	assert.Equal(t, StateSuccess, res.State, res.Trace)
	assert.Contains(t, res.Trace, "hello-from-repo")
	assert.Contains(t, res.Trace, sha)
}

// The Custom executor with a trivial local driver: checks that run-single
// takes RunSingle's --custom-* flags and drives every stage.
func TestRealRunnerCustomExecutor(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	dir := t.TempDir()
	script := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte("#!/usr/bin/env bash\n"+body+"\n"), 0o755))
		return p
	}
	builds := filepath.Join(dir, "builds")
	custom := &CustomConfig{
		ConfigExec:  script("config", `printf '{"builds_dir":"%s","cache_dir":"%s/cache","driver":{"name":"test-driver"}}' "`+builds+`" "`+dir+`"`),
		PrepareExec: script("prepare", `echo "prepare: $1 job=$CUSTOM_ENV_CI_JOB_ID"`),
		PrepareArgs: []string{"prep-arg"},
		// run_exec <args> <script> <stage>: a failing user script is BUILD_FAILURE.
		RunExec:     script("run", `bash "$1" || exit "$BUILD_FAILURE_EXIT_CODE"`),
		CleanupExec: script("cleanup", `echo cleanup >> "`+dir+`/cleanups"`),
	}
	pass := r.srv.Enqueue(Job{Name: "custom-pass", Script: []string{"echo hello-from-custom"}})
	fail := r.srv.Enqueue(Job{Name: "custom-fail", Script: []string{"exit 3"}})
	r.runnerWith(2, custom)

	res := r.wait(pass)
	assert.Equal(t, StateSuccess, res.State, res.Trace)
	assert.Contains(t, res.Trace, "test-driver")
	assert.Contains(t, res.Trace, "prepare: prep-arg job="+strconv.FormatInt(pass, 10))
	assert.Contains(t, res.Trace, "hello-from-custom")
	res = r.wait(fail)
	assert.Equal(t, StateFailed, res.State)
	assert.Equal(t, "script_failure", res.FailureReason)
	assert.Equal(t, 1, res.ExitCode, "the runner reports run_exec's BUILD_FAILURE_EXIT_CODE, not the script's 3")
	require.Eventually(t, func() bool {
		b, _ := os.ReadFile(filepath.Join(dir, "cleanups"))
		return string(b) == "cleanup\ncleanup\n"
	}, 10*time.Second, 50*time.Millisecond, "cleanup_exec runs once per job")
}

func lineWith(s, sub string) string {
	for l := range strings.Lines(s) {
		if strings.Contains(l, sub) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}
