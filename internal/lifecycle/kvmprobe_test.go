package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

const msrAbort = "internal error: qemu unexpectedly closed the monitor: 2026-11-29T01:53:57.506720Z qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\n" +
	"qemu-system-x86_64: ../../target/i386/kvm/kvm.c:3183: kvm_buf_set_msrs: Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed."

// brokenKVM makes hv a nested host whose KVM cannot run guests: QEMU
// aborts as a kvm domain starts.
func brokenKVM(hv *vmtest.Fake) {
	hv.KVM = true
	hv.StartErr = func(_ string, d *libvirtxml.Domain) error {
		if d.Type == "kvm" {
			return errors.New(msrAbort)
		}
		return nil
	}
}

// said records the lines a Manager says, as text.
type said struct {
	mu    sync.Mutex
	lines []string
}

func (s *said) Say(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lines = append(s.lines, fmt.Sprintf(format, args...))
}

func (s *said) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.lines, "\n")
}

func probes(hv *vmtest.Fake) int {
	hv.Lock()
	defer hv.Unlock()
	n := 0
	for _, c := range hv.Calls {
		if c == "Define" {
			n++
		}
	}
	return n
}

func autoManager(t *testing.T, hv *vmtest.Fake) (*Manager, *config.Image, *said) {
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	// The fake guest boots the machines, not the probe's (no disk).
	boot := hv.OnStart
	hv.OnStart = func(name string, d *libvirtxml.Domain) {
		if len(d.Devices.Disks) > 0 {
			boot(name, d)
		}
	}
	m.Cfg.DomainType = config.DomainAuto
	m.KVMProbeBound = 300 * time.Millisecond
	s := &said{}
	m.Say = s.Say
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("said:\n%s", s)
		}
	})
	return m, img, s
}

// "auto" on a host whose KVM cannot run guests: the probe finds it once,
// the verdict is remembered for this host, and qemu is chosen with a
// warning that says why.
func TestDomainTypeAutoProbesOnceAndFallsBack(t *testing.T) {
	hv := vmtest.New()
	brokenKVM(hv)
	m, _, s := autoManager(t, hv)
	dt, err := m.KVM().DomainType(context.Background())
	require.NoError(t, err)
	require.Equal(t, "qemu", dt)
	require.Contains(t, s.String(), `Warning: domain_type = "auto": this host's KVM cannot run guests (QEMU exited as the guest started under KVM: failed to set MSR 0x10a to 0x69); the VM runs under qemu`)
	require.Empty(t, hv.Domains, "the probe's domain is gone")
	require.Equal(t, 1, probes(hv))

	rec, err := m.KVM().Record(context.Background())
	require.NoError(t, err)
	require.NotNil(t, rec)
	require.False(t, rec.Works)
	require.Equal(t, "probe", rec.By)
	require.Equal(t, "7.2.0", rec.QEMU)
	require.Equal(t, "qemu:///system", rec.URI)
	require.NotEmpty(t, rec.Kernel)

	// Remembered: no second probe.
	dt, err = m.KVM().DomainType(context.Background())
	require.NoError(t, err)
	require.Equal(t, "qemu", dt)
	require.Equal(t, 1, probes(hv))

	// Another QEMU: probed again.
	hv.HVVersion = 8002000
	_, err = m.KVM().DomainType(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, probes(hv))
}

func TestDomainTypeAutoKVMWorks(t *testing.T) {
	hv := vmtest.New()
	hv.KVM = true
	m, _, _ := autoManager(t, hv)
	dt, err := m.KVM().DomainType(context.Background())
	require.NoError(t, err)
	require.Equal(t, "kvm", dt)
	rec, err := m.KVM().Record(context.Background())
	require.NoError(t, err)
	require.True(t, rec.Works)
}

