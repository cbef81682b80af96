//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// l2Script runs as a job in VM A (as root, or through sudo -n): it takes
// B's MAC, routes to B through the gateway, floods DHCP from random MACs,
// and reports what it could do. Busybox tools only (ip, udhcpc).
const l2Script = `#!/bin/sh
S=; [ "$(id -u)" = 0 ] || S="sudo -n"
command -v ip >/dev/null && command -v udhcpc >/dev/null || { echo NOTOOLS; exit 0; }
dev=$(ip -o link | awk -F': ' '$2 != "lo" { print $2; exit }')
mac=$(cat /sys/class/net/$dev/address)
gw=$(ip route | awk '/^default/ { print $3; exit }')
probe() { if timeout 5 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; then echo "$3=REACHED"; else echo "$3=FAILED"; fi; }
# 1. routed through the host to B
$S ip route add %[1]s/32 via "$gw" dev "$dev" 2>/dev/null || true
probe %[1]s 22 routed
$S ip route del %[1]s/32 2>/dev/null || true
# 2. DHCP flood from random MACs (each through udhcpc, 1 try, no waiting)
i=0
while [ $i -lt 40 ]; do
	r=$(od -An -N3 -tx1 /dev/urandom | tr -s ' ' ':'); r="52:54:01${r%%:}"
	$S ip link set "$dev" address "$r" 2>/dev/null
	$S timeout 3 udhcpc -n -q -t 1 -T 1 -i "$dev" -s /bin/true >/dev/null 2>&1 && echo "flood-lease=$r"
	i=$((i + 1))
done
# 3. B's MAC (the last step: this VM's network is no use after it)
$S ip link set "$dev" address %[2]s && echo took-mac
$S arping -c 3 -U -I "$dev" %[1]s >/dev/null 2>&1 || true
sleep 3
$S ip link set "$dev" address "$mac"
echo done
`

// TestL2FilterStopsSpoofing: with l2_filter (the rig's default), VM A takes
// VM B's MAC, routes to B through the gateway and floods DHCP from random
// MACs; B's next stage still passes, nothing of A's reaches B, no forged
// MAC gets a lease, and a new VM still gets an address.
func TestL2FilterStopsSpoofing(t *testing.T) {
	r := setup(t)
	if r.cfg.L2Filter != nil && !*r.cfg.L2Filter {
		t.Skip("l2_filter = false in the rig configuration")
	}
	a, b := newStageRunner(t, r), newStageRunner(t, r)
	for _, s := range []*stageRunner{a, b} {
		require.Equal(t, 0, s.run(t, "config").code)
		require.Equal(t, 0, s.run(t, "prepare").code)
	}
	defer func() {
		for _, s := range []*stageRunner{a, b} {
			require.Equal(t, 0, s.run(t, "cleanup").code)
		}
	}()
	bAddr := machineAddress(t, r, b.name(t))
	bMAC := machineMAC(t, r, b.name(t))

	res := a.runScript(t, "build_script", fmt.Sprintf(l2Script, bAddr, bMAC))
	if res.code == 0 && containsLine(res.stdout, "NOTOOLS") {
		t.Skip("the guest has no ip/udhcpc")
	}
	t.Logf("attacker: %s", res.stdout)
	require.NotContains(t, res.stdout, "routed=REACHED", "the host must not route one guest to another")
	require.NotContains(t, res.stdout, "flood-lease=", "a forged MAC must not get a lease")

	res = b.runScript(t, "build_script", "#!/bin/sh\necho b-alive\n")
	require.Equal(t, 0, res.code, "B's next stage passes: %s", res.stderr)
	require.Contains(t, res.stdout, "b-alive")

	c := newStageRunner(t, r)
	require.Equal(t, 0, c.run(t, "config").code)
	require.Equal(t, 0, c.run(t, "prepare").code, "a new VM still gets an address")
	require.Equal(t, 0, c.run(t, "cleanup").code)
}

func containsLine(out, line string) bool {
	for _, l := range splitLines(out) {
		if l == line {
			return true
		}
	}
	return false
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}

func machineMAC(t *testing.T, r *rig, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(r.cfg.StateDir, "machines", name, "machine.json"))
	require.NoError(t, err)
	var m struct {
		MAC string `json:"mac"`
	}
	require.NoError(t, json.Unmarshal(b, &m))
	require.NotEmpty(t, m.MAC)
	return m.MAC
}
