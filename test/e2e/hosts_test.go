//go:build e2e

package e2e

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// kvmHost is a second (third, ...) libvirt host for the fleet tests: a
// libvirtd with its own network namespace (its guest network, NAT and
// guard there), its own mount namespace (its own /run/libvirt,
// /var/lib/libvirt, /etc/libvirt, logs) and a storage pool of its own,
// reached from the test's namespace only over TLS (qemu+tls://) through a
// veth pair, as garm's host reaches a KVM host. The test's temporary
// directory (where the provider keeps its state) is hidden from it: a
// path of the provider's host given to that libvirt fails there, as it
// would on another machine.
type kvmHost struct {
	URI, Pool, Network, PoolDir string
	conn                        *libvirt.Connect
}

// tlsFiles is a CA, one server certificate per host address and garm's
// client certificate, as libvirt reads them (pkipath).
type tlsFiles struct {
	caCert *x509.Certificate
	caKey  *rsa.PrivateKey
	caPEM  []byte
	client string // pkipath of the client: cacert.pem, clientcert.pem, clientkey.pem
}

func newTLSFiles(t *testing.T, dir string) *tlsFiles {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "lve-e2e CA", Organization: []string{"lve-e2e"}},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	f := &tlsFiles{caCert: ca, caKey: key, caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), client: filepath.Join(dir, "pki-client")}
	f.issue(t, f.client, "client", "lve-e2e-garm", nil)
	return f
}

// issue writes cacert.pem, <kind>cert.pem and <kind>key.pem (0600) into
// dir: a certificate for a server at ip, or a client one (ip nil).
func (f *tlsFiles) issue(t *testing.T, dir, kind, cn string, ip net.IP) {
	t.Helper()
	require.NoError(t, os.MkdirAll(dir, 0o700))
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn, Organization: []string{"lve-e2e"}},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if ip != nil {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses, tmpl.DNSNames = []net.IP{ip}, []string{ip.String()}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, f.caCert, &key.PublicKey, f.caKey)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "cacert.pem"), f.caPEM, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, kind+"cert.pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, kind+"key.pem"),
		pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600))
}

