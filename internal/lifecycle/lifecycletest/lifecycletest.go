// Package lifecycletest has the fakes that tests of internal/lifecycle and
// of the packages built on it share: a guest that boots on the fake
// hypervisor (internal/vm/vmtest) with the keys the domain carries, and a
// recorder of job-log lines.
package lifecycletest

import (
	"encoding/base64"
	"fmt"
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
	// TemplateSilent makes a snapshot template's guest never say it
	// waits; CloneSilent makes a restored clone's guest not go on when
	// its credentials disk arrives.
	TemplateSilent, CloneSilent bool
}

func NewGuest(t *testing.T, hv *vmtest.Fake) *Guest {
	g := &Guest{Server: sshtest.Start(t), hv: hv}
	g.RejectSessions(true)
	hv.OnStart = func(name string, d *libvirtxml.Domain) { g.boot(t, name, d) }
	hv.OnPlug = func(name string, d *libvirtxml.Domain) { g.plugged(t, name, d) }
	return g
}

// TemplateWaiting is the console line of a snapshot template's guest
// (lifecycle.TemplateWaiting; not imported: lifecycle's tests use this
// package).
const TemplateWaiting = "snapshot template: waiting for the credentials disk"

// template "boots" a snapshot template: it says on its console that it
// waits for its credentials disk.
func (g *Guest) template(t *testing.T, name string, d *libvirtxml.Domain) {
	if g.TemplateSilent {
		return
	}
	for _, s := range d.Devices.Serials {
		if s.Log != nil && s.Log.File != "" {
			f, err := os.OpenFile(s.Log.File, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
			if err != nil {
				t.Errorf("%s: console log: %v", name, err)
				return
			}
			_, _ = f.WriteString("booting\n" + TemplateWaiting + "\n")
			_ = f.Close()
		}
	}
}

// plugged is the guest of a restored clone seeing a hot plug: once it has
// a credentials disk (the last of its hot plugs), it takes its keys from
// it and gets its lease on its interface, as a fresh boot would.
func (g *Guest) plugged(t *testing.T, name string, d *libvirtxml.Domain) {
	if d.GenID == nil {
		return // a booted machine (a clone has its template's generation id)
	}
	var creds bool
	for _, disk := range d.Devices.Disks {
		creds = creds || disk.Serial == guestinit.CredentialDiskSerial
	}
	if !creds || g.CloneSilent {
		return
	}
	fail := func(format string, args ...any) { t.Errorf("%s: "+format, append([]any{name}, args...)...) }
	if len(d.Devices.Interfaces) != 1 {
		fail("credentials disk plugged before the network interface")
		return
	}
	g.hv.Lock()
	disk := g.hv.Volumes["jobs/"+vm.SeedVolume(name)]
	g.hv.Unlock()
	var authorized, hostPEM []byte
	for _, line := range strings.Split(strings.TrimRight(string(disk), "\x00"), "\n") {
		if v, ok := strings.CutPrefix(line, "io.systemd.credential:ssh.authorized_keys.root="); ok {
			authorized = []byte(v)
		}
		if v, ok := strings.CutPrefix(line, "io.systemd.credential.binary:"+guestinit.HostKeyCredential+"="); ok {
			hostPEM, _ = base64.StdEncoding.DecodeString(v)
		}
	}
	g.serve(t, name, authorized, hostPEM, d.Devices.Interfaces[0].MAC.Address)
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
	if d.GenID != nil && len(d.Devices.Interfaces) == 0 {
		g.template(t, name, d)
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
	g.serve(t, name, authorized, hostPEM, d.Devices.Interfaces[0].MAC.Address)
}

// serve makes the guest answer SSH with the keys it was given and get its
// lease on mac.
func (g *Guest) serve(t *testing.T, name string, authorized, hostPEM []byte, mac string) {
	fail := func(format string, args ...any) { t.Errorf("%s: "+format, append([]any{name}, args...)...) }
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
type Sayings struct{ buf, text sshtest.Buffer }

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
func (s *Sayings) Say(format string, args ...any) {
	_, _ = s.buf.Write([]byte(format + "\n"))
	_, _ = s.text.Write([]byte(fmt.Sprintf(format, args...) + "\n"))
}

// Args is every line said so far, formatted with its arguments.
func (s *Sayings) Args() string { return s.text.String() }

// Has reports whether a line recorded so far contains sub.
func (s *Sayings) Has(sub string) bool { return strings.Contains(s.buf.String(), sub) }
