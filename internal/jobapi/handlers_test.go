package jobapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const testRunnerToken = "lve-runner-test-token"

func startServer(t *testing.T) *Server {
	t.Helper()
	srv, err := Start(context.Background(), Options{
		Listen:      "127.0.0.1:0",
		RunnerToken: testRunnerToken,
		Logger:      slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, srv.Close()) })
	return srv
}

type response struct {
	code   int
	header http.Header
	body   string
}

func call(t *testing.T, srv *Server, method, path string, header http.Header, body io.Reader) response {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, srv.URL()+strings.TrimPrefix(path, "/"), body)
	require.NoError(t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return response{code: res.StatusCode, header: res.Header, body: string(b)}
}

func jsonBody(t *testing.T, v any) io.Reader {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return bytes.NewReader(b)
}

// take asks for a job as the runner does and returns the payload.
func take(t *testing.T, srv *Server) jobResponse {
	t.Helper()
	res := call(t, srv, "POST", "/api/v4/jobs/request", nil, jsonBody(t, map[string]any{"token": testRunnerToken}))
	require.Equal(t, http.StatusCreated, res.code, res.body)
	var job jobResponse
	require.NoError(t, json.Unmarshal([]byte(res.body), &job))
	return job
}

func patch(t *testing.T, srv *Server, job jobResponse, token string, start int, data string) response {
	t.Helper()
	h := http.Header{
		"Content-Range": {fmt.Sprintf("%d-%d", start, start+len(data)-1)},
		"Job-Token":     {token},
	}
	return call(t, srv, "PATCH", fmt.Sprintf("/api/v4/jobs/%d/trace?debug_trace=false", job.ID), h, strings.NewReader(data))
}

func update(t *testing.T, srv *Server, id int64, body map[string]any) response {
	t.Helper()
	return call(t, srv, "PUT", fmt.Sprintf("/api/v4/jobs/%d", id), nil, jsonBody(t, body))
}

func final(token, state, reason string, exitCode int, trace string) map[string]any {
	sum := fmt.Sprintf("crc32:%08x", crc32.ChecksumIEEE([]byte(trace)))
	return map[string]any{
		"token": token, "state": state, "failure_reason": reason, "exit_code": exitCode,
		"checksum": sum, "output": map[string]any{"checksum": sum, "bytesize": len(trace)},
	}
}

func waitResult(t *testing.T, srv *Server, id int64) Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	res, err := srv.Wait(ctx, id)
	require.NoError(t, err)
	return res
}

func variable(job jobResponse, key string) (jobVariable, bool) {
	for _, v := range job.Variables {
		if v.Key == key {
			return v, true
		}
	}
	return jobVariable{}, false
}

