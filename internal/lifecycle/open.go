package lifecycle

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Connector opens one connection to the hypervisor at uri, giving up when
// ctx ends (vm.Connector).
type Connector = vm.Connector

// Options are what a front end chooses when it opens a Manager.
type Options struct {
	// Connect opens the hypervisor connections; nil means vm.Connect: the
	// libvirt implementation in an executable that imports
	// internal/vm/libvirtvm, else vm.ErrNoConnector. Tests pass a fake.
	Connect Connector
	// Log, if set, is told about lost and re-made connections.
	Log *slog.Logger
	// Say receives progress lines meant for the person watching the job.
	Say func(format string, args ...any)
	// OnReconnect, if set, is told about each re-made connection.
	OnReconnect func(cause error)
	// Hooks are what the kinds of machines add (internal/jobvm.Open gives
	// the job machines').
	Hooks Hooks
	// ReadOnly promises that the caller only looks (list, explain): then
	// a state directory of another user (root looking) is no refusal, as
	// long as its controller id exists already; nothing is created.
	ReadOnly bool
}

// Open is how every front end gets a Manager for the installation that cfg
// describes: its state store, its controller id (made on first use), and
// its hypervisor connection. The connection is opened when first needed (or
// by Dial), so a caller that needs libvirt only now and then does not
// connect otherwise, and the config and run stages, which never do, are
// built without libvirt (run asks the admin tool's explain-machine when it
// wants an explanation); it reconnects when libvirtd restarts. Close
// releases it. A state directory of another user is refused
// (*state.OwnerError, from ControllerID), unless o.ReadOnly, and so is one
// that keeps another libvirt's machines (*state.HostError).
func Open(cfg *config.Config, o Options) (*Manager, error) {
	hv := reconnecting(cfg.LibvirtURI, o) // connects on first use
	store := state.Store{Dir: cfg.StateDir}
	ctrl, err := store.ControllerID()
	if _, foreign := errors.AsType[*state.OwnerError](err); foreign && o.ReadOnly {
		if id, rerr := store.ExistingControllerID(); rerr == nil {
			ctrl, err = id, nil
		}
	}
	if err != nil {
		return nil, err
	}
	// One state directory per libvirt: another host's machines are not
	// this directory's to count or sweep.
	if err := store.BindHost(vm.HostKey(cfg.LibvirtURI), !cfg.LocalLibvirt(), o.ReadOnly); err != nil {
		return nil, err
	}
	return &Manager{Cfg: cfg, Store: store, Controller: ctrl, Say: o.Say, hv: hv, hooks: o.Hooks}, nil
}

// New is a Manager over a hypervisor connection the caller made (tests
// and tools: a fake, or a connection of their own); Open is how the
// executables get one.
func New(cfg *config.Config, hv vm.Hypervisor, controller string, o Options) *Manager {
	return &Manager{Cfg: cfg, Store: state.Store{Dir: cfg.StateDir}, Controller: controller, Say: o.Say, hv: hv, hooks: o.Hooks}
}

// SetHooks replaces the Manager's hooks before its first use (a Manager
// made by New; Open takes them in its Options).
func (m *Manager) SetHooks(h Hooks) { m.hooks = h }

// reconnecting is the hypervisor connection of a Manager: made through
// o.Connect on first use, made again after it breaks.
func reconnecting(uri string, o Options) *vm.Reconnecting {
	connect := o.Connect
	if connect == nil {
		connect = vm.Connect
	}
	r := vm.NewReconnecting(func(ctx context.Context) (vm.Hypervisor, error) { return connect(ctx, uri) })
	r.OnReconnect = func(cause error) {
		if o.Log != nil {
			o.Log.Warn("libvirt connection lost; reconnected", "uri", uri, "cause", cause)
		}
		if o.OnReconnect != nil {
			o.OnReconnect(cause)
		}
	}
	return r
}

// dialer is a connection that can be made before its first call (the one
// Open makes).
type dialer interface {
	Dial(ctx context.Context) error
}

// Dial connects to the hypervisor now, if no call has yet. A caller that
// will surely need it (prepare, cleanup) calls Dial first, so that an
// unreachable libvirt fails it before it changes anything.
func (m *Manager) Dial(ctx context.Context) error {
	if d, ok := m.hv.(dialer); ok {
		return d.Dial(ctx)
	}
	return nil
}

// Close releases the hypervisor connection. It does not wait for calls
// abandoned on a hung libvirtd.
func (m *Manager) Close() error {
	if m.hv == nil {
		return nil
	}
	return m.hv.Close()
}

// explainWait bounds Explain: an explanation is worth a few seconds, not
// the rest of a stage's deadline.
const explainWait = 5 * time.Second

// Explain says, in one sentence, what became of the machine name whose
// guest stopped answering: gone, shut off, crashed, or paused by QEMU after
// a failed disk write (vm.Engine.Explain). It is empty when the domain runs
// normally, or libvirt cannot tell within explainWait and before ctx ends.
// It connects to the hypervisor if nothing has yet.
func (mc Machine) Explain(ctx context.Context) string {
	m, name := mc.m, mc.name
	ctx, cancel := context.WithTimeout(ctx, explainWait)
	defer cancel()
	return m.engine().Explain(ctx, name, m.Cfg.StoragePool)
}
