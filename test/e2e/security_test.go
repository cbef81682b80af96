//go:build e2e

package e2e

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestSecretsStayOffTheHost passes a canary secret the way the runner does:
// in the environment (CUSTOM_ENV_*) and inside the stage script. It must never
// appear in a process command line, the executables' own output, the domain
// XML, or any file left on the host after cleanup.
func TestSecretsStayOffTheHost(t *testing.T) {
	r := setup(t)
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	canary := "lve-canary-" + hex.EncodeToString(b)

	s := newStageRunner(t, r)
	s.env = append(s.env, "CUSTOM_ENV_DEPLOY_TOKEN="+canary)
	var outputs []string
	collect := func(res stageResult) stageResult {
		outputs = append(outputs, res.stdout, res.stderr)
		return res
	}
	require.Equal(t, 0, collect(s.run(t, "config")).code)
	require.Equal(t, 0, collect(s.run(t, "prepare")).code)
	name := s.name(t)

	// Sample every process's command line while the stage runs.
	stop := make(chan struct{})
	var hits []string
	var mu sync.Mutex
	var samples int
	go func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
			for _, p := range procs {
				if b, err := os.ReadFile(p); err == nil && bytes.Contains(b, []byte(canary)) {
					mu.Lock()
					hits = append(hits, p+": "+strings.ReplaceAll(string(b), "\x00", " "))
					mu.Unlock()
				}
			}
			mu.Lock()
			samples++
			mu.Unlock()
			time.Sleep(20 * time.Millisecond)
		}
	}()
	script := "#!/usr/bin/env bash\n\ntrap exit 1 TERM\n\nexport DEPLOY_TOKEN=$'" + canary + "'\n" +
		"test \"${#DEPLOY_TOKEN}\" -gt 10 && echo token-present\nsleep 3\n"
	res := collect(s.runScript(t, "build_script", script))
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "token-present", "the secret reached the guest")

	// The domain XML while the VM runs.
	d, err := r.conn.LookupDomainByName(name)
	require.NoError(t, err)
	x, err := d.GetXMLDesc(0)
	_ = d.Free()
	require.NoError(t, err)
	require.NotContains(t, x, canary, "domain XML")
	require.NotContains(t, x, "PRIVATE KEY", "no private key material in the domain XML")

	close(stop)
	require.Equal(t, 0, collect(s.run(t, "cleanup")).code)
	mu.Lock()
	require.Greater(t, samples, 10, "command lines were sampled during the stage")
	require.Empty(t, hits, "secret on a command line")
	mu.Unlock()
	for _, o := range outputs {
		require.NotContains(t, o, canary, "the executables' output")
	}

	// The job's VM goes in its reaper, after cleanup returned: its disk
	// holds what the job wrote until then (a loaded host showed it).
	r.requireNoLeftovers(t, "after cleanup")
	// Files left on the host: state, pool, libvirt's own directories, /tmp
	// (the runner's script dir is the test's own temp dir, removed by the
	// runner; it is skipped here).
	roots := []string{r.cfg.StateDir, "/var/lib/libvirt", "/etc/libvirt", "/var/log/libvirt", "/run/libvirt", "/tmp", "/var/tmp"}
	if active, path, err := poolPath(r); err == nil && active {
		roots = append(roots, path)
	}
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			if e.IsDir() {
				if p == s.dir || strings.HasPrefix(p, os.TempDir()+"/go-build") {
					return filepath.SkipDir
				}
				return nil
			}
			info, err := e.Info()
			if err != nil || !info.Mode().IsRegular() || info.Size() > 64<<20 {
				return nil
			}
			b, err := os.ReadFile(p)
			if err == nil && bytes.Contains(b, []byte(canary)) {
				t.Errorf("secret left on the host in %s", p)
			}
			return nil
		})
	}
}

func poolPath(r *rig) (bool, string, error) {
	p, err := r.conn.LookupStoragePoolByName(r.cfg.StoragePool)
	if err != nil {
		return false, "", err
	}
	defer p.Free()
	active, err := p.IsActive()
	if err != nil {
		return false, "", err
	}
	x, err := p.GetXMLDesc(0)
	if err != nil {
		return false, "", err
	}
	i := strings.Index(x, "<path>")
	j := strings.Index(x, "</path>")
	if i < 0 || j < i {
		return active, "", nil
	}
	return active, x[i+6 : j], nil
}

