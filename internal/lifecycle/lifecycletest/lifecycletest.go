// Package lifecycletest has the fakes that tests of internal/lifecycle and
// of the packages built on it share: a guest that boots on the fake
// hypervisor (internal/vm/vmtest) with the keys the domain carries, and a
// recorder of job-log lines.
package lifecycletest

import (
	"encoding/base64"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// Controller is the controller id of the tests' installation.
const Controller = "0123abcd-0000-4000-8000-000000000000"

// Guest "boots" when the fake hypervisor starts a domain: it reads the
// SMBIOS credentials from the domain XML, as a systemd guest would, and
// serves SSH on 127.0.0.1 (sshtest) with the delivered host key and
// authorized key. It runs no commands.
type Guest struct {
	*sshtest.Server
	hv *vmtest.Fake
	// OwnHostKey makes the guest ignore the delivered host key (an image
	// without the host key unit).
	OwnHostKey bool
	// NoLease makes the guest never get an address.
	NoLease bool
}

func NewGuest(t *testing.T, hv *vmtest.Fake) *Guest {
	g := &Guest{Server: sshtest.Start(t), hv: hv}
	g.RejectSessions(true)
	hv.OnStart = func(name string, d *libvirtxml.Domain) { g.boot(t, name, d) }
	return g
}

func (g *Guest) boot(t *testing.T, name string, d *libvirtxml.Domain) {
	// It runs in whatever goroutine starts the domain (a pool service's
	// boot goroutines too): problems go to Errorf, never FailNow.
	fail := func(format string, args ...any) { t.Errorf("%s: "+format, append([]any{name}, args...)...) }
	x, err := d.Marshal()
	if err != nil {
		fail("domain XML: %v", err)
		return
	}
	if strings.Contains(x, "credential.binary") {
		fail("private key material in the domain XML")
		return
	}
	if len(d.SysInfo) == 0 || d.SysInfo[0].SMBIOS == nil || d.SysInfo[0].SMBIOS.OEMStrings == nil {
		fail("no SMBIOS credentials")
		return
	}
	var authorized, hostPEM []byte
	for _, e := range d.SysInfo[0].SMBIOS.OEMStrings.Entry {
		if v, ok := strings.CutPrefix(e, "io.systemd.credential:ssh.authorized_keys.root="); ok {
			authorized = []byte(v)
		}
	}
	// The host key comes from the read-only credentials disk, as a guest
	// reads /dev/disk/by-id/virtio-lve-credentials (a third disk: the guest
	// tools disk).
	if len(d.Devices.Disks) < 2 || d.Devices.Disks[1].Serial != guestinit.CredentialDiskSerial || d.Devices.Disks[1].ReadOnly == nil {
		fail("no read-only credentials disk as the second disk")
		return
	}
	g.hv.Lock()
	disk := g.hv.Volumes["jobs/"+vm.SeedVolume(name)]
	g.hv.Unlock()
	for _, line := range strings.Split(strings.TrimRight(string(disk), "\x00"), "\n") {
		if v, ok := strings.CutPrefix(line, "io.systemd.credential.binary:"+guestinit.HostKeyCredential+"="); ok {
			if hostPEM, err = base64.StdEncoding.DecodeString(v); err != nil {
				fail("host key credential: %v", err)
				return
			}
		}
	}
	allowed, _, _, _, err := ssh.ParseAuthorizedKey(authorized)
	if err != nil {
		fail("authorized key: %v", err)
		return
	}
	hostKey, err := ssh.ParsePrivateKey(hostPEM)
	if err != nil {
		fail("host key: %v", err)
		return
	}
	if g.OwnHostKey {
		other, err := guestinit.NewKeys("baked")
		if err == nil {
			hostKey, err = ssh.ParsePrivateKey(other.HostPEM)
		}
		if err != nil {
			fail("baked host key: %v", err)
			return
		}
	}
	// This boot's keys serve every connection from now on.
	g.SetHostKey(hostKey)
	g.SetAuthorizedKey(allowed)
	if !g.NoLease {
		// The address appears a little after boot, as DHCP does.
		mac := d.Devices.Interfaces[0].MAC.Address
		go func() {
			time.Sleep(LeaseDelay)
			g.hv.SetLeases(name, vm.Lease{MAC: mac, IP: net.ParseIP("127.0.0.1")})
		}()
	}
}

// LeaseDelay is how long after its start a guest gets its lease: the
// wait for the address is a real wait, as with DHCP.
const LeaseDelay = 20 * time.Millisecond

// Machine is the name the engine's tests give their one machine.
const Machine = "lve-0123abcd-7"

// RequireNothingLeft asserts that no domain, no volume and no state
// directory of Machine (in store) is left. Call it from the test's
// goroutine.
func RequireNothingLeft(t *testing.T, hv *vmtest.Fake, store state.Store) {
	t.Helper()
	hv.Lock()
	defer hv.Unlock()
	if len(hv.Domains) > 0 || len(hv.Volumes) > 0 {
		t.Fatalf("left: domains %v, volumes %v", keys(hv.Domains), keys(hv.Volumes))
	}
	if _, err := os.Stat(store.MachineDir(Machine)); !os.IsNotExist(err) {
		t.Fatalf("state dir left: %v", err)
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TinyConfig is the configuration the engine's tests share: domain type
// qemu, storage pool "jobs", a state directory of the test's own, a boot
// timeout of 20 s and one image, tiny.
func TinyConfig(t *testing.T) (*config.Config, *config.Image) {
	t.Helper()
	cfg, err := config.Parse([]byte(`
domain_type = "qemu"
state_dir = "` + t.TempDir() + `"
storage_pool = "jobs"
[timeouts]
boot = "20s"
[images.tiny]
base = "/img/tiny.qcow2"
`))
	if err != nil {
		t.Fatalf("test configuration: %v", err)
	}
	img, _ := cfg.Image("tiny")
	return cfg, img
}

// Sayings records the job-log lines (their formats) a Manager says, and
// logs them when the test fails.
type Sayings struct{ buf sshtest.Buffer }

// NewSayings is a recorder whose lines the test's log gets if it fails.
func NewSayings(t *testing.T) *Sayings {
	s := &Sayings{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("progress:\n%s", s.buf.String())
		}
	})
	return s
}

// Say records one line (Manager.Say); the format, not the text.
func (s *Sayings) Say(format string, _ ...any) { _, _ = s.buf.Write([]byte(format + "\n")) }

// Has reports whether a line recorded so far contains sub.
func (s *Sayings) Has(sub string) bool { return strings.Contains(s.buf.String(), sub) }
