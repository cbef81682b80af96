package gitlab

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
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
	Connect jobvm.Connector
	// Explain, if set, says in one sentence what became of the named
	// machine whose guest stopped answering, or "" (the run stage, built
	// without libvirt, asks the admin tool: stagecli.Exe.ExplainViaAdminTool).
	// nil means the stage's own answer (jobvm.Job.Explain).
	Explain func(ctx context.Context, name string) string
	// CacheDisk, if set, hands the host cache to a machine on a restore
	// disk (the run stage, built without libvirt, asks the admin tool:
	// stagecli.Exe.ExplainViaAdminTool). nil means the stage's own
	// jobvm.Host.
	CacheDisk cachexfer.Disk
	// Pull, if set, pulls an image with a source (oci://) into the host's
	// store: prepare does on an image's first use. Only the prepare
	// executable links the registry client (stagecli.Exe.Pull); without
	// it an image not pulled yet fails the stage, saying so.
	Pull jobvm.PullFunc
	// Refresh, if set, asks the registry again in the background what an
	// image's source names (a detached `libvirt-executor image pull`):
	// prepare's, for a host without the pool service to follow the tags.
	Refresh func(image string) error
	// Steps, if set, runs a GitLab Steps job's steps natively in the
	// job's VM (gitlab.steps = "native"): the run stage's executable sets
	// it (stagecli.Exe.Steps: internal/stepsvc's RunJob), so that only it
	// links the Step Runner's gRPC client.
	Steps func(ctx context.Context, j StepsJob) error
	// Report, if set, is told what the stage did, step by step, for the
	// host's metrics and structured log (the stage shell records it).
	Report *obs.Report
}

// say writes a progress line to the job log.
func (e Env) say(format string, args ...any) { fmt.Fprintf(e.Stdout, format+"\n", args...) }

// job is the shared start of every stage: configuration, identity, and
// the job's handle (jobvm.Job; its machine's libvirt connection is made
// only when asked for). The stage closes jobs when done.
type job struct {
	cfg  *config.Config
	job  *Job
	jobs *jobvm.Jobs
	vm   *jobvm.Job
	name string
	log  *slog.Logger
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
	jobs, err := jobvm.OpenJobs(cfg, jobvm.Options{Connect: e.Connect, Log: e.Log, Say: e.say})
	if err != nil {
		return nil, err
	}
	jobs.Explain = e.Explain
	// A job prepared by another version keeps the name that version gave
	// it (an upgrade between its stages): the handle resolves it.
	h, err := jobs.Job(jobvm.JobRef{Frontend: Frontend, Instance: j.Instance, ID: j.ID}, e.Log)
	if err != nil {
		_ = jobs.Close()
		return nil, err
	}
	name := h.Name()
	e.Report.Identify(strconv.FormatInt(j.ID, 10), j.Server, name)
	log := e.Log.With("job", j.ID, "domain", name)
	h.SetLog(log)
	return &job{cfg: cfg, job: j, jobs: jobs, vm: h, name: name, log: log}, nil
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
		_ = j.jobs.Close()
		return nil, nil, Resources{}, err
	}
	e.Report.Machine(j.name, img.Name)
	res, err := ChooseResources(cfg, img, e.Getenv)
	if err != nil {
		_ = j.jobs.Close()
		return nil, nil, Resources{}, err
	}
	return j, img, res, nil
}