// The guest that hangs after the kernel's real-mode setup: no banner on
// the console of the smallest kernel image within the bound.
func TestDomainTypeAutoGuestNeverBoots(t *testing.T) {
	hv := vmtest.New()
	hv.KVM = true
	m, _, s := autoManager(t, hv)
	dir := t.TempDir()
	for _, f := range []string{"big", "small"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, f+"-vmlinuz"), make([]byte, map[string]int{"big": 2000, "small": 1000}[f]), 0o600))
		m.Cfg.Images[f] = &config.Image{Boot: config.BootKernel, Kernel: filepath.Join(dir, f+"-vmlinuz"), Base: "/img/" + f}
	}
	var booted string
	hv.OnStart = func(_ string, d *libvirtxml.Domain) {
		booted = d.OS.Kernel
		if err := os.WriteFile(d.Devices.Serials[0].Log.File, []byte("Probing EDD (edd=off to disable)... ok\r\n"), 0o600); err != nil {
			t.Errorf("console: %v", err)
		}
	}
	dt, err := m.KVM().DomainType(context.Background())
	require.NoError(t, err)
	require.Equal(t, "qemu", dt)
	require.Equal(t, filepath.Join(dir, "small-vmlinuz"), booted, "the smallest kernel")
	require.Contains(t, s.String(), "no kernel banner on the console within")
	require.Empty(t, hv.Domains)
	_, err = os.Stat(filepath.Join(m.Cfg.StateDir, "kvm-probe.console.log"))
	require.True(t, os.IsNotExist(err), "the probe's console log is removed")
}

// domain_type = "kvm" on such a host: the prepare fails in one line that
// says why and what to set, leaves nothing, and remembers it for "auto".
func TestProvisionKVMCannotRunSaysWhatToSet(t *testing.T) {
	hv := vmtest.New()
	brokenKVM(hv)
	m, img, _ := autoManager(t, hv)
	m.Cfg.DomainType = config.DomainKVM
	m.Cfg.Path = "/etc/libvirt-executor/config.toml"
	_, err := m.Provision(context.Background(), testRequest(img))
	var kerr *KVMCannotRunError
	require.ErrorAs(t, err, &kerr)
	require.Equal(t, `this host's KVM cannot run guests (QEMU: failed to set MSR 0x10a to 0x69): set domain_type = "qemu" in /etc/libvirt-executor/config.toml`, kerr.Error())
	require.NotContains(t, err.Error(), "\n")
	requireNothingLeft(t, hv, m)
	rec, rerr := m.KVM().Record(context.Background())
	require.NoError(t, rerr)
	require.NotNil(t, rec)
	require.False(t, rec.Works)
	require.Equal(t, "prepare", rec.By)
}

// "auto" whose remembered verdict is stale (KVM worked when probed): the
// start under KVM fails, and the same prepare starts the VM under qemu.
func TestProvisionAutoFallsBackWhenKVMStartFails(t *testing.T) {
	hv := vmtest.New()
	hv.KVM = true
	m, img, s := autoManager(t, hv)
	_, err := m.KVM().DomainType(context.Background()) // probed: works
	require.NoError(t, err)
	brokenKVM(hv)
	ready, err := m.Provision(context.Background(), testRequest(img))
	require.NoError(t, err)
	defer ready.Client.Close()
	var dx libvirtxml.Domain
	require.NoError(t, dx.Unmarshal(hv.Domains["lve-0123abcd-7"].XML))
	require.Equal(t, "qemu", dx.Type)
	require.Contains(t, s.String(), `Warning: this host's KVM cannot run guests (QEMU: failed to set MSR 0x10a to 0x69): set domain_type = "qemu"; domain_type = "auto" starts the VM under qemu instead`)
	dt, err := m.KVM().DomainType(context.Background())
	require.NoError(t, err)
	require.Equal(t, "qemu", dt, "remembered for the next jobs")
	require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(context.Background()))
}

// Jobs that start at once on a host never probed wait for one probe.
func TestDomainTypeAutoOneProbeAtATime(t *testing.T) {
	hv := vmtest.New()
	brokenKVM(hv)
	m, _, _ := autoManager(t, hv)
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			dt, err := m.KVM().DomainType(context.Background())
			if err != nil || dt != "qemu" {
				t.Errorf("got %q, %v", dt, err)
			}
		})
	}
	wg.Wait()
	require.Equal(t, 1, probes(hv))
}
