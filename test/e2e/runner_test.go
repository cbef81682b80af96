//go:build e2e

package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// sharedRunnerRelease is the gitlab-runner release binary provided beside
// the checkout on the project's CI machines (../shared/tools/README.md).
const sharedRunnerRelease = "../shared/tools/gitlab-runner-17.9.3.xz"

// runnerExpected says whether a real gitlab-runner should be there: one is
// named (LVE_E2E_GITLAB_RUNNER) or provided beside the checkout. It returns
// what was looked at.
func runnerExpected() (string, bool) {
	if v := os.Getenv("LVE_E2E_GITLAB_RUNNER"); v != "" {
		return "LVE_E2E_GITLAB_RUNNER=" + v, true
	}
	_, file, _, _ := runtime.Caller(0)
	rel := filepath.Join(filepath.Dir(file), "..", "..", sharedRunnerRelease)
	if _, err := os.Stat(rel); err == nil {
		return rel + " (unpack it with deploy/rig/test-runner.sh bin)", true
	}
	return "", false
}

// runnerBinary is the real gitlab-runner of the real-runner tier:
// LVE_E2E_GITLAB_RUNNER, else gitlab-runner on PATH. Without one the test
// skips, with what to do; it fails instead when LVE_E2E_REQUIRED=1 and a
// binary was expected (named, or provided beside the checkout).
func runnerBinary(t *testing.T) string {
	t.Helper()
	if v := os.Getenv("LVE_E2E_GITLAB_RUNNER"); v != "" {
		if st, err := os.Stat(v); err != nil || st.Mode()&0o111 == 0 {
			t.Fatalf("LVE_E2E_GITLAB_RUNNER=%s is not an executable file", v)
		}
		return v
	}
	if p, err := exec.LookPath("gitlab-runner"); err == nil {
		return p
	}
	what, expected := runnerExpected()
	if expected && os.Getenv("LVE_E2E_REQUIRED") == "1" {
		t.Fatalf("no gitlab-runner binary although one is expected (%s) and LVE_E2E_REQUIRED=1", what)
	}
	t.Skip("no real gitlab-runner: set LVE_E2E_GITLAB_RUNNER or put gitlab-runner on PATH (make test uses the release binary in ../shared/tools when there is one)")
	return ""
}
