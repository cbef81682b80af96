package jobvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// JobRequest asks for the machine of one job (Acquire, Claim): the one
// machine's lifecycle.Request, whose Name is the name the job knows its
// machine by (the machine name of a cold start, lifecycle.MachineName,
// and its mapping key), Frontend and Job (the job's id) go into the
// ownership record, Image is the job's and Lifetime how long the job may
// run (its timeout); and what a job adds to it. Its sizes are Size's
// (Request's VCPUs, MemoryMiB and DiskGiB are set from it), its check is
// Check below (Request.Check is not used).
type JobRequest struct {
	lifecycle.Request
	Size config.Size
	// Check, if set, is the front end's look at the machine before the job
	// gets it (are the tools its jobs need there?): over the provisioning's
	// connection for a cold start, over one made on first use for a
	// claimed standby machine. tools is the guest tools disk the machine
	// has (nil for none). An error fails the acquisition; the machine is
	// removed.
	Check func(ctx context.Context, g Guest, tools *state.Tools) error
	// Holder starts the job's connection holder (one SSH connection for
	// all its stages) once the machine is the job's.
	Holder bool
	// Container is the container the job's scripts will run in (a
	// container job's, started by the front end once the machine is the
	// job's): the job's mapping names it for the later stages
	// (JobMachine.Container).
	Container string
	// Pull and Refresh bring an image with a registry source to this host
	// before anything of the job is made (Job.Acquire, ensureImage): a job
	// on an image not pulled yet pulls it (nil Pull: such a job fails,
	// naming the command that pulls it); Refresh starts a background pull
	// when the registry was last asked a pull interval ago (nil: none).
	Pull    PullFunc
	Refresh func(image string) error
	// Observe, if set, is told what the acquisition did, for the host's
	// metrics and structured log.
	Observe Observer
	// Log, if set, gets what the host's admin should know (no holder).
	Log *slog.Logger
}

// Observer is told what an acquisition (or a release) does; every field
// is optional.
type Observer struct {
	// Step is each step as it ends: its name, duration and error.
	Step func(name string, took time.Duration, err error)
	// Pool is a standby pool's answer: "hit", or "miss" and why (Miss*).
	Pool func(result, reason string)
	// Machine is the machine the job has now (a claim changes it).
	Machine func(name, image string)
}

// filled is o with a no-op for each field not set: the acquisition and
// the release call its fields without asking.
func (o Observer) filled() Observer {
	if o.Step == nil {
		o.Step = func(string, time.Duration, error) {}
	}
	if o.Pool == nil {
		o.Pool = func(string, string) {}
	}
	if o.Machine == nil {
		o.Machine = func(string, string) {}
	}
	return o
}

// Guest runs a fixed command in the job's guest (sshexec.Client).
type Guest interface {
	Output(ctx context.Context, cmd string) ([]byte, error)
}

// Acquired is the job's machine, ready for its stages.
type Acquired struct {
	// Name is the machine's name.
	Name string
	// Warm says it is a claimed standby machine (Claimed); otherwise it
	// was provisioned for the job (Ready, its connection closed).
	Warm    bool
	Claimed *Claimed
	Ready   *lifecycle.Ready
}

// Acquire gives the job its machine (an earlier attempt's claim is gone:
// Job.Acquire): it claims an idle standby machine of the image's pool if
// there is one that passes the front end's check, else provisions one
// cold; it maps the job to the machine (MachineOf finds it) and starts the
// connection holder. The job log says which path it took and why. On
// failure or cancellation nothing of the job is left.
func (h *Host) Acquire(ctx context.Context, req JobRequest) (*Acquired, error) {
	req.Observe = req.Observe.filled()
	if req.Image.Pool != nil {
		a, err := h.acquireWarm(ctx, req)
		if a != nil || err != nil {
			return a, err
		}
	}
	return h.acquireCold(ctx, req)
}

