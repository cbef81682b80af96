//go:build e2e

package e2e

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// The attacks of VM A (as root, or through sudo -n), busybox tools only.
// Each forged-MAC window is short (A's own MAC is back within ~2 s) so that
// A's own job connection, and so its output, survives them.
const l2Prelude = `#!/usr/bin/env bash
S=; [ "$(id -u)" = 0 ] || S="sudo -n"
command -v ip >/dev/null && command -v udhcpc >/dev/null || { echo NOTOOLS; exit 0; }
dev=$(ip -o link | awk -F': ' '$2 != "lo" { print $2; exit }'); dev=${dev%%@*}
mac=$(cat /sys/class/net/$dev/address)
gw=$(ip route | awk '/^default/ { print $3; exit }')
`

// l2Route: datagrams to B (%[1]s) through the gateway (the host as router).
const l2Route = l2Prelude + `$S ip route add %[1]s/32 via "$gw" dev "$dev" || exit 3
for i in 1 2 3 4 5; do echo x >/dev/udp/%[1]s/7777; done
$S ip route del %[1]s/32
echo routed-sent
`

// l2Flood: DHCP from 8 random MACs, own MAC back after each try. A lease
// is what udhcpc's script is told ("bound"), not its exit status: udhcpc
// ends with 0 also when timeout's SIGTERM stops it, which a slow guest
// took for a lease once.
const l2Flood = l2Prelude + `hook=$(mktemp) || exit 3
printf '#!/bin/sh\n[ "$1" = bound ] && echo "flood-lease=$ip"\nexit 0\n' > "$hook"; chmod 755 "$hook"
i=0
while [ $i -lt 8 ]; do
	r=$(od -An -N3 -tx1 /dev/urandom | tr -s ' ' ':'); r="52:54:01${r%%:}"
	$S ip link set "$dev" address "$r" || exit 3
	$S timeout 2 udhcpc -n -q -t 1 -T 1 -i "$dev" -s "$hook" 2>/dev/null | sed "s/\$/ mac=$r/"
	$S ip link set "$dev" address "$mac"
	sleep 1
	i=$((i + 1))
done
echo flood-done
`

// l2TakeMAC: B's MAC (%[2]s) and B's address announced (%[1]s) for ~3 s.
const l2TakeMAC = l2Prelude + `echo took-mac
sleep 1
$S ip link set "$dev" address %[2]s || exit 3
command -v arping >/dev/null && $S timeout 3 arping -c 3 -U -I "$dev" %[1]s >/dev/null 2>&1
$S ip link set "$dev" address "$mac"
echo mac-back
`

