package jobapi

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// countingBody is a request body of size bytes that counts what was read of
// it.
type countingBody struct {
	size int64
	read atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	left := b.size - b.read.Load()
	if left <= 0 {
		return 0, io.EOF
	}
	n := min(int64(len(p)), left)
	for i := range p[:n] {
		p[i] = 'x'
	}
	b.read.Add(n)
	return int(n), nil
}

// serve runs one request through the server's handler in this process, so
// that the test sees exactly what was read of body.
func serve(h http.Handler, method, path string, header http.Header, body io.Reader) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, path, body)
	for k, v := range header {
		req.Header[k] = v
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// Calls with a wrong, missing or another job's token, or for a job that
// does not exist or no longer runs, are refused before a byte of their
// (large) bodies is read (issue #22, item 8: 24 unauthenticated 8 MiB
// trace patches took the heap from 8 to 203 MiB). The two calls whose
// token is inside their JSON body read at most 64 KiB of it.
func TestUnauthenticatedBodiesAreNotRead(t *testing.T) {
	srv := startServer(t)
	id := srv.Enqueue(Job{Script: []string{"true"}})
	job := take(t, srv)
	require.Equal(t, id, job.ID)
	done := srv.Enqueue(Job{Script: []string{"true"}})
	doneJob := take(t, srv)
	require.Equal(t, http.StatusOK, update(t, srv, done, final(doneJob.Token, StateSuccess, "", 0, "")).code)
	h := srv.handler()
	const big = 8 << 20

	for _, tc := range []struct {
		name, method, path, token string
		code                      int
	}{
		{"trace, wrong token", "PATCH", fmt.Sprintf("/api/v4/jobs/%d/trace", id), "lve-job-wrong", http.StatusForbidden},
		{"trace, no token", "PATCH", fmt.Sprintf("/api/v4/jobs/%d/trace", id), "", http.StatusForbidden},
		{"trace, another job's token", "PATCH", fmt.Sprintf("/api/v4/jobs/%d/trace", id), doneJob.Token, http.StatusForbidden},
		{"trace, unknown job", "PATCH", "/api/v4/jobs/1/trace", job.Token, http.StatusNotFound},
		{"trace, job done", "PATCH", fmt.Sprintf("/api/v4/jobs/%d/trace", done), doneJob.Token, http.StatusForbidden},
		{"artifacts, wrong token", "POST", fmt.Sprintf("/api/v4/jobs/%d/artifacts", id), "lve-job-wrong", http.StatusForbidden},
		{"update, unknown job", "PUT", "/api/v4/jobs/1", job.Token, http.StatusNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := &countingBody{size: big}
			hdr := http.Header{"Content-Range": {fmt.Sprintf("0-%d", big-1)}, "Content-Type": {"application/octet-stream"}}
			if tc.token != "" {
				hdr.Set("JOB-TOKEN", tc.token)
			}
			rec := serve(h, tc.method, tc.path, hdr, body)
			require.Equal(t, tc.code, rec.Code, rec.Body.String())
			require.Zero(t, body.read.Load(), "body read before the token was checked")
		})
	}

	// The runner's token is in the job request's body, a job's token in
	// its status update's: at most maxJSONBody is read, then 413.
	for _, path := range []string{"/api/v4/jobs/request", fmt.Sprintf("/api/v4/jobs/%d", id)} {
		body := &countingBody{size: big}
		method := "POST"
		if path != "/api/v4/jobs/request" {
			method = "PUT"
		}
		rec := serve(h, method, path, http.Header{"Content-Type": {"application/json"}}, io.MultiReader(strings.NewReader(`{"token":"`), body))
		require.NotEqual(t, http.StatusCreated, rec.Code)
		require.LessOrEqual(t, body.read.Load(), int64(maxJSONBody+64<<10), path)
		require.LessOrEqual(t, maxJSONBody, 64<<10)
	}

	// The job's own token still gets its patch in.
	require.Equal(t, http.StatusAccepted, patch(t, srv, job, job.Token, 0, "hello").code)
	require.Equal(t, "hello", srv.Trace(id))
}

// At most Options.MaxConcurrent requests are handled at once: with that
// many slow uploads in flight, the next request is answered 503 at once,
// its body unread; once they end, requests are served again.
func TestConcurrentRequestsAreCapped(t *testing.T) {
	const limit = 3
	srv, err := Start(t.Context(), Options{RunnerToken: testRunnerToken, MaxConcurrent: limit})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	id := srv.Enqueue(Job{Script: []string{"true"}})
	job := take(t, srv)
	h := srv.handler()
	path := fmt.Sprintf("/api/v4/jobs/%d/trace", id)
	hdr := http.Header{"Content-Range": {"0-4"}, "Job-Token": {job.Token}}

	var wg sync.WaitGroup
	writers := make([]*io.PipeWriter, limit)
	codes := make([]int, limit)
	for i := range limit {
		r, w := io.Pipe()
		writers[i] = w
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i] = serve(h, "PATCH", path, hdr, r).Code
		}()
	}
	// All of them hold a slot, reading bodies that do not come.
	require.Eventually(t, func() bool { return len(srv.slots) == limit }, 5*time.Second, 5*time.Millisecond)

	body := &countingBody{size: 8 << 20}
	start := time.Now()
	rec := serve(h, "PATCH", path, hdr, body)
	require.Equal(t, http.StatusServiceUnavailable, rec.Code, rec.Body.String())
	require.Less(t, time.Since(start), 3*time.Second, "refused at once")
	require.Zero(t, body.read.Load(), "the refused request's body is not read")
	require.Equal(t, "close", rec.Header().Get("Connection"))
	require.NotEmpty(t, rec.Header().Get("Retry-After"))

	for _, w := range writers {
		_, _ = io.WriteString(w, "hello")
		require.NoError(t, w.Close())
	}
	wg.Wait()
	for i, c := range codes {
		require.Equal(t, http.StatusAccepted, c, "slow request %d", i)
	}
	require.Empty(t, srv.slots, "every slot given back")
	require.Equal(t, http.StatusAccepted, patch(t, srv, job, job.Token, 5, " world").code)
	require.Equal(t, "hello world", srv.Trace(id))
}