// acquireCold provisions the job's machine.
func (h *Host) acquireCold(ctx context.Context, req JobRequest) (*Acquired, error) {
	lreq := req.Request
	lreq.VCPUs, lreq.MemoryMiB, lreq.DiskGiB = req.Size.VCPUs, req.Size.MemoryMiB, req.Size.DiskGiB
	lreq.OnStep, lreq.Check = req.Observe.Step, nil
	// The job's holder gives the filter its address, while the job's first
	// stages run (startHolder; without a holder, here).
	lreq.DeferFilterPin = req.Holder
	if req.Check != nil {
		lreq.Check = func(ctx context.Context, c *sshexec.Client, tools *state.Tools) error {
			return req.Check(ctx, c, tools)
		}
	}
	ready, err := h.m.Provision(ctx, lreq)
	if err != nil {
		return nil, err
	}
	_ = ready.Client.Close()
	err = h.m.Store.MapJob(req.Name, state.JobMachine{Machine: req.Name, At: time.Now().UTC(), Container: req.Container})
	if err == nil && ctx.Err() != nil {
		// Stopped just after the machine became ready: a cancelled prepare
		// leaves nothing behind, whenever the signal came.
		err = fmt.Errorf("stopped: %w", context.Cause(ctx))
	}
	if err != nil {
		// The machine is the one this path made, under the job's name
		// (an earlier attempt's claim is gone already: Acquire).
		tctx, cancel := detachctx.WithTimeout(ctx, h.m.Cfg.Timeouts.Cleanup.D())
		defer cancel()
		return nil, errors.Join(err, h.m.Machine(req.Name).Teardown(tctx), h.m.Store.UnmapJob(req.Name))
	}
	if !h.startHolder(req, req.Name) && lreq.DeferFilterPin {
		h.pinNow(ctx, req, ready.Machine.Address)
	}
	return &Acquired{Name: req.Name, Ready: ready}, nil
}

// pinNow gives the job machine's network filter its address here (no
// holder does it). A failure leaves the learnt address: the job runs, and
// only a libvirtd restart would cut its VM off; the job log says so.
func (h *Host) pinNow(ctx context.Context, req JobRequest, addr string) {
	t0 := time.Now()
	if err := h.m.Machine(req.Name).PinAddress(ctx, addr); err != nil {
		if req.Log != nil {
			req.Log.Warn("network filter not given the address", "err", err)
		}
		h.m.Sayf("Note: the VM's network filter holds its address only as learnt from DHCP (%v): a libvirtd restart during the job would cut the VM off", err)
		return
	}
	h.m.Sayf("Network filter given the address in %s", vm.Round(time.Since(t0)))
}

// SharesRefusedError is Acquire's error when a claimed standby machine
// did not take the job's shared directories (JobRequest.Dirs): it was
// removed, and nothing of the job is left. Their servers may have served
// their one connection: the caller starts them again and may ask for a
// cold machine (a request without the image's pool).
type SharesRefusedError struct {
	Machine string
	Err     error
}

func (e *SharesRefusedError) Error() string {
	return fmt.Sprintf("the claimed VM %s did not take the job's shared directories: %v", e.Machine, e.Err)
}

func (e *SharesRefusedError) Unwrap() error { return e.Err }

