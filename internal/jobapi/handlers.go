package jobapi

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Request bounds.
const (
	// maxJSONBody bounds the job request and status update bodies: they
	// carry their token inside, so they are read before it is checked
	// (the runner's are about 2 KiB).
	maxJSONBody = 64 << 10
	// jsonReadWait bounds how long reading such a body may take, so that
	// a slow sender does not hold one of the server's slots.
	jsonReadWait    = 30 * time.Second
	maxTracePatch   = 8 << 20   // one trace PATCH (the runner sends at most 1 MiB)
	maxTrace        = 64 << 20  // a whole job log
	maxArtifactBody = 256 << 20 // one artifacts upload
	// maxTraceMismatches bounds how often a final update is refused because
	// the log received differs from the runner's; then it is accepted anyway.
	maxTraceMismatches = 3
	// traceUpdateInterval is what the runner is told to use between trace
	// patches (its default is 3 s): a cancel reaches it sooner.
	traceUpdateInterval = "1"
)

var contentRangeRE = regexp.MustCompile(`^(\d+)-(\d+)$`)

func (s *Server) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /api/v4/jobs/request", s.requestJob)
	mux.HandleFunc("PUT /api/v4/jobs/{id}", s.updateJob)
	mux.HandleFunc("PATCH /api/v4/jobs/{id}/trace", s.patchTrace)
	mux.HandleFunc("POST /api/v4/jobs/{id}/artifacts", s.uploadArtifacts)
	mux.HandleFunc("GET /api/v4/jobs/{id}/artifacts", s.downloadArtifacts)
	if s.cache != nil {
		mux.Handle("/"+s.cache.bucket+"/", s.cache)
	}
	mux.HandleFunc("/", http.NotFound)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w, code: http.StatusOK}
		select {
		case s.slots <- struct{}{}:
			defer func() { <-s.slots }()
			mux.ServeHTTP(rec, r)
		default:
			// Busy: answer at once, the body unread; close the connection
			// rather than drain it.
			rec.Header().Set("Connection", "close")
			rec.Header().Set("Retry-After", "1")
			http.Error(rec, "503 too many requests at once", http.StatusServiceUnavailable)
		}
		// The job API's queries carry no secrets; a cache URL's does (its
		// signature): only its path is logged.
		uri := r.URL.RequestURI()
		if s.cache != nil && strings.HasPrefix(r.URL.Path, "/"+s.cache.bucket+"/") {
			uri = r.URL.Path
		}
		s.log.Debug("request", "method", r.Method, "uri", uri, "status", rec.code)
	})
}

type statusRecorder struct {
	http.ResponseWriter
	code int
}

