//go:build e2e

package e2e

import (
	"context"
	"crypto/rand"
	"encoding/xml"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	_ "gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm" // vm.Connect's libvirt
)

// TestSnapshotClonesFromOneSaveFile is #48's engine step on the rig's
// libvirt, for the tiny image (Debian's goes through the driver in
// TestSnapshotRealRunnerJobs): a template (no NIC, ACPI for
// hot plug, kernel option lve.snapshot=template) boots until its guest says
// it waits for its credentials disk and is saved once (vm.Hypervisor.Save);
// two clones restore from that one file at the same time (RestoreClone:
// the save header's XML rewritten with each clone's name, UUID, overlay and
// console, streamed through a pipe), each runs under its own identity on
// its own overlay over the frozen one, and each gets its identity by hot
// plug (its NIC, then the credentials disk the template's guest waits for),
// takes its own lease and answers SSH with its own host key, its clock the
// credential's and its CRNG reseeded from the host's entropy (the guest's
// kernel log says so). The driver does the same through
// its own calls (Engine.Restore; docs/pool.md).
func TestSnapshotClonesFromOneSaveFile(t *testing.T) {
	r := setup(t)
	hv, err := vm.Connect(context.Background(), r.cfg.LibvirtURI)
	require.NoError(t, err)
	defer hv.Close()
	tag := make([]byte, 3)
	_, _ = rand.Read(tag)
	for i, c := range []struct {
		image     string
		memoryMiB int
		// wait bounds the template's boot to its wait for the credentials
		// disk (Debian's systemd boot takes ~25 s under emulation).
		wait time.Duration
	}{
		// Debian's side (its systemd wait unit) is run through the driver
		// by TestSnapshotRealRunnerJobs.
		{"tiny", 256, 2 * time.Minute},
	} {
		t.Run(c.image, func(t *testing.T) {
			img, ok := r.cfg.Images[c.image]
			if !ok {
				require.NotContains(t, strings.Split(os.Getenv("LVE_E2E_IMAGES")+",tiny", ","), c.image,
					"the rig has no %s image", c.image)
				t.Skipf("the rig has no %s image (LVE_E2E_IMAGES does not name it)", c.image)
			}
			require.Equal(t, "kernel", img.Boot, "the %s image boots its kernel directly", c.image)
			snapshotClones(t, r, hv, img, c.memoryMiB, c.wait, fmt.Sprintf("%x%d", tag, i), tag[0], byte(2*i))
		})
	}
}

