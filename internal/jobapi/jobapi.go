// Package jobapi is a small fake of the GitLab job API: just enough of
// /api/v4/jobs for an unmodified `gitlab-runner run-single` to request jobs,
// stream their logs, report their final state, and upload and download
// artifacts. End-to-end tests and `libvirt-executor selftest` use it to drive
// the Custom executor with a real runner and no GitLab instance.
//
// The server hands out jobs queued with Enqueue, one per POST
// /api/v4/jobs/request, and records what the runner reports back; Wait returns
// the result. Every job has its own random job token, checked on every call
// made for that job; the runner token is checked when the runner asks for work.
package jobapi

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"
)

// Options configure a Server.
type Options struct {
	// Listen is the TCP address to listen on: "127.0.0.1:0" (the default) for
	// a local test, or an address a guest can reach, e.g. "10.213.7.1:20100".
	Listen string
	// Logger receives the server's logs; nil discards them.
	Logger *slog.Logger
	// RunnerToken is the token `gitlab-runner run-single` must present when it
	// asks for a job. Empty: a random one is generated (see Server.RunnerToken).
	RunnerToken string
	// CacheBucket, if set, also serves an S3 endpoint with this one bucket
	// for the runner's distributed cache (see Server.CacheEnv).
	CacheBucket string
	// MaxConcurrent bounds the requests handled at once; more are answered
	// 503 at once, their bodies unread. 0 means DefaultMaxConcurrent.
	MaxConcurrent int
}

// DefaultMaxConcurrent is Options.MaxConcurrent's default: far more than
// the few calls at once of the runners one self test or e2e test starts,
// few enough that requests cannot make the server hold much memory (each
// body is bounded, and read only after its token is checked where the
// token is in a header).
const DefaultMaxConcurrent = 32

// Variable is one CI/CD variable of a job.
type Variable struct {
	Key, Value string
	// Masked asks the runner to hide the value in the job log.
	Masked bool
	// File makes the runner write Value to a file and set the variable to its path.
	File bool
	// Public marks a variable that is not a secret.
	Public bool
}

// Artifacts is a job's `artifacts:` keyword.
type Artifacts struct {
	Name      string
	Paths     []string
	Untracked bool
	// When is on_success (default), on_failure or always.
	When string
	// ExpireIn is passed to the upload as is ("1 day"); empty: never.
	ExpireIn string
}

// Cache is a job's `cache:` keyword.
type Cache struct {
	Key       string
	Paths     []string
	Untracked bool
	// Policy is pull-push (default), pull or push.
	Policy string
	// When is on_success (default), on_failure or always.
	When string
}

// Job is what Enqueue hands to the runner.
type Job struct {
	Name, Stage         string
	Script, AfterScript []string
	Variables           []Variable
	// TimeoutSeconds is the job timeout; 0 means one hour.
	TimeoutSeconds int
	// GitURL is the repository the runner clones, at SHA (required with a
	// GitURL) on branch Ref (default "main"). Empty: GIT_STRATEGY=none.
	GitURL, SHA, Ref string
	Artifacts        *Artifacts
	Cache            *Cache
	// Dependencies are the ids of earlier jobs of this server whose artifacts
	// the runner downloads before the script.
	Dependencies []int64
	// Image is the job's `image:` name, if any.
	Image string
	// Run is the job's `run:` keyword (GitLab Steps) as GitLab sends it: a
	// JSON string holding the list of steps. A job with Run and no Script
	// gets no script step, as GitLab sends it.
	Run string
	// Services are the job's `services:`, sent as GitLab sends them.
	Services []Service
	// Project, if set, is the job's project instead of the fake's own
	// (id 1, lve/selftest).
	Project *Project
}

// Project is a GitLab project a job belongs to.
type Project struct {
	ID              int64
	Namespace, Name string
}

// Service is one entry of a job's `services:` keyword.
type Service struct {
	Name, Alias         string
	Entrypoint, Command []string
}