// startHost starts host n (1, 2, ...) whose pool holds the files of img
// (same names), hiding the directory hide from it.
func startHost(t *testing.T, tls *tlsFiles, n int, img *config.Image, hide string) *kvmHost {
	t.Helper()
	tag := fmt.Sprintf("lveh%d-%d", n, os.Getpid()%100000)
	dir, err := os.MkdirTemp("/var/lib/libvirt-executor-rig", "host-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(dir, 0o755)) // QEMU (libvirt-qemu) reads the pool's files
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	hostIP := net.IPv4(10, 213, 9, byte(4*n+2))
	peerIP := net.IPv4(10, 213, 9, byte(4*n+1))
	h := &kvmHost{URI: fmt.Sprintf("qemu+tls://%s/system?pkipath=%s", hostIP, tls.client),
		Pool: tag + "-pool", Network: tag + "-net", PoolDir: filepath.Join(dir, "pool")}
	run := func(args ...string) {
		t.Helper()
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		require.NoError(t, err, "%v: %s", args, out)
	}

	// the host's files: certificates, /etc/libvirt (its network filters and
	// qemu.conf; no domains, networks or pools), the guard hook, the pool
	server := filepath.Join(dir, "pki-server")
	tls.issue(t, server, "server", hostIP.String(), hostIP)
	for _, d := range []string{"etc", "varlib", "cache", "log", "run", "pool", "etc/hooks/network.d"} {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, d), 0o755))
	}
	run("cp", "-a", "/etc/libvirt/nwfilter", filepath.Join(dir, "etc"))
	run("cp", "-a", "/etc/libvirt/qemu.conf", filepath.Join(dir, "etc"))
	guard, err := filepath.Abs("../../deploy/network/libvirt-executor-guard")
	require.NoError(t, err)
	run("install", "-m", "0755", guard, filepath.Join(dir, "etc/hooks/network.d/50-libvirt-executor-guard"))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "etc/hooks/libvirt-executor-guard.conf"), []byte(h.Network+" 20000:20999\n"), 0o644))
	for _, f := range []string{img.Base, img.Kernel, img.Initrd} {
		if f != "" {
			run("cp", f, filepath.Join(h.PoolDir, filepath.Base(f)))
		}
	}
	conf := filepath.Join(dir, "libvirtd.conf")
	require.NoError(t, os.WriteFile(conf, []byte(fmt.Sprintf(`listen_tls = 1
listen_tcp = 0
listen_addr = %q
key_file = %q
cert_file = %q
ca_file = %q
auth_tls = "none"
tls_no_verify_certificate = 0
`, hostIP, filepath.Join(server, "serverkey.pem"), filepath.Join(server, "servercert.pem"), filepath.Join(server, "cacert.pem"))), 0o644))

	// its network namespace, reached through a veth pair (what an earlier
	// run killed half-way left of host n goes first)
	removeStaleHosts(t, n)
	run("ip", "netns", "add", tag)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", tag).Run() })
	run("ip", "link", "add", tag, "type", "veth", "peer", "name", "eth0", "netns", tag)
	run("ip", "addr", "add", peerIP.String()+"/30", "dev", tag)
	run("ip", "link", "set", tag, "up")
	run("ip", "-n", tag, "addr", "add", hostIP.String()+"/30", "dev", "eth0")
	run("ip", "-n", tag, "link", "set", "eth0", "up")
	run("ip", "-n", tag, "link", "set", "lo", "up")

	// virtlogd and libvirtd in a mount namespace of their own
	pids := map[string]string{"virtlogd": filepath.Join(dir, "run/virtlogd.pid"), "libvirtd": filepath.Join(dir, "run/libvirtd.pid")}
	const script = `set -e
d=$1 hide=$2
mount -t tmpfs -o mode=0755 lve-host /run/libvirt
mount --bind "$d/varlib" /var/lib/libvirt
mount --bind "$d/cache" /var/cache/libvirt
mount --bind "$d/log" /var/log/libvirt
mount --bind "$d/etc" /etc/libvirt
mount -t tmpfs -o mode=0700 lve-hidden "$hide"
LIBVIRT_LOG_OUTPUTS="3:file:$d/run/virtlogd.log" virtlogd -d -p "$d/run/virtlogd.pid"
LIBVIRT_LOG_OUTPUTS="3:file:$d/run/libvirtd.log" libvirtd -d -l -f "$d/libvirtd.conf" -p "$d/run/libvirtd.pid"
`
	out, err := exec.Command("ip", "netns", "exec", tag, "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", dir, hide).CombinedOutput()
	stop := func() {
		if h.conn != nil {
			// nothing of the tests may outlive the host's libvirtd: its
			// QEMUs would stay behind it
			if doms, err := h.conn.ListAllDomains(0); err == nil {
				for _, d := range doms {
					_ = d.DestroyFlags(libvirt.DOMAIN_DESTROY_DEFAULT)
					_ = d.UndefineFlags(libvirt.DOMAIN_UNDEFINE_NVRAM)
					_ = d.Free()
				}
			}
			if nw, err := h.conn.LookupNetworkByName(h.Network); err == nil {
				_ = nw.Destroy() // its dnsmasq
				_ = nw.Free()
			}
			_, _ = h.conn.Close()
		}
		for _, name := range []string{"libvirtd", "virtlogd"} {
			b, err := os.ReadFile(pids[name])
			if err != nil {
				continue
			}
			pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err != nil || pid <= 1 {
				continue
			}
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); !strings.HasSuffix(exe, "/"+name) {
				continue // not ours (any more)
			}
			_ = syscall.Kill(pid, syscall.SIGTERM)
			if !processEnds(pid, 15*time.Second) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
				processEnds(pid, 5*time.Second)
			}
		}
		// whatever else still runs in its namespace is the host's (its
		// QEMUs and dnsmasq if its libvirt could not be asked): it goes
		killNetnsPids(tag)
	}
	t.Cleanup(stop)
	require.NoError(t, err, "start host %d: %s", n, out)

	// it answers over TLS, with the certificate of its address
	deadline := time.Now().Add(60 * time.Second)
	for {
		if h.conn, err = libvirt.NewConnect(h.URI); err == nil {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "run/libvirtd.log"))
			t.Fatalf("host %d: libvirt at %s does not answer: %v\n%s", n, h.URI, err, tailLines(string(log), 20))
		}
		time.Sleep(100 * time.Millisecond)
	}

	// its guest network (NAT, DHCP; guarded by its hook) and its pool
	nx := libvirtxml.Network{Name: h.Network, Forward: &libvirtxml.NetworkForward{Mode: "nat"},
		Bridge: &libvirtxml.NetworkBridge{Name: "virbr-" + tag[:5], STP: "off"},
		IPs: []libvirtxml.NetworkIP{{Address: fmt.Sprintf("10.213.%d.1", 9+n), Netmask: "255.255.255.0",
			DHCP: &libvirtxml.NetworkDHCP{Ranges: []libvirtxml.NetworkDHCPRange{{Start: fmt.Sprintf("10.213.%d.10", 9+n), End: fmt.Sprintf("10.213.%d.200", 9+n)}}}}}}
	x, err := nx.Marshal()
	require.NoError(t, err)
	nw, err := h.conn.NetworkCreateXML(x)
	require.NoError(t, err, "host %d: network", n)
	_ = nw.Free()
	px := libvirtxml.StoragePool{Type: "dir", Name: h.Pool, Target: &libvirtxml.StoragePoolTarget{Path: h.PoolDir}}
	x, err = px.Marshal()
	require.NoError(t, err)
	pool, err := h.conn.StoragePoolCreateXML(x, 0)
	require.NoError(t, err, "host %d: pool", n)
	_ = pool.Free()
	return h
}

