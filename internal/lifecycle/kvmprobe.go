package lifecycle

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// KVMRecord is the verdict of the KVM probe (ProbeKVM) for one host,
// remembered in the state directory (cache/kvm-probe.json) so that
// domain_type = "auto" probes once per host: for the libvirt URI, the
// QEMU version and the host's kernel it was made for. A change of any of
// them probes again; so does libvirt-executor doctor, every time.
type KVMRecord struct {
	URI     string `json:"uri"`
	Libvirt string `json:"libvirt"`
	QEMU    string `json:"qemu"`
	// Kernel is this host's kernel release ("" for another host's libvirt).
	Kernel string `json:"kernel"`
	// Works: a guest ran under KVM. Why says in one line what was seen.
	Works bool   `json:"works"`
	Why   string `json:"why"`
	// Image is the image whose kernel the probe booted ("" for none).
	Image string    `json:"image,omitempty"`
	At    time.Time `json:"at"`
	// By is what made the record: "probe", or "prepare" (a machine's
	// start that QEMU refused under KVM).
	By string `json:"by"`
}

// kvmRecordName is the record's name in the store's cache.
const kvmRecordName = "kvm-probe"

// kvmProbeLock is the store lock that one probe at a time holds.
const kvmProbeLock = "kvm-probe"

// sameHost reports whether r was made for the host that h describes.
func (r KVMRecord) sameHost(h KVMRecord) bool {
	return r.URI == h.URI && r.QEMU == h.QEMU && r.Kernel == h.Kernel
}

// Say is the record's verdict in one line.
func (r KVMRecord) Say() string {
	if r.Works {
		return "this host's KVM runs guests (" + r.Why + ")"
	}
	return "this host's KVM cannot run guests (" + r.Why + ")"
}

// kvmHost is the record's key for this installation's host: libvirt URI,
// versions and (for this host's libvirt) the kernel release.
func (m *Manager) kvmHost(ctx context.Context) (KVMRecord, error) {
	lv, hv, err := m.hv.Version(ctx)
	if err != nil {
		return KVMRecord{}, fmt.Errorf("libvirt version: %w", err)
	}
	h := KVMRecord{URI: m.Cfg.LibvirtURI, Libvirt: vm.FormatVersion(lv), QEMU: vm.FormatVersion(hv)}
	if m.Cfg.LocalLibvirt() {
		var u unix.Utsname
		if err := unix.Uname(&u); err == nil {
			h.Kernel = unix.ByteSliceToString(u.Release[:])
		}
	}
	return h, nil
}

// KVMRecordFor returns the remembered verdict for this host, if there is
// one made for it (nil otherwise).
func (kh KVM) Record(ctx context.Context) (*KVMRecord, error) {
	m := kh.m
	h, err := m.kvmHost(ctx)
	if err != nil {
		return nil, err
	}
	return m.recalledKVM(h), nil
}

func (m *Manager) recalledKVM(h KVMRecord) *KVMRecord {
	var r KVMRecord
	if !m.Store.Recall(kvmRecordName, &r) || !r.sameHost(h) {
		return nil
	}
	return &r
}