// TestForgedJobIDCannotTouchAnotherJob: a job that sets CI_JOB_ID to another
// job's id gets its identity from JOB_RESPONSE_FILE anyway; the other job's VM
// survives the forger's cleanup.
func TestForgedJobIDCannotTouchAnotherJob(t *testing.T) {
	r := setup(t)
	victim := newStageRunner(t, r)
	require.Equal(t, 0, victim.run(t, "config").code)
	require.Equal(t, 0, victim.run(t, "prepare").code)
	defer func() { require.Equal(t, 0, victim.run(t, "cleanup").code) }()
	victimName := victim.name(t)
	victimID := victimName[strings.LastIndex(victimName, "-")+1:]

	forger := newStageRunner(t, r)
	forger.env = append(forger.env, "CUSTOM_ENV_CI_JOB_ID="+victimID, "CUSTOM_ENV_CI_BUILD_ID="+victimID)
	require.Equal(t, 0, forger.run(t, "config").code)
	require.NotEqual(t, victimName, forger.name(t), "the forger's VM name comes from its own payload")
	require.Equal(t, 0, forger.run(t, "cleanup").code)

	res := victim.runScript(t, "build_script", "#!/usr/bin/env bash\necho victim-alive\n")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "victim-alive")
}

// TestJobVMsCannotReachEachOther: with isolated ports (the default), job A's VM
// cannot open a connection to job B's SSH port, while it still reaches the
// host side of the network.
func TestJobVMsCannotReachEachOther(t *testing.T) {
	r := setup(t)
	if r.cfg.IsolateGuests != nil && !*r.cfg.IsolateGuests {
		t.Skip("isolate_guests = false in the rig configuration")
	}
	a, b := newStageRunner(t, r), newStageRunner(t, r)
	prepareTogether(t, a, b)
	defer func() {
		for _, s := range []*stageRunner{a, b} {
			require.Equal(t, 0, s.run(t, "cleanup").code)
		}
	}()
	bAddr := machineAddress(t, r, b.name(t))

	ln := r.serviceListener(t)
	defer ln.Close()
	go acceptAndClose(ln)
	hostPort := ln.Addr().(*net.TCPAddr)

	probe := `probe() { bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null & p=$!
  for i in $(seq 1 16); do sleep 0.5; if ! kill -0 $p 2>/dev/null; then if wait $p; then echo "$3=REACHED"; else echo "$3=FAILED"; fi; return; fi; done
  kill $p 2>/dev/null; echo "$3=TIMEOUT"; }
`
	script := "#!/usr/bin/env bash\n" + probe +
		fmt.Sprintf("probe %s %d host\nprobe %s 22 peer\n", hostPort.IP, hostPort.Port, bAddr)
	res := a.runScript(t, "build_script", script)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "host=REACHED", "the host side of the network stays reachable")
	require.NotContains(t, res.stdout, "peer=REACHED", "another job's VM must not be reachable")
	require.Regexp(t, `peer=(FAILED|TIMEOUT)`, res.stdout)
}

// TestJobVMsReachOnlyAllowedHostServices: the rig's guard lets a job VM reach
// the host side of its network only on DHCP, DNS and the declared service
// ports; any other host port is refused.
func TestJobVMsReachOnlyAllowedHostServices(t *testing.T) {
	r := setup(t)
	allowed := r.serviceListener(t)
	defer allowed.Close()
	other, err := net.Listen("tcp", r.gateway(t)+":0") // an ephemeral port: a "host service"
	require.NoError(t, err)
	defer other.Close()
	go acceptAndClose(allowed)
	go acceptAndClose(other)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	defer func() { require.Equal(t, 0, s.run(t, "cleanup").code) }()
	a, o := allowed.Addr().(*net.TCPAddr), other.Addr().(*net.TCPAddr)
	script := "#!/usr/bin/env bash\n" +
		fmt.Sprintf("if bash -c 'exec 3<>/dev/tcp/%s/%d' 2>/dev/null; then echo allowed=REACHED; else echo allowed=FAILED; fi\n", a.IP, a.Port) +
		fmt.Sprintf("if bash -c 'exec 3<>/dev/tcp/%s/%d' 2>/dev/null; then echo other=REACHED; else echo other=FAILED; fi\n", o.IP, o.Port)
	res := s.runScript(t, "build_script", script)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "allowed=REACHED")
	require.Contains(t, res.stdout, "other=FAILED", "a host service outside the allowed ports must not be reachable")
}

