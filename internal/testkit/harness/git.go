package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/cgi"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
)

// ServeGit serves the bare repository dir read-only over git's smart HTTP
// protocol (git http-backend behind net/http/cgi), so a guest can
// `git clone URL`. listenAddr is host:port ("127.0.0.1:0" picks a port). The
// returned URL is http://<listen address>/<basename of dir>; a listener on
// an unspecified address (0.0.0.0, [::]) is reported as 127.0.0.1, so give a
// guest the host address it can reach instead. Pushes are refused. The
// server stops when ctx is done or stop is called; stop waits for it.
func ServeGit(ctx context.Context, dir, listenAddr string) (url string, stop func(), err error) {
	dir, err = filepath.Abs(dir)
	if err != nil {
		return "", nil, err
	}
	if _, err := os.Stat(filepath.Join(dir, "objects")); err != nil {
		return "", nil, fmt.Errorf("harness: %s is not a bare git repository", dir)
	}
	execPath, err := exec.Command("git", "--exec-path").Output()
	if err != nil {
		return "", nil, fmt.Errorf("harness: git --exec-path: %w", err)
	}
	backend := filepath.Join(strings.TrimSpace(string(execPath)), "git-http-backend")
	name := filepath.Base(dir)
	cgiHandler := &cgi.Handler{
		Path: backend,
		Root: "/",
		Env: []string{
			"GIT_PROJECT_ROOT=" + filepath.Dir(dir),
			"GIT_HTTP_EXPORT_ALL=1",
		},
		InheritEnv: []string{"PATH", "HOME"},
	}
	prefix := "/" + name + "/"
	handler := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		// One repository only, fetch only.
		if !strings.HasPrefix(req.URL.Path, prefix) || strings.Contains(req.URL.Path, "..") ||
			strings.Contains(req.URL.Path, "git-receive-pack") || req.URL.Query().Get("service") == "git-receive-pack" {
			http.Error(w, "forbidden", http.StatusForbidden)
			return
		}
		cgiHandler.ServeHTTP(w, req)
	})

	ln, err := net.Listen("tcp", listenAddr)
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	stopCtx, cancel := context.WithCancel(ctx)
	go func() {
		<-stopCtx.Done()
		sctx, c := detachctx.WithTimeout(ctx, 5*time.Second)
		defer c()
		if srv.Shutdown(sctx) != nil {
			_ = srv.Close()
		}
	}()
	stop = func() {
		cancel()
		<-served
	}

	addr := ln.Addr().(*net.TCPAddr)
	host := addr.IP.String()
	if addr.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	return fmt.Sprintf("http://%s/%s", net.JoinHostPort(host, fmt.Sprint(addr.Port)), name), stop, nil
}

// Demo repository content made by MakeDemoRepo.
const (
	demoReadme  = "# lve-harness demo\n\nA tiny repository the harness clones in end-to-end tests.\n"
	demoBuildSh = `#!/bin/sh
# Demo build: proves the checkout and the CI variables reached the guest.
set -eu
echo "demo build: job ${CI_JOB_ID:-?} on $(uname -sr) as $(id -un 2>/dev/null || id -u)"
test -f README.md
echo "demo build: commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "demo build: OK"
`
)

// MakeDemoRepo creates dir/demo.git, a bare repository with one commit on
// main holding README.md and an executable build.sh, with the git CLI. The
// commit is deterministic (fixed author and dates). It returns the bare
// repository's path and the commit's SHA.
func MakeDemoRepo(dir string) (bareDir, sha string, err error) {
	work := filepath.Join(dir, "demo-work")
	bareDir = filepath.Join(dir, "demo.git")
	if err := os.MkdirAll(work, 0o755); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(filepath.Join(work, "README.md"), []byte(demoReadme), 0o644); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(filepath.Join(work, "build.sh"), []byte(demoBuildSh), 0o755); err != nil {
		return "", "", err
	}
	env := append(os.Environ(),
		"GIT_AUTHOR_NAME=lve-harness", "GIT_AUTHOR_EMAIL=harness@example.invalid",
		"GIT_COMMITTER_NAME=lve-harness", "GIT_COMMITTER_EMAIL=harness@example.invalid",
		"GIT_AUTHOR_DATE=2025-01-01T00:00:00Z", "GIT_COMMITTER_DATE=2025-01-01T00:00:00Z",
		"GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null",
	)
	git := func(dir string, args ...string) (string, error) {
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		cmd.Env = env
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
		}
		return strings.TrimSpace(string(out)), nil
	}
	steps := [][]string{
		{"init", "-q", "-b", "main"},
		{"add", "README.md", "build.sh"},
		{"-c", "commit.gpgsign=false", "commit", "-q", "-m", "demo: README and build.sh"},
	}
	for _, s := range steps {
		if _, err := git(work, s...); err != nil {
			return "", "", err
		}
	}
	if sha, err = git(work, "rev-parse", "HEAD"); err != nil {
		return "", "", err
	}
	if _, err := os.Stat(bareDir); err == nil {
		return "", "", errors.New("harness: " + bareDir + " already exists")
	}
	if _, err := git(dir, "clone", "-q", "--bare", work, bareDir); err != nil {
		return "", "", err
	}
	return bareDir, sha, nil
}