// Unwrap lets http.ResponseController reach the connection (decodeJSON's
// read deadline).
func (r *statusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

func (r *statusRecorder) WriteHeader(code int) {
	r.code = code
	r.ResponseWriter.WriteHeader(code)
}

// requestJob answers the runner's poll: 201 with the next queued job, 204 if
// there is none, 403 for a wrong runner token.
func (s *Server) requestJob(w http.ResponseWriter, r *http.Request) {
	var req jobRequest
	if !decodeJSON(w, r, &req) {
		return
	}
	if !tokenEqual(req.Token, s.runnerToken) {
		s.log.Warn("job request with a wrong runner token", "remote", r.RemoteAddr)
		http.Error(w, "403 Forbidden", http.StatusForbidden)
		return
	}
	s.mu.Lock()
	if len(s.queue) == 0 {
		s.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
		return
	}
	j := s.jobs[s.queue[0]]
	s.queue = s.queue[1:]
	j.status = statusRunning
	j.started = time.Now()
	resp := s.payload(j)
	s.mu.Unlock()

	s.log.Info("job handed to runner", "job", j.id, "name", j.spec.Name)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	if err := json.NewEncoder(w).Encode(resp); err != nil {
		s.log.Warn("sending job to runner", "job", j.id, "err", err)
	}
}

// updateJob takes the runner's status updates: "running" (a keep-alive,
// answered with the job's remote state, so it carries a cancel) and the
// final success/failed/canceled.
func (s *Server) updateJob(w http.ResponseWriter, r *http.Request) {
	if !s.knownJob(w, r) {
		return
	}
	var req updateJobRequest
	if !decodeJSON(w, r, &req) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	j, ok := s.authJob(w, r, req.Token)
	if !ok {
		return
	}
	log := s.log.With("job", j.id)
	log.Debug("job update", "state", req.State, "failure_reason", req.FailureReason, "exit_code", req.ExitCode)
	switch j.status {
	case statusQueued:
		http.Error(w, "403 job is not running", http.StatusForbidden)
		return
	case statusDone:
		// A repeated final update (the runner retries when it missed our
		// answer): the first one stands.
		s.writeJobStatus(w, j, http.StatusOK)
		return
	}
	switch req.State {
	case "running":
		s.writeJobStatus(w, j, http.StatusOK)
		return
	case StateSuccess, StateFailed, StateCanceled:
	default:
		http.Error(w, fmt.Sprintf("400 unknown state %q", req.State), http.StatusBadRequest)
		return
	}

	// The runner sends the size and CRC32 of the log it wrote. If ours
	// differs, 412 makes it send the whole log again from offset 0.
	if sum := traceChecksum(j.trace); req.Output.Checksum != "" &&
		(req.Output.Checksum != sum || req.Output.Bytesize != len(j.trace)) {
		if j.mismatches < maxTraceMismatches {
			j.mismatches++
			log.Warn("job log differs from the runner's: asking for it again",
				"runner_bytes", req.Output.Bytesize, "runner_checksum", req.Output.Checksum,
				"bytes", len(j.trace), "checksum", sum)
			s.writeJobStatus(w, j, http.StatusPreconditionFailed)
			return
		}
		log.Warn("job log still differs from the runner's: keeping what arrived")
	}

	res := Result{State: req.State, FailureReason: req.FailureReason, ExitCode: req.ExitCode}
	if j.cancel {
		// GitLab turns a canceling job into a canceled one, whatever the
		// runner reports at the end.
		res.State = StateCanceled
	}
	s.finish(j, res)
	log.Info("job finished", "state", j.result.State, "failure_reason", j.result.FailureReason,
		"exit_code", j.result.ExitCode, "duration", j.result.Duration.Round(time.Millisecond))
	s.writeJobStatus(w, j, http.StatusOK)
}

// patchTrace appends to the job log the way GitLab does: the patch is
// written at its start offset (overwriting anything from there on); a start
// past the end of the log is answered 416 with the log's current range.
func (s *Server) patchTrace(w http.ResponseWriter, r *http.Request) {
	m := contentRangeRE.FindStringSubmatch(r.Header.Get("Content-Range"))
	if m == nil {
		http.Error(w, "400 missing or bad Content-Range", http.StatusBadRequest)
		return
	}
	start, err := strconv.Atoi(m[1])
	if err != nil {
		http.Error(w, "400 bad Content-Range", http.StatusBadRequest)
		return
	}
	// The token first, the body (up to 8 MiB) only for a running job's.
	if _, ok := s.runningJob(w, r); !ok {
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxTracePatch))
	if err != nil {
		bodyError(w, err)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// Again: the job may have ended while the body came.
	j, ok := s.authJob(w, r, r.Header.Get("JOB-TOKEN"))
	if !ok {
		return
	}
	if j.status != statusRunning {
		http.Error(w, "403 job is not running", http.StatusForbidden)
		return
	}
	if start > len(j.trace) {
		w.Header().Set("Range", fmt.Sprintf("0-%d", len(j.trace)))
		http.Error(w, "416 Range Not Satisfiable", http.StatusRequestedRangeNotSatisfiable)
		return
	}
	if start+len(body) > maxTrace {
		http.Error(w, "403 job log too large", http.StatusForbidden)
		return
	}
	j.trace = append(j.trace[:start], body...)
	w.Header().Set("Range", fmt.Sprintf("0-%d", len(j.trace)))
	s.writeJobStatus(w, j, http.StatusAccepted)
}

// uploadArtifacts stores the "file" part of the runner's multipart upload.
// Only the archive is kept; other artifact types (reports) are accepted and
// dropped.
func (s *Server) uploadArtifacts(w http.ResponseWriter, r *http.Request) {
	j, ok := s.runningJob(w, r)
	if !ok {
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxArtifactBody)
	mr, err := r.MultipartReader()
	if err != nil {
		http.Error(w, "400 "+err.Error(), http.StatusBadRequest)
		return
	}
	var data []byte
	for {
		part, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			bodyError(w, err)
			return
		}
		if part.FormName() == "file" && data == nil {
			if data, err = io.ReadAll(part); err != nil {
				bodyError(w, err)
				return
			}
		}
	}
	if data == nil {
		http.Error(w, "400 no file", http.StatusBadRequest)
		return
	}
	kind := r.URL.Query().Get("artifact_type")
	s.mu.Lock()
	if kind == "" || kind == "archive" {
		j.artifacts = data
	}
	s.mu.Unlock()
	s.log.Info("artifacts uploaded", "job", j.id, "type", kind, "bytes", len(data))
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = io.WriteString(w, "{}")
}