// Job states as reported in Result.State.
const (
	StateSuccess  = "success"
	StateFailed   = "failed"
	StateCanceled = "canceled"
)

// Result is what the runner reported for a finished job.
type Result struct {
	// State is success, failed or canceled.
	State string
	// FailureReason is the runner's reason for a failed or canceled job
	// (script_failure, job_execution_timeout, runner_system_failure, ...).
	FailureReason string
	// ExitCode is the exit code the runner reported (0 when it sent none).
	ExitCode int
	// Trace is the job log as the runner sent it (masked values hidden).
	Trace string
	// Duration runs from the runner picking the job up to its final update.
	Duration time.Duration
	// Artifacts is the uploaded archive (zip); nil if none.
	Artifacts []byte
}

// ErrClosed is returned by Wait when the server is closed before the job ends.
var ErrClosed = errors.New("jobapi: server closed")

type jobStatus int

const (
	statusQueued jobStatus = iota
	statusRunning
	statusDone
)

// job is the server's record of one enqueued job. Guarded by Server.mu.
type job struct {
	id      int64
	token   string
	spec    Job
	status  jobStatus
	started time.Time
	// cancel is set by Cancel: the runner is told the job is canceling.
	cancel     bool
	trace      []byte
	artifacts  []byte
	mismatches int // final updates refused because the trace did not match
	result     Result
	done       chan struct{}
}

// Server is a running fake job API. Its methods are safe for concurrent use.
type Server struct {
	log         *slog.Logger
	runnerToken string
	url         string
	public      string // SetPublicURL; "" for url. Guarded by mu.
	srv         *http.Server
	serveErr    chan error
	closed      chan struct{}
	closeOnce   sync.Once

	cache *cacheStore // nil without Options.CacheBucket
	// slots holds one token per request being handled (MaxConcurrent).
	slots chan struct{}

	mu     sync.Mutex
	nextID int64
	queue  []int64
	jobs   map[int64]*job
}