func machineAddress(t *testing.T, r *rig, name string) string {
	t.Helper()
	return machineRecordField(t, r, name, "address")
}

// machineRecordField is a non-empty string field of the machine's state
// record (machine.json).
func machineRecordField(t *testing.T, r *rig, name, field string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(r.cfg.StateDir, "machines", name, "machine.json"))
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	v, _ := m[field].(string)
	require.NotEmpty(t, v, "%s of %s", field, name)
	return v
}

// TestJobVMsCannotReachMetadataAddress: a stand-in for a cloud metadata
// service (169.254.169.254) sits behind the rig's host, reachable by
// routing, next to an ordinary outside address (192.0.2.10) on the same
// link. The guest reaches the ordinary address (so routing and NAT work)
// but not the metadata address: the network's guard refuses it.
func TestJobVMsCannotReachMetadataAddress(t *testing.T) {
	r := setup(t)
	metadataStandIn(t)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	defer func() { require.Equal(t, 0, s.run(t, "cleanup").code) }()
	probe := func(label, ip string) string {
		return fmt.Sprintf("if timeout 10 bash -c 'exec 3<>/dev/tcp/%s/80' 2>/dev/null; then echo %s=REACHED; else echo %s=FAILED; fi\n", ip, label, label)
	}
	script := "#!/usr/bin/env bash\n" + probe("outside", "192.0.2.10") + probe("metadata", "169.254.169.254")
	res := s.runScript(t, "build_script", script)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "outside=REACHED", "the stand-in is reachable by routing: the test can tell a refusal from no route")
	require.Contains(t, res.stdout, "metadata=FAILED", "the link-local metadata address must not be reachable from a job")

	// Without the guard's FORWARD rule the same guest reaches it: the rule,
	// not something else, is what keeps it out.
	bridge := rigBridge(t, r)
	rule := []string{"FORWARD", "-i", bridge, "-d", "169.254.0.0/16", "-j", "DROP"}
	out, err := exec.Command("iptables", append([]string{"-w", "-t", "mangle", "-D"}, rule...)...).CombinedOutput()
	require.NoError(t, err, "the guard's rule is in place: %s", out)
	t.Cleanup(func() {
		if exec.Command("iptables", append([]string{"-w", "-t", "mangle", "-C"}, rule...)...).Run() != nil {
			_ = exec.Command("iptables", append([]string{"-w", "-t", "mangle", "-I", rule[0], "1"}, rule[1:]...)...).Run()
		}
	})
	res = s.runScript(t, "build_script", script)
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "metadata=REACHED", "without the guard rule the stand-in answers")
	out, err = exec.Command("iptables", append([]string{"-w", "-t", "mangle", "-I", rule[0], "1"}, rule[1:]...)...).CombinedOutput()
	require.NoError(t, err, "restore the guard: %s", out)
}

// rigBridge is the bridge of the rig's network, from libvirt.
func rigBridge(t *testing.T, r *rig) string {
	t.Helper()
	n, err := r.conn.LookupNetworkByName(r.cfg.Network)
	require.NoError(t, err)
	defer n.Free()
	name, err := n.GetBridgeName()
	require.NoError(t, err)
	return name
}

const helperListenEnv = "LVE_E2E_HELPER_LISTEN"