func TestRequestJob(t *testing.T) {
	srv := startServer(t)
	ask := func(token string) response {
		return call(t, srv, "POST", "/api/v4/jobs/request", nil, jsonBody(t, map[string]any{"token": token}))
	}
	assert.Equal(t, http.StatusNoContent, ask(testRunnerToken).code, "nothing queued")
	assert.Equal(t, http.StatusForbidden, ask("wrong").code)
	assert.Equal(t, http.StatusForbidden, ask("").code)
	assert.Equal(t, http.StatusBadRequest,
		call(t, srv, "POST", "/api/v4/jobs/request", nil, strings.NewReader("{")).code)
	assert.Equal(t, http.StatusRequestEntityTooLarge, call(t, srv, "POST", "/api/v4/jobs/request", nil,
		strings.NewReader(`{"token":"`+strings.Repeat("x", maxJSONBody)+`"}`)).code)

	id := srv.Enqueue(Job{
		Name: "build", Stage: "test", Script: []string{"make"}, AfterScript: []string{"echo done"},
		TimeoutSeconds: 120, Image: "debian-12",
		Variables: []Variable{{Key: "SECRET", Value: "hunter2-hunter2", Masked: true}, {Key: "CONF", Value: "x=1", File: true}},
		Artifacts: &Artifacts{Paths: []string{"out/"}, ExpireIn: "1 day"},
		Cache:     &Cache{Key: "k", Paths: []string{"vendor/"}},
	})
	assert.Equal(t, http.StatusForbidden, ask("wrong").code, "a wrong token gets no job")
	job := take(t, srv)
	assert.Equal(t, id, job.ID)
	assert.True(t, strings.HasPrefix(job.Token, "lve-job-") && len(job.Token) > 40, "a random job token")
	assert.Equal(t, "build", job.JobInfo.Name)
	assert.Equal(t, 120, job.RunnerInfo.Timeout)
	assert.Equal(t, "debian-12", job.Image.Name)
	require.Len(t, job.Steps, 2)
	assert.Equal(t, step{Name: "script", Script: []string{"make"}, Timeout: 120, When: "on_success"}, job.Steps[0])
	assert.Equal(t, step{Name: "after_script", Script: []string{"echo done"}, Timeout: 120, When: "always"}, job.Steps[1])
	assert.Equal(t, []artifact{{Paths: []string{"out/"}, Exclude: []string{}, When: "on_success",
		Type: "archive", Format: "zip", ExpireIn: "1 day"}}, job.Artifacts)
	assert.Equal(t, []cache{{Key: "k", Paths: []string{"vendor/"}, Policy: "pull-push", When: "on_success"}}, job.Cache)
	assert.NotEmpty(t, job.GitInfo.RepoURL, "the runner needs a repository URL even without a clone")

	v, ok := variable(job, "GIT_STRATEGY")
	assert.True(t, ok && v.Value == "none", "no GitURL: no clone")
	v, _ = variable(job, "CI_JOB_TOKEN")
	assert.Equal(t, jobVariable{Key: "CI_JOB_TOKEN", Value: job.Token, Masked: true}, v)
	v, _ = variable(job, "CI_JOB_ID")
	assert.Equal(t, fmt.Sprint(id), v.Value)
	v, _ = variable(job, "SECRET")
	assert.True(t, v.Masked && !v.Public)
	v, _ = variable(job, "CONF")
	assert.True(t, v.File)

	assert.Equal(t, http.StatusNoContent, ask(testRunnerToken).code, "a job is handed out once")
	next := srv.Enqueue(Job{Name: "second", GitURL: "https://example.com/x.git", SHA: "abc"})
	assert.Greater(t, next, id)
	job2 := take(t, srv)
	assert.NotEqual(t, job.Token, job2.Token)
	assert.Equal(t, "https://example.com/x.git", job2.GitInfo.RepoURL)
	_, ok = variable(job2, "GIT_STRATEGY")
	assert.False(t, ok)
}

func TestTrace(t *testing.T) {
	srv := startServer(t)
	id := srv.Enqueue(Job{Name: "t", Script: []string{"true"}})

	assert.Equal(t, http.StatusForbidden, patch(t, srv, jobResponse{ID: id}, "", 0, "x").code, "not handed out yet, no token")
	job := take(t, srv)

	res := patch(t, srv, job, job.Token, 0, "hello ")
	require.Equal(t, http.StatusAccepted, res.code)
	assert.Equal(t, "0-6", res.header.Get("Range"))
	assert.Equal(t, "running", res.header.Get("Job-Status"))
	assert.Equal(t, "1", res.header.Get("X-GitLab-Trace-Update-Interval"))

	assert.Equal(t, http.StatusForbidden, patch(t, srv, job, "wrong", 6, "evil").code)
	assert.Equal(t, http.StatusNotFound, patch(t, srv, jobResponse{ID: id + 100}, job.Token, 0, "x").code)
	h := http.Header{"Job-Token": {job.Token}, "Content-Range": {"bytes 0-1"}}
	assert.Equal(t, http.StatusBadRequest, call(t, srv, "PATCH", fmt.Sprintf("/api/v4/jobs/%d/trace", id), h, strings.NewReader("x")).code)

	res = patch(t, srv, job, job.Token, 10, "gap")
	assert.Equal(t, http.StatusRequestedRangeNotSatisfiable, res.code, "a patch must not leave a gap")
	assert.Equal(t, "0-6", res.header.Get("Range"))

	res = patch(t, srv, job, job.Token, 6, "world")
	assert.Equal(t, "0-11", res.header.Get("Range"))
	res = patch(t, srv, job, job.Token, 6, "there")
	assert.Equal(t, http.StatusAccepted, res.code, "an overlapping patch rewrites from its start")
	assert.Equal(t, "hello there", srv.Trace(id))
	patch(t, srv, job, job.Token, 0, "bye")
	assert.Equal(t, "bye", srv.Trace(id), "a resend from 0 replaces the log")

	srv.Cancel(id)
	res = patch(t, srv, job, job.Token, 3, "!")
	assert.Equal(t, http.StatusAccepted, res.code)
	assert.Equal(t, "canceling", res.header.Get("Job-Status"))

	require.Equal(t, http.StatusOK, update(t, srv, id, final(job.Token, "failed", "unknown_failure", 0, "bye!")).code)
	res = patch(t, srv, job, job.Token, 4, "late")
	assert.Equal(t, http.StatusForbidden, res.code, "no log after the job ended")
}

