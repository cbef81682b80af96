package lifecycle

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/steps"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// provision is one Provision call once the leftovers are gone: the request,
// and what its steps have made so far. Each step is a method; run runs them
// in order and, when one fails or ctx ends, undoes the completed ones in
// reverse order.
type provision struct {
	m          *Manager
	req        request
	eng        *vm.Engine
	domainType string
	consoleLog string

	dir     string          // the machine's state directory (admit)
	keys    *guestinit.Keys // makeKeys
	seed    []byte          // the cloud-init seed, if the image takes one (makeKeys)
	mac     string          // makeKeys
	created time.Time       // create
	// bootCtx bounds the waits for the address and SSH by timeouts.boot,
	// from the domain's start on (create); endBoot releases it.
	bootCtx context.Context
	endBoot context.CancelFunc
	shared  *Attached // attachShared: nil for none
	addr    string    // waitAddress
	// filtered: the interface has the project's network filter (create),
	// which waitAddress pins to the address.
	filtered bool
	client   *sshexec.Client // waitSSH
	timings  Timings
	// snap is the snapshot the machine was restored from (create), nil
	// for a cold boot.
	snap *vm.Snapshot
	// failedStep is the step that failed (run), "" for none.
	failedStep string
}

// newProvision prepares the steps of one Provision call.
func (m *Manager) newProvision(ctx context.Context, req request) (*provision, error) {
	eng := m.engine()
	domainType, err := m.KVM().DomainType(ctx)
	if err != nil {
		return nil, err
	}
	return &provision{
		m: m, req: req, eng: eng, domainType: domainType,
		consoleLog: m.Machine(req.Name).ConsoleLog(),
		endBoot:    func() {},
	}, nil
}

// list is the steps, in order, with their undos.
func (p *provision) list() []steps.Step {
	if p.req.detached {
		return []steps.Step{
			{Name: "admission", Do: p.admit, Undo: p.teardown},
			{Name: "keys", Do: p.makeKeys},
			{Name: "create", Do: p.create, Undo: p.remove},
			{Name: "record", Do: p.record},
		}
	}
	return []steps.Step{
		// The state directory is the record that volumes of this name are
		// ours: it goes only once they are gone (teardown), else a sweep
		// could never remove what a failed undo left.
		{Name: "admission", Do: p.admit, Undo: p.teardown},
		{Name: "keys", Do: p.makeKeys},
		{Name: "tools", Do: p.attachShared},
		// What is there under this name now, this call made.
		{Name: "create", Do: p.create, Undo: p.remove},
		{Name: "address", Do: p.waitAddress},
		{Name: "ssh", Do: p.waitSSH, Undo: p.disconnect},
		{Name: "check", Do: p.check},
		{Name: "record", Do: p.record},
	}
}

// run runs the steps. When the boot fails (no address, no SSH), the job log
// gets the last lines of the guest's console, and the error what libvirt
// says became of the guest, both read before the undo removes the machine.
func (p *provision) run(ctx context.Context) error {
	r := steps.Runner{
		UndoTimeout: p.m.Cfg.Timeouts.Cleanup.D(),
		OnDone: func(name string, took time.Duration) {
			if p.req.OnStep != nil {
				p.req.OnStep(name, took, nil)
			}
		},
		OnFailed: func(name string, took time.Duration, err error) {
			p.failedStep = name
			if p.req.OnStep != nil {
				p.req.OnStep(name, took, err)
			}
		},
		OnUndo: func(name string, err error) {
			if err != nil {
				p.m.say("Undo %s failed: %v", name, err)
			}
		},
	}
	var consoleTail []byte
	var why string
	err := r.Run(ctx, withConsoleCapture(p.list(), func() {
		consoleTail = tail(p.consoleLog, 25)
		if ctx.Err() == nil {
			why = p.m.Machine(p.req.Name).Explain(ctx)
		}
	}))
	if err == nil {
		if p.snap != nil {
			SnapshotsOf(p.m).noteRestore(ctx, p.req.Image.Name, *p.snap, nil)
		}
		return nil
	}
	if p.snap != nil && ctx.Err() == nil && (p.failedStep == "address" || p.failedStep == "ssh") {
		// A clone that got its lease but never answered SSH counts
		// against its snapshot like a refused restore: after a few in a
		// row the snapshot is not used (and remade). The check and the
		// record are the job's and the host's: a cold boot fails them too.
		SnapshotsOf(p.m).noteRestore(ctx, p.req.Image.Name, *p.snap, err)
	}
	if len(consoleTail) > 0 {
		p.m.say("Last lines of the guest console:\n%s", consoleTail)
	}
	if why != "" {
		err = fmt.Errorf("%w; %s", err, why)
	}
	return err
}