// downloadArtifacts serves job id's archive. The JOB-TOKEN is that of the
// running job asking for it (which must depend on job id, or be it).
func (s *Server) downloadArtifacts(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		http.NotFound(w, r)
		return
	}
	token := r.Header.Get("JOB-TOKEN")
	s.mu.Lock()
	target := s.jobs[id]
	allowed := false
	for _, j := range s.jobs {
		if j.status == statusRunning && tokenEqual(token, j.token) &&
			(j.id == id || slices.Contains(j.spec.Dependencies, id)) {
			allowed = true
		}
	}
	var data []byte
	if target != nil {
		data = target.artifacts
	}
	s.mu.Unlock()
	switch {
	case target == nil:
		http.NotFound(w, r)
	case !allowed:
		s.log.Warn("artifacts download refused", "job", id, "remote", r.RemoteAddr)
		http.Error(w, "403 Forbidden", http.StatusForbidden)
	case data == nil:
		http.Error(w, "404 no artifacts", http.StatusNotFound)
	default:
		w.Header().Set("Content-Type", "application/zip")
		w.Header().Set("Content-Length", strconv.Itoa(len(data)))
		_, _ = w.Write(data) // data is never modified after upload: safe unlocked
	}
}

// authJob finds the job named in the path and checks its token: 404 for an
// unknown job, 403 for a wrong token. Called with s.mu held.
func (s *Server) authJob(w http.ResponseWriter, r *http.Request, token string) (*job, bool) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	j := s.jobs[id]
	if err != nil || j == nil {
		http.NotFound(w, r)
		return nil, false
	}
	if !tokenEqual(token, j.token) {
		s.log.Warn("request with a wrong job token", "job", id, "method", r.Method, "path", r.URL.Path)
		http.Error(w, "403 Forbidden", http.StatusForbidden)
		return nil, false
	}
	return j, true
}

// runningJob authenticates a call by its JOB-TOKEN header before anything
// of its body is read: the job named in the path, which must be running
// (404, 403 otherwise).
func (s *Server) runningJob(w http.ResponseWriter, r *http.Request) (*job, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	j, ok := s.authJob(w, r, r.Header.Get("JOB-TOKEN"))
	if !ok {
		return nil, false
	}
	if j.status != statusRunning {
		http.Error(w, "403 job is not running", http.StatusForbidden)
		return nil, false
	}
	return j, true
}

// knownJob answers 404, before the body is read, for a call about a job
// this server never had; the call's token is in its body.
func (s *Server) knownJob(w http.ResponseWriter, r *http.Request) bool {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	s.mu.Lock()
	j := s.jobs[id]
	s.mu.Unlock()
	if err != nil || j == nil {
		http.NotFound(w, r)
		return false
	}
	return true
}

// writeJobStatus answers with the job's remote state, as GitLab does on
// trace and status calls. Called with s.mu held.
func (s *Server) writeJobStatus(w http.ResponseWriter, j *job, code int) {
	state := "running"
	switch {
	case j.status == statusDone:
		state = j.result.State
	case j.cancel:
		state = "canceling"
	}
	w.Header().Set("Job-Status", state)
	w.Header().Set("X-GitLab-Trace-Update-Interval", traceUpdateInterval)
	w.WriteHeader(code)
}

func traceChecksum(b []byte) string {
	return fmt.Sprintf("crc32:%08x", crc32.ChecksumIEEE(b))
}

// decodeJSON reads a JSON body (at most maxJSONBody, within
// jsonReadWait) into v, or answers 400/413.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	// Not every ResponseWriter can (a test's recorder): then no deadline.
	_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(jsonReadWait))
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxJSONBody)).Decode(v); err != nil {
		bodyError(w, err)
		return false
	}
	return true
}

func bodyError(w http.ResponseWriter, err error) {
	if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
		http.Error(w, "413 Request Entity Too Large", http.StatusRequestEntityTooLarge)
		return
	}
	http.Error(w, "400 "+err.Error(), http.StatusBadRequest)
}

func tokenEqual(got, want string) bool {
	return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}