// TestL2FilterStopsSpoofing: with l2_filter (the default), VM A routes
// datagrams to VM B through the host, floods DHCP from random MACs and takes
// B's MAC. Nothing routed reaches B's side of the bridge (the host counts
// it; without the guard's no-routing rule it does), no forged MAC gets a
// lease, B's stage passes while A holds B's MAC, and a new VM still gets an
// address.
func TestL2FilterStopsSpoofing(t *testing.T) {
	r := setup(t)
	if r.cfg.L2Filter != nil && !*r.cfg.L2Filter {
		t.Skip("l2_filter = false in the rig configuration")
	}
	// A's own connection stalls while A sends from a forged MAC (the
	// host's packets to A's MAC go unanswered): A's runner gives its guest
	// longer before calling it dead.
	ra := r.withConfig(t, func(s string) string {
		return regexp.MustCompile(`(?m)^keepalive_count = .*$`).ReplaceAllString(s, "keepalive_count = 30")
	})
	require.Equal(t, 30, ra.cfg.SSH.KeepaliveCount)
	a, b := newStageRunner(t, ra), newStageRunner(t, r)
	prepareTogether(t, a, b)
	defer func() {
		for _, s := range []*stageRunner{a, b} {
			require.Equal(t, 0, s.run(t, "cleanup").code)
		}
	}()
	aAddr, bAddr := machineAddress(t, r, a.name(t)), machineAddress(t, r, b.name(t))
	bMAC := machineMAC(t, r, b.name(t))
	bridge := rigBridge(t, r)

	// 1. routed through the host: counted where it would leave towards B
	count := []string{"POSTROUTING", "-o", bridge, "-s", aAddr, "-d", bAddr, "-p", "udp", "--dport", "7777"}
	ipt := func(args ...string) string {
		out, err := exec.Command("iptables", append([]string{"-w", "-t", "mangle"}, args...)...).CombinedOutput()
		require.NoError(t, err, "iptables %v: %s", args, out)
		return string(out)
	}
	ipt(append([]string{"-I"}, count...)...)
	t.Cleanup(func() { _ = exec.Command("iptables", append([]string{"-w", "-t", "mangle", "-D"}, count...)...).Run() })
	counted := func() int {
		out := ipt("-L", "POSTROUTING", "-v", "-x", "-n")
		for _, l := range strings.Split(out, "\n") {
			f := strings.Fields(l)
			if len(f) > 0 && strings.Contains(l, " "+aAddr+" ") && strings.Contains(l, " "+bAddr+" ") && strings.Contains(l, "dpt:7777") {
				n, err := strconv.Atoi(f[0])
				require.NoError(t, err)
				return n
			}
		}
		t.Fatalf("no counting rule in %s", out)
		return 0
	}
	res := a.runScript(t, "build_script", fmt.Sprintf(l2Route, bAddr))
	if res.code == 0 && containsLine(res.stdout, "NOTOOLS") {
		t.Skip("the guest has no ip/udhcpc")
	}
	require.Equal(t, 0, res.code, "route: %s %s", res.stdout, res.stderr)
	require.Contains(t, res.stdout, "routed-sent")
	require.Equal(t, 0, counted(), "nothing A routes through the host leaves towards B")
	// Without the guard's rules the same datagrams go out towards B: the
	// rules are what stop them (its no-routing rule on the bridge, and
	// its jump to the chain that keeps guarded networks apart, which
	// drops routed traffic into any guarded bridge, this one included).
	noRouting := []string{"FORWARD", "-i", bridge, "-o", bridge, "-m", "physdev", "!", "--physdev-is-bridged", "-j", "DROP"}
	xnet := []string{"FORWARD", "-i", bridge, "-j", "LVE-GUARD-XNET"}
	ipt(append([]string{"-D"}, noRouting...)...)
	ipt(append([]string{"-D"}, xnet...)...)
	restored := false
	restore := func() {
		if !restored {
			ipt(append([]string{"-I", noRouting[0], "1"}, noRouting[1:]...)...)
			ipt(append([]string{"-I", xnet[0], "1"}, xnet[1:]...)...)
			restored = true
		}
	}
	t.Cleanup(restore)
	res = a.runScript(t, "build_script", fmt.Sprintf(l2Route, bAddr))
	require.Equal(t, 0, res.code, "route: %s %s", res.stdout, res.stderr)
	require.Positive(t, counted(), "without the guard's rule the host routes A's datagrams to B")
	restore()

	// 2. DHCP from forged MACs
	res = a.runScript(t, "build_script", l2Flood)
	require.Equal(t, 0, res.code, "flood: %s %s", res.stdout, res.stderr)
	require.Contains(t, res.stdout, "flood-done")
	require.NotContains(t, res.stdout, "flood-lease=", "a forged MAC must not get a lease")
	n, err := r.conn.LookupNetworkByName(r.cfg.Network)
	require.NoError(t, err)
	leases, err := n.GetDHCPLeases()
	_ = n.Free()
	require.NoError(t, err)
	for _, l := range leases {
		require.False(t, strings.HasPrefix(strings.ToLower(l.Mac), "52:54:01"), "lease for a forged MAC: %s %s", l.Mac, l.IPaddr)
	}

	// 3. B's MAC: B's next stage passes while A holds it
	rn := a.start(t, "run", writeScript(t, a, fmt.Sprintf(l2TakeMAC, bAddr, bMAC)), "build_script")
	waitFor(t, 30*time.Second, "A about to take B's MAC", func() bool { return strings.Contains(rn.out.String(), "took-mac") })
	res = b.runScript(t, "build_script", "#!/bin/sh\nsleep 2\necho b-alive\n")
	require.Equal(t, 0, res.code, "B's stage passes: %s", res.stderr)
	require.Contains(t, res.stdout, "b-alive")
	resA := rn.wait(t, time.Minute)
	require.Equal(t, 0, resA.code, "A's stage: %s %s", resA.stdout, resA.stderr)
	require.Contains(t, resA.stdout, "mac-back", "A did take B's MAC and gave it back")

	c := newStageRunner(t, r)
	require.Equal(t, 0, c.run(t, "config").code)
	require.Equal(t, 0, c.run(t, "prepare").code, "a new VM still gets an address")
	require.Equal(t, 0, c.run(t, "cleanup").code)
}

// writeScript writes a stage script into s's directory under its own name.
func writeScript(t *testing.T, s *stageRunner, text string) string {
	t.Helper()
	f, err := os.CreateTemp(s.dir, "script-*")
	require.NoError(t, err)
	_, err = f.WriteString(text)
	require.NoError(t, err)
	require.NoError(t, f.Chmod(0o700))
	require.NoError(t, f.Close())
	return f.Name()
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
	return machineRecordField(t, r, name, "mac")
}

// l2ClientIDs: DHCP from the VM's own MAC with a new client identifier
// each time (busybox udhcpc -C -x 0x3d:...), as a guest that wants more
// addresses than its own would.
const l2ClientIDs = l2Prelude + `hook=$(mktemp) || exit 3
printf '#!/bin/sh\n[ "$1" = bound ] && echo "clid-lease=$ip"\nexit 0\n' > "$hook"; chmod 755 "$hook"
i=0
while [ $i -lt 10 ]; do
	id=$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
	$S timeout 3 udhcpc -n -q -t 1 -T 1 -C -x "0x3d:ff$id" -i "$dev" -s "$hook" 2>/dev/null
	i=$((i + 1))
done
echo clid-done
`

