package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"time"

	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// timedHV times the calls the floor is measured from.
type timedHV struct {
	vm.Hypervisor
	startAt    time.Time
	startCall  time.Duration
	destroyDur time.Duration
}

func (h *timedHV) Start(ctx context.Context, name string) error {
	t := time.Now()
	err := h.Hypervisor.Start(ctx, name)
	h.startAt, h.startCall = t, time.Since(t)
	return err
}

func (h *timedHV) Destroy(ctx context.Context, name string) error {
	t := time.Now()
	err := h.Hypervisor.Destroy(ctx, name)
	h.destroyDur = time.Since(t)
	return err
}

// floorEnv is what a floor boot needs.
type floorEnv struct {
	cfg        *config.Config
	hv         vm.Hypervisor
	store      state.Store
	controller string
	poll       time.Duration
	// domainXML returns a domain's persistent definition; overlay a
	// machine's overlay allocation.
	domainXML func(name string) (string, error)
	overlay   func(name string) (*uint64, error)
}

// measureFloor boots img the way prepare does (lifecycle.MachineSpec, the
// spec lifecycle.Provision creates: linked clone, seed, keys from
// internal/guestinit, the domain XML of internal/vm; compareSpecs checks the
// result against prepare's) and
// times, from the start call, the first SSH login that succeeds, trying
// every e.poll with golang.org/x/crypto/ssh. Everything is removed before it
// returns, also on failure or cancellation.
func measureFloor(ctx context.Context, e floorEnv, img *config.Image) (fs FloorSample) {
	fail := func(err error) FloorSample {
		fs.OK, fs.Error = false, err.Error()
		return fs
	}
	tag := make([]byte, 4)
	_, _ = rand.Read(tag)
	// The installation's own naming: `libvirt-executor list` shows it and a
	// gc sweep would remove it if the benchmark were killed.
	name := lifecycle.MachinePrefix(e.cfg.NamePrefix, e.controller) + "floor-" + hex.EncodeToString(tag)
	unlock, err := e.store.Lock(ctx, name)
	if err != nil {
		return fail(err)
	}
	hv := &timedHV{Hypervisor: e.hv}
	eng := &vm.Engine{HV: hv, Controller: e.controller, UndoTimeout: e.cfg.Timeouts.Cleanup.D(), PollInterval: e.poll, Network: e.cfg.Network}
	defer func() {
		cctx, cancel := detachctx.WithTimeout(ctx, e.cfg.Timeouts.Cleanup.D())
		defer cancel()
		t := time.Now()
		// Whatever exists under this fresh random name, this call made.
		err := eng.Remove(cctx, name, e.cfg.StoragePool, true)
		fs.RemoveMs, fs.DestroyMs = ms(time.Since(t)), ms(hv.destroyDur)
		err = errors.Join(err, e.store.Remove(name))
		unlock()
		e.store.RemoveLock(name)
		if err != nil {
			fs.OK = false
			fs.Error = errors.Join(errors.New(fs.Error), fmt.Errorf("remove %s: %w", name, err)).Error()
		}
	}()

	res, err := gitlab.ChooseResources(e.cfg, img, func(string) string { return "" })
	if err != nil {
		return fail(err)
	}
	domainType, err := eng.ResolveDomainType(ctx, e.cfg.DomainType)
	if err != nil {
		return fail(err)
	}
	dir, err := e.store.Create(name)
	if err != nil {
		return fail(err)
	}
	keys, err := guestinit.NewKeys(name)
	if err != nil {
		return fail(err)
	}
	seed, err := lifecycle.CloudInitSeed(name, img, keys, dir)
	if err != nil {
		return fail(err)
	}
	mac, err := eng.FreshMAC(ctx, e.cfg.Network)
	if err != nil {
		return fail(err)
	}
	// The guest tools disk a job's machine gets now, as prepare attaches
	// it (the images mount it while they boot): the floor boots the same
	// machine, and its agent is measured below.
	var shared []vm.SharedDisk
	if t, _ := guesttools.Now(&lifecycle.Manager{Cfg: e.cfg, Store: e.store, Controller: e.controller}); t != nil {
		if p, err := e.hv.VolumePath(ctx, e.cfg.StoragePool, t.Volume); err == nil {
			shared = []vm.SharedDisk{{Path: p, Serial: guestinit.ToolsDiskSerial}}
		}
	}
	spec := lifecycle.MachineSpec(e.cfg, lifecycle.SpecInput{
		Request: lifecycle.Request{Name: name, Image: img, VCPUs: res.VCPUs, MemoryMiB: res.MemoryMiB, DiskGiB: res.DiskGiB,
			// An hour (plus timeouts.job_slack) is plenty: a sweep removes
			// the machine after that if the benchmark was killed.
			Frontend: "lve-bench", Job: "floor", Lifetime: time.Hour},
		Controller: e.controller, DomainType: domainType, Keys: keys, CloudInitSeed: seed, MAC: mac,
		Created: time.Now().UTC(), ConsoleLog: filepath.Join(dir, "console.log"), Shared: shared,
	})
	mach, err := eng.Create(ctx, spec)
	if err != nil {
		return fail(err)
	}
	for _, s := range mach.Steps {
		if s.Name == "reserve address" {
			fs.EntryMs = ms(s.Took)
		}
	}
	t0 := hv.startAt
	fs.StartCallMs = ms(hv.startCall)
	if e.overlay != nil {
		fs.OverlayAtCreate, _ = e.overlay(name)
	}
	if e.domainXML != nil {
		fs.domainXML, _ = e.domainXML(name)
	}
	bootCtx, cancel := context.WithTimeout(ctx, e.cfg.Timeouts.Boot.D())
	defer cancel()
	addr, err := eng.WaitAddress(bootCtx, name, mac, vm.AddressSource(img.AddressSource))
	if err != nil {
		return fail(err)
	}
	fs.AddressMs = ms(time.Since(t0))

	sc := &ssh.ClientConfig{
		User:              img.User,
		Auth:              []ssh.AuthMethod{ssh.PublicKeys(keys.Client)},
		HostKeyCallback:   ssh.FixedHostKey(keys.Host),
		HostKeyAlgorithms: []string{keys.Host.Type()},
		Timeout:           5 * time.Second,
	}
	if e.cfg.HostKeyPolicy == config.HostKeyInsecureIgnore {
		sc.HostKeyCallback, sc.HostKeyAlgorithms = ssh.InsecureIgnoreHostKey(), nil
	}
	target := net.JoinHostPort(addr, "22")
	tAddr := time.Now()
	client, attempts, err := pollSSH(bootCtx, target, sc, e.poll, func(began time.Time, took time.Duration, err error) {
		if len(fs.AttemptLog) < 40 {
			what := "ok"
			if err != nil {
				what = err.Error()
			}
			fs.AttemptLog = append(fs.AttemptLog, fmt.Sprintf("+%s %s: %s", began.Sub(tAddr).Round(time.Millisecond), took.Round(time.Millisecond), what))
		}
	})
	fs.Attempts = attempts
	if err != nil {
		return fail(err)
	}
	fs.SSHMs = ms(time.Since(t0))
	defer func() { _ = client.Close() }()

	// What each run_exec pays on a booted guest: a fresh connection, and
	// sessions (run_exec opens two: upload, then run).
	var hs, ex []float64
	for range 3 {
		t := time.Now()
		c, err := dialSSH(ctx, target, sc)
		if err != nil {
			return fail(fmt.Errorf("second handshake: %w", err))
		}
		hs = append(hs, ms(time.Since(t)))
		_ = c.Close()
	}
	for range 5 {
		t := time.Now()
		s, err := client.NewSession()
		if err != nil {
			return fail(fmt.Errorf("session: %w", err))
		}
		err = s.Run("true")
		_ = s.Close()
		if err != nil {
			return fail(fmt.Errorf("session: %w", err))
		}
		ex = append(ex, ms(time.Since(t)))
	}
	fs.HandshakeMs, fs.ExecMs = Summarize(hs).Median, Summarize(ex).Median
	// The stage wrapper (sshexec.Client.Run, what run_exec and the
	// connection holder use) around an empty script, with sh and with bash:
	// the guest's share of a stage beyond the bare session.
	st := sshexec.Target{Addr: target, User: img.User, Signer: keys.Client, HostKey: keys.Host,
		InsecureIgnoreHostKey: e.cfg.HostKeyPolicy == config.HostKeyInsecureIgnore}
	if wc, err := sshexec.Dial(ctx, st); err == nil {
		// The same through the guest agent (the floor VM's tools disk has
		// it when the jobs' machines have it).
		var agent *sshexec.AgentSession
		if len(shared) > 0 {
			agent, _ = wc.StartAgent(ctx, guestinit.GuestAgentPath)
		}
		type way struct {
			shell string
			agent *sshexec.AgentSession
			into  *float64
		}
		ways := []way{{"sh", nil, &fs.WrapperShMs}, {"bash", nil, &fs.WrapperBashMs}}
		if agent != nil {
			ways = append(ways, way{"sh", agent, &fs.AgentShMs}, way{"bash", agent, &fs.AgentBashMs})
		}
		for _, sh := range ways {
			var w []float64
			for range 5 {
				t := time.Now()
				if err := wc.Run(ctx, []byte("exit 0\n"), sshexec.RunOptions{Shell: sh.shell, Agent: sh.agent}); err != nil {
					break
				}
				w = append(w, ms(time.Since(t)))
			}
			if len(w) > 0 {
				*sh.into = Summarize(w).Median
			}
		}
		if agent != nil {
			_ = agent.Close()
		}
		_ = wc.Close()
	}
	fs.OK = true
	return fs
}

