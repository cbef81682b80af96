// Package lifecycle owns one machine of this installation from its name to
// its removal: admission to the host's capacity, keys, linked clone, boot,
// address, SSH readiness and the recorded state (Manager.Provision and
// Launch, both from one Request), the per-machine operations on a small
// handle (Manager.Machine(name): Connect, Keep, Teardown, Explain, Start,
// Stop, PinAddress, the seed and the cache disks), the host's capacity
// (Manager.Capacity), its KVM probe (Manager.KVM) and the pool's volumes
// (Manager.Volumes), the machine's spec, the inventory and sweep of what
// the installation left on the host (OwnedBy, Inventory, Sweep), and the
// event records of what it did. It knows no CI system, no front end, no
// pool, no executable and no tool in the guest: what differs between
// machines comes in the Request (MakeRoom, ReachServicePorts, Seed, ...),
// and what the machines of a kind add through Hooks (room made by a
// standby pool, shared disks, work to stop when a machine's user is done
// with it, extra sweeps). The machine of a CI job is internal/jobvm's; the
// guest tools disk is internal/guesttools'.
package lifecycle

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Manager ties configuration, hypervisor and state together. Front ends get
// one from Open and Close it when done.
type Manager struct {
	Cfg        *config.Config
	Store      state.Store
	Controller string
	// Say receives progress lines meant for the person watching the job.
	Say func(format string, args ...any)
	// SSHPollInterval is how often an SSH readiness attempt starts, at a
	// fixed rate (default sshexec.DefaultPollInterval, 50ms);
	// AddressPollInterval likewise for DHCP leases (default 50ms).
	SSHPollInterval     time.Duration
	AddressPollInterval time.Duration
	// SSHPort is the guest's SSH port (default 22).
	SSHPort int
	// KVMProbeBound bounds the KVM probe's wait for the kernel's banner
	// (default vm.KVMProbeBound; ProbeKVM).
	KVMProbeBound time.Duration
	// hooks are what the kinds of machines add (Options.Hooks).
	hooks Hooks
	// hv is the hypervisor connection (from Open: one that connects on
	// first use and reconnects after libvirtd restarts).
	hv vm.Hypervisor
	// afterInventory, if set, runs in Sweep between the inventory and acting
	// on it. Tests put a stage's work into that gap with it; it is nil in
	// production.
	afterInventory func()
}

func (m *Manager) sshPort() int {
	if m.SSHPort != 0 {
		return m.SSHPort
	}
	return 22
}

func (m *Manager) say(format string, args ...any) {
	if m.Say != nil {
		m.Say(format, args...)
	}
}

func (m *Manager) engine() *vm.Engine {
	return &vm.Engine{HV: m.hv, Controller: m.Controller, UndoTimeout: m.Cfg.Timeouts.Cleanup.D(),
		PollInterval: m.AddressPollInterval, Network: m.Cfg.Network, Addresses: AddressBook{m.Store},
		NamePrefix: MachinePrefix(m.Cfg.NamePrefix, m.Controller)}
}