func TestUpdateJob(t *testing.T) {
	srv := startServer(t)
	id := srv.Enqueue(Job{Name: "u"})
	assert.Equal(t, http.StatusForbidden, update(t, srv, id, map[string]any{"token": "", "state": "running"}).code)
	job := take(t, srv)

	assert.Equal(t, http.StatusForbidden, update(t, srv, id, map[string]any{"token": "wrong", "state": "success"}).code)
	assert.Equal(t, http.StatusNotFound, update(t, srv, id+1, map[string]any{"token": job.Token, "state": "success"}).code)
	assert.Equal(t, http.StatusBadRequest, update(t, srv, id, map[string]any{"token": job.Token, "state": "bogus"}).code)
	res := update(t, srv, id, map[string]any{"token": job.Token, "state": "running"})
	assert.Equal(t, http.StatusOK, res.code)
	assert.Equal(t, "running", res.header.Get("Job-Status"))

	patch(t, srv, job, job.Token, 0, "log line\n")
	// The runner's log has more than arrived: 412 makes it resend from 0,
	// a bounded number of times, then the update is taken as is.
	for range maxTraceMismatches {
		res = update(t, srv, id, final(job.Token, "failed", "script_failure", 3, "log line\nmore\n"))
		assert.Equal(t, http.StatusPreconditionFailed, res.code)
	}
	res = update(t, srv, id, final(job.Token, "failed", "script_failure", 3, "log line\nmore\n"))
	assert.Equal(t, http.StatusOK, res.code)
	assert.Equal(t, "failed", res.header.Get("Job-Status"))

	r := waitResult(t, srv, id)
	assert.Equal(t, StateFailed, r.State)
	assert.Equal(t, "script_failure", r.FailureReason)
	assert.Equal(t, 3, r.ExitCode)
	assert.Equal(t, "log line\n", r.Trace)
	assert.Positive(t, r.Duration)

	res = update(t, srv, id, final(job.Token, "success", "", 0, "log line\n"))
	assert.Equal(t, http.StatusOK, res.code, "a repeated final update is acknowledged")
	assert.Equal(t, StateFailed, waitResult(t, srv, id).State, "the first final update stands")
}

func TestFinalUpdateAfterResend(t *testing.T) {
	srv := startServer(t)
	id := srv.Enqueue(Job{Name: "ok"})
	job := take(t, srv)
	patch(t, srv, job, job.Token, 0, "garbled")
	assert.Equal(t, http.StatusPreconditionFailed, update(t, srv, id, final(job.Token, "success", "", 0, "all good\n")).code)
	patch(t, srv, job, job.Token, 0, "all good\n")
	res := update(t, srv, id, final(job.Token, "success", "", 0, "all good\n"))
	assert.Equal(t, http.StatusOK, res.code)
	r := waitResult(t, srv, id)
	assert.Equal(t, Result{State: StateSuccess, Trace: "all good\n", Duration: r.Duration}, r)
}