// metadataStandIn makes a network namespace (private to this test process)
// joined to the rig's namespace by a veth pair: 192.0.2.10 and
// 169.254.169.254 live there, each serving TCP port 80, and the rig's side
// routes to both. Everything is removed with the namespace.
func metadataStandIn(t *testing.T) {
	t.Helper()
	ipc := func(args ...string) {
		out, err := exec.Command("ip", args...).CombinedOutput()
		require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
	}
	const ns = "lve-e2e-meta"
	_ = exec.Command("ip", "netns", "del", ns).Run() // an interrupted earlier run
	ipc("netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() }) // takes the veth pair with it
	ipc("link", "add", "lve-meta0", "type", "veth", "peer", "name", "lve-meta1")
	ipc("link", "set", "lve-meta1", "netns", ns)
	ipc("addr", "add", "192.0.2.1/24", "dev", "lve-meta0")
	ipc("link", "set", "lve-meta0", "up")
	ipc("route", "add", "169.254.169.254/32", "dev", "lve-meta0")
	ipc("-n", ns, "addr", "add", "192.0.2.10/24", "dev", "lve-meta1")
	ipc("-n", ns, "addr", "add", "169.254.169.254/16", "dev", "lve-meta1")
	ipc("-n", ns, "link", "set", "lo", "up")
	ipc("-n", ns, "link", "set", "lve-meta1", "up")

	// The service: this test binary, run inside the namespace.
	cmd := exec.Command("ip", "netns", "exec", ns, os.Args[0])
	cmd.Env = append(os.Environ(), helperListenEnv+"=0.0.0.0:80")
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	stdin, err := cmd.StdinPipe() // closing it ends the helper
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	line := make([]byte, 6)
	_, err = io.ReadFull(stdout, line)
	require.NoError(t, err)
	require.Equal(t, "ready\n", string(line))
}

// helperListen serves addr (accept and close) until stdin closes.
func helperListen(addr string) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Print("ready\n")
	go acceptAndClose(ln)
	_, _ = io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

// TestGuardHook runs deploy/network/libvirt-executor-guard the way libvirt
// does (network name, operation, network XML on stdin) in a network
// namespace of its own: rules appear on "started" for a configured network,
// twice is the same as once, they go on "stopped"; unconfigured networks are
// left alone; and it fails closed (non-zero, so libvirt does not bring the
// network up) on a missing configuration, bad ports, IPv6 or a host bridge.
func TestGuardHook(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for iptables in a private network namespace")
	}
	script, err := filepath.Abs("../../deploy/network/libvirt-executor-guard")
	require.NoError(t, err)
	dir := t.TempDir()
	conf := filepath.Join(dir, "guard.conf")
	// CRLF line ends and no final newline: the last network still counts.
	require.NoError(t, os.WriteFile(conf, []byte("# comment\r\nother\r\nbadports 0,70000\r\nci 3128,8080"), 0o644))
	// One shell in a fresh network namespace runs every step and prints the
	// rules (or the exit status) after each, separated by markers.
	steps := `
hook() { LIBVIRT_EXECUTOR_GUARD_CONF=${CONF:-` + conf + `} "` + script + `" "$@"; }
net() { echo "<network><name>$1</name><forward mode='${3:-nat}'/><bridge name='$2' stp='on' delay='0'/>${4:-}</network>"; }
dump() { echo "== $1"; { iptables -w -S; iptables -w -t mangle -S; } | grep -E 'GUARD|169.254|physdev' || true; }
status() { echo "== $1 $2"; }
ip link add virbr-ci type bridge && ip addr add 192.168.150.1/24 dev virbr-ci && ip link set virbr-ci up
net ci virbr-ci | hook ci started begin -;  dump started
net ci virbr-ci | hook ci started begin -;  dump again
iptables -w -N LVE-GUARD-virbr-ci-n; iptables -w -I INPUT 1 -i virbr-ci -j LVE-GUARD-virbr-ci-n  # as an interrupted apply leaves it
net ci virbr-ci | hook ci stopped end -;    dump stopped
net unknown virbr-x | hook unknown started begin -; dump unknown
net ci virbr-ci | CONF=` + dir + `/missing hook ci started begin - 2>/dev/null; status noconf $?
net badports virbr-b | hook badports started begin - 2>/dev/null; status badports $?
net ci virbr-ci nat "<ip family='ipv6' address='fd00::1' prefix='64'/>" | hook ci started begin - 2>/dev/null; status ipv6 $?
net ci br0 bridge | hook ci started begin - 2>/dev/null; status hostbridge $?
dump afterrefusals
hook apply 'br0;reboot' 80 2>/dev/null; status badbridge $?
hook apply br0 '80 -j ACCEPT' 2>/dev/null; status badportsyntax $?
hook apply br0 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 2>/dev/null; status toomanyports $?
iptables -w -N libvirt-host-in; iptables -w -I INPUT 1 -j libvirt-host-in  # as libvirt's network filters do
net ci virbr-ci | hook ci started begin -; echo "== order"; iptables -w -S INPUT
`
	out, err := exec.Command("unshare", "--net", "bash", "-c", steps).CombinedOutput()
	require.NoError(t, err, "%s", out)
	sections := map[string]string{}
	for _, part := range strings.Split(string(out), "== ")[1:] {
		name, body, _ := strings.Cut(part, "\n")
		fields := strings.Fields(name)
		sections[fields[0]] = strings.Join(fields[1:], " ") + body
	}
	t.Logf("%s", out)
	started := sections["started"]
	for _, want := range []string{
		"-A INPUT -i virbr-ci -j LVE-GUARD-virbr-ci",
		"-A LVE-GUARD-virbr-ci -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
		"-A LVE-GUARD-virbr-ci -p udp -m udp --dport 67 -j ACCEPT",
		// the service ports at the bridge's own address only
		"-A LVE-GUARD-virbr-ci -d 192.168.150.1/32 -p tcp -m multiport --dports 3128,8080 -j ACCEPT",
		"-A LVE-GUARD-virbr-ci -j REJECT --reject-with icmp-port-unreachable",
		// forwarding rules in the mangle table, before libvirt's filter jumps
		"-A FORWARD -d 169.254.0.0/16 -i virbr-ci -j DROP",
		// no routing from the bridge back into it (guest -> host -> guest)
		"-A FORWARD -i virbr-ci -o virbr-ci -m physdev ! --physdev-is-bridged -j DROP",
	} {
		require.Contains(t, started, want)
	}
	require.Equal(t, started, sections["again"], "applying twice is the same as once (and leaves no temporary chain)")
	require.Empty(t, strings.TrimSpace(sections["stopped"]), "all rules gone when the network stops")
	require.Empty(t, strings.TrimSpace(sections["unknown"]), "networks not in the configuration are left alone")
	for _, refused := range []string{"noconf", "badports", "ipv6", "hostbridge"} {
		require.Equal(t, "1", strings.TrimSpace(sections[refused]), "%s: the hook fails, so libvirt does not start the network", refused)
	}
	require.Empty(t, strings.TrimSpace(sections["afterrefusals"]), "a refusal installs nothing")
	for _, bad := range []string{"badbridge", "badportsyntax", "toomanyports"} {
		require.Equal(t, "2", strings.TrimSpace(sections[bad]), bad)
	}
	// With libvirt's filter jump in INPUT, the guard's comes after it: a VM's
	// own filter (garm's port refused to job VMs) decides first.
	order := sections["order"]
	lv, guard := strings.Index(order, "-A INPUT -j libvirt-host-in"), strings.Index(order, "-A INPUT -i virbr-ci -j LVE-GUARD-virbr-ci")
	require.True(t, lv >= 0 && guard > lv, "libvirt's jump first, then the guard's: %s", order)
}

