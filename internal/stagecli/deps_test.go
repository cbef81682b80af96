package stagecli

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	module    = "gitlab.com/libvirt-executor/libvirt-executor"
	binding   = "libvirt.org/go/libvirt"
	libvirtvm = module + "/internal/vm/libvirtvm"
)

// deps lists the packages pkg is built from (go list -deps), skipping the
// test when the go tool is not at hand.
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("the go tool is not on PATH:", err)
	}
	out, err := exec.Command(goTool, "list", "-deps", pkg).CombinedOutput() //nolint:gosec // G204: the go tool and a package of this module
	require.NoError(t, err, "go list -deps %s: %s", pkg, out)
	return strings.Fields(string(out))
}

// The config and run stages are built without libvirt's cgo binding: they
// start in a few milliseconds instead of ~20 (the dynamic loader maps
// libvirt and ~60 shared libraries they would never use). Run asks the
// admin tool when it wants libvirt's word (ExplainViaAdminTool). The stages
// that do talk to libvirt, and the admin tool, import its implementation.
func TestOnlyTheExecutablesThatTalkToLibvirtLinkIt(t *testing.T) {
	for _, cmd := range []string{"config", "run"} {
		d := deps(t, module+"/cmd/"+cmd)
		require.Contains(t, d, module+"/internal/gitlab", "go list works for cmd/%s", cmd)
		require.NotContains(t, d, binding, "cmd/%s must not link libvirt (see docs/performance.md, Lean config and run)", cmd)
		require.NotContains(t, d, libvirtvm, "cmd/%s", cmd)
	}
	for _, cmd := range []string{"prepare", "cleanup", "admin"} {
		d := deps(t, module+"/cmd/"+cmd)
		require.True(t, slices.Contains(d, libvirtvm) && slices.Contains(d, binding),
			"cmd/%s talks to libvirt: it must import internal/vm/libvirtvm, which registers the connection lifecycle.Open makes", cmd)
	}
}
