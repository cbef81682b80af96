package vm_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// msrAbort is what libvirt 9.0 said here, starting a kvm domain on a
// nested host whose KVM cannot run guests (QEMU 7.2).
const msrAbort = "internal error: qemu unexpectedly closed the monitor: 2026-11-29T01:53:57.506720Z qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\n" +
	"qemu-system-x86_64: ../../target/i386/kvm/kvm.c:3183: kvm_buf_set_msrs: Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed."

func testProbe(t *testing.T) KVMProbe {
	log := filepath.Join(t.TempDir(), "console.log")
	require.NoError(t, os.WriteFile(log, nil, 0o600))
	now := time.Now().UTC()
	return KVMProbe{
		Name:       "lve-0123abcd-kvm-00112233",
		Owner:      Owner{Controller: "0123abcd-c", Frontend: "kvm-probe", Job: "lve-0123abcd-kvm-00112233", Created: now, Deadline: now.Add(time.Minute)},
		Kernel:     "/images/vmlinuz",
		Initrd:     "/images/initrd.img",
		ConsoleLog: log,
		Bound:      300 * time.Millisecond,
		Cleanup:    time.Second,
	}
}

// prints makes the fake guest write text to its console log when it starts.
func prints(t *testing.T, hv *vmtest.Fake, text string) {
	hv.OnStart = func(_ string, d *libvirtxml.Domain) {
		log := d.Devices.Serials[0].Log.File
		if err := os.WriteFile(log, []byte(text), 0o600); err != nil {
			t.Errorf("console: %v", err)
		}
	}
}

func TestProbeKVMQEMUAbortsAtStart(t *testing.T) {
	hv := vmtest.New()
	hv.StartErr = func(_ string, d *libvirtxml.Domain) error {
		if d.Type == "kvm" {
			return errors.New(msrAbort)
		}
		return nil
	}
	v, err := (&Engine{HV: hv}).ProbeKVM(context.Background(), testProbe(t))
	require.NoError(t, err)
	require.False(t, v.Works)
	require.Equal(t, "QEMU exited as the guest started under KVM: failed to set MSR 0x10a to 0x69", v.Why)
	require.Empty(t, hv.Domains, "the probe removes its domain")
}

func TestProbeKVMBanner(t *testing.T) {
	hv := vmtest.New()
	prints(t, hv, "Probing EDD (edd=off to disable)... ok\r\n[    0.000000] Linux version 6.1.0-56-cloud-amd64\r\n")
	p := testProbe(t)
	p.Bound = 10 * time.Second
	start := time.Now()
	v, err := (&Engine{HV: hv}).ProbeKVM(context.Background(), p)
	require.NoError(t, err)
	require.True(t, v.Works, v.Why)
	require.Less(t, time.Since(start), 5*time.Second, "the banner ends the wait")
	require.Empty(t, hv.Domains)
}

// The nested host whose guest hangs after the kernel's real-mode setup:
// the console stops at the setup's last line until the bound.
func TestProbeKVMNeverBoots(t *testing.T) {
	hv := vmtest.New()
	prints(t, hv, "Probing EDD (edd=off to disable)... ok\r\n")
	v, err := (&Engine{HV: hv}).ProbeKVM(context.Background(), testProbe(t))
	require.NoError(t, err)
	require.False(t, v.Works)
	require.Contains(t, v.Why, "no kernel banner on the console within")
	require.Contains(t, v.Why, `the console stops at "Probing EDD (edd=off to disable)... ok"`)
	require.Empty(t, hv.Domains)
	require.Contains(t, hv.Calls, "Destroy")
}

func TestProbeKVMGuestStops(t *testing.T) {
	hv := vmtest.New()
	hv.OnStart = func(name string, _ *libvirtxml.Domain) {
		hv.Lock()
		defer hv.Unlock()
		hv.Domains[name].Active = false
		hv.Domains[name].State = &DomainState{Code: StatePaused, Summary: "paused (internal error)"}
	}
	v, err := (&Engine{HV: hv}).ProbeKVM(context.Background(), testProbe(t))
	require.NoError(t, err)
	require.False(t, v.Works)
	require.Equal(t, "QEMU stopped the guest under KVM: paused (internal error) (the console stayed empty)", v.Why)
	require.Empty(t, hv.Domains)
}

// Without a console to watch (another host's libvirt), a guest that starts
// and runs on for the bound passes.
func TestProbeKVMUnwatched(t *testing.T) {
	hv := vmtest.New()
	p := testProbe(t)
	p.ConsoleLog = ""
	v, err := (&Engine{HV: hv}).ProbeKVM(context.Background(), p)
	require.NoError(t, err)
	require.True(t, v.Works)
	require.Contains(t, v.Why, "its console is not watched: another host's libvirt")
	require.Empty(t, hv.Domains)
}

// A start that fails for another reason than KVM's is no verdict.
func TestProbeKVMOtherStartFailure(t *testing.T) {
	hv := vmtest.New()
	hv.FailOn["Start"] = errors.New("Cannot access storage file '/images/vmlinuz': No such file or directory")
	v, err := (&Engine{HV: hv}).ProbeKVM(context.Background(), testProbe(t))
	require.ErrorContains(t, err, "start the KVM probe domain lve-0123abcd-kvm-00112233: Cannot access storage file")
	require.Empty(t, v.Why)
	require.Empty(t, hv.Domains)
}

func TestProbeKVMDomain(t *testing.T) {
	hv := vmtest.New()
	var got libvirtxml.Domain
	hv.OnStart = func(_ string, d *libvirtxml.Domain) { got = *d }
	p := testProbe(t)
	p.Bound = 50 * time.Millisecond
	_, err := (&Engine{HV: hv}).ProbeKVM(context.Background(), p)
	require.NoError(t, err)
	require.Equal(t, "kvm", got.Type)
	require.Equal(t, "host-passthrough", got.CPU.Mode, "the jobs' CPU mode")
	require.Empty(t, got.Devices.Disks)
	require.Empty(t, got.Devices.Interfaces)
	require.Equal(t, "destroy", got.OnReboot)
	require.Equal(t, "/images/vmlinuz", got.OS.Kernel)
	require.Contains(t, got.OS.Cmdline, "earlyprintk=serial")
	require.Equal(t, p.ConsoleLog, got.Devices.Serials[0].Log.File)
	o, err := ParseOwner(got.Metadata.XML)
	require.NoError(t, err)
	require.Equal(t, "kvm-probe", o.Frontend)
}

func TestKVMCannotRun(t *testing.T) {
	d, ok := KVMCannotRun(errors.New("start domain lve-x: " + msrAbort))
	require.True(t, ok)
	require.Equal(t, "failed to set MSR 0x10a to 0x69", d)
	require.False(t, strings.Contains(d, "\n"))
	_, ok = KVMCannotRun(errors.New("Cannot access storage file"))
	require.False(t, ok)
	_, ok = KVMCannotRun(nil)
	require.False(t, ok)
}
