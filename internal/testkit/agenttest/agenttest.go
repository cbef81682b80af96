// Package agenttest is test tooling: the guest agent (cmd/lve-agent)
// built static for a test that runs it as a process.
package agenttest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// Package is the agent's main package.
const Package = "gitlab.com/libvirt-executor/libvirt-executor/cmd/lve-agent"

// Build builds the agent (CGO_ENABLED=0, as for a guest) into dir and
// returns its path.
func Build(dir string) (string, error) {
	bin := filepath.Join(dir, "lve-agent")
	build := exec.Command("go", "build", "-o", bin, Package)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build lve-agent: %v\n%s", err, out)
	}
	return bin, nil
}

// BuildT is Build into the test's temporary directory, failing the test
// when the build fails.
func BuildT(t testing.TB) string {
	t.Helper()
	bin, err := Build(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return bin
}
