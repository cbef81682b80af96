package gitlab

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// DriverName is reported to the runner.
const DriverName = "libvirt-executor"

// Env is what a stage gets from its process.
type Env struct {
	Getenv func(string) string
	// Environ lists the stage's environment (native steps hand the job's
	// CUSTOM_ENV_* to the steps); nil means os.Environ.
	Environ func() []string
	Stdout  io.Writer
	Stderr  io.Writer
	Log     *slog.Logger
	// Connect opens the hypervisor; nil means libvirt (vm.Connect, in an
	// executable that imports internal/vm/libvirtvm). Tests substitute a
	// fake.
	Connect lifecycle.Connector
	// Explain, if set, says in one sentence what became of the named
	// machine whose guest stopped answering, or "" (the run stage, built
	// without libvirt, asks the admin tool: stagecli.Exe.ExplainViaAdminTool).
	// nil means the stage's lifecycle.Manager.Explain.
	Explain func(ctx context.Context, name string) string
	// CacheDisk, if set, hands the host cache to a machine on a restore
	// disk (the run stage, built without libvirt, asks the admin tool:
	// stagecli.Exe.ExplainViaAdminTool). nil means the stage's own
	// jobvm.Host.
	CacheDisk CacheDisk
	// Pull, if set, pulls an image with a source (oci://) into the host's
	// store: prepare does on an image's first use. Only the prepare
	// executable links the registry client (stagecli.Exe.Pull); without
	// it an image not pulled yet fails the stage, saying so.
	Pull PullFunc
	// Refresh, if set, asks the registry again in the background what an
	// image's source names (a detached `libvirt-executor image pull`):
	// prepare's, for a host without the pool service to follow the tags.
	Refresh func(image string) error
	// Report, if set, is told what the stage did, step by step, for the
	// host's metrics and structured log (the stage shell records it).
	Report *obs.Report
}

// say writes a progress line to the job log.
func (e Env) say(format string, args ...any) { fmt.Fprintf(e.Stdout, format+"\n", args...) }

// job is the shared start of every stage: configuration, identity, name,
// and the lifecycle manager (which connects to libvirt only when asked to).
// The stage closes m when done.
type job struct {
	cfg  *config.Config
	job  *Job
	m    *jobvm.Host
	name string
	// key is the job's frozen key (lifecycle.JobKey) under which prepare
	// records name for the later stages of any version.
	key string
	log *slog.Logger
}

func (e Env) load(cfg *config.Config) (*job, error) {
	j, err := ReadJob(e.Getenv, cfg.InsecureJobIDFromEnv, func(msg string) { e.Log.Warn(msg) })
	if err != nil {
		return nil, err
	}
	if !cfg.LocalLibvirt() {
		// The stages reach their guest over SSH on this host's network
		// and keep its console, holder and cache disks here.
		return nil, fmt.Errorf("libvirt_uri %q is another host's libvirt: GitLab's stages run on the host of their VMs; "+
			"register a runner on that host with libvirt_uri = \"qemu:///system\" (docs/fleet.md); another host's libvirt is for garm's provider entries (docs/garm.md)", cfg.LibvirtURI)
	}
	m, err := jobvm.Open(cfg, lifecycle.Options{Connect: e.Connect, Log: e.Log, Say: e.say})
	if err != nil {
		return nil, err
	}
	name := lifecycle.MachineName(cfg.NamePrefix, m.Controller, j.Instance, j.ID)
	key := lifecycle.JobKey(Frontend, j.Instance, j.ID)
	// A job prepared by another version keeps the name that version gave
	// it (an upgrade between its stages).
	rec, err := m.Store.JobNameOf(key)
	if state.IsBadRecord(err) {
		// Cut short by a host crash: the name this version gives.
		e.Log.Warn("the job's name record does not decode; using the name this version gives the job", "err", err)
		rec, err = nil, nil
	}
	if err != nil {
		// Not readable (permissions, I/O): guessing a name could leave
		// the job's machine behind.
		_ = m.Close()
		return nil, fmt.Errorf("job name record: %w", err)
	}
	if rec != nil && rec.Job != name {
		if err := m.CheckOurName(rec.Job); err != nil {
			_ = m.Close()
			return nil, fmt.Errorf("job name record %s: %w", key, err)
		}
		e.Log.Info("job prepared by another version: using the name it gave the job", "name", rec.Job, "version", rec.Version, "name_now", name)
		name = rec.Job
	}
	e.Report.Identify(strconv.FormatInt(j.ID, 10), j.Server, name)
	return &job{cfg: cfg, job: j, m: m, name: name, key: key, log: e.Log.With("job", j.ID, "domain", name)}, nil
}

// plan is what the job gets: its identity, image and resources. Config and
// prepare both decide it, so a bad request fails already in config (the
// runner does not retry a config stage that exits with BUILD_FAILURE).
func (e Env) plan(cfg *config.Config) (*job, *config.Image, Resources, error) {
	j, err := e.load(cfg)
	if err != nil {
		return nil, nil, Resources{}, err
	}
	img, err := ChooseImage(cfg, j.job.Image)
	if err != nil {
		_ = j.m.Close()
		return nil, nil, Resources{}, err
	}
	e.Report.Machine(j.name, img.Name)
	res, err := ChooseResources(cfg, img, e.Getenv)
	if err != nil {
		_ = j.m.Close()
		return nil, nil, Resources{}, err
	}
	return j, img, res, nil
}
