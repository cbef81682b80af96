// Package jobvm owns the machine of a CI job (a GitLab job, a garm
// runner's job) on top of internal/lifecycle's one machine. A front end
// gets Jobs (OpenJobs) and, for each job, its handle Job (Jobs.Job): it
// resolves the job's name record, mapping and claim once and is their
// only writer; Acquire (the job's image on the host, its name record, an
// earlier attempt's claim removed; then claim an idle standby machine,
// else provision one cold; map the job, with its container; start the
// connection holder), Release (stop now, remove in a detached reaper),
// Keep (for debugging), Explain, and Session, the one way into the job's
// guest (Run and Stream go through the holder when it answers, else a
// direct connection; connect is the one place a job's guest connections
// are made). The standby pool's side is here too: boot,
// claim, retire, and what makes a standby outdated; the pool service
// (internal/pool) drives it through Host. Open wires lifecycle's hooks for
// every front end, garm's included: idle standbys make room for jobs,
// every provisioned machine gets the guest tools disk
// (internal/guesttools), a machine's holder stops when its user is done
// with it, and sweeps also remove stale mappings and the tools of earlier
// binaries.
package jobvm

import (
	"context"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghshare"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guesttools"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// Host is the machines of CI jobs on this host: lifecycle's Manager with
// the hooks of job machines, standby pools and the guest tools disk. It
// does not embed the Manager: a front end reaches a job's machine through
// Jobs and Job; the host's tools (admin, pool service, test tooling) that
// work on machines as such take Manager.
type Host struct {
	m *lifecycle.Manager
	// HolderExe is the connection holder's executable (StartHolder);
	// empty means HolderExecutable next to the running executable.
	HolderExe string
	// ReaperExe is the reaper's executable (StartReaper); empty means
	// ReaperExecutable next to the running executable.
	ReaperExe string
}

// Open opens the installation cfg describes (lifecycle.Open) with the
// hooks of job machines, given at open time; o.Hooks is replaced.
func Open(cfg *config.Config, o lifecycle.Options) (*Host, error) {
	h := &Host{}
	o.Hooks = h.hooks()
	m, err := lifecycle.Open(cfg, o)
	if err != nil {
		return nil, err
	}
	h.m = m
	return h, nil
}

// New is a Host over a Manager the caller made (tests and tools:
// lifecycle.New, a fake hypervisor); its hooks are replaced by the job
// machines'.
func New(m *lifecycle.Manager) *Host {
	h := &Host{m: m}
	m.SetHooks(h.hooks())
	return h
}

// hooks are what job machines add to lifecycle: idle standbys make room
// (makeRoom), every provisioned machine gets the guest tools disk, a
// machine's holder stops when its user is done with it, and the sweeps
// also remove stale job mappings, old tools volumes and the shares of
// GitHub hook jobs whose runner is gone (ghshare.Sweep).
func (h *Host) hooks() lifecycle.Hooks {
	return lifecycle.Hooks{
		MakeRoom: func(ctx context.Context, _ *lifecycle.Manager, short lifecycle.Shortfall, reason string) string {
			return h.makeRoom(ctx, short, reason)
		},
		Shared:   guesttools.Disk{},
		Release:  []func(*lifecycle.Manager, string){stopHolder},
		Sweepers: []lifecycle.Sweeper{sweepJobMappings, guesttools.Sweep, ghshare.Sweep},
	}
}

// Manager is the one-machine layer under the host: for the host's tools
// (admin, the pool service, sweeps, test tooling), not for front ends.
func (h *Host) Manager() *lifecycle.Manager { return h.m }

// Close closes the host's libvirt connection, if it was made.
func (h *Host) Close() error { return h.m.Close() }

// Dial makes the host's libvirt connection now (it is otherwise made on
// first use): a stage fails early, before it says anything, when libvirt
// cannot be reached.
func (h *Host) Dial(ctx context.Context) error { return h.m.Dial(ctx) }

// Reconnects is how often the libvirt connection was made again.
func (h *Host) Reconnects() int { return h.m.Reconnects() }

// OwnerKind names the kind of a machine's owner for the metrics, by its
// ownership record's front end ("" for none readable): standby, garm,
// other (no record), job (any other front end).
func OwnerKind(frontend string) string {
	switch frontend {
	case FrontendStandby:
		return "standby"
	case FrontendGarm:
		return "garm"
	case "":
		return "other"
	}
	return "job"
}

// FrontendGarm is the ownership record's front end of garm's instances
// (internal/garm.Frontend).
const FrontendGarm = "garm"

// ToolsNow is the guest tools disk a machine booted now gets, as its
// record says it (nil for none), found without libvirt; exact is false
// where a boot now might get another one (guesttools.Now).
func (h *Host) ToolsNow() (t *state.Tools, exact bool) { return guesttools.Now(h.m) }