// FloorConnectTimeout bounds each TCP connect of the floor's SSH polling.
// The lease is known before the guest has configured its address, so the
// first SYN is often lost; the kernel would resend it only after its 1 s
// initial retransmission timeout. A short connect timeout and a new attempt
// avoid that wait: the floor is the guest's boot, not TCP's back-off.
const FloorConnectTimeout = 250 * time.Millisecond

// pollSSH tries to log in every interval (a slow attempt is followed by the
// next one at once) until one succeeds or ctx ends. Each TCP connect is
// bounded by FloorConnectTimeout, the handshake and login by sc.Timeout.
func pollSSH(ctx context.Context, addr string, sc *ssh.ClientConfig, interval time.Duration,
	onAttempt func(began time.Time, took time.Duration, err error)) (*ssh.Client, int, error) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var lastErr error
	for attempts := 1; ; attempts++ {
		began := time.Now()
		c, err := dialSSHWithConnectTimeout(ctx, addr, sc, FloorConnectTimeout)
		if onAttempt != nil {
			onAttempt(began, time.Since(began), err)
		}
		if err == nil {
			return c, attempts, nil
		}
		lastErr = err
		select {
		case <-ctx.Done():
			return nil, attempts, fmt.Errorf("no SSH login at %s after %d attempts: %v (%w)", addr, attempts, lastErr, ctx.Err())
		case <-t.C:
		}
	}
}

// dialSSH makes one TCP connect + SSH handshake + login, bounded by
// sc.Timeout and ctx.
func dialSSH(ctx context.Context, addr string, sc *ssh.ClientConfig) (*ssh.Client, error) {
	return dialSSHWithConnectTimeout(ctx, addr, sc, sc.Timeout)
}

func dialSSHWithConnectTimeout(ctx context.Context, addr string, sc *ssh.ClientConfig, connect time.Duration) (*ssh.Client, error) {
	d := net.Dialer{Timeout: connect}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	_ = conn.SetDeadline(time.Now().Add(sc.Timeout))
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	c, chans, reqs, err := ssh.NewClientConn(conn, addr, sc)
	stop()
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	_ = conn.SetDeadline(time.Time{})
	return ssh.NewClient(c, chans, reqs), nil
}
