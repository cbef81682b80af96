package lifecycle

import (
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

func TestMachineName(t *testing.T) {
	inst := InstanceTag("https://gitlab.example.com", "7")
	require.Regexp(t, `^[0-9a-f]{8}$`, inst)
	require.Equal(t, inst, InstanceTag("https://gitlab.example.com", "7"), "stable")
	require.NotEqual(t, inst, InstanceTag("https://gitlab.example.org", "7"))
	require.NotEqual(t, inst, InstanceTag("https://gitlab.example.com", "8"))
	require.NotEqual(t, InstanceTag("ab", "c"), InstanceTag("a", "bc"), "parts do not run into each other")

	n := MachineName("lve", "0123abcd-0000-4000-8000-000000000000", inst, 1000)
	require.Equal(t, "lve-0123abcd-"+inst+"-1000", n)
	require.NoError(t, vm.CheckName(n))
}

// longestPrefix is the longest name_prefix the configuration accepts.
func longestPrefix(t *testing.T) string {
	t.Helper()
	longest := ""
	for n := 1; n <= 80; n++ {
		p := "p" + strings.Repeat("9", n-1)
		if _, err := config.Parse([]byte("name_prefix = \"" + p + "\"\n[images.a]\nbase = \"/a.qcow2\"\n")); err == nil {
			longest = p
		}
	}
	require.NotEmpty(t, longest)
	return longest
}

// Every name MachineName makes is one the sweep recognises as this
// installation's (it starts with MachinePrefix) and one the VM engine accepts
// (vm.CheckName), up to the longest prefix the configuration allows and the
// largest job id.
func TestMachineNameFitsSweepAndEngine(t *testing.T) {
	ctrl := "0123abcd-0000-4000-8000-000000000000"
	for _, prefix := range []string{"a", "lve", "ci-runner-2", longestPrefix(t)} {
		for _, inst := range []string{InstanceTag("", ""), InstanceTag("https://gitlab.example.com", "1")} {
			for _, id := range []int64{1, 1000, math.MaxInt64} {
				n := MachineName(prefix, ctrl, inst, id)
				require.True(t, strings.HasPrefix(n, MachinePrefix(prefix, ctrl)), n)
				require.NoError(t, vm.CheckName(n))
			}
		}
	}
}