// withConsoleCapture wraps the boot-wait steps so that, when one fails, the
// guest's console is read before the undo removes it.
func withConsoleCapture(list []steps.Step, capture func()) []steps.Step {
	out := make([]steps.Step, len(list))
	for i, s := range list {
		do := s.Do
		if s.Name == "address" || s.Name == "ssh" {
			s.Do = func(ctx context.Context) error {
				err := do(ctx)
				if err != nil {
					capture()
				}
				return err
			}
		}
		out[i] = s
	}
	return out
}

// admit reserves the host capacity and makes the state directory.
func (p *provision) admit(ctx context.Context) error {
	var err error
	p.dir, err = p.m.admit(ctx, p.req)
	return err
}

// teardown removes everything of the machine, the state directory last.
func (p *provision) teardown(ctx context.Context) error { return p.m.teardown(ctx, p.req.Name) }

// makeKeys makes the machine's client and host keys (saving the client's),
// the cloud-init seed that carries them if the image takes one, and a MAC
// that holds no lease.
func (p *provision) makeKeys(ctx context.Context) error {
	var err error
	if p.keys, err = guestinit.NewKeys(p.req.Name); err != nil {
		return err
	}
	if err := p.m.Store.SaveKey(p.req.Name, p.keys.ClientPEM); err != nil {
		return err
	}
	if p.req.Seed != nil {
		p.seed, err = p.req.Seed(p.keys, p.dir)
	} else {
		p.seed, err = CloudInitSeed(p.req.Name, p.req.Image, p.keys, p.dir)
	}
	if err != nil {
		return err
	}
	p.mac, err = p.eng.FreshMAC(ctx, p.m.Cfg.Network)
	return err
}

// attachShared attaches the shared disks (Hooks.Shared), if any.
func (p *provision) attachShared(ctx context.Context) error {
	if p.m.hooks.Shared == nil {
		return nil
	}
	a, err := p.m.hooks.Shared.Attach(ctx, p.m)
	if err != nil {
		return err
	}
	p.shared = a
	return nil
}

// create creates and starts the domain of MachineSpec, then starts the boot
// deadline.
func (p *provision) create(ctx context.Context) error {
	p.created = time.Now().UTC()
	// The console log is written by libvirt (as root); made here first, it
	// stays this user's, who reads it when a boot fails.
	if p.consoleLog != "" {
		if err := touchPrivate(p.consoleLog); err != nil {
			return err
		}
	}
	spec := MachineSpec(p.m.Cfg, SpecInput{
		Request: p.req.Request, Controller: p.m.Controller, DomainType: p.domainType,
		Keys: p.keys, CloudInitSeed: p.seed, MAC: p.mac, Created: p.created, ConsoleLog: p.consoleLog,
		Shared: p.shared.disks(),
	})
	img := p.req.Image
	snaps := SnapshotsOf(p.m)
	if snap, why := snaps.usable(ctx, p.req, p.domainType); snap != nil {
		snap.PipeDir = p.dir
		// Bounded: a restore libvirt does not finish leaves time to boot.
		rctx, cancel := context.WithTimeout(ctx, snapshotRestoreLimit)
		err := p.restore(rctx, spec, *snap)
		cancel()
		if err != nil && snapshotsFault(err) {
			snaps.noteRestore(ctx, img.Name, *snap, err)
		}
		if err == nil {
			p.snap = snap
			p.startBootDeadline(ctx)
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		// Whatever the failed restore left under this name goes before
		// the boot (a clone libvirt started although its call failed).
		dctx, dcancel := detachctx.WithTimeout(ctx, p.m.Cfg.Timeouts.Cleanup.D())
		rerr := p.remove(dctx)
		dcancel()
		if rerr != nil {
			return fmt.Errorf("restore from the memory snapshot failed (%w), and removing what it left failed: %v", err, rerr)
		}
		p.m.say("Memory snapshot of image %s not used: %v; booting cold", img.Name, err)
	} else if why != "" {
		p.m.say("Memory snapshot of image %s not used: %s; booting cold", img.Name, why)
	}
	p.filtered = spec.Filter != nil
	p.eng.Progress = func(format string, args ...any) { p.m.say("  "+format, args...) }
	t0 := time.Now()
	mach, err := p.eng.Create(ctx, spec)
	if err != nil && p.domainType == config.DomainKVM {
		var retry bool
		if retry, err = p.m.kvmStartRefused(ctx, err); retry {
			p.domainType, spec.DomainType = config.DomainQEMU, config.DomainQEMU
			mach, err = p.eng.Create(ctx, spec)
		}
	}
	if err != nil {
		return err
	}
	p.mac = mach.MAC // a spare DHCP host entry's, when the machine took one
	p.timings.Started = time.Now()
	p.timings.Created, p.timings.Create, p.timings.Start = p.timings.Started.Sub(t0), mach.Steps, StartCold
	req := p.req
	p.m.say("Created %s from image %s (%s, %d vCPU, %d MiB) in %s", req.Name, req.Image.Name, p.domainType, req.VCPUs, req.MemoryMiB, vm.Round(p.timings.Created))
	p.startBootDeadline(ctx)
	return nil
}

// startBootDeadline bounds the waits for the address and SSH by
// timeouts.boot from now on.
func (p *provision) startBootDeadline(ctx context.Context) {
	boot := p.m.Cfg.Timeouts.Boot.D()
	p.bootCtx, p.endBoot = context.WithTimeoutCause(ctx, boot,
		fmt.Errorf("%w %s (timeouts.boot) reached", ErrBootTimeout, boot))
}

// snapshotRestoreLimit bounds a restore, its hot plugs and its guest's
// lease (snapshotLeaseWait).
var snapshotRestoreLimit = time.Minute

// snapshotsFault reports whether err is the snapshot's fault (its save
// file refused, libvirt refusing the restore): a job's own failure (a hot
// plug, its guest's lease, a lost connection) does not count against the
// snapshot.
func snapshotsFault(err error) bool {
	if errors.Is(err, vm.ErrConnectionLost) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, errCloneSilent) {
		return false // the stream or libvirt's connection, not the file
	}
	return errors.Is(err, vm.ErrSaveImage) || errors.Is(err, vm.ErrRestore) || errors.Is(err, errCloneSilent)
}