// TestGuardHookKeepsGuardedNetworksApart: a route or open network forwards,
// so with two guarded networks on one host a guest of one could reach the
// guests of the other through the host (libvirt's route rules accept
// anything addressed to the network's subnet; open adds none). In a network
// namespace of its own, with forwarding on: two guarded bridges (route and
// open) and an unguarded one, a guest (a namespace of its own) on each. A
// guest of one guarded network reaches neither the other's guest nor is
// reached from it; the unguarded network is still reached (outbound traffic
// follows the network's forward mode); stopping one network leaves the
// other's rules, stopping both leaves nothing.
func TestGuardHookKeepsGuardedNetworksApart(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for iptables in a private network namespace")
	}
	script, err := filepath.Abs("../../deploy/network/libvirt-executor-guard")
	require.NoError(t, err)
	dir := t.TempDir()
	conf := filepath.Join(dir, "guard.conf")
	require.NoError(t, os.WriteFile(conf, []byte("ci\nci2\n"), 0o644))
	steps := `
set -u
hook() { LIBVIRT_EXECUTOR_GUARD_CONF=` + conf + ` "` + script + `" "$@"; }
net() { echo "<network><name>$1</name><forward mode='$3'/><bridge name='$2' stp='on' delay='0'/></network>"; }
dump() { echo "== $1"; iptables -w -t mangle -S | grep -E 'GUARD' || true; }
pids=()
mkfifo ` + dir + `/stdin && exec 4<>` + dir + `/stdin
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
echo 1 >/proc/sys/net/ipv4/ip_forward
# guest NAME BRIDGE PREFIX: a bridge at PREFIX.1/24, a guest at PREFIX.2
# serving TCP port 8080; its namespace's pid in the variable NAME.
guest() {
	ip link add "$2" type bridge && ip addr add "$3.1/24" dev "$2" && ip link set "$2" up
	unshare --net sleep 600 </dev/null >/dev/null 2>&1 & local pid=$!; pids+=("$pid"); sleep 0.2
	ip link add "$1-h" type veth peer name "$1-g"
	ip link set "$1-h" master "$2" up
	ip link set "$1-g" netns "$pid"
	nsenter -t "$pid" -n sh -c "ip link set lo up && ip link set $1-g up && ip addr add $3.2/24 dev $1-g && ip route add default via $3.1"
	# (its stdin stays open: the shell holds the FIFO too; it ends when killed)
	nsenter -t "$pid" -n env ` + helperListenEnv + `=0.0.0.0:8080 "` + os.Args[0] + `" <&4 >/dev/null 2>&1 & pids+=("$!")
	printf -v "$1" %s "$pid"
}
guest a virbr-ci 192.168.150
guest b virbr-ci2 192.168.151
guest c virbr-x 192.168.152
sleep 1
# reach FROM TO: can the guest FROM open a TCP connection to the guest at TO?
reach() {
	if nsenter -t "$1" -n timeout 2 bash -c "exec 3<>/dev/tcp/$2/8080" 2>/dev/null; then echo "$3 reached"; else echo "$3 refused"; fi
}
echo "== before"; reach "$a" 192.168.151.2 a-b
net ci virbr-ci route | hook ci started begin -
net ci2 virbr-ci2 open | hook ci2 started begin -
dump started
echo "== guarded"; reach "$a" 192.168.151.2 a-b; reach "$b" 192.168.150.2 b-a; reach "$a" 192.168.152.2 a-c
net ci2 virbr-ci2 open | hook ci2 stopped end -
dump onestopped
net ci virbr-ci route | hook ci stopped end -
dump stopped
`
	out, err := exec.Command("unshare", "--net", "bash", "-c", steps).CombinedOutput()
	require.NoError(t, err, "%s", out)
	t.Logf("%s", out)
	sections := map[string]string{}
	for _, part := range strings.Split(string(out), "== ")[1:] {
		name, body, _ := strings.Cut(part, "\n")
		sections[name] = body
	}
	require.Contains(t, sections["before"], "a-b reached", "without the guard the host routes between the two networks")
	for _, want := range []string{
		"-A FORWARD -i virbr-ci -j LVE-GUARD-XNET",
		"-A FORWARD -i virbr-ci2 -j LVE-GUARD-XNET",
		"-A LVE-GUARD-XNET -o virbr-ci -m physdev ! --physdev-is-bridged -j DROP",
		"-A LVE-GUARD-XNET -o virbr-ci2 -m physdev ! --physdev-is-bridged -j DROP",
	} {
		require.Contains(t, sections["started"], want)
	}
	guarded := sections["guarded"]
	require.Contains(t, guarded, "a-b refused", "route network -> open network")
	require.Contains(t, guarded, "b-a refused", "open network -> route network")
	require.Contains(t, guarded, "a-c reached", "an unguarded network still follows the forward mode")
	one := sections["onestopped"]
	require.Contains(t, one, "-A LVE-GUARD-XNET -o virbr-ci -m physdev ! --physdev-is-bridged -j DROP")
	require.NotContains(t, one, "virbr-ci2", "the stopped network's rules are gone")
	require.Empty(t, strings.TrimSpace(sections["stopped"]), "all rules and the shared chain gone when both networks stop")
}