// Request asks for one machine.
type Request struct {
	Name      string
	Image     *config.Image
	VCPUs     int
	MemoryMiB int
	DiskGiB   int
	Frontend  string
	Job       string
	// Lifetime is how long the job may run; the ownership deadline is
	// now + Lifetime + the configured slack.
	Lifetime time.Duration
	// Check, if set, is the front end's last look at the machine once SSH
	// answers (for example: are the tools its jobs need installed?). An
	// error undoes everything, like any failed step. tools is the guest
	// tools disk the machine got (nil for none).
	Check func(ctx context.Context, c *sshexec.Client, tools *state.Tools) error
	// OnStep, if set, is told about each step of the provisioning as it
	// ends: its name, how long it took, its error (nil when it succeeded).
	OnStep func(name string, took time.Duration, err error)
	// Standby, if set, is recorded with the machine: it is made for a
	// standby pool (internal/jobvm's BootStandby).
	Standby *state.Standby
	// NoWait fails admission at once (ErrNoRoom) when the host is full,
	// instead of waiting for room.
	NoWait bool
	// MakeRoom has a NoWait request ask Hooks.MakeRoom to free the room
	// it lacks (idle standby machines) before it fails: a machine that
	// serves a job (garm's), not one that waits for a job (a standby).
	// A request that waits always asks.
	MakeRoom bool
	// Tags are the front end's marks in the ownership metadata.
	Tags []vm.Tag
	// SeedWritable attaches the cloud-init seed writable, with the serial
	// guestinit.WritableSeedSerial: the guest wipes it once it has read it
	// (garm's bootstrap), not waiting for the host to take it away.
	SeedWritable bool
	// Seed, if set, builds the machine's cloud-init seed instead of the
	// image's default one (CloudInitSeed): a front end's own user-data.
	Seed func(keys *guestinit.Keys, dir string) ([]byte, error)
	// ReachServicePorts lets the machine's guest reach the service ports
	// of the network's address that other machines are refused
	// (MachineFilter): the guests those services serve (garm's runners).
	ReachServicePorts bool
	// DeferFilterPin: the network filter is not given the machine's
	// address at boot (PinAddress); the caller has it done later, off the
	// critical path (libvirt re-instantiates the filter, seconds on a busy
	// host). Until then the filter holds the address it learnt from DHCP.
	DeferFilterPin bool
	// Dirs are host directories shared into the guest with virtiofs, each
	// through a virtiofsd the caller started (vm.Spec.Dirs): a GitHub
	// hook job's _work. A machine with Dirs is never a standby's.
	Dirs []vm.SharedDir
}

// request is what one provisioning asks for: a Request, provisioned
// (waited for) or launched (detached).
type request struct {
	Request
	detached bool
}

// Ready is a provisioned machine with an open SSH connection.
type Ready struct {
	Machine *state.Machine
	Client  *sshexec.Client
	// Timings are the durations the job log showed, unrounded, and when the
	// boot reached each of its stages.
	Timings Timings
}

// Provision removes leftovers of an earlier attempt under the same name, then
// creates, boots and connects to a fresh machine (the steps of provision). On
// failure or cancellation everything made by this call is removed before it
// returns.
func (m *Manager) Provision(ctx context.Context, req Request) (*Ready, error) {
	return m.provision(ctx, request{Request: req})
}