// ProbeKVM boots the kernel of the smallest image that boots one directly
// under KVM, without disk or network, for at most KVMProbeBound, and
// removes the guest again (vm.Engine.ProbeKVM). With save it remembers the
// verdict for domain_type = "auto" (save only as the state directory's
// user). An error means no verdict: the probe could not run.
func (kh KVM) Probe(ctx context.Context, save bool) (KVMRecord, error) {
	m := kh.m
	h, err := m.kvmHost(ctx)
	if err != nil {
		return KVMRecord{}, err
	}
	name, err := KVMProbeName(m.Cfg.NamePrefix, m.Controller)
	if err != nil {
		return KVMRecord{}, err
	}
	img, kernel, initrd, machine := probeImage(m.Cfg)
	bound := m.KVMProbeBound
	if bound <= 0 {
		bound = vm.KVMProbeBound
	}
	now := time.Now().UTC()
	p := vm.KVMProbe{
		Name:   name,
		Owner:  vm.Owner{Controller: m.Controller, Frontend: "kvm-probe", Job: name, Created: now, Deadline: now.Add(bound + 5*time.Minute)},
		Kernel: kernel, Initrd: initrd, Machine: machine, Bound: bound,
		Cleanup: m.Cfg.Timeouts.Cleanup.D(),
	}
	if m.Cfg.LocalLibvirt() {
		log, done, err := m.probeConsole(save)
		if err != nil {
			return KVMRecord{}, err
		}
		defer done()
		p.ConsoleLog = log
	}
	v, err := m.engine().ProbeKVM(ctx, p)
	if v.Why == "" {
		return KVMRecord{}, err
	}
	if err != nil {
		m.say("Warning: %v", err)
	}
	rec := h
	rec.Works, rec.Why, rec.Image, rec.At, rec.By = v.Works, v.Why, img, time.Now().UTC(), "probe"
	if save {
		if err := m.Store.Remember(kvmRecordName, rec); err != nil {
			m.say("Warning: the KVM probe's verdict is not remembered: %v", err)
		}
	}
	return rec, nil
}

// probeConsole makes the file that libvirt logs the probe's console to:
// in the state directory when the probe saves its verdict (the directory
// is this user's then), else in a temporary directory. done removes it.
func (m *Manager) probeConsole(save bool) (path string, done func(), err error) {
	dir := m.Cfg.StateDir
	if !save {
		if dir, err = os.MkdirTemp("", "lve-kvm-probe-"); err != nil {
			return "", nil, err
		}
		// libvirt's log daemon (root) writes into the file this user made.
		_ = os.Chmod(dir, 0o711) //nolint:gosec // G302: searchable, not listable; the file in it is 0600
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", nil, err
	}
	path = filepath.Join(dir, "kvm-probe.console.log")
	if err := touchPrivate(path); err != nil {
		return "", nil, err
	}
	return path, func() {
		_ = os.Remove(path)
		if !save {
			_ = os.Remove(dir)
		}
	}, nil
}

// probeImage picks what the probe boots: the image whose kernel and initrd
// are the smallest of those that boot a kernel directly (on another host's
// libvirt, whose files are not here to measure, the first). "" for none.
func probeImage(cfg *config.Config) (name, kernel, initrd, machine string) {
	best := int64(-1)
	for _, n := range cfg.ImageNames() {
		img, ok := cfg.Image(n)
		if !ok || img.Boot != config.BootKernel {
			continue
		}
		c := *img
		if c.Source != "" && !c.Pulled() {
			if err := cfg.ResolveSource(&c); err != nil {
				continue
			}
		}
		if c.Kernel == "" {
			continue
		}
		var size int64
		if cfg.LocalLibvirt() {
			k, err := os.Stat(c.Kernel)
			if err != nil {
				continue
			}
			size = k.Size()
			if c.Initrd != "" {
				i, err := os.Stat(c.Initrd)
				if err != nil {
					continue
				}
				size += i.Size()
			}
		}
		if best < 0 || size < best {
			best, name, kernel, initrd, machine = size, n, c.Kernel, c.Initrd, c.Machine
		}
	}
	return name, kernel, initrd, machine
}