// acceptAndClose serves ln as a minimal TCP service until it is closed.
func acceptAndClose(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_ = c.Close()
	}
}

// TestReleasedVMConnectionsForgotten: the host's connection tracking
// entries of a job VM's address go with the VM (the QEMU hook
// deploy/network/libvirt-executor-conntrack, which the rig installs as an
// admin does). Without it a tracked connection of job A outlives A, and on a
// NAT network a late reply would be translated to whichever VM has A's
// address next. The guest opens a connection to the host; the entry is
// there before cleanup, and gone once cleanup has ended the VM, before its
// own timeout (about a minute for the connection the guest's script closed,
// days for an established one) would have removed it.
func TestReleasedVMConnectionsForgotten(t *testing.T) {
	r := setup(t)
	_, err := exec.LookPath("conntrack")
	require.NoError(t, err, "conntrack(8) is needed to look at the host's tracked connections (deploy/install-deps.sh installs it)")
	ln := r.serviceListener(t)
	defer ln.Close()
	peers := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			peers <- c // left open: only the guest's side ends
		}
	}()
	host, port, err := net.SplitHostPort(ln.Addr().String())
	require.NoError(t, err)

	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	cleaned := false
	defer func() {
		if !cleaned {
			s.run(t, "cleanup")
		}
	}()
	require.Equal(t, 0, s.run(t, "prepare").code)
	res := s.runScript(t, "build_script", fmt.Sprintf("#!/usr/bin/env bash\nexec 3<>/dev/tcp/%s/%s || exit 3\necho hello >&3\necho opened\n", host, port))
	require.Equal(t, 0, res.code, "the guest reaches the service port")
	var peer net.Conn
	select {
	case peer = <-peers:
	case <-time.After(30 * time.Second):
		t.Fatal("the guest's connection did not arrive")
	}
	defer peer.Close()
	addr, _, err := net.SplitHostPort(peer.RemoteAddr().String())
	require.NoError(t, err)
	// tracked is the number of entries of addr and the longest time one of
	// them has left (conntrack -L's third field, seconds).
	tracked := func() (n, left int) {
		out, _ := exec.Command("conntrack", "-L", "--orig-src", addr).Output()
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if f := strings.Fields(l); len(f) > 2 {
				n++
				var s int
				_, _ = fmt.Sscan(f[2], &s)
				left = max(left, s)
			}
		}
		return n, left
	}
	n, left := tracked()
	require.Positive(t, n, "the guest's connection is tracked while its VM runs")
	expires := time.Now().Add(time.Duration(left) * time.Second)
	// The hook finds the address in the VM's filter, which the job's holder
	// gives it while the first stages run.
	name := s.name(t)
	waitFor(t, 30*time.Second, "the VM's filter given its address "+addr, func() bool {
		d, err := r.conn.LookupDomainByName(name)
		if err != nil {
			return false
		}
		defer d.Free()
		x, err := d.GetXMLDesc(0)
		return err == nil && strings.Contains(strings.ReplaceAll(x, `"`, "'"), "<parameter name='IP' value='"+addr+"'/>")
	})

	require.Equal(t, 0, s.run(t, "cleanup").code)
	cleaned = true
	waitFor(t, 15*time.Second, "no tracked connection of "+addr+" once its VM is gone", func() bool { n, _ := tracked(); return n == 0 })
	// Without the hook the entry would still be there: its own timeout had
	// not run out (a closed connection's is about a minute).
	require.True(t, time.Now().Before(expires), "the entry's own timeout (%d s when cleanup began) ran out first: the test showed nothing", left)
}
