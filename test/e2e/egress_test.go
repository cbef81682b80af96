//go:build e2e

package e2e

import (
	"fmt"
	"net"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// tcpProbe is a bash function for job scripts: probe HOST PORT LABEL prints
// LABEL=REACHED when a TCP connection opens within 10 s, else LABEL=FAILED.
const tcpProbe = `probe() { if timeout 10 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; then echo "$3=REACHED"; else echo "$3=FAILED"; fi; }
`

// withImageKey adds "line" to the rig's [images.NAME] table.
func withImageKey(name, line string) func(string) string {
	return func(s string) string {
		re := regexp.MustCompile(`(?m)^\[images\.` + regexp.QuoteMeta(name) + `\]$`)
		if !re.MatchString(s) {
			return s + "\n# no [images." + name + "] table in the rig's config\n"
		}
		return re.ReplaceAllLiteralString(s, "[images."+name+"]\n"+line)
	}
}

// TestEgressAllow: an image with egress_allow reaches only the listed
// destinations (and the network's own address: the stages' SSH, DHCP,
// DNS). Two outside addresses behind the rig's host serve the same port;
// the job VM reaches the allowed one and is refused the other, which a VM
// of an image without the list reaches (so the refusal is the filter's).
func TestEgressAllow(t *testing.T) {
	base := setup(t)
	metadataStandIn(t) // 192.0.2.10:80 (and 169.254.169.254) behind the host
	out, err := exec.Command("ip", "-n", "lve-e2e-meta", "addr", "add", "192.0.2.11/24", "dev", "lve-meta1").CombinedOutput()
	require.NoError(t, err, "second outside address: %s", out)

	r := base.withConfig(t, withImageKey("tiny", `egress_allow = ["192.0.2.10:80", "198.51.100.0/24"]`))
	require.NotNil(t, r.cfg.Images["tiny"].EgressAllow, "the edited config has the list")
	limited, open := newStageRunner(t, r), newStageRunner(t, base)
	prepareTogether(t, limited, open)
	defer func() {
		for _, s := range []*stageRunner{limited, open} {
			require.Equal(t, 0, s.run(t, "cleanup").code)
		}
	}()
	script := "#!/usr/bin/env bash\n" + tcpProbe + "probe 192.0.2.10 80 allowed\nprobe 192.0.2.11 80 other\n"
	res := limited.runScript(t, "build_script", script)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "allowed=REACHED", "the listed destination answers")
	require.Contains(t, res.stdout, "other=FAILED", "a destination not listed is refused")

	res = open.runScript(t, "build_script", script)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "other=REACHED", "without egress_allow the same destination answers")

	// The stages still work after the refusals (SSH to the network's
	// address is always allowed).
	res = limited.runScript(t, "after_script", "#!/bin/sh\necho still-here\n")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "still-here")
}

// TestGarmPortClosedToJobVMs: the guard opens garm's endpoint port on the
// network for garm's guests; a GitLab job VM on the same network is
// refused it by its own network filter, while another service port of
// the host answers it (so the refusal is the filter's, not the guard's).
func TestGarmPortClosedToJobVMs(t *testing.T) {
	base := setup(t)
	garmLn, other := base.serviceListener(t), base.serviceListener(t)
	defer garmLn.Close()
	defer other.Close()
	go acceptAndClose(garmLn)
	go acceptAndClose(other)
	r := base.withConfig(t, func(s string) string {
		return s + fmt.Sprintf("\n[garm]\nimages = [\"tiny\"]\nendpoints = [%q]\n[garm.flavors.small]\nvcpus = 1\nmemory_mib = 512\n",
			"http://"+garmLn.Addr().String())
	})
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	defer func() { require.Equal(t, 0, s.run(t, "cleanup").code) }()
	gp, op := garmLn.Addr().(*net.TCPAddr), other.Addr().(*net.TCPAddr)
	res := s.runScript(t, "build_script", "#!/usr/bin/env bash\n"+tcpProbe+
		fmt.Sprintf("probe %s %d garm\nprobe %s %d other\n", gp.IP, gp.Port, op.IP, op.Port))
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "other=REACHED", "the guard's other service port answers the job VM")
	require.Contains(t, res.stdout, "garm=FAILED", "garm's port is closed to GitLab job VMs")
	require.False(t, strings.Contains(res.stdout, "garm=REACHED"))
}