// errCloneSilent: a restored clone's guest took no lease (it did not go
// on from its wait, or powered itself off).
var errCloneSilent = errors.New("the restored guest took no address")

// restore starts the machine of spec as a clone of snap (vm.Engine.Restore)
// with a credentials disk of its own (its keys, the host's clock and 64
// bytes of the host's entropy), then waits, within snapshotLeaseWait, for
// its lease: a clone whose guest does not go on is removed again, and the
// error says why (create then boots cold).
func (p *provision) restore(ctx context.Context, spec vm.Spec, snap vm.Snapshot) error {
	entropy := make([]byte, 64)
	if _, err := rand.Read(entropy); err != nil {
		return err
	}
	spec.Seed = p.keys.CloneCredentialDisk(p.req.Name, time.Now(), entropy)
	spec.SeedSerial, spec.OEMStrings, spec.SeedWritable = guestinit.CredentialDiskSerial, nil, false
	p.filtered = spec.Filter != nil
	p.eng.Progress = func(format string, args ...any) { p.m.say("  "+format, args...) }
	t0 := time.Now()
	mach, err := p.eng.Restore(ctx, spec, snap)
	if err != nil {
		return err
	}
	restored := time.Since(t0)
	lctx, cancel := context.WithTimeout(ctx, snapshotLeaseWait)
	_, err = p.eng.WaitAddress(lctx, p.req.Name, mach.MAC, vm.SourceLease)
	// The guest's own silence only when the wait had its whole time (a
	// restore that took most of its bound is the host's slowness).
	silent := ctx.Err() == nil
	cancel()
	if err != nil {
		if t := tail(p.consoleLog, 25); len(t) > 0 {
			p.m.say("Last lines of the restored guest's console:\n%s", t)
		}
		rctx, rcancel := detachctx.WithTimeout(ctx, p.m.Cfg.Timeouts.Cleanup.D())
		defer rcancel()
		why := fmt.Errorf("the restored guest took no address within %s: %w", snapshotLeaseWait, err)
		if silent {
			why = fmt.Errorf("%w within %s: %w", errCloneSilent, snapshotLeaseWait, err)
		}
		if rerr := p.remove(rctx); rerr != nil {
			return errors.Join(why, rerr)
		}
		return why
	}
	p.mac = mach.MAC
	p.timings.Started = time.Now()
	p.timings.Created, p.timings.Create, p.timings.Start = p.timings.Started.Sub(t0), mach.Steps, StartSnapshot
	req := p.req
	p.m.say("Restored %s from the memory snapshot of image %s (%s, %d vCPU, %d MiB) in %s, its lease after %s",
		req.Name, req.Image.Name, p.domainType, req.VCPUs, req.MemoryMiB, vm.Round(restored), vm.Round(p.timings.Created-restored))
	return nil
}

