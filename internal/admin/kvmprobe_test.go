package admin

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func kvmProbeConfig(t *testing.T, domainType string) *config.Config {
	dir := t.TempDir()
	kernel := filepath.Join(dir, "vmlinuz")
	require.NoError(t, os.WriteFile(kernel, []byte("kernel"), 0o600))
	cfg, err := config.Parse([]byte(`
domain_type = "` + domainType + `"
state_dir = "` + filepath.Join(dir, "state") + `"
[images.tiny]
base = "/img/tiny.qcow2"
boot = "kernel"
kernel = "` + kernel + `"
`))
	require.NoError(t, err)
	require.NoError(t, os.Mkdir(cfg.StateDir, 0o700))
	return cfg
}

func nestedHost() *vmtest.Fake {
	hv := vmtest.New()
	hv.KVM = true
	hv.StartErr = func(_ string, d *libvirtxml.Domain) error {
		return errors.New("internal error: qemu unexpectedly closed the monitor: 2026-11-29T01:53:57.506720Z qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\n" +
			"qemu-system-x86_64: ../../target/i386/kvm/kvm.c:3183: kvm_buf_set_msrs: Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed.")
	}
	return hv
}

func TestKVMProbeCheckAutoFallsBack(t *testing.T) {
	cfg := kvmProbeConfig(t, "auto")
	c := kvmProbeCheck(context.Background(), cfg, nestedHost(), "kvm available (/dev/kvm usable)")
	require.True(t, c.OK)
	require.True(t, c.Warn)
	require.Equal(t, "auto: kvm available (/dev/kvm usable), but this host's KVM cannot run guests (QEMU exited as the guest started under KVM: failed to set MSR 0x10a to 0x69); jobs run under qemu (software emulation, much slower)", c.Info)
	_, err := os.Stat(filepath.Join(cfg.StateDir, "cache", "kvm-probe.json"))
	require.NoError(t, err, "remembered for auto")
}

func TestKVMProbeCheckKVMFails(t *testing.T) {
	c := kvmProbeCheck(context.Background(), kvmProbeConfig(t, "kvm"), nestedHost(), "kvm available (/dev/kvm usable)")
	require.False(t, c.OK)
	require.Contains(t, c.Info, `domain_type = "kvm" but this host's KVM cannot run guests`)
	require.Contains(t, c.Fix, `set domain_type = "qemu"`)
}

func TestKVMProbeCheckWorks(t *testing.T) {
	hv := vmtest.New()
	hv.KVM = true
	hv.OnStart = func(_ string, d *libvirtxml.Domain) {
		_ = os.WriteFile(d.Devices.Serials[0].Log.File, []byte("[    0.000000] Linux version 6.1.0\n"), 0o600)
	}
	c := kvmProbeCheck(context.Background(), kvmProbeConfig(t, "auto"), hv, "kvm available (/dev/kvm usable)")
	require.True(t, c.OK)
	require.False(t, c.Warn)
	require.Contains(t, c.Info, "kvm available (/dev/kvm usable); this host's KVM runs guests (the kernel printed its banner under KVM in")
	require.Empty(t, hv.Domains)
}