func (m *Manager) provision(ctx context.Context, req request) (*Ready, error) {
	start := time.Now()
	if err := vm.CheckName(req.Name); err != nil {
		return nil, err
	}
	if img := req.Image; img != nil && img.Source != "" && !img.Pulled() {
		// Only prepare pulls on first use; garm's creates and anything
		// else need the image stored (docs/fleet.md).
		return nil, fmt.Errorf("image %s (%s) is not on this host: libvirt-executor image pull %s (as the stages' user), or let a job pull it", img.Name, img.Source, img.Name)
	}
	// The image's files by the names they have now (a rebuild that moves
	// image build's link never changes them under this machine later).
	req.Image = m.Cfg.ResolveFiles(req.Image)
	// A base image is input: one that names a host file or claims a size
	// past the limits never gets a machine (docs/security.md).
	if err := m.Cfg.CheckBase(req.Image); err != nil {
		return nil, err
	}
	// The machine lock keeps sweeps (and a concurrent attempt) away while
	// this machine is being made; the kernel drops it if we are killed.
	unlock, err := m.Store.Lock(ctx, req.Name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if req.detached {
		// A front end's instance of this name that has a domain is alive
		// (a duplicate create), not the leftover of an earlier attempt.
		if _, err := m.hv.State(ctx, req.Name); err == nil {
			return nil, fmt.Errorf("%w: %s", ErrExists, req.Name)
		} else if !errors.Is(err, vm.ErrNotFound) {
			return nil, err
		}
	}
	if err := m.teardown(ctx, req.Name); err != nil {
		return nil, fmt.Errorf("remove leftovers of %s: %w", req.Name, err)
	}
	p, err := m.newProvision(ctx, req)
	if err != nil {
		return nil, err
	}
	defer func() { p.endBoot() }() // the one create set, if it ran
	if err := p.run(ctx); err != nil {
		return nil, err
	}
	p.timings.Ready = time.Since(start)
	m.say("Machine ready in %s", vm.Round(p.timings.Ready))
	mach, _, _, err := m.Store.Load(req.Name)
	if err != nil {
		if p.client != nil {
			_ = p.client.Close()
		}
		tctx, cancel := detachctx.WithTimeout(ctx, m.Cfg.Timeouts.Cleanup.D())
		defer cancel()
		return nil, errors.Join(err, m.teardown(tctx, req.Name))
	}
	return &Ready{Machine: mach, Client: p.client, Timings: p.timings}, nil
}

// ErrExists is Launch's refusal of a name whose machine exists.
var ErrExists = errors.New("a machine of this name exists")

// Launch makes and starts a machine of req and returns without waiting for
// its boot: its guest reports back by itself (a front end whose guest
// does: garm's runners). It gets no shared disks, and nothing waits for its
// address or SSH. A machine of that name that
// exists is refused (ErrExists): a duplicate, not a leftover. Everything
// made is undone when a step fails, as in Provision.
func (m *Manager) Launch(ctx context.Context, req Request) (*state.Machine, error) {
	// Nothing waits for the guest: no front end's check, no shared disks.
	req.Check = nil
	r, err := m.provision(ctx, request{detached: true, Request: req})
	if err != nil {
		return nil, err
	}
	return r.Machine, nil
}

// ConsoleLog is the file on this host that keeps the serial console of
// the named machine (in its state directory), or "" when libvirt is
// another host's: that host's virtlogd could not write here, and a path
// of this host's there would leave files on it that nothing removes. A
// machine on another host has a console nobody keeps (virsh console
// still reaches it while it runs).
func (mc Machine) ConsoleLog() string {
	m, name := mc.m, mc.name
	if !m.Cfg.LocalLibvirt() {
		return ""
	}
	return filepath.Join(m.Store.MachineDir(name), "console.log")
}

// touchPrivate creates an empty 0600 file owned by this process's user.
func touchPrivate(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	return f.Close()
}

// tail is the last lines of the guest's console log at path, from its
// last 64 KiB, with control characters (a guest's terminal escapes) but
// newlines and tabs shown as '?' (carriage returns dropped): what a guest prints reaches a job log or
// an admin's terminal.
func tail(path string, lines int) []byte {
	if path == "" {
		return nil
	}
	b := lastBytes(path, 64<<10)
	if b == nil {
		return nil
	}
	b = bytes.Map(func(r rune) rune {
		if r == '\r' {
			return -1
		}
		if (r < 0x20 && r != '\n' && r != '\t') || r == 0x7f {
			return '?'
		}
		return r
	}, bytes.TrimRight(b, "\r\n\x00"))
	parts := bytes.Split(b, []byte("\n"))
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return bytes.Join(parts, []byte("\n"))
}

func (m *Manager) target(addr, user string, signer ssh.Signer, hostKey ssh.PublicKey) sshexec.Target {
	return sshexec.Target{
		Addr: net.JoinHostPort(addr, strconv.Itoa(m.sshPort())), User: user, Signer: signer, HostKey: hostKey,
		InsecureIgnoreHostKey: m.Cfg.HostKeyPolicy == config.HostKeyInsecureIgnore,
		ConnectTimeout:        m.Cfg.SSH.ConnectTimeout.D(),
		KeepaliveInterval:     m.Cfg.SSH.KeepaliveInterval.D(),
		KeepaliveCount:        m.Cfg.SSH.KeepaliveCount,
	}
}

// Connect opens an SSH connection to a provisioned machine using the recorded
// address and pinned host key.
func (mc Machine) Connect(ctx context.Context) (*state.Machine, *sshexec.Client, error) {
	m, name := mc.m, mc.name
	mach, signer, hostKey, err := m.Store.Load(name)
	if err != nil {
		return nil, nil, err
	}
	t := m.target(mach.Address, mach.User, signer, hostKey)
	t.Addr = net.JoinHostPort(mach.Address, strconv.Itoa(mach.Port))
	c, err := sshexec.Dial(ctx, t)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to %s at %s: %w", name, t.Addr, err)
	}
	return mach, c, nil
}