// acquireWarm tries to give the job an idle machine of its image's
// standby pool. It returns nil and no error when the job takes the cold
// path (the job log says why).
func (h *Host) acquireWarm(ctx context.Context, req JobRequest) (*Acquired, error) {
	img := req.Image
	t0 := time.Now()
	c, err := h.Claim(ctx, req)
	var none *ErrNoStandby
	if errors.As(err, &none) {
		req.Observe.Pool("miss", none.Code)
		h.m.Sayf("Cold start: %s", none.Why)
		return nil, nil
	}
	req.Observe.Step("claim", time.Since(t0), err)
	if err != nil {
		req.Observe.Pool("miss", MissError)
		return nil, fmt.Errorf("claiming a standby VM: %w", err)
	}
	req.Observe.Pool("hit", "")
	mach := c.Machine
	req.Observe.Machine(mach.Name, img.Name)
	h.m.Sayf("Warm start: VM %s (idle for %s, booted with its own fresh keys) claimed in %s", mach.Name, vm.Round(c.Idle), vm.Round(c.Took))
	for _, s := range c.Skipped {
		h.m.Sayf("  passed over %s", s)
	}
	if mach.Tools != nil {
		h.m.Sayf("%s", guesttools.DescribeTools(mach.Tools, 0))
	}
	var connErr, plugErr error
	if len(req.Dirs) > 0 {
		// The job's shared directories (a GitHub hook job's), hot-plugged:
		// the pool's machines of its image boot with shared memory.
		t1 := time.Now()
		if plugErr = h.m.Machine(mach.Name).AttachDirs(ctx, req.Dirs); plugErr == nil {
			h.m.Sayf("The job's shared directories hot-plugged into %s in %s", mach.Name, vm.Round(time.Since(t1)))
		}
	}
	if req.Check != nil && plugErr == nil {
		g := &guestOnDemand{h: h, name: mach.Name}
		err = req.Check(ctx, g, mach.Tools)
		g.close()
		connErr = g.connErr
	}
	if err == nil {
		err = ctx.Err()
	}
	if err != nil || connErr != nil || plugErr != nil {
		// The claimed machine goes, with the mapping to it (the handle
		// knows both names: nothing is looked up again). A cold machine
		// an earlier attempt left under the job's name goes with them.
		tctx, cancel := detachctx.WithTimeout(ctx, h.m.Cfg.Timeouts.Cleanup.D())
		defer cancel()
		terr := errors.Join(h.m.Machine(mach.Name).Teardown(tctx), h.m.Machine(req.Name).Teardown(tctx), h.m.Store.UnmapJob(req.Name))
		switch {
		case ctx.Err() != nil:
			err = fmt.Errorf("stopped: %w", context.Cause(ctx))
		case plugErr != nil && err == nil && terr == nil:
			// A share's server (virtiofsd) serves one connection: the one
			// the refused plug made is spent. The caller starts its
			// servers again before it boots cold (SharesRefusedError).
			h.m.Sayf("The claimed VM %s did not take the job's shared directories (%v); it was removed", mach.Name, plugErr)
			req.Observe.Pool("miss", MissError)
			req.Observe.Machine(req.Name, img.Name)
			return nil, &SharesRefusedError{Machine: mach.Name, Err: plugErr}
		case err == nil && terr == nil:
			// The claimed VM does not take the SSH connection every stage
			// needs: it is gone, and the job can still start cold.
			h.m.Sayf("Cold start: the claimed VM %s does not accept SSH (%v); it was removed", mach.Name, connErr)
			req.Observe.Pool("miss", MissError)
			req.Observe.Machine(req.Name, img.Name)
			return nil, nil
		}
		return nil, errors.Join(err, plugErr, terr)
	}
	h.startHolder(req, mach.Name)
	return &Acquired{Name: mach.Name, Warm: true, Claimed: c}, nil
}

// startHolder starts the job's connection holder (StartHolder) if the
// request asks for one. Without one the job still runs: each stage
// connects directly, as the job log says. A claimed standby machine's
// holder, started with the machine (BootStandby) and still running, is
// kept and given the job's deadline: its connection (and the guest agent)
// is open already.
func (h *Host) startHolder(req JobRequest, name string) bool {
	dir := h.m.Store.MachineDir(name)
	if !req.Holder {
		holder.Stop(dir) // a standby's, which this job does not use
		return false
	}
	t0 := time.Now()
	until := time.Now().Add(req.Lifetime + h.m.Cfg.Timeouts.JobSlack.D())
	// Kept unless it lost its connection (or could not make it): one whose
	// connection died while the machine waited (a stalled host, the
	// guest's sshd) would fail the job's first stage. One still making its
	// first connection (a VM claimed right after its boot) is kept: the
	// first stage waits for the rest of it.
	if holder.Usable(dir) {
		err := holder.SetUntil(dir, until)
		if err == nil && holder.Running(dir) != 0 {
			h.m.Sayf("Connection holder of the standby VM kept (connected while the VM waited): the job's stages share its SSH connection")
			return true
		}
		// Not given the job's deadline, or gone meanwhile: a new one.
	}
	holder.Stop(dir) // a standby's without a connection, if any

	if err := h.StartHolder(name, until); err != nil {
		if req.Log != nil {
			req.Log.Warn("no connection holder", "err", err)
		}
		h.m.Sayf("Note: the job's stages connect one by one (no connection holder: %v)", err)
		return false
	}
	h.m.Sayf("Connection holder started in %s: the job's stages share one SSH connection", vm.Round(time.Since(t0)))
	return true
}

// guestOnDemand is a Guest that connects to the machine on first use;
// connErr is that connection's failure (not a cancellation's).
type guestOnDemand struct {
	h       *Host
	name    string
	c       *sshexec.Client
	connErr error
}

func (g *guestOnDemand) Output(ctx context.Context, cmd string) ([]byte, error) {
	if g.c == nil {
		_, c, err := g.h.connect(ctx, g.name)
		if err != nil {
			if ctx.Err() == nil {
				g.connErr = err
			}
			return nil, err
		}
		g.c = c
	}
	return g.c.Output(ctx, cmd)
}

func (g *guestOnDemand) close() {
	if g.c != nil {
		_ = g.c.Close()
	}
}
