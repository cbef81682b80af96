package harness

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func requireGit(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git not installed")
	}
}

func gitOut(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "git %v: %s", args, out)
	return strings.TrimSpace(string(out))
}

func TestServeGitClone(t *testing.T) {
	t.Parallel()
	requireGit(t)
	tmp := t.TempDir()
	bare, sha, err := MakeDemoRepo(tmp)
	require.NoError(t, err)
	require.Len(t, sha, 40)

	url, stop, err := ServeGit(context.Background(), bare, "127.0.0.1:0")
	require.NoError(t, err)
	defer stop()
	assert.True(t, strings.HasPrefix(url, "http://127.0.0.1:"), url)
	assert.True(t, strings.HasSuffix(url, "/demo.git"), url)

	dest := filepath.Join(tmp, "clone")
	gitOut(t, tmp, "clone", "-q", url, dest)
	assert.Equal(t, sha, gitOut(t, dest, "rev-parse", "HEAD"))
	assert.FileExists(t, filepath.Join(dest, "build.sh"))
	assert.Contains(t, gitOut(t, tmp, "ls-remote", url), "refs/heads/main")

	// Read-only: pushes and other paths are refused.
	resp, err := http.Get(url + "/info/refs?service=git-receive-pack")
	require.NoError(t, err)
	_ = resp.Body.Close()
	assert.Equal(t, http.StatusForbidden, resp.StatusCode)
	resp, err = http.Get(strings.TrimSuffix(url, "/demo.git") + "/demo-work/.git/info/refs?service=git-upload-pack")
	require.NoError(t, err)
	_ = resp.Body.Close()
	assert.Equal(t, http.StatusForbidden, resp.StatusCode)

	// Second repo in the same dir is refused by MakeDemoRepo.
	_, _, err = MakeDemoRepo(tmp)
	assert.Error(t, err)
}

// TestJobWithRealGetSources runs a whole job whose get_sources really
// fetches the served repository (token embedded in the URL, as GitLab does)
// and whose build runs the checked-out build.sh.
func TestJobWithRealGetSources(t *testing.T) {
	t.Parallel()
	requireGit(t)
	tmp := t.TempDir()
	bare, sha, err := MakeDemoRepo(tmp)
	require.NoError(t, err)
	url, stop, err := ServeGit(context.Background(), bare, "127.0.0.1:0")
	require.NoError(t, err)
	defer stop()

	f := newFake(t, nil)
	opts := f.opts(t)
	opts.Env = append(os.Environ(), "GIT_CONFIG_GLOBAL=/dev/null", "GIT_CONFIG_NOSYSTEM=1")
	const token = "glcbt-git-test-token-42"
	res := run(t, opts, Job{
		Token: token, RepoURL: url, SHA: sha, Ref: "main",
		Script: []string{"./build.sh", "git rev-parse HEAD"},
	})
	require.Equal(t, StateSuccess, res.State, res.Log)
	assert.Contains(t, res.Log, "demo build: OK")
	assert.Contains(t, res.Log, sha)
	assert.Contains(t, res.Log, "Checking out "+sha[:8]+" as detached HEAD (ref is main)...")
	assert.NotContains(t, res.Log, token)
	assert.Equal(t, filepath.Join(f.builds, "demo"), res.ProjectDir)
	assert.FileExists(t, filepath.Join(res.ProjectDir, "README.md"))

	// A second job in the same builds dir fetches into the existing checkout.
	res = run(t, opts, Job{RepoURL: url, Ref: "main", Script: []string{"./build.sh"}})
	require.Equal(t, StateSuccess, res.State, res.Log)
	assert.Contains(t, res.Log, "Checking out origin/main")
}