// Teardown removes the machine, its volumes, its state and its lock, holding
// the machine's lock. Missing pieces count as success. What is not provably
// this installation's is left alone and reported with vm.ErrNotOurs: a name
// outside its prefix, a domain of that name that is not ours, and volumes
// with neither a domain nor a state record.
func (mc Machine) Teardown(ctx context.Context) error {
	m, name := mc.m, mc.name
	return m.Machine(name).TeardownIf(ctx, nil)
}

// TeardownIf is Teardown; when still is set it is asked under the lock,
// and the machine is removed only if it says so (still returns an error to
// refuse, or false for nothing to do).
func (mc Machine) TeardownIf(ctx context.Context, still func() (bool, error)) error {
	m, name := mc.m, mc.name
	if err := vm.CheckName(name); err != nil {
		return err
	}
	// Before the lock: it would leave a lock file under a name not ours.
	if err := m.checkOurName(name); err != nil {
		return err
	}
	unlock, err := m.Store.Lock(ctx, name)
	if err != nil {
		return err
	}
	defer unlock()
	if still != nil {
		if ok, err := still(); err != nil || !ok {
			return err
		}
	}
	if err := m.teardown(ctx, name); err != nil {
		return err
	}
	m.Store.RemoveLock(name)
	return nil
}

// Keep leaves the machine running for debugging until the given time, after
// which a sweep removes it like any expired machine. Its user is done with
// it (Hooks.Release runs).
func (mc Machine) Keep(ctx context.Context, until time.Time) error {
	m, name := mc.m, mc.name
	unlock, err := m.Store.Lock(ctx, name)
	if err != nil {
		return err
	}
	defer unlock()
	if err := m.engine().Extend(ctx, name, until); err != nil {
		return err
	}
	m.release(name)
	return nil
}

// TeardownLocked is Teardown for a caller that holds the machine's lock.
func (mc Machine) TeardownLocked(ctx context.Context) error {
	m, name := mc.m, mc.name
	return m.teardown(ctx, name)
}

// teardown is Teardown for a caller that holds the lock. The state directory
// goes last: while anything else of the machine is left, it is the record
// that says that rest is ours.
func (m *Manager) teardown(ctx context.Context, name string) error {
	if err := m.checkOurName(name); err != nil {
		return err
	}
	recorded, err := m.Store.Has(name)
	if err != nil {
		return fmt.Errorf("state of %s: %w", name, err)
	}
	m.release(name)
	if err := m.engine().Remove(ctx, name, m.Cfg.StoragePool, recorded); err != nil {
		return err
	}
	return m.Store.Remove(name)
}

// CheckOurName refuses a name outside this installation's prefix (an
// error matching vm.ErrNotOurs).
func (mc Machine) CheckOurName() error {
	m, name := mc.m, mc.name
	return m.checkOurName(name)
}

// checkOurName refuses a name outside this installation's prefix: whatever
// has such a name (a base image "debian-12.qcow2" in the same pool, another
// installation's machine) is not this installation's to remove.
func (m *Manager) checkOurName(name string) error {
	if p := m.namePrefix(); !strings.HasPrefix(name, p) {
		return notOurs(fmt.Sprintf("refusing to remove %q: not a machine of this installation (names start with %q)", name, p))
	}
	return nil
}

// notOurs is a refusal that says why in its own words and matches
// vm.ErrNotOurs.
type notOurs string

// NotOurs is a refusal in its own words that matches vm.ErrNotOurs.
func NotOurs(msg string) error { return notOurs(msg) }

func (e notOurs) Error() string        { return string(e) }
func (e notOurs) Is(target error) bool { return target == vm.ErrNotOurs }
