package vm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
)

// KVMProbe is one short boot of a kernel under KVM, with no disk and no
// network. It tells a host whose KVM runs guests from one where /dev/kvm
// opens and libvirt offers the kvm domain type, yet no guest runs: some
// nested hosts, where QEMU aborts as the vCPU starts ("failed to set MSR
// 0x10a ... kvm_buf_set_msrs: Assertion ... failed"), or where the guest
// hangs right after the kernel's real-mode setup.
type KVMProbe struct {
	// Name is the probe domain's name (CheckName); Owner its ownership
	// record, whose Deadline lets a sweep remove what a killed probe left.
	Name  string
	Owner Owner
	// Kernel and Initrd are the kernel booted directly (Initrd optional).
	// Without a Kernel the firmware runs and finds nothing to boot: only
	// QEMU's start under KVM is judged then.
	Kernel, Initrd string
	// Machine is the QEMU machine type ("" for libvirt's default).
	Machine string
	// CPU is the guest's CPU; nil: host-passthrough, as the jobs' guests
	// have (DomainXML).
	CPU *libvirtxml.DomainCPU
	// ConsoleLog is a file of this host, made by the caller, that libvirt
	// appends the serial console to; "" where libvirt is another host's:
	// only QEMU's start and its running on for Bound are judged then.
	ConsoleLog string
	// Bound is how long the kernel has to print its banner (default
	// KVMProbeBound).
	Bound time.Duration
	// Cleanup bounds the removal of the probe domain (default 30s).
	Cleanup time.Duration
	// PollInterval is how often the console and the domain's state are
	// looked at (default 100ms).
	PollInterval time.Duration
}

// KVMProbeBound is how long a probe waits for the kernel's banner: under
// working KVM it comes in well under a second.
const KVMProbeBound = 20 * time.Second

// unwatchedBound is how long a probe whose console is not watched waits
// for QEMU to exit.
const unwatchedBound = 5 * time.Second

// KVMBanner is what the probe waits for on the console: the kernel's
// first line, printed once it runs in protected mode (the hang of a broken
// nested KVM comes before it).
const KVMBanner = "Linux version"

// kvmProbeCmdline makes the kernel write to the serial console from its
// first instructions on (earlyprintk), whatever its default log level.
const kvmProbeCmdline = "console=ttyS0 earlyprintk=serial,ttyS0,115200 ignore_loglevel panic=-1"

// KVMVerdict is what a probe found.
type KVMVerdict struct {
	// Works: the kernel printed its banner under KVM (without a console
	// log or a kernel: QEMU started the guest and it ran on for Bound).
	Works bool
	// Why says in one line what the probe saw.
	Why string
	// Took is how long the probe's guest took to its verdict.
	Took time.Duration
}

// ProbeKVM defines and starts the probe domain (type kvm, the jobs' CPU
// mode host-passthrough), watches its console and state for at most
// p.Bound, and removes it again, whatever happened, before it returns. An
// error means the probe could not judge (libvirt refused the definition,
// QEMU failed to start for a reason that is not KVM's, ctx ended); a
// verdict otherwise. A failed removal is returned as an error together
// with the verdict.
func (e *Engine) ProbeKVM(ctx context.Context, p KVMProbe) (KVMVerdict, error) {
	if p.Bound <= 0 {
		p.Bound = KVMProbeBound
	}
	if p.Cleanup <= 0 {
		p.Cleanup = 30 * time.Second
	}
	if p.PollInterval <= 0 {
		p.PollInterval = 100 * time.Millisecond
	}
	x, err := kvmProbeXML(p)
	if err != nil {
		return KVMVerdict{}, err
	}
	if err := change(ctx, func(ctx context.Context) error { return e.HV.Define(ctx, x) }); err != nil {
		return KVMVerdict{}, fmt.Errorf("define the KVM probe domain %s: %w", p.Name, err)
	}
	v, err := e.watchKVMProbe(ctx, p)
	cctx, cancel := detachctx.WithTimeout(ctx, p.Cleanup)
	defer cancel()
	rerr := ignoreNotFound(change(cctx, func(ctx context.Context) error { return e.HV.Destroy(ctx, p.Name) }))
	if rerr == nil {
		rerr = ignoreNotFound(change(cctx, func(ctx context.Context) error { return e.HV.Undefine(ctx, p.Name) }))
	}
	if rerr != nil {
		rerr = fmt.Errorf("remove the KVM probe domain %s: %w", p.Name, rerr)
	}
	return v, errors.Join(err, rerr)
}

