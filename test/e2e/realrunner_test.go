//go:build e2e

package e2e

import (
	"archive/zip"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// The real-runner tier: an unmodified gitlab-runner (run-single) drives
// the four executables against the project's fake GitLab job API, served
// on the host side of the rig network where the guests reach it (artifacts
// and caches go from the guest's own gitlab-runner straight to it).

// realRunner is one test's fake GitLab with what its jobs need.
type realRunner struct {
	r       *rig
	bin     string
	api     *jobapi.Server
	repo    string // git URL the guests clone from
	sha     string
	home    string
	workDir string
	// cfgPath, if set, is the driver configuration instead of the rig's.
	cfgPath string
	// stages, if set, are the Custom executor's settings instead of the
	// rig's executables (the package test: the installed ones).
	stages *jobapi.CustomConfig
	// noDistributedCache: the runner gets no S3 cache (the host cache's
	// tests: the archives stay in the guest's cache_dir).
	noDistributedCache bool
	// asUser, in the confined mode, starts bin as the runner's user.
	asUser string
	// url and caFile, if set, are the GitLab URL the runner is given
	// instead of the fake's own, and the CA file it trusts for it
	// (--tls-ca-file): the fake behind a TLS front with a host name.
	url, caFile string
}

func newRealRunner(t *testing.T) *realRunner {
	t.Helper()
	r := setup(t)
	bin := runnerBinary(t)
	requireGuestRunner(t, r)
	ln := r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	ctx, cancel := context.WithCancel(context.Background())
	api, err := jobapi.Start(ctx, jobapi.Options{Listen: addr, CacheBucket: "lve-cache"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = api.Close(); cancel() })
	repo, sha := r.repo(t)
	rr := &realRunner{r: r, bin: bin, api: api, repo: repo, sha: sha, home: r.userDir(t), workDir: r.userDir(t)}
	if r.user != nil {
		rr.asUser = confined.runner
	}
	return rr
}

// custom is the Custom executor's settings: the four executables with the
// driver configuration (the test's, else the rig's).
func (rr *realRunner) custom() *jobapi.CustomConfig {
	if rr.stages != nil {
		return rr.stages
	}
	cfgPath := rr.r.cfgPath
	if rr.cfgPath != "" {
		cfgPath = rr.cfgPath
	}
	return jobapi.DriverStages(rr.r.bin, cfgPath)
}

// start runs one `gitlab-runner run-single` for n jobs in the background;
// wait returns its error and output.
func (rr *realRunner) start(t *testing.T, n int) (wait func() (string, error)) {
	t.Helper()
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + rr.home}
	if !rr.noDistributedCache {
		env = append(env, rr.api.CacheEnv()...)
	}
	var out sshtest.Buffer
	done := make(chan error, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	go func() {
		done <- jobapi.RunSingle(ctx, jobapi.RunSingleOptions{
			Binary: cmp.Or(rr.asUser, rr.bin), URL: cmp.Or(rr.url, rr.api.URL()), TLSCAFile: rr.caFile, Token: rr.api.RunnerToken(), Executor: "custom",
			Custom:    rr.custom(),
			BuildsDir: "/builds", CacheDir: "/cache",
			MaxBuilds: n, WaitTimeout: 5 * time.Minute,
			Env: env,
			Dir: rr.workDir, Stdout: &out, Stderr: &out,
		})
	}()
	// A test that fails before it waits for this runner stops it here, so
	// that its job is cancelled and cleaned up by the runner (SIGTERM)
	// before the leftover check, not left running into the next tests.
	var once sync.Once
	var runErr error
	wait = func() (string, error) {
		once.Do(func() {
			defer cancel()
			runErr = <-done
		})
		return out.String(), runErr
	}
	t.Cleanup(func() { cancel(); _, _ = wait() })
	return wait
}

// runJobs queues jobs, runs them one after another through one runner and
// returns their results in order.
func (rr *realRunner) runJobs(t *testing.T, jobs ...jobapi.Job) []jobapi.Result {
	t.Helper()
	ids := make([]int64, len(jobs))
	for i, j := range jobs {
		ids[i] = rr.api.Enqueue(j)
	}
	wait := rr.start(t, len(jobs))
	return rr.results(t, wait, ids)
}

// runJobsAtOnce queues jobs and runs them at the same time, one runner
// (`gitlab-runner run-single` for one job) each; which runner takes which
// job is the runners' race. It returns their results in order once every
// runner has ended.
func (rr *realRunner) runJobsAtOnce(t *testing.T, jobs ...jobapi.Job) []jobapi.Result {
	t.Helper()
	ids := make([]int64, len(jobs))
	for i, j := range jobs {
		ids[i] = rr.api.Enqueue(j)
	}
	waits := make([]func() (string, error), len(jobs))
	for i := range jobs {
		waits[i] = rr.start(t, 1)
	}
	all := func() (string, error) {
		outs := make([]string, len(waits))
		errs := make([]error, len(waits))
		for i, w := range waits {
			outs[i], errs[i] = w()
		}
		return strings.Join(outs, "\n"), errors.Join(errs...)
	}
	return rr.results(t, all, ids)
}

func (rr *realRunner) results(t *testing.T, wait func() (string, error), ids []int64) []jobapi.Result {
	t.Helper()
	out, err := wait()
	t.Logf("gitlab-runner run-single:\n%s", out)
	require.NoError(t, err)
	res := make([]jobapi.Result, len(ids))
	for i, id := range ids {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		res[i], err = rr.api.Wait(ctx, id)
		cancel()
		require.NoError(t, err, "job %d got no final state", id)
		t.Logf("job %d: %s %s exit %d in %s\n%s", id, res[i].State, res[i].FailureReason, res[i].ExitCode, res[i].Duration, res[i].Trace)
	}
	return res
}

// zipFiles lists the files of an artifacts archive with their content.
func zipFiles(t *testing.T, b []byte) map[string]string {
	t.Helper()
	require.NotEmpty(t, b, "an artifacts archive was uploaded")
	z, err := zip.NewReader(bytes.NewReader(b), int64(len(b)))
	require.NoError(t, err)
	out := map[string]string{}
	for _, f := range z.File {
		if f.FileInfo().IsDir() {
			continue
		}
		rc, err := f.Open()
		require.NoError(t, err)
		c, err := io.ReadAll(rc)
		require.NoError(t, err)
		_ = rc.Close()
		out[f.Name] = string(c)
	}
	return out
}

// TestRealRunnerPassingJob: a job clones the repository over HTTP from the
// host side, gets a file variable and a masked one, and passes; the job log
// carries no caches/artifacts note and never the masked value.
func TestRealRunnerPassingJob(t *testing.T) {
	rr := newRealRunner(t)
	const secret = "s3cr3t-M4sked-value"
	res := rr.runJobs(t, jobapi.Job{
		Name: "build", GitURL: rr.repo, SHA: rr.sha,
		Variables: []jobapi.Variable{
			{Key: "MY_SECRET", Value: secret, Masked: true},
			{Key: "MY_FILE", Value: "file-variable-content\n", File: true},
		},
		Script: []string{
			"test -f README.md && echo CLONED $(git rev-parse HEAD)",
			`echo "secret is $MY_SECRET"`,
			`echo "file at $MY_FILE: $(cat "$MY_FILE")"`,
		},
	})[0]
	require.Equal(t, jobapi.StateSuccess, res.State, res.Trace)
	require.Contains(t, res.Trace, "CLONED "+rr.sha)
	require.Contains(t, res.Trace, "file-variable-content")
	require.Contains(t, res.Trace, "secret is [MASKED]")
	require.NotContains(t, res.Trace, secret)
	require.Contains(t, res.Trace, "gitlab-runner for the guest:")
	require.NotContains(t, res.Trace, "caches and artifacts will not work")
	require.NotRegexp(t, `lve-job-[0-9a-f]{40}`, res.Trace, "no job token in the log")
}

// TestRealRunnerScriptFailure: `exit 3` is a script_failure with exit code
// 3; after_script and the on_failure artifacts still run.
func TestRealRunnerScriptFailure(t *testing.T) {
	rr := newRealRunner(t)
	res := rr.runJobs(t, jobapi.Job{
		Name:        "fails",
		Script:      []string{"echo failing > report.txt", "exit 3"},
		AfterScript: []string{"echo AFTER-SCRIPT-RAN"},
		Artifacts:   &jobapi.Artifacts{Name: "report", Paths: []string{"report.txt"}, When: "on_failure"},
	})[0]
	require.Equal(t, jobapi.StateFailed, res.State, res.Trace)
	require.Equal(t, "script_failure", res.FailureReason)
	require.Equal(t, 3, res.ExitCode, "the script's own exit code (BUILD_EXIT_CODE_FILE)")
	require.Contains(t, res.Trace, "AFTER-SCRIPT-RAN")
	require.Equal(t, "failing\n", zipFiles(t, res.Artifacts)["report.txt"], "on_failure artifacts were uploaded from the guest")
}

// TestRealRunnerArtifactsAndCacheBetweenJobs: a job's artifacts, uploaded
// by the guest's gitlab-runner, are downloaded by a second job
// (dependencies) in another VM, and its cache, archived into the runner's
// distributed cache (an S3 endpoint of the fake; docs/images.md says why not
// a host directory), is restored there. (Two tests until 2026-11-27, a pair
// of jobs each.)
func TestRealRunnerArtifactsAndCacheBetweenJobs(t *testing.T) {
	rr := newRealRunner(t)
	cache := &jobapi.Cache{Key: "deps-v1", Paths: []string{"vendor/"}}
	first := rr.api.Enqueue(jobapi.Job{
		Name: "produce", Stage: "build", Cache: cache,
		Script:    []string{"mkdir -p out vendor", "echo artifact-from-$CI_JOB_ID > out/result.txt", "echo cached-$CI_JOB_ID > vendor/dep.txt"},
		Artifacts: &jobapi.Artifacts{Name: "out", Paths: []string{"out/"}},
	})
	second := rr.api.Enqueue(jobapi.Job{
		Name: "consume", Stage: "test", Dependencies: []int64{first}, Cache: cache,
		Script: []string{`echo "got: $(cat out/result.txt)"`, `echo "restored: $(cat vendor/dep.txt)"`},
	})
	res := rr.results(t, rr.start(t, 2), []int64{first, second})
	require.Equal(t, jobapi.StateSuccess, res[0].State, res[0].Trace)
	require.Equal(t, fmt.Sprintf("artifact-from-%d\n", first), zipFiles(t, res[0].Artifacts)["out/result.txt"])
	require.Contains(t, res[0].Trace, "Created cache")
	require.NotZero(t, rr.api.CacheObjects(), "the archive went to the cache server")
	require.Equal(t, jobapi.StateSuccess, res[1].State, res[1].Trace)
	require.Contains(t, res[1].Trace, fmt.Sprintf("got: artifact-from-%d", first))
	require.Contains(t, res[1].Trace, fmt.Sprintf("restored: cached-%d", first))
}

// TestRealRunnerCancel: a job cancelled in GitLab while its script runs
// ends as canceled, and nothing of it is left (the rig checks).
func TestRealRunnerCancel(t *testing.T) {
	rr := newRealRunner(t)
	id := rr.api.Enqueue(jobapi.Job{Name: "long", Script: []string{"for i in $(seq 1 600); do echo tick $i; sleep 1; done"}})
	wait := rr.start(t, 1)
	waitFor(t, 3*time.Minute, "the script ticking", func() bool { return strings.Contains(rr.api.Trace(id), "tick 3") })
	t0 := time.Now()
	rr.api.Cancel(id)
	res := rr.results(t, wait, []int64{id})[0]
	require.Equal(t, jobapi.StateCanceled, res.State, res.Trace)
	require.NotContains(t, res.Trace, "tick 60\n")
	t.Logf("canceled: the runner was done %s after the cancel", time.Since(t0).Round(time.Millisecond))
}

// TestRealRunnerJobTimeout: a job that outlives its timeout fails as
// job_execution_timeout, at the timeout. (35 s: a tiny guest's prepare
// takes 6-9 s here and up to 17 s beside other work, and the runner's
// stages before the script 1-2 s each under emulation; the timeout, which
// counts from the job's start, comes during the script, with room for a
// loaded host.)
func TestRealRunnerJobTimeout(t *testing.T) {
	rr := newRealRunner(t)
	res := rr.runJobs(t, jobapi.Job{Name: "slow", TimeoutSeconds: 35, Script: []string{"echo sleeping", "sleep 600"}})[0]
	require.Equal(t, jobapi.StateFailed, res.State, res.Trace)
	require.Equal(t, "job_execution_timeout", res.FailureReason)
	require.Regexp(t, `(?m)^sleeping\r?$`, res.Trace, "the timeout ended the script, not prepare")
	require.Less(t, res.Duration, 90*time.Second, "ended at the timeout, not at the sleep's end")
}

// TestRealRunnerTwoRunnersAtOnce: two runners run a job each at the same
// time, each in its own VM.
func TestRealRunnerTwoRunnersAtOnce(t *testing.T) {
	rr := newRealRunner(t)
	ids := []int64{
		rr.api.Enqueue(jobapi.Job{Name: "a", Script: []string{`echo "job-a on boot $(cat /proc/sys/kernel/random/boot_id)"`, "sleep 5"}}),
		rr.api.Enqueue(jobapi.Job{Name: "b", Script: []string{`echo "job-b on boot $(cat /proc/sys/kernel/random/boot_id)"`, "sleep 5"}}),
	}
	t0 := time.Now()
	waitA, waitB := rr.start(t, 1), rr.start(t, 1)
	outA, errA := waitA()
	outB, errB := waitB()
	wall := time.Since(t0)
	both := func() (string, error) { return outA + outB, errors.Join(errA, errB) }
	res := rr.results(t, both, ids)
	for _, x := range res {
		require.Equal(t, jobapi.StateSuccess, x.State, x.Trace)
	}
	hostA := regexp.MustCompile(`job-a on boot ([0-9a-f-]{36})`).FindStringSubmatch(res[0].Trace)
	hostB := regexp.MustCompile(`job-b on boot ([0-9a-f-]{36})`).FindStringSubmatch(res[1].Trace)
	require.Len(t, hostA, 2)
	require.Len(t, hostB, 2)
	require.NotEqual(t, hostA[1], hostB[1], "each job in a VM of its own (boot ids)")
	require.Less(t, wall, res[0].Duration+res[1].Duration, "the two jobs ran at the same time")
}

// TestRealRunnerServices: the driver starts no `services:`. With
// gitlab.services = "fail" (the rig's configuration plus that key) a job
// that asks for them fails in prepare, as a build failure naming them,
// before any VM boots: cheap, no VM. (The default, "warn", is covered
// without a VM by internal/gitlab's TestRealRunnerServices.)
func TestRealRunnerServices(t *testing.T) {
	rr := newRealRunner(t)
	text, err := os.ReadFile(rr.r.cfgPath)
	require.NoError(t, err)
	rr.cfgPath = filepath.Join(readableDir(t), "config.toml")
	require.NoError(t, os.WriteFile(rr.cfgPath, append(text, "\n[gitlab]\nservices = \"fail\"\n"...), 0o644))
	res := rr.runJobs(t, jobapi.Job{
		Name: "with-services", Script: []string{"echo SCRIPT-RAN"},
		Services: []jobapi.Service{{Name: "postgres:15", Alias: "db"}, {Name: "redis:7"}},
	})[0]
	require.Equal(t, jobapi.StateFailed, res.State, res.Trace)
	require.Equal(t, "script_failure", res.FailureReason, "a build failure, not retried as a system failure")
	require.Contains(t, res.Trace, `the job asks for 2 services: "postgres:15" (alias "db"), "redis:7"`)
	require.Contains(t, res.Trace, "docs/services.md")
	require.NotContains(t, res.Trace, "Preparing a fresh", "no VM")
	require.NotContains(t, res.Trace, "SCRIPT-RAN")
}