// remove removes the domain and its volumes.
func (p *provision) remove(ctx context.Context) error {
	return p.m.engine().Remove(ctx, p.req.Name, p.m.Cfg.StoragePool, true)
}

// waitAddress waits, within the boot deadline, for the address of the
// machine's own MAC.
func (p *provision) waitAddress(context.Context) error {
	img := p.req.Image
	t0 := time.Now()
	addr, err := p.eng.WaitAddress(p.bootCtx, p.req.Name, p.mac, vm.AddressSource(img.AddressSource))
	if err != nil {
		return err
	}
	p.addr = addr
	p.timings.Addressed = time.Now()
	p.timings.Address = p.timings.Addressed.Sub(t0)
	p.m.say("Booted, address %s (MAC %s, from %s) in %s", addr, p.mac, img.AddressSource, vm.Round(p.timings.Address))
	if p.filtered && !p.req.DeferFilterPin {
		return p.pin()
	}
	return nil
}

// sshPinAfter is how long waitSSH waits for a machine whose filter pin is
// deferred before it pins the filter itself: a guest that does not answer
// by then may be one whose learnt address libvirt forgot (libvirtd
// restarted while it booted), and it passes nothing but DHCP until then.
const sshPinAfter = 10 * time.Second

// pin gives the machine's network filter its address: what the filter
// learnt from DHCP, libvirt forgets when libvirtd restarts.
func (p *provision) pin() error {
	t0 := time.Now()
	if err := p.m.hv.PinFilterAddress(p.bootCtx, p.req.Name, p.mac, p.addr); err != nil {
		return fmt.Errorf("network filter of %s: pin address %s: %w", p.req.Name, p.addr, err)
	}
	if err := p.m.markPinned(p.req.Name, p.addr); err != nil {
		return err
	}
	p.m.say("Network filter given the address in %s", vm.Round(time.Since(t0)))
	return nil
}

// waitSSH dials, within the boot deadline, until the handshake with the
// pinned host key and the login succeed.
func (p *provision) waitSSH(context.Context) error {
	img := p.req.Image
	t0 := time.Now()
	target := p.m.target(p.addr, img.User, p.keys.Client, p.keys.Host)
	type ready struct {
		c        *sshexec.Client
		attempts int
		err      error
	}
	done := make(chan ready, 1)
	go func() {
		c, n, err := sshexec.WaitReady(p.bootCtx, target, p.m.SSHPollInterval, 20*time.Second)
		done <- ready{c, n, err}
	}()
	var r ready
	if p.filtered && p.req.DeferFilterPin {
		t := time.NewTimer(sshPinAfter)
		select {
		case r = <-done:
		case <-t.C:
			if err := p.pin(); err != nil {
				p.m.say("Note: %v", err)
			}
			r = <-done
		}
		t.Stop()
	} else {
		r = <-done
	}
	if r.err != nil {
		return r.err
	}
	p.client = r.c
	attempts := r.attempts
	p.timings.Connected = time.Now()
	p.timings.SSH, p.timings.SSHAttempts = p.timings.Connected.Sub(t0), attempts
	p.m.say("SSH ready as %s@%s, host key %s pinned, in %s (%d attempts)", img.User, p.addr, ssh.FingerprintSHA256(p.keys.Host), vm.Round(p.timings.SSH), attempts)
	return nil
}

// disconnect closes the SSH connection.
func (p *provision) disconnect(context.Context) error {
	if p.client != nil {
		_ = p.client.Close()
	}
	return nil
}

// check runs the front end's check, if it has one.
func (p *provision) check(ctx context.Context) error {
	if p.req.Check == nil {
		return nil
	}
	t0 := time.Now()
	err := p.req.Check(ctx, p.client, p.shared.record())
	p.timings.Check = time.Since(t0)
	return err
}

// record saves the machine's state: what run and cleanup find it by.
func (p *provision) record(context.Context) error {
	img := p.req.Image
	return p.m.Store.Save(state.Machine{
		Name: p.req.Name, Image: img.Name, Address: p.addr, Port: p.m.sshPort(), User: img.User, Shell: img.Shell,
		HostKey: p.keys.HostPublicLine(), MAC: p.mac, Created: p.created,
		BuildsDir: img.BuildsDir, CacheDir: img.CacheDir, Standby: p.req.Standby,
		Tools: p.shared.record(),
	})
}
