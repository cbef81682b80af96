package jobapi

import (
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// cacheStore is a minimal S3-compatible object store for the runner's
// distributed cache ([runners.cache] Type "s3"): the runner signs URLs for
// one object with its access key, and the gitlab-runner in the guest PUTs
// and GETs the cache archive there. It keeps objects in memory, bounded in
// size (256 MiB an object, 1 GiB in all), and accepts only requests that
// name its access key; the signature itself is not verified (a test
// endpoint that lives as long as one test or selftest).
type cacheStore struct {
	bucket, accessKey, secretKey string

	mu      sync.Mutex
	objects map[string][]byte
}

// maxCacheObject bounds one cache archive, maxCacheTotal all of them.
const (
	maxCacheObject = 256 << 20
	maxCacheTotal  = 1 << 30
)

func newCacheStore(bucket string) *cacheStore {
	return &cacheStore{bucket: bucket, accessKey: "LVEFAKE" + strings.ToUpper(randomHex(6)), secretKey: randomHex(20), objects: map[string][]byte{}}
}

// signedByUs: a pre-signed URL (X-Amz-Credential) or a signed request
// (Authorization) naming our access key.
func (c *cacheStore) signedByUs(r *http.Request) bool {
	cred := r.URL.Query().Get("X-Amz-Credential")
	if cred == "" {
		if _, after, ok := strings.Cut(r.Header.Get("Authorization"), "Credential="); ok {
			cred = after
		}
	}
	return strings.HasPrefix(cred, c.accessKey+"/")
}

func (c *cacheStore) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := strings.TrimPrefix(r.URL.Path, "/"+c.bucket+"/")
	if key == "" || strings.Contains(key, "..") {
		http.Error(w, "bad object key", http.StatusBadRequest)
		return
	}
	if !c.signedByUs(r) {
		http.Error(w, "AccessDenied", http.StatusForbidden)
		return
	}
	switch r.Method {
	case http.MethodPut:
		b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxCacheObject))
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			http.Error(w, "EntityTooLarge", http.StatusRequestEntityTooLarge)
			return
		case err != nil:
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		total := len(b)
		for k, o := range c.objects {
			if k != key {
				total += len(o)
			}
		}
		if total > maxCacheTotal {
			c.mu.Unlock()
			http.Error(w, "QuotaExceeded", http.StatusInsufficientStorage)
			return
		}
		c.objects[key] = b
		c.mu.Unlock()
		w.WriteHeader(http.StatusOK)
	case http.MethodGet, http.MethodHead:
		c.mu.Lock()
		b, ok := c.objects[key]
		c.mu.Unlock()
		if !ok {
			http.Error(w, "NoSuchKey", http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		w.WriteHeader(http.StatusOK)
		if r.Method == http.MethodGet {
			_, _ = w.Write(b)
		}
	default:
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
	}
}

// CacheEnv is the environment that points gitlab-runner's distributed
// cache at this server's S3 endpoint (Options.CacheBucket); nil without one.
// The keys are this server's own, made up at Start.
func (s *Server) CacheEnv() []string {
	if s.cache == nil {
		return nil
	}
	host := strings.TrimSuffix(strings.TrimPrefix(s.url, "http://"), "/")
	if _, _, err := net.SplitHostPort(host); err != nil {
		return nil
	}
	return []string{
		"CACHE_TYPE=s3", "CACHE_SHARED=true",
		"CACHE_S3_SERVER_ADDRESS=" + host, "CACHE_S3_INSECURE=true",
		"CACHE_S3_BUCKET_NAME=" + s.cache.bucket, "CACHE_S3_BUCKET_LOCATION=us-east-1",
		"CACHE_S3_ACCESS_KEY=" + s.cache.accessKey, "CACHE_S3_SECRET_KEY=" + s.cache.secretKey,
	}
}

// CacheObjects is how many objects the cache endpoint holds.
func (s *Server) CacheObjects() int {
	if s.cache == nil {
		return 0
	}
	s.cache.mu.Lock()
	defer s.cache.mu.Unlock()
	return len(s.cache.objects)
}