// snapshotClones is TestSnapshotClonesFromOneSaveFile for one image; id
// names its domains. The clones' MACs are 52:54:00:e5:mac5:mac6+i, random
// per run (a MAC of an earlier run would find that run's lease) and apart
// between the images.
func snapshotClones(t *testing.T, r *rig, hv vm.Hypervisor, img *config.Image, memoryMiB int, wait time.Duration, id string, mac5, mac6 byte) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// Files libvirt's QEMU can reach (the rig's directory, not the test's
	// private temporary one).
	dir, err := os.MkdirTemp(filepath.Dir(r.cfg.StateDir), "e2e-snapshot-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(dir, 0o755)) //nolint:gosec // G302: QEMU's user reads the overlays
	defer func() { _ = os.RemoveAll(dir) }()
	overlay := func(name, backing string) string {
		p := filepath.Join(dir, name+".qcow2")
		out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", backing, p).CombinedOutput()
		require.NoError(t, err, "%s", out)
		return p
	}
	prefix := fmt.Sprintf("%s-e2esnap-%s", r.cfg.NamePrefix, id)
	var names []string
	defer func() {
		cctx, ccancel := context.WithTimeout(context.Background(), time.Minute)
		defer ccancel()
		for _, n := range names {
			_ = hv.Destroy(cctx, n)
			_ = hv.Undefine(cctx, n)
		}
	}()

	domainType := r.cfg.DomainType
	if domainType == "" || domainType == "auto" {
		domainType = "qemu" // the rig's: no code trusts /dev/kvm alone
	}
	tmpl := prefix + "-tmpl"
	tmplDisk := overlay(tmpl, img.Base)
	tmplLog := filepath.Join(dir, tmpl+".log")
	x := fmt.Sprintf(`<domain type='%s'><name>%s</name><genid/><memory unit='MiB'>%d</memory><vcpu>1</vcpu>
<os><type arch='x86_64' machine='pc'>hvm</type><kernel>%s</kernel><initrd>%s</initrd><cmdline>%s</cmdline></os>
<features><acpi/><apic/></features>
<devices><disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='%s'/><target dev='vda' bus='virtio'/></disk>
<serial type='file'><source path='%s'/><target port='0'/></serial></devices></domain>`,
		domainType, tmpl, memoryMiB, img.Kernel, img.Initrd, xmlText(img.Cmdline+" lve.snapshot=template"), tmplDisk, tmplLog)
	require.NoError(t, hv.Define(ctx, x))
	names = append(names, tmpl)
	require.NoError(t, hv.Start(ctx, tmpl))
	t0 := time.Now()
	waitFor(t, wait, "the template's wait for its credentials disk", func() bool {
		b, _ := os.ReadFile(tmplLog)
		return strings.Contains(string(b), "snapshot template: waiting for the credentials disk")
	})
	t.Logf("template booted to its wait for the credentials disk in %s", time.Since(t0).Round(time.Millisecond))
	save := filepath.Join(dir, tmpl+".save")
	t0 = time.Now()
	require.NoError(t, hv.Save(ctx, tmpl, save))
	t.Logf("template saved in %s", time.Since(t0).Round(time.Millisecond))
	require.NoError(t, os.Chmod(tmplDisk, 0o444)) // frozen: the clones' overlays are over it

	// The saved XML, as the file holds it (its disk is the template's).
	f, err := os.Open(save)
	require.NoError(t, err)
	head, err := vm.ReadSaveHead(f)
	_ = f.Close()
	require.NoError(t, err)

	type clone struct{ name, uuid, disk, log string }
	clones := make([]clone, 2)
	for i := range clones {
		c := clone{name: fmt.Sprintf("%s-c%d", prefix, i)}
		c.uuid = fmt.Sprintf("%x-%x-%x-%x-%x", rnd(4), rnd(2), rnd(2), rnd(2), rnd(6))
		c.disk = overlay(c.name, tmplDisk)
		c.log = filepath.Join(dir, c.name+".log")
		clones[i] = c
	}
	var wg sync.WaitGroup
	errs := make([]error, len(clones))
	took := make([]time.Duration, len(clones))
	for i, c := range clones {
		cx, err := vm.CloneXML(head.XML, vm.CloneIdentity{Name: c.name, UUID: c.uuid, Disks: map[string]string{tmplDisk: c.disk}, ConsoleLog: c.log})
		require.NoError(t, err)
		names = append(names, c.name)
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			errs[i] = hv.RestoreClone(ctx, save, cx)
			took[i] = time.Since(t0)
		}()
	}
	wg.Wait()
	for i, c := range clones {
		require.NoError(t, errs[i], "restore of %s", c.name)
		t.Logf("%s restored in %s (at the same time as the other)", c.name, took[i].Round(time.Millisecond))
		st, err := hv.State(ctx, c.name)
		require.NoError(t, err)
		require.True(t, st.Running, "%s runs", c.name)
		d, err := r.conn.LookupDomainByName(c.name)
		require.NoError(t, err)
		dx, err := d.GetXMLDesc(0)
		_ = d.Free()
		require.NoError(t, err)
		require.Contains(t, dx, "<uuid>"+c.uuid+"</uuid>")
		require.Contains(t, dx, "<source file='"+c.disk+"'", "%s writes its own overlay", c.name)
	}
	// Each clone's identity arrives by hot plug, no network needed: its
	// NIC (its own MAC), then the credentials disk the template waits for
	// (its own host key, which the host pins, root's key, the clock and
	// entropy). Then it takes its lease and starts sshd as a fresh boot
	// would.
	hostKeys := map[string]string{}
	addrs := map[string]string{}
	for i, c := range clones {
		t0 := time.Now()
		mac := fmt.Sprintf("52:54:00:e5:%02x:%02x", mac5, int(mac6)+i)
		iface := &libvirtxml.DomainInterface{Source: &libvirtxml.DomainInterfaceSource{Network: &libvirtxml.DomainInterfaceSourceNetwork{Network: r.cfg.Network}},
			MAC: &libvirtxml.DomainInterfaceMAC{Address: mac}, Model: &libvirtxml.DomainInterfaceModel{Type: "virtio"}}
		require.NoError(t, hv.AttachInterface(ctx, c.name, iface))
		keys, err := guestinit.NewKeys(c.name)
		require.NoError(t, err)
		creds := filepath.Join(dir, c.name+".creds")
		// An hour ahead: the clone's clock is the credential's, not the
		// template's (which the restore continues from).
		clock := time.Now().Add(time.Hour)
		require.NoError(t, os.WriteFile(creds, keys.CloneCredentialDisk(c.name, clock, rnd(64)), 0o644)) //nolint:gosec // G306: QEMU's user reads it; removed with dir
		require.NoError(t, hv.AttachDisk(ctx, c.name, &libvirtxml.DomainDisk{Device: "disk", Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
			Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: creds}}, Target: &libvirtxml.DomainDiskTarget{Dev: "vdb", Bus: "virtio"},
			ReadOnly: &libvirtxml.DomainDiskReadOnly{}, Serial: guestinit.CredentialDiskSerial}))
		plugged := time.Since(t0)
		var ip string
		waitFor(t, time.Minute, c.name+"'s lease", func() bool {
			ls, err := hv.Addresses(ctx, c.name, vm.SourceLease)
			for _, l := range ls {
				if err == nil && strings.EqualFold(l.MAC, mac) && l.IP != nil {
					ip = l.IP.String()
				}
			}
			return ip != ""
		})
		leased := time.Since(t0)
		wctx, wcancel := context.WithTimeout(ctx, time.Minute)
		cl, _, err := sshexec.WaitReady(wctx, sshexec.Target{Addr: net.JoinHostPort(ip, "22"), User: "root", Signer: keys.Client, HostKey: keys.Host}, 0, 0)
		wcancel()
		require.NoError(t, err, "%s answers SSH with its own host key", c.name)
		out, err := cl.Output(ctx, "date +%s; cat /proc/sys/kernel/random/boot_id")
		require.NoError(t, err)
		// The clone's CRNG is not the template's: the guest reseeded it
		// from the entropy credential (RNDRESEEDCRNG; the images' cloud
		// kernel has no vmgenid driver, which would log "crng reseeded due
		// to virtual machine fork" on the restore's new generation id).
		kmsg, err := cl.Output(ctx, "dmesg")
		require.NoError(t, err)
		_ = cl.Close()
		require.Contains(t, string(kmsg), "lve: crng reseeded from the host's entropy credential",
			"%s's kernel log says its CRNG was reseeded from the host's entropy", c.name)
		t.Logf("%s: kernel reseed on the VM generation id change (vmgenid): %v", c.name,
			strings.Contains(string(kmsg), "crng reseeded due to virtual machine fork"))
		t.Logf("%s: NIC and credentials plugged in %s, lease after %s, SSH after %s; guest says %q",
			c.name, plugged.Round(time.Millisecond), leased.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond), strings.TrimSpace(string(out)))
		var guestNow int64
		_, err = fmt.Sscan(string(out), &guestNow)
		require.NoError(t, err)
		require.InDelta(t, clock.Unix(), guestNow, 30, "the clone's clock is the credential's, not the template's")
		hostKeys[string(keys.Host.Marshal())] = c.name
		addrs[ip] = c.name
	}
	require.Len(t, hostKeys, len(clones), "no two clones share a host key (each answered with its own, pinned)")
	require.Len(t, addrs, len(clones), "no two clones share an address")

	// A save file that is not one is refused before libvirt is asked.
	bad := filepath.Join(dir, "bad.save")
	require.NoError(t, os.WriteFile(bad, []byte("not a save file"), 0o600))
	err = hv.RestoreClone(ctx, bad, "<domain/>")
	require.ErrorIs(t, err, vm.ErrSaveImage)
}

func rnd(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

// xmlText is s escaped for XML character data.
func xmlText(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s))
	return b.String()
}