// DomainType is the domain type this installation's machines get now:
// domain_type as configured, where "auto" is kvm when libvirt offers it
// and KVM runs guests on this host, as the probe remembered for it says
// (probing first, once per host, when nothing is remembered), else qemu,
// with a warning that says why.
func (kh KVM) DomainType(ctx context.Context) (string, error) {
	m := kh.m
	if m.Cfg.DomainType != config.DomainAuto {
		return m.Cfg.DomainType, nil
	}
	kvm, err := m.hv.KVMAvailable(ctx)
	if err != nil {
		return "", fmt.Errorf("read host capabilities: %w", err)
	}
	if !kvm {
		return config.DomainQEMU, nil
	}
	rec, err := m.kvmVerdict(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return "", err
		}
		m.say("Warning: domain_type = \"auto\": the KVM probe could not run (%v); using kvm", err)
		return config.DomainKVM, nil
	}
	if rec.Works {
		return config.DomainKVM, nil
	}
	m.say("Warning: domain_type = \"auto\": %s; the VM runs under qemu, software emulation, much slower (set domain_type = \"qemu\" to say so; libvirt-executor doctor probes again)", rec.Say())
	return config.DomainQEMU, nil
}

// kvmVerdict is the remembered verdict for this host, or a probe's, made
// and remembered now under the probe's lock (another process may be
// probing: its verdict is taken once it is done).
func (m *Manager) kvmVerdict(ctx context.Context) (KVMRecord, error) {
	h, err := m.kvmHost(ctx)
	if err != nil {
		return KVMRecord{}, err
	}
	if r := m.recalledKVM(h); r != nil {
		return *r, nil
	}
	unlock, err := m.Store.Lock(ctx, kvmProbeLock)
	if err != nil {
		return KVMRecord{}, err
	}
	defer unlock()
	if r := m.recalledKVM(h); r != nil {
		return *r, nil
	}
	m.say("Probing whether this host's KVM runs guests (once per host, at most %s)", vm.Round(m.probeBound()))
	r, err := m.KVM().Probe(ctx, true)
	if err == nil {
		m.say("KVM probe: %s", r.Say())
	}
	return r, err
}

func (m *Manager) probeBound() time.Duration {
	if m.KVMProbeBound > 0 {
		return m.KVMProbeBound
	}
	return vm.KVMProbeBound
}

// KVMCannotRunError is a machine's start that QEMU refused because the
// host's KVM cannot run guests (vm.KVMCannotRun); its message says so in
// one line, and what to set.
type KVMCannotRunError struct {
	// Detail is QEMU's own words ("failed to set MSR 0x10a to 0x69").
	Detail string
	// Config is the configuration file to set domain_type in ("" unknown).
	Config string
	Err    error
}

func (e *KVMCannotRunError) Error() string {
	in := ""
	if e.Config != "" {
		in = " in " + e.Config
	}
	return fmt.Sprintf("this host's KVM cannot run guests (QEMU: %s): set domain_type = \"qemu\"%s", e.Detail, in)
}

func (e *KVMCannotRunError) Unwrap() error { return e.Err }

// kvmStartRefused handles a machine's create that failed under KVM with
// err: when QEMU said the host's KVM cannot run guests, it remembers that
// for this host (domain_type = "auto" then chooses qemu) and returns the
// error that says so, retry false; with domain_type = "auto" it warns
// instead and asks for a retry under qemu. Any other err is returned as is.
func (m *Manager) kvmStartRefused(ctx context.Context, err error) (retryQEMU bool, _ error) {
	detail, ok := vm.KVMCannotRun(err)
	if !ok {
		return false, err
	}
	if h, herr := m.kvmHost(ctx); herr == nil {
		rec := h
		rec.Why, rec.At, rec.By = "QEMU exited as a guest started under KVM: "+detail, time.Now().UTC(), "prepare"
		if rerr := m.Store.Remember(kvmRecordName, rec); rerr != nil {
			m.say("Warning: that this host's KVM cannot run guests is not remembered: %v", rerr)
		}
	}
	kerr := &KVMCannotRunError{Detail: detail, Config: m.Cfg.Path, Err: err}
	if m.Cfg.DomainType == config.DomainAuto {
		m.say("Warning: %v; domain_type = \"auto\" starts the VM under qemu instead, now and from now on on this host", kerr)
		return true, nil
	}
	return false, kerr
}