func TestCancel(t *testing.T) {
	srv := startServer(t)
	queued := srv.Enqueue(Job{Name: "never-runs"})
	srv.Cancel(queued)
	assert.Equal(t, StateCanceled, waitResult(t, srv, queued).State, "a queued job is canceled at once")
	assert.Equal(t, http.StatusNoContent,
		call(t, srv, "POST", "/api/v4/jobs/request", nil, jsonBody(t, map[string]any{"token": testRunnerToken})).code)

	id := srv.Enqueue(Job{Name: "running"})
	job := take(t, srv)
	srv.Cancel(id)
	res := update(t, srv, id, map[string]any{"token": job.Token, "state": "running"})
	assert.Equal(t, "canceling", res.header.Get("Job-Status"), "the keep-alive carries the cancel")
	// What runner 17.9 reports after a cancel: failed, unknown_failure.
	update(t, srv, id, final(job.Token, "failed", "unknown_failure", 0, ""))
	r := waitResult(t, srv, id)
	assert.Equal(t, StateCanceled, r.State)
	assert.Equal(t, "unknown_failure", r.FailureReason)

	srv.Cancel(id) // finished: no effect
	srv.Cancel(id + 1000)
	assert.Equal(t, StateCanceled, waitResult(t, srv, id).State)
}

func uploadArtifacts(t *testing.T, srv *Server, id int64, token string, data []byte) response {
	t.Helper()
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, err := mw.CreateFormFile("file", "artifacts.zip")
	require.NoError(t, err)
	_, err = fw.Write(data)
	require.NoError(t, err)
	require.NoError(t, mw.Close())
	h := http.Header{"Job-Token": {token}, "Content-Type": {mw.FormDataContentType()}}
	return call(t, srv, "POST", fmt.Sprintf("/api/v4/jobs/%d/artifacts?artifact_format=zip&artifact_type=archive", id), h, &body)
}

func download(t *testing.T, srv *Server, id int64, token string) response {
	t.Helper()
	return call(t, srv, "GET", fmt.Sprintf("/api/v4/jobs/%d/artifacts?direct_download=true", id), http.Header{"Job-Token": {token}}, nil)
}

func TestArtifacts(t *testing.T) {
	srv := startServer(t)
	data := []byte("PK\x03\x04 pretend zip")
	producer := srv.Enqueue(Job{Name: "producer"})
	empty := srv.Enqueue(Job{Name: "no-artifacts"})
	pj := take(t, srv)
	ej := take(t, srv)

	assert.Equal(t, http.StatusForbidden, uploadArtifacts(t, srv, producer, ej.Token, data).code, "another job's token")
	assert.Equal(t, http.StatusBadRequest, call(t, srv, "POST", fmt.Sprintf("/api/v4/jobs/%d/artifacts", producer),
		http.Header{"Job-Token": {pj.Token}}, strings.NewReader("not multipart")).code)
	require.Equal(t, http.StatusCreated, uploadArtifacts(t, srv, producer, pj.Token, data).code)
	res := download(t, srv, producer, pj.Token)
	assert.Equal(t, http.StatusOK, res.code, "a running job may read its own artifacts")
	assert.Equal(t, string(data), res.body)
	update(t, srv, producer, final(pj.Token, "success", "", 0, ""))
	update(t, srv, empty, final(ej.Token, "success", "", 0, ""))
	assert.Equal(t, data, waitResult(t, srv, producer).Artifacts)
	assert.Nil(t, waitResult(t, srv, empty).Artifacts)

	consumer := srv.Enqueue(Job{Name: "consumer", Dependencies: []int64{producer, empty}})
	srv.Enqueue(Job{Name: "unrelated"})
	cj := take(t, srv)
	oj := take(t, srv)
	require.Len(t, cj.Dependencies, 2)
	assert.Equal(t, dependency{ID: producer, Name: "producer", Token: cj.Token,
		ArtifactsFile: &artifactsFile{Filename: "artifacts.zip", Size: int64(len(data))}}, cj.Dependencies[0],
		"a dependency carries the downloading job's token")
	assert.Nil(t, cj.Dependencies[1].ArtifactsFile, "no artifacts: nothing to download")

	res = download(t, srv, producer, cj.Token)
	assert.Equal(t, http.StatusOK, res.code)
	assert.Equal(t, string(data), res.body)
	assert.Equal(t, http.StatusForbidden, download(t, srv, producer, pj.Token).code, "the producer's token died with it")
	assert.Equal(t, http.StatusForbidden, download(t, srv, producer, oj.Token).code, "not a dependency")
	assert.Equal(t, http.StatusForbidden, download(t, srv, producer, "").code)
	assert.Equal(t, http.StatusNotFound, download(t, srv, empty, cj.Token).code)
	assert.Equal(t, http.StatusNotFound, download(t, srv, producer+1000, cj.Token).code)

	update(t, srv, consumer, final(cj.Token, "success", "", 0, ""))
	assert.Equal(t, http.StatusForbidden, download(t, srv, producer, cj.Token).code, "only while the consumer runs")
	assert.Equal(t, http.StatusForbidden, uploadArtifacts(t, srv, consumer, cj.Token, data).code, "no upload after the end")
}