// watchKVMProbe starts the defined probe domain and judges it.
func (e *Engine) watchKVMProbe(ctx context.Context, p KVMProbe) (KVMVerdict, error) {
	t0 := time.Now()
	err := change(ctx, func(ctx context.Context) error { return e.HV.Start(ctx, p.Name) })
	if err != nil {
		if detail, ok := KVMCannotRun(err); ok {
			return KVMVerdict{Why: "QEMU exited as the guest started under KVM: " + detail, Took: time.Since(t0)}, nil
		}
		return KVMVerdict{}, fmt.Errorf("start the KVM probe domain %s: %w", p.Name, err)
	}
	bound := p.Bound
	if p.ConsoleLog == "" || p.Kernel == "" {
		// Only QEMU's exit is watched for: it comes at the vCPU's start.
		bound = min(bound, unwatchedBound)
	}
	deadline := time.NewTimer(bound)
	defer deadline.Stop()
	tick := time.NewTicker(p.PollInterval)
	defer tick.Stop()
	for {
		if p.ConsoleLog != "" && p.Kernel != "" {
			if b, _ := os.ReadFile(p.ConsoleLog); bytes.Contains(b, []byte(KVMBanner)) {
				took := time.Since(t0)
				return KVMVerdict{Works: true, Why: fmt.Sprintf("the kernel printed its banner under KVM in %s", Round(took)), Took: took}, nil
			}
		}
		st, err := e.HV.State(ctx, p.Name)
		switch {
		case errors.Is(err, ErrNotFound):
			return KVMVerdict{Why: "the guest vanished under KVM (QEMU exited)" + consoleNote(p), Took: time.Since(t0)}, nil
		case err != nil && ctx.Err() != nil:
			return KVMVerdict{}, err
		case err == nil && !st.Running:
			return KVMVerdict{Why: "QEMU stopped the guest under KVM: " + st.Summary + consoleNote(p), Took: time.Since(t0)}, nil
		}
		select {
		case <-ctx.Done():
			return KVMVerdict{}, context.Cause(ctx)
		case <-deadline.C:
			took := time.Since(t0)
			if p.ConsoleLog == "" || p.Kernel == "" {
				return KVMVerdict{Works: true, Why: fmt.Sprintf("the guest started under KVM and ran for %s (its console is not watched: %s)", Round(took), unwatched(p)), Took: took}, nil
			}
			return KVMVerdict{Why: fmt.Sprintf("no kernel banner on the console within %s under KVM%s", p.Bound, consoleNote(p)), Took: took}, nil
		case <-tick.C:
		}
	}
}

func unwatched(p KVMProbe) string {
	if p.Kernel == "" {
		return "no image boots a kernel directly"
	}
	return "another host's libvirt"
}

// consoleNote is the last line the probe's guest printed, for a verdict.
func consoleNote(p KVMProbe) string {
	if p.ConsoleLog == "" {
		return ""
	}
	b, err := os.ReadFile(p.ConsoleLog)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(strings.ReplaceAll(string(b), "\r", "")), "\n")
	last := strings.TrimSpace(lines[len(lines)-1])
	if last == "" {
		return " (the console stayed empty)"
	}
	if len(last) > 120 {
		last = last[:120] + "..."
	}
	return fmt.Sprintf(" (the console stops at %q)", last)
}

// kvmProbeXML is the probe domain: no disk, no network, the serial
// console logged to p.ConsoleLog; it never restarts.
func kvmProbeXML(p KVMProbe) (string, error) {
	if err := CheckName(p.Name); err != nil {
		return "", err
	}
	owner, err := MarshalOwner(p.Owner)
	if err != nil {
		return "", err
	}
	bootOS := &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Arch: "x86_64", Machine: p.Machine, Type: "hvm"}}
	if p.Kernel != "" {
		bootOS.Kernel, bootOS.Initrd, bootOS.Cmdline = p.Kernel, p.Initrd, kvmProbeCmdline
	}
	serial := libvirtxml.DomainSerial{Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}}}
	if p.ConsoleLog != "" {
		serial.Log = &libvirtxml.DomainChardevLog{File: p.ConsoleLog, Append: "on"}
	}
	if p.CPU == nil {
		p.CPU = &libvirtxml.DomainCPU{Mode: "host-passthrough"}
	}
	d := &libvirtxml.Domain{
		Type:       "kvm",
		Name:       p.Name,
		Metadata:   &libvirtxml.DomainMetadata{XML: owner},
		Memory:     &libvirtxml.DomainMemory{Value: 256, Unit: "MiB"},
		VCPU:       &libvirtxml.DomainVCPU{Value: 1},
		OS:         bootOS,
		CPU:        p.CPU,
		OnPoweroff: "destroy",
		OnCrash:    "destroy",
		OnReboot:   "destroy",
		Features:   &libvirtxml.DomainFeatureList{ACPI: &libvirtxml.DomainFeature{}, APIC: &libvirtxml.DomainFeatureAPIC{}},
		Devices: &libvirtxml.DomainDeviceList{
			Serials:    []libvirtxml.DomainSerial{serial},
			MemBalloon: &libvirtxml.DomainMemBalloon{Model: "none"},
		},
	}
	return d.Marshal()
}

// FormatVersion writes a version as libvirt encodes it (major*1e6 +
// minor*1e3 + release) the way people do: "9.0.0".
func FormatVersion(v uint32) string {
	return fmt.Sprintf("%d.%d.%d", v/1000000, v/1000%1000, v%1000)
}

// kvmFailures are what QEMU says, in libvirt's start error, when the
// host's KVM cannot run a guest at all, most telling first.
var kvmFailures = []string{
	"failed to set msr",
	"kvm_buf_set_msrs",
	"kvm_put_msrs",
	"failed to initialize kvm",
	"could not access kvm kernel module",
	"kvm_init_vcpu",
}

// KVMCannotRun reports whether err, a domain's failed start, is QEMU
// saying that the host's KVM cannot run the guest, with QEMU's words for
// it on one line ("failed to set MSR 0x10a to 0x69").
func KVMCannotRun(err error) (detail string, ok bool) {
	if err == nil {
		return "", false
	}
	msg := err.Error()
	low := strings.ToLower(msg)
	for _, f := range kvmFailures {
		i := strings.Index(low, f)
		if i < 0 {
			continue
		}
		detail = msg[i:]
		if j := strings.IndexAny(detail, "\r\n"); j >= 0 {
			detail = detail[:j]
		}
		detail = strings.TrimSpace(detail)
		if len(detail) > 160 {
			detail = detail[:160] + "..."
		}
		return detail, true
	}
	return "", false
}