// processEnds waits up to d for pid to end.
func processEnds(pid int, d time.Duration) bool {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
			return true
		}
	}
	return false
}

// killNetnsPids SIGKILLs every process in network namespace ns (one of
// this test's hosts).
func killNetnsPids(ns string) {
	out, _ := exec.Command("ip", "netns", "pids", ns).Output()
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// removeStaleHosts removes what a run of this test killed before its
// cleanup left of host n: its namespaces (lvehN-PID), their processes and
// the links of that name here.
func removeStaleHosts(t *testing.T, n int) {
	t.Helper()
	out, _ := exec.Command("ip", "netns", "list").Output()
	stale := regexp.MustCompile(fmt.Sprintf(`^lveh%d-[0-9]+$`, n))
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || !stale.MatchString(f[0]) {
			continue
		}
		t.Logf("removing host %d of an earlier run: %s", n, f[0])
		killNetnsPids(f[0])
		_ = exec.Command("ip", "netns", "del", f[0]).Run()
		_ = exec.Command("ip", "link", "del", f[0]).Run()
	}
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// domains is the names of the host's domains.
func (h *kvmHost) domains(t *testing.T) []string {
	t.Helper()
	doms, err := h.conn.ListAllDomains(0)
	require.NoError(t, err)
	var names []string
	for _, d := range doms {
		n, _ := d.GetName()
		_ = d.Free()
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// volumes is the names of the volumes of the host's pool.
func (h *kvmHost) volumes(t *testing.T) []string {
	t.Helper()
	p, err := h.conn.LookupStoragePoolByName(h.Pool)
	require.NoError(t, err)
	defer p.Free()
	require.NoError(t, p.Refresh(0))
	v, err := p.ListStorageVolumes()
	require.NoError(t, err)
	slices.Sort(v)
	return v
}

// TestGarmAcrossHosts: one garm host, two KVM hosts reached over
// qemu+tls:// (each a libvirtd in its own network and mount namespaces),
// one provider entry (configuration, state directory) per host. doctor
// checks the remote host over its connection and says what it cannot;
// CreateInstance on each lands on its own host; ListInstances and
// RemoveAllInstances of each see only its own host's instance, whatever
// the controller and pool ids; an entry whose state directory keeps the
// other host's machines is refused; a base image that is this host's file
// but no volume of that host's pools is refused with nothing made; nothing
// of a machine is a path of the provider's host (no console log), and
// nothing is left on either host. The guest's own boot does not matter
// here: the tiny guest stands in for a cloud-init image.
func TestGarmAcrossHosts(t *testing.T) {
	cfgPath, bin := os.Getenv("LVE_E2E_CONFIG"), os.Getenv("LVE_E2E_BIN")
	if cfgPath == "" || bin == "" || os.Geteuid() != 0 {
		if os.Getenv("LVE_E2E_REQUIRED") != "" {
			t.Fatal("end-to-end prerequisites missing: LVE_E2E_CONFIG, LVE_E2E_BIN, root")
		}
		t.Skip("skipping end-to-end test: run `make test-e2e` as root")
	}
	figures.begin(t)
	rigCfg, err := config.Load(cfgPath)
	require.NoError(t, err)
	tiny := rigCfg.Images["tiny"]
	require.NotNil(t, tiny, "the rig has no tiny image")

	// The provider's side: its configurations and state directories (hidden
	// from both hosts).
	local := t.TempDir()
	tls := newTLSFiles(t, local)
	hosts := []*kvmHost{startHost(t, tls, 1, tiny, local), startHost(t, tls, 2, tiny, local)}
	cfgs := make([]string, len(hosts))
	for i, h := range hosts {
		pooled := func(f string) string { return filepath.Join(h.PoolDir, filepath.Base(f)) }
		cfgs[i] = filepath.Join(local, fmt.Sprintf("garm-%d.toml", i+1))
		require.NoError(t, os.WriteFile(cfgs[i], []byte(fmt.Sprintf(`libvirt_uri = %q
domain_type = "qemu"
storage_pool = %q
network = %q
name_prefix = "lvg"
state_dir = %q
[defaults]
vcpus = 1
memory_mib = 256
[timeouts]
boot = "3m"
[guest_tools]
gitlab_runner = "none"
step_runner = "none"
[garm]
images = ["tiny"]
[images.tiny]
base = %q
format = "qcow2"
user = "root"
key_injection = "cloud-init"
boot = "kernel"
kernel = %q
initrd = %q
cmdline = %q
`, h.URI, h.Pool, h.Network, filepath.Join(local, fmt.Sprintf("state-%d", i+1)), pooled(tiny.Base), pooled(tiny.Kernel), pooled(tiny.Initrd), tiny.Cmdline)), 0o600))
	}
	boot := func(name string) string {
		b, _ := json.Marshal(map[string]any{
			"name": name, "os_type": "linux", "arch": "amd64", "image": "tiny", "flavor": "default",
			"callback-url": "http://10.213.10.1:20000/api/v1/callbacks", "metadata-url": "http://10.213.10.1:20000/api/v1/metadata",
			"instance-token": "garm-token-" + name, "repo_url": "https://github.com/example/repo", "labels": []string{"lve"},
			"tools": []map[string]any{{"os": "linux", "architecture": "x64", "download_url": "http://10.213.10.1:20000/runner.tar.gz",
				"filename": "runner.tar.gz", "sha256_checksum": strings.Repeat("ab", 32)}},
		})
		return string(b)
	}
	const ctrl, pool = "11111111-2222-3333-4444-555555555555", "aaaaaaaa-0000-0000-0000-000000000001"
	call := func(cfg, command, instance, stdin string) (string, string, int) {
		return garmCall(t, bin, cfg, ctrl, pool, command, instance, stdin)
	}
	t.Cleanup(func() {
		for _, c := range cfgs {
			_, _, _ = call(c, "RemoveAllInstances", "", "")
		}
	})

	// doctor over the connection: the host's libvirt, pool, network,
	// filters and image volumes; what it cannot see said as a warning
	doc, err := exec.Command(filepath.Join(bin, "libvirt-executor"), "--config", cfgs[1], "doctor").CombinedOutput()
	t.Logf("doctor:\n%s", doc)
	require.NoError(t, err, "doctor fails on a remote host that is fine")
	for _, absent := range []string{"[FAIL]", "] user ", "] polkit", "] service:", "] guest tools:"} {
		require.NotContains(t, string(doc), absent, "not this entry's to check")
	}
	for _, want := range []string{
		"[warn] libvirt host: " + hosts[1].URI + " is another host's libvirt",
		"[ok  ] libvirt: " + hosts[1].URI,
		"[ok  ] storage pool " + hosts[1].Pool,
		"[ok  ] network " + hosts[1].Network,
		"[ok  ] image tiny: " + filepath.Join(hosts[1].PoolDir, filepath.Base(tiny.Base)),
		"[ok  ] state dir libvirt: not tied to a libvirt yet: the first use ties it to qemu://" + hostAddr(hosts[1].URI) + "/system",
	} {
		require.Contains(t, string(doc), want, string(doc))
	}

	// one instance on each host, from the same garm controller and pool
	names := []string{"runner-host-1", "runner-host-2"}
	ids := make([]string, len(hosts))
	for i := range hosts {
		out, errs, code := call(cfgs[i], "CreateInstance", "", boot(names[i]))
		require.Equal(t, 0, code, "CreateInstance on host %d: %s%s", i+1, out, errs)
		var inst garmInstance
		require.NoError(t, json.Unmarshal([]byte(out), &inst), out)
		require.Equal(t, "running", inst.Status)
		ids[i] = inst.ProviderID
	}
	require.NotEqual(t, ids[0], ids[1])
	for i, h := range hosts {
		require.Equal(t, []string{ids[i]}, h.domains(t), "host %d has its own instance and nothing else", i+1)
		d, err := h.conn.LookupDomainByName(ids[i])
		require.NoError(t, err)
		x, err := d.GetXMLDesc(0)
		_ = d.Free()
		require.NoError(t, err)
		require.NotContains(t, x, local, "a path of the provider's host in host %d's domain", i+1)
		require.NotContains(t, x, "garm-token-", "the instance token in the domain XML")
		require.Contains(t, x, "<source file='"+h.PoolDir+"/", "its disks are volumes of host %d's pool", i+1)
		require.NotContains(t, x, "<log ", "a console log file on host %d", i+1)
	}
	for i := range hosts {
		out, errs, code := call(cfgs[i], "ListInstances", "", "")
		require.Equal(t, 0, code, errs)
		var list []garmInstance
		require.NoError(t, json.Unmarshal([]byte(out), &list), out)
		require.Len(t, list, 1, "host %d lists only its own: %s", i+1, out)
		require.Equal(t, ids[i], list[0].ProviderID)
		require.Equal(t, names[i], list[0].Name)
		// the other host's instance is not found through this entry
		_, _, code = call(cfgs[i], "GetInstance", ids[1-i], "")
		require.Equal(t, 30, code, "host %d found the other host's instance", i+1)
	}

	// an entry whose state directory keeps the other host's machines
	shared := filepath.Join(local, "shared.toml")
	b, err := os.ReadFile(cfgs[1])
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(shared, []byte(strings.Replace(string(b), filepath.Join(local, "state-2"), filepath.Join(local, "state-1"), 1)), 0o600))
	_, errs, code := call(shared, "ListInstances", "", "")
	require.Equal(t, 1, code, errs)
	require.Contains(t, errs, "keeps the machines of libvirt qemu://"+hostAddr(hosts[0].URI)+"/system")

	// a base that is a file of this host, not a volume of that host's pools
	notPooled := filepath.Join(local, "notpooled.toml")
	require.NoError(t, os.WriteFile(notPooled, []byte(strings.Replace(string(b), filepath.Join(hosts[1].PoolDir, filepath.Base(tiny.Base)), tiny.Base, 1)), 0o600))
	out, errs, code := call(notPooled, "CreateInstance", "", boot("runner-not-pooled"))
	require.Equal(t, 1, code, out+errs)
	require.Contains(t, errs, tiny.Base+" is not a volume of a storage pool of that host's libvirt")
	require.Equal(t, []string{ids[1]}, hosts[1].domains(t), "nothing made of the refused instance")

	// RemoveAllInstances on host 2 leaves host 1's instance alone
	_, errs, code = call(cfgs[1], "RemoveAllInstances", "", "")
	require.Equal(t, 0, code, errs)
	require.Empty(t, hosts[1].domains(t))
	require.Equal(t, []string{ids[0]}, hosts[0].domains(t))
	_, errs, code = call(cfgs[0], "DeleteInstance", ids[0], "")
	require.Equal(t, 0, code, errs)

	// nothing left: domains, volumes (the image's files only), machine state
	for i, h := range hosts {
		require.Empty(t, h.domains(t), "host %d", i+1)
		want := []string{filepath.Base(tiny.Base), filepath.Base(tiny.Initrd), filepath.Base(tiny.Kernel)}
		slices.Sort(want)
		require.Equal(t, want, h.volumes(t), "host %d's pool", i+1)
		entries, _ := os.ReadDir(filepath.Join(local, fmt.Sprintf("state-%d", i+1), "machines"))
		require.Empty(t, entries, "host %d's machine records", i+1)
	}
}

// garmInstance is what the provider says of an instance.
type garmInstance struct {
	ProviderID string `json:"provider_id"`
	Name       string `json:"name"`
	Status     string `json:"status"`
}

// hostAddr is the host part of a libvirt URI.
func hostAddr(uri string) string {
	_, rest, _ := strings.Cut(uri, "://")
	h, _, _ := strings.Cut(rest, "/")
	return h
}