func TestUnknownRoutes(t *testing.T) {
	srv := startServer(t)
	assert.Equal(t, http.StatusNotFound, call(t, srv, "GET", "/api/v4/runners/verify", nil, nil).code)
	assert.Equal(t, http.StatusNotFound, call(t, srv, "GET", "/", nil, nil).code)
	assert.Equal(t, http.StatusNotFound, call(t, srv, "GET", "/api/v4/jobs/request", nil, nil).code)
}

func TestWaitAndClose(t *testing.T) {
	srv, err := Start(context.Background(), Options{Listen: "127.0.0.1:0"})
	require.NoError(t, err)
	assert.NotEmpty(t, srv.RunnerToken(), "a runner token is generated")
	assert.True(t, strings.HasPrefix(srv.URL(), "http://127.0.0.1:") && strings.HasSuffix(srv.URL(), "/"))

	_, err = srv.Wait(t.Context(), 42)
	assert.ErrorContains(t, err, "no job 42")
	id := srv.Enqueue(Job{Name: "w"})
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err = srv.Wait(ctx, id)
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	srv.Cancel(id)
	pending := srv.Enqueue(Job{Name: "pending"})
	done := make(chan error, 1)
	go func() { _, err := srv.Wait(t.Context(), pending); done <- err }()
	require.NoError(t, srv.Close())
	assert.ErrorIs(t, <-done, ErrClosed)
	r, err := srv.Wait(t.Context(), id)
	require.NoError(t, err, "a job that ended before the close keeps its result")
	assert.Equal(t, StateCanceled, r.State)
	assert.NoError(t, srv.Close(), "Close twice")
}

func TestStartStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	srv, err := Start(ctx, Options{Listen: "127.0.0.1:0"})
	require.NoError(t, err)
	cancel()
	require.Eventually(t, func() bool {
		res, err := http.Get(srv.URL())
		if err == nil {
			res.Body.Close()
		}
		return err != nil
	}, 5*time.Second, 10*time.Millisecond, "the server stops when its context ends")
	_, err = Start(t.Context(), Options{Listen: "256.0.0.1:0"})
	assert.Error(t, err)
}

// A public URL (a TLS front with a host name) is what the payload names
// the server by; a bad one is refused.
func TestPublicURL(t *testing.T) {
	s, err := Start(context.Background(), Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.Error(t, s.SetPublicURL("gitlab.example:443"))
	require.Error(t, s.SetPublicURL("https://gitlab.example:8443"))
	require.NoError(t, s.SetPublicURL("https://gitlab.example:8443/"))
	id := s.Enqueue(Job{Name: "x", Script: []string{"true"}})
	s.mu.Lock()
	p := s.payload(s.jobs[id])
	s.mu.Unlock()
	vars := map[string]string{}
	for _, v := range p.Variables {
		vars[v.Key] = v.Value
	}
	require.Equal(t, "https://gitlab.example:8443", vars["CI_SERVER_URL"])
	require.Equal(t, "gitlab.example", vars["CI_SERVER_HOST"])
	require.True(t, strings.HasPrefix(vars["CI_PROJECT_URL"], "https://gitlab.example:8443/"), vars["CI_PROJECT_URL"])
}