// Start listens on o.Listen and serves until Close is called or ctx ends.
func Start(ctx context.Context, o Options) (*Server, error) {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	token := o.RunnerToken
	if token == "" {
		// The runner prints the first 8 characters of its token in every job
		// log: let those be the prefix, not the secret.
		token = "lve-runner-" + randomHex(16)
	}
	if o.Listen == "" {
		o.Listen = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", o.Listen)
	if err != nil {
		return nil, fmt.Errorf("jobapi: listen on %q: %w", o.Listen, err)
	}
	s := &Server{
		log:         log,
		runnerToken: token,
		url:         "http://" + ln.Addr().String() + "/",
		serveErr:    make(chan error, 1),
		closed:      make(chan struct{}),
		// Ids start at a random point so that two servers (two selftests at
		// once) do not hand out the same job ids, which name resources.
		nextID: 1_000_000 + randomInt64(1_000_000_000),
		jobs:   make(map[int64]*job),
		slots:  make(chan struct{}, cmp.Or(o.MaxConcurrent, DefaultMaxConcurrent)),
	}
	if o.CacheBucket != "" {
		s.cache = newCacheStore(o.CacheBucket)
	}
	s.srv = &http.Server{
		Handler:           s.handler(),
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	go func() { s.serveErr <- s.srv.Serve(ln) }()
	go func() {
		select {
		case <-ctx.Done():
			_ = s.Close()
		case <-s.closed:
		}
	}()
	log.Info("job API listening", "url", s.url)
	return s, nil
}

// URL is the base URL to give `gitlab-runner --url`, e.g. "http://127.0.0.1:4321/".
func (s *Server) URL() string { return s.url }

// SetPublicURL makes the jobs' payloads name the server by u (CI_SERVER_URL,
// the project's URLs): the URL runners and guests reach it at when a TLS
// front with a host name of its own stands before it, as a real GitLab is
// reached. u must be an absolute http(s) URL ending in "/".
func (s *Server) SetPublicURL(u string) error {
	p, err := url.Parse(u)
	if err != nil || (p.Scheme != "https" && p.Scheme != "http") || p.Host == "" || !strings.HasSuffix(p.Path, "/") {
		return fmt.Errorf("jobapi: public URL %q: want http(s)://HOST[:PORT]/", u)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.public = u
	return nil
}

// RunnerToken is the token the runner must present (Options.RunnerToken or a
// generated one). It is a secret: do not log it.
func (s *Server) RunnerToken() string { return s.runnerToken }

// Close stops the server. Jobs still waited for end Wait with ErrClosed.
func (s *Server) Close() error {
	var err error
	s.closeOnce.Do(func() {
		close(s.closed)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err = s.srv.Shutdown(ctx)
		if serr := <-s.serveErr; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
	})
	return err
}

// Enqueue queues j for the next job request and returns its id. An empty
// Name or Stage becomes "job" or "test".
func (s *Server) Enqueue(j Job) int64 {
	j.Name, j.Stage = orDefault(j.Name, "job"), orDefault(j.Stage, "test")
	j.Script = slices.Clone(j.Script)
	j.AfterScript = slices.Clone(j.AfterScript)
	j.Variables = slices.Clone(j.Variables)
	j.Dependencies = slices.Clone(j.Dependencies)
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.nextID
	s.nextID++
	s.jobs[id] = &job{
		id:    id,
		token: "lve-job-" + randomHex(20),
		spec:  j,
		done:  make(chan struct{}),
	}
	s.queue = append(s.queue, id)
	s.log.Info("job queued", "job", id, "name", j.Name)
	return id
}

// Wait blocks until the runner has reported a final state for job id (or the
// job was canceled before a runner took it), ctx ends, or the server closes.
func (s *Server) Wait(ctx context.Context, id int64) (Result, error) {
	s.mu.Lock()
	j := s.jobs[id]
	s.mu.Unlock()
	if j == nil {
		return Result{}, fmt.Errorf("jobapi: no job %d", id)
	}
	select {
	case <-j.done:
	case <-ctx.Done():
		return Result{}, fmt.Errorf("jobapi: waiting for job %d: %w", id, context.Cause(ctx))
	case <-s.closed:
		select {
		case <-j.done: // a result that came before the close still counts
		default:
			return Result{}, ErrClosed
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := j.result
	r.Artifacts = slices.Clone(j.artifacts)
	return r, nil
}

// Cancel cancels job id. A queued job ends at once as canceled; for a running
// job, the next trace or status response tells the runner "canceling", which
// makes it stop the script, run after_script and report the job. A finished
// job is left alone.
func (s *Server) Cancel(id int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	j := s.jobs[id]
	if j == nil {
		return
	}
	switch j.status {
	case statusQueued:
		s.queue = slices.DeleteFunc(s.queue, func(q int64) bool { return q == id })
		s.finish(j, Result{State: StateCanceled})
	case statusRunning:
		j.cancel = true
	}
	s.log.Info("job cancel requested", "job", id)
}

// Trace returns the job log received so far for job id.
func (s *Server) Trace(id int64) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if j := s.jobs[id]; j != nil {
		return string(j.trace)
	}
	return ""
}

// finish records the final result of j. Called with s.mu held.
func (s *Server) finish(j *job, r Result) {
	r.Trace = string(j.trace)
	if !j.started.IsZero() {
		r.Duration = time.Since(j.started)
	}
	j.result = r
	j.status = statusDone
	close(j.done)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails (crypto/rand: it crashes the program instead)
	return hex.EncodeToString(b)
}

// randomInt64 is a random number in [0, n) from crypto/rand.
func randomInt64(n int64) int64 {
	v, err := rand.Int(rand.Reader, big.NewInt(n))
	if err != nil {
		panic(fmt.Sprintf("jobapi: crypto/rand: %v", err))
	}
	return v.Int64()
}