// TestOneLeasePerVM (#42): every VM has a static DHCP host entry of its
// own (static_addresses), so a guest that asks again and again with a new
// client identifier from its own MAC holds one lease, its own address, and
// a new VM still gets its address. The entries are spares that outlive
// their VMs: a VM prepared after both are gone takes one over, MAC and
// address, without changing the network, and boots with it.
func TestOneLeasePerVM(t *testing.T) {
	r := setup(t)
	a := newStageRunner(t, r)
	require.Equal(t, 0, a.run(t, "config").code)
	require.Equal(t, 0, a.run(t, "prepare").code)
	aName := a.name(t)
	aAddr, aMAC := machineAddress(t, r, aName), strings.ToLower(machineMAC(t, r, aName))
	hosts := func() map[string]string { // name -> "mac ip"
		n, err := r.conn.LookupNetworkByName(r.cfg.Network)
		require.NoError(t, err)
		defer func() { _ = n.Free() }()
		x, err := n.GetXMLDesc(0)
		require.NoError(t, err)
		out := map[string]string{}
		for _, m := range regexp.MustCompile(`<host mac=['"]([^'"]+)['"] name=['"]([^'"]+)['"] ip=['"]([^'"]+)['"]`).FindAllStringSubmatch(x, -1) {
			out[m[2]] = strings.ToLower(m[1]) + " " + m[3]
		}
		return out
	}
	prefix := lifecycle.MachinePrefix(r.cfg.NamePrefix, r.controller(t))
	spare := func(addr string) string { return vm.SpareName(prefix, net.ParseIP(addr)) }
	require.Equal(t, aMAC+" "+aAddr, hosts()[spare(aAddr)], "A's entry: its MAC to the address it has")

	res := a.runScript(t, "build_script", l2ClientIDs)
	if res.code == 0 && containsLine(res.stdout, "NOTOOLS") {
		t.Fatalf("the rig's tiny guest has ip and udhcpc: %s", res.stdout)
	}
	require.Equal(t, 0, res.code, "client ids: %s %s", res.stdout, res.stderr)
	require.Contains(t, res.stdout, "clid-done")
	for _, l := range splitLines(res.stdout) {
		if ip, ok := strings.CutPrefix(l, "clid-lease="); ok {
			require.Equal(t, aAddr, ip, "a new client id gets no other address")
		}
	}
	n, err := r.conn.LookupNetworkByName(r.cfg.Network)
	require.NoError(t, err)
	leases, err := n.GetDHCPLeases()
	_ = n.Free()
	require.NoError(t, err)
	var mine []string
	for _, l := range leases {
		if strings.EqualFold(l.Mac, aMAC) || l.IPaddr == aAddr {
			mine = append(mine, l.IPaddr+" "+l.Clientid)
		}
	}
	require.LessOrEqual(t, len(mine), 1, "A holds one lease: %v", mine)

	c := newStageRunner(t, r)
	require.Equal(t, 0, c.run(t, "config").code)
	require.Equal(t, 0, c.run(t, "prepare").code, "a new VM still gets its address")
	cName := c.name(t)
	cAddr, cMAC := machineAddress(t, r, cName), strings.ToLower(machineMAC(t, r, cName))
	require.NotEqual(t, aAddr, cAddr)
	require.Equal(t, cMAC+" "+cAddr, hosts()[spare(cAddr)])
	for _, s := range []*stageRunner{a, c} {
		require.Equal(t, 0, s.run(t, "cleanup").code)
	}
	// cleanup's reaper removes the VMs after it returns; their entries stay.
	exists := func(name string) bool {
		d, err := r.conn.LookupDomainByName(name)
		if err != nil {
			return false
		}
		_ = d.Free()
		return true
	}
	waitFor(t, 2*time.Minute, "both VMs gone", func() bool { return !exists(aName) && !exists(cName) })
	before := hosts()
	require.Equal(t, aMAC+" "+aAddr, before[spare(aAddr)], "A's entry outlives A")
	require.Equal(t, cMAC+" "+cAddr, before[spare(cAddr)], "C's entry outlives C")

	d := newStageRunner(t, r)
	require.Equal(t, 0, d.run(t, "config").code)
	res = d.run(t, "prepare")
	require.Equal(t, 0, res.code, "a VM on a spare entry boots and answers: %s", res.stderr)
	dName := d.name(t)
	dAddr, dMAC := machineAddress(t, r, dName), strings.ToLower(machineMAC(t, r, dName))
	require.Equal(t, dMAC+" "+dAddr, before[spare(dAddr)], "D took over a spare that was there (A's, C's or an earlier VM's), MAC and address")
	require.Contains(t, res.stdout, "took spare DHCP host entry "+spare(dAddr))
	require.Equal(t, before, hosts(), "the network's entries did not change")
	got := d.runScript(t, "build_script", "ip -4 -o addr show | grep -c "+dAddr+"/")
	require.Equal(t, 0, got.code, "D has its address: %s %s", got.stdout, got.stderr)
	require.Equal(t, 0, d.run(t, "cleanup").code)
}
