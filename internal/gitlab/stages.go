package gitlab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/holder"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// DriverName is reported to the runner.
const DriverName = "libvirt-executor"

// Env is what a stage gets from its process.
type Env struct {
	Getenv func(string) string
	Stdout io.Writer
	Stderr io.Writer
	Log    *slog.Logger
	// Connect opens the hypervisor; nil means libvirt (vm.Connect, in an
	// executable that imports internal/vm/libvirtvm). Tests substitute a
	// fake.
	Connect lifecycle.Connector
	// Explain, if set, says in one sentence what became of the named
	// machine whose guest stopped answering, or "" (the run stage, built
	// without libvirt, asks the admin tool: stagecli.ExplainViaAdminTool).
	// nil means the stage's lifecycle.Manager.Explain.
	Explain func(ctx context.Context, name string) string
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
	m    *lifecycle.Manager
	name string
	log  *slog.Logger
}

func (e Env) load(cfg *config.Config) (*job, error) {
	j, err := ReadJob(e.Getenv, cfg.InsecureJobIDFromEnv, func(msg string) { e.Log.Warn(msg) })
	if err != nil {
		return nil, err
	}
	m, err := lifecycle.Open(cfg, lifecycle.Options{Connect: e.Connect, Log: e.Log, Say: e.say})
	if err != nil {
		return nil, err
	}
	name := lifecycle.MachineName(cfg.NamePrefix, m.Controller, j.Instance, j.ID)
	e.Report.Identify(strconv.FormatInt(j.ID, 10), j.Server, name)
	return &job{cfg: cfg, job: j, m: m, name: name, log: e.Log.With("job", j.ID, "domain", name)}, nil
}

// ConfigOutput is the JSON the runner reads from config_exec.
type ConfigOutput struct {
	BuildsDir         string            `json:"builds_dir"`
	CacheDir          string            `json:"cache_dir"`
	BuildsDirIsShared bool              `json:"builds_dir_is_shared"`
	Hostname          string            `json:"hostname"`
	Driver            ConfigDriver      `json:"driver"`
	Shell             string            `json:"shell"`
	JobEnv            map[string]string `json:"job_env,omitempty"`
}

// ConfigDriver names the driver.
type ConfigDriver struct {
	Name    string `json:"name"`
	Version string `json:"version"`
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

// Config is the config stage: it prints the runner's JSON on stdout.
func Config(ctx context.Context, e Env, cfg *config.Config) error {
	j, img, _, err := e.plan(cfg)
	if err != nil {
		return err
	}
	defer j.m.Close()
	out := ConfigOutput{
		BuildsDir: img.BuildsDir, CacheDir: img.CacheDir, Hostname: j.name,
		Driver: ConfigDriver{Name: DriverName, Version: buildinfo.Version}, Shell: "bash",
	}
	return json.NewEncoder(e.Stdout).Encode(out)
}

// Prepare is the prepare stage: a fresh machine for the job, ready for SSH.
func Prepare(ctx context.Context, e Env, cfg *config.Config) error {
	j, img, res, err := e.plan(cfg)
	if err != nil {
		return err
	}
	defer j.m.Close()
	defer func() { e.Report.Reconnects(j.m.Reconnects()) }()
	say := e.say
	began := time.Now()
	say("Preparing a fresh %s VM %s for job %d (%s)", img.Name, j.name, j.job.ID, DriverName+" "+buildinfo.Version)
	if !j.job.FromPayload {
		say("Warning: job identity taken from CUSTOM_ENV_CI_JOB_ID because JOB_RESPONSE_FILE is not set (insecure_job_id_from_env = true)")
	}
	if req := j.job.Image; req.expanded() && !req.Hidden {
		say("Image %q from the job's variables: %q", cut(req.Written), cut(req.Name))
	}
	if keepRequested(e.Getenv) && !cfg.Debug.AllowKeepOnFailure {
		say("Note: %s is set, but this runner does not keep VMs of failed jobs (debug.allow_keep_on_failure = false)", VarKeep)
	}
	m := j.m
	if err := m.Dial(ctx); err != nil {
		return err
	}
	if name, err := m.RemoveEarlierClaim(ctx, j.name); err != nil {
		return exitcodes.System(fmt.Errorf("remove the VM %s an earlier attempt of this job claimed: %w", name, err))
	} else if name != "" {
		say("Removed VM %s that an earlier attempt of this job claimed", name)
	}
	// The image as it is before the clone: what the tool check finds is
	// remembered for this version of it.
	version := imageVersion(img)
	if img.Pool != nil {
		done, err := prepareWarm(ctx, e, j, img, res, version, began)
		if done || err != nil {
			return err
		}
	}
	req := lifecycle.Request{
		Name: j.name, Image: img, VCPUs: res.VCPUs, MemoryMiB: res.MemoryMiB,
		DiskGiB: res.DiskGiB, Frontend: "gitlab", Job: strconv.FormatInt(j.job.ID, 10),
		Lifetime: j.job.Timeout, OnStep: e.Report.Step,
		Check: func(ctx context.Context, c *sshexec.Client, tools *state.Tools) error {
			return checkGuestTools(ctx, c, say, m.Store, img, version.withTools(tools), tools)
		},
	}
	ready, err := m.Provision(ctx, req)
	if err != nil {
		j.log.Error("prepare failed", "err", err)
		return exitcodes.System(err)
	}
	_ = ready.Client.Close()
	err = m.Store.MapJob(j.name, state.JobMachine{Machine: j.name, At: time.Now().UTC()})
	if err == nil && ctx.Err() != nil {
		// Stopped just after the machine became ready: a cancelled prepare
		// leaves nothing behind, whenever the signal came.
		err = fmt.Errorf("stopped: %w", context.Cause(ctx))
	}
	if err != nil {
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.Timeouts.Cleanup.D())
		defer cancel()
		_, terr := m.TeardownJob(tctx, j.name)
		return exitcodes.System(errors.Join(err, terr))
	}
	startHolder(e, j, j.name)
	writeTimings(e, j, ready, began)
	e.Report.Path(obs.PathCold)
	return nil
}

// startHolder starts the job's connection holder (lifecycle.StartHolder),
// unless the configuration says every stage connects on its own. Without
// one the job still runs: each stage connects directly, as the job log
// says.
func startHolder(e Env, j *job, name string) {
	if !j.cfg.SSH.HolderEnabled() {
		return
	}
	t0 := time.Now()
	until := time.Now().Add(j.job.Timeout + j.cfg.Timeouts.JobSlack.D())
	if err := j.m.StartHolder(name, until); err != nil {
		j.log.Warn("no connection holder", "err", err)
		e.say("Note: the job's stages connect one by one (no connection holder: %v)", err)
		return
	}
	e.say("Connection holder started in %s: the job's stages share one SSH connection", vm.Round(time.Since(t0)))
}

// prepareWarm tries to give the job an idle VM of img's standby pool. done
// says it did (or failed in a way the job must see); otherwise the job
// log says why not and prepare takes the cold path.
func prepareWarm(ctx context.Context, e Env, j *job, img *config.Image, res Resources, version *toolCheck, began time.Time) (done bool, err error) {
	m := j.m
	t0 := time.Now()
	c, err := m.Claim(ctx, lifecycle.ClaimRequest{
		Job: j.name, Image: img, Size: res, Frontend: "gitlab", JobID: strconv.FormatInt(j.job.ID, 10), Lifetime: j.job.Timeout,
	})
	var none *lifecycle.ErrNoStandby
	if errors.As(err, &none) {
		e.Report.Pool("miss", none.Code)
		e.say("Cold start: %s", none.Why)
		return false, nil
	}
	e.Report.Step("claim", time.Since(t0), err)
	if err != nil {
		e.Report.Pool("miss", lifecycle.MissError)
		j.log.Error("claiming a standby VM failed", "err", err)
		return true, exitcodes.System(err)
	}
	e.Report.Pool("hit", "")
	mach := c.Machine
	e.Report.Machine(mach.Name, img.Name)
	e.say("Warm start: VM %s (idle for %s, booted with its own fresh keys) claimed in %s", mach.Name, vm.Round(c.Idle), vm.Round(c.Took))
	for _, s := range c.Skipped {
		e.say("  passed over %s", s)
	}
	// The guest tool check: remembered per image version, so a claim
	// normally costs no SSH session here.
	if mach.Tools != nil {
		e.say("%s", lifecycle.DescribeTools(mach.Tools, 0))
	}
	connErr, err := checkGuestToolsOf(ctx, m, mach.Name, e.say, img, version.withTools(mach.Tools), mach.Tools)
	if err == nil {
		err = ctx.Err()
	}
	if err != nil || connErr != nil {
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), j.cfg.Timeouts.Cleanup.D())
		defer cancel()
		_, terr := m.TeardownJob(tctx, j.name)
		switch {
		case ctx.Err() != nil:
			err = fmt.Errorf("stopped: %w", context.Cause(ctx))
		case err == nil && terr == nil:
			// The claimed VM does not take the SSH connection every stage
			// needs: it is gone, and the job can still start cold.
			e.say("Cold start: the claimed VM %s does not accept SSH (%v); it was removed", mach.Name, connErr)
			e.Report.Pool("miss", lifecycle.MissError)
			e.Report.Machine(j.name, img.Name)
			return false, nil
		}
		return true, exitcodes.System(errors.Join(err, terr))
	}
	startHolder(e, j, mach.Name)
	e.Report.Path(obs.PathWarm)
	took := time.Since(began)
	e.say("Machine ready in %s (warm)", vm.Round(took))
	writeWarmTimings(e, j, mach, c, began)
	return true, nil
}

// checkGuestToolsOf runs the guest tool check for a claimed machine: from
// the answer remembered for this image version, or over an SSH connection
// made only when there is none. connErr is that connection's failure.
func checkGuestToolsOf(ctx context.Context, m *lifecycle.Manager, name string, say func(string, ...any), img *config.Image, version *toolCheck, tools *state.Tools) (connErr, err error) {
	g := &guestOnDemand{m: m, name: name}
	defer g.close()
	err = checkGuestTools(ctx, g, say, m.Store, img, version, tools)
	return g.connErr, err
}

// guestOnDemand is an outputter that connects to the machine on first use.
type guestOnDemand struct {
	m       *lifecycle.Manager
	name    string
	c       *sshexec.Client
	connErr error
}

func (g *guestOnDemand) Output(ctx context.Context, cmd string) ([]byte, error) {
	if g.c == nil {
		_, c, err := g.m.Connect(ctx, g.name)
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

// writeTimings appends the machine's timing record (lifecycle.TimingRecord)
// to the file that LIBVIRT_EXECUTOR_TIMINGS (lifecycle.TimingsEnv) names, if
// it is set. That is a variable of the runner host, which the stage inherits
// from the runner: never a job's, whose variables arrive as CUSTOM_ENV_*
// (CUSTOM_ENV_LIBVIRT_EXECUTOR_TIMINGS is not looked at). The job does not
// depend on the record: a failure to write it is only logged.
func writeTimings(e Env, j *job, ready *lifecycle.Ready, began time.Time) {
	path := e.Getenv(lifecycle.TimingsEnv)
	if path == "" {
		return
	}
	if err := lifecycle.AppendTimings(path, lifecycle.NewTimingRecord(ready, began)); err != nil {
		j.log.Warn("timings record not written", "err", err)
	}
}

// writeWarmTimings is writeTimings for a claimed standby machine.
func writeWarmTimings(e Env, j *job, mach *state.Machine, c *lifecycle.Claimed, began time.Time) {
	path := e.Getenv(lifecycle.TimingsEnv)
	if path == "" {
		return
	}
	if err := lifecycle.AppendTimings(path, lifecycle.NewClaimRecord(mach, c, began)); err != nil {
		j.log.Warn("timings record not written", "err", err)
	}
}

// outputter runs a fixed command in the guest (sshexec.Client).
type outputter interface {
	Output(ctx context.Context, cmd string) ([]byte, error)
}

// toolCheck is what the guest tool check found for one version of an image.
type toolCheck struct {
	// Format is toolCheckFormat when the entry was made: entries of an
	// older check (which did not look for the image's shell) are asked again.
	Format  int    `json:"format"`
	Base    string `json:"base"`
	Size    int64  `json:"size"`
	ModTime int64  `json:"mtime_ns"`
	User    string `json:"user"`
	Shell   string `json:"shell"`
	// Tools is the guest tools disk's volume the machine had ("" for
	// none): it decides whether gitlab-runner is there.
	Tools   string   `json:"tools"`
	Missing []string `json:"missing"`
}

// toolCheckFormat is the version of what the check looks for.
const toolCheckFormat = 4

// missingShell stands in the check's answer for the image's configured
// shell (no tool has this name).
const missingShell = "@shell"

// imageVersion identifies the image file and the account the check runs as
// (its PATH decides what is found); nil if the file cannot be examined.
func imageVersion(img *config.Image) *toolCheck {
	st, err := os.Stat(img.Base)
	if err != nil {
		return nil
	}
	return &toolCheck{Format: toolCheckFormat, Base: img.Base, Size: st.Size(), ModTime: st.ModTime().UnixNano(), User: img.User, Shell: img.Shell}
}

func (a *toolCheck) sameVersion(b *toolCheck) bool {
	return a.Format == b.Format && a.Base == b.Base && a.Size == b.Size && a.ModTime == b.ModTime && a.User == b.User && a.Shell == b.Shell && a.Tools == b.Tools
}

// withTools is the version of a machine of the image with the guest tools
// disk tools (nil for none); nil stays nil.
func (a *toolCheck) withTools(tools *state.Tools) *toolCheck {
	if a == nil {
		return nil
	}
	v := *a
	v.Tools = ""
	if tools != nil {
		v.Tools = tools.Volume
	}
	return &v
}

// toolCheckCommand lists, one a line, what the guest lacks: the tools
// GitLab's stages use, and missingShell when the image's configured shell
// (a name on PATH, or an absolute path) cannot be run. The shell comes from
// the administrator's configuration, never from the job, and is quoted all
// the same.
func toolCheckCommand(shell string) string {
	return `for t in bash git git-lfs gitlab-runner setsid mkfifo; do command -v "$t" >/dev/null 2>&1 || echo "$t"; done; ` +
		`s=` + sshexec.ShellQuote(shell) + `; case $s in /*) [ -f "$s" ] && [ -x "$s" ] ;; *) command -v "$s" >/dev/null 2>&1 ;; esac || echo ` + missingShell
}

// checkGuestTools tells the job log which of the tools GitLab's stages use are
// missing in the guest. A missing tool is only reported (a job may not need
// it). A missing shell of the image is an error (a system failure: the
// image or the configuration must change): every stage would exit 127, and
// that would pass for the script's own failure. The only other error is the
// stage being cancelled. The answer is remembered per version of the image
// (file, size, modification time, user, shell): every job of an unchanged
// image would get the same answer, and asking costs an SSH session. version
// is nil when the image cannot be identified: then the guest is always asked.
func checkGuestTools(ctx context.Context, c outputter, say func(string, ...any), store state.Store, img *config.Image, version *toolCheck, tools *state.Tools) error {
	key := "tools-" + img.Name
	if version != nil {
		var old toolCheck
		if store.Recall(key, &old) && old.sameVersion(version) {
			reportMissingTools(old.Missing, tools != nil, say)
			return shellMissing(img, old.Missing)
		}
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := c.Output(cctx, toolCheckCommand(img.Shell))
	if err != nil {
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		say("Could not check the guest's tools: %v", err)
		return nil
	}
	missing := strings.Fields(string(out))
	// A VM with the tools disk whose guest lacks gitlab-runner: the image
	// may mount the disk late or not at all; not remembered, so that one
	// slow mount does not stand for every later job of the image.
	if unmounted := tools != nil && slices.Contains(missing, "gitlab-runner"); version != nil && !unmounted {
		found := *version
		found.Missing = missing
		_ = store.Remember(key, found) // a lost cache entry costs one more check
	}
	reportMissingTools(missing, tools != nil, say)
	return shellMissing(img, missing)
}

// shellMissing is the error for an image whose shell the check did not find.
func shellMissing(img *config.Image, missing []string) error {
	if slices.Contains(missing, "mkfifo") {
		return exitcodes.System(fmt.Errorf("image %q: mkfifo is not installed in the guest; the driver needs it (with cat, wc, mv and sleep: coreutils or busybox) to run every stage; install it in the image (see docs/images.md)", img.Name))
	}
	if !slices.Contains(missing, missingShell) {
		return nil
	}
	return exitcodes.System(fmt.Errorf("image %q: its shell %q is not installed in the guest (or not executable by %s), so every stage would fail with exit status 127; "+
		"install it in the image, or set images.%s.shell in the driver configuration to a shell the image has (\"bash\", \"sh\" or an absolute path)",
		img.Name, img.Shell, img.User, img.Name))
}

// reportMissingTools says what the guest lacks. hasToolsDisk: the machine
// got the guest tools disk, so a missing gitlab-runner means the image does
// not mount it.
func reportMissingTools(missing []string, hasToolsDisk bool, say func(string, ...any)) {
	for _, t := range missing {
		switch t {
		case "git":
			say("Warning: git is not installed in the guest: get_sources will fail unless GIT_STRATEGY is none")
		case "git-lfs":
			say("Note: git-lfs is not installed in the guest (needed only for LFS repositories)")
		case "gitlab-runner":
			if hasToolsDisk {
				say("Warning: gitlab-runner is not on the guest's PATH although the VM has the guest tools disk: the image does not mount it (serial %s at %s, see docs/images.md); caches and artifacts will not work", guestinit.ToolsDiskSerial, guestinit.ToolsMountPoint)
			} else {
				say("Note: gitlab-runner is not on the guest's PATH: caches and artifacts will not work (see docs/images.md)")
			}
		case "setsid":
			say("Warning: setsid is not installed in the guest (util-linux or busybox): processes a stage leaves running in the background are not stopped when it ends")
		case "bash":
			say("Warning: bash is not installed in the guest: GitLab's job scripts need it")
		}
	}
}

// Run is the run stage: it executes the runner's script for one stage in the
// job's machine.
func Run(ctx context.Context, e Env, cfg *config.Config, scriptPath, stage string) error {
	j, err := e.load(cfg)
	if err != nil {
		return err
	}
	defer j.m.Close()
	script, err := os.ReadFile(scriptPath)
	if err != nil {
		return exitcodes.System(fmt.Errorf("read the stage script: %w", err))
	}
	e.Report.SetStage(stage)
	jm, err := j.m.MachineOf(j.name)
	if err != nil {
		return exitcodes.System(err)
	}
	if mach, rerr := j.m.Store.Record(jm.Name); rerr == nil {
		e.Report.Machine(jm.Name, mach.Image)
	}
	var span time.Duration
	held, err := runHeld(ctx, e, j, jm.Name, script, &span)
	if !held {
		err = runDirect(ctx, e, j, jm.Name, script, stage, &span)
	}
	e.Report.GuestSpan(span)
	if code, ok := exitcodes.ScriptCode(err); ok {
		if keepRequested(e.Getenv) && cfg.Debug.AllowKeepOnFailure {
			if mach, rerr := j.m.Store.Record(jm.Name); rerr == nil {
				fmt.Fprintf(e.Stderr, "libvirt-executor: %s is set: if the job fails, VM %s stays up for %s for debugging.\n"+
					"  On the runner host: ssh -i %s/id_ed25519 %s@%s   (libvirt-executor list shows it; gc removes it after its deadline)\n",
					VarKeep, jm.Name, cfg.Debug.KeepMaxAge.D(), j.m.Store.MachineDir(jm.Name), mach.User, mach.Address)
			}
		}
		if path := e.Getenv("BUILD_EXIT_CODE_FILE"); path != "" {
			if werr := os.WriteFile(path, //nolint:gosec // G703: BUILD_EXIT_CODE_FILE is set by the runner, not by the job (CUSTOM_ENV_* is the job's)
				[]byte(strconv.Itoa(code)+"\n"), 0o600); werr != nil {
				return exitcodes.System(errors.Join(err, fmt.Errorf("write BUILD_EXIT_CODE_FILE: %w", werr)))
			}
		}
		return err
	}
	if err != nil && ctx.Err() == nil && !errors.Is(err, state.ErrNoMachine) {
		// The guest stopped answering: say what became of it.
		err = exitcodes.System(explained(ctx, e, j, jm.Name, err))
	}
	if err != nil {
		j.log.Error("stage failed", "stage", stage, "err", err)
	}
	return err
}

// runHeld runs the stage through the job's connection holder. held is
// false when the stage did not run there (holders are off, or the holder
// is gone or could not take it; the job log says which): then nothing of
// it was started, and the caller connects directly.
func runHeld(ctx context.Context, e Env, j *job, name string, script []byte, span *time.Duration) (held bool, err error) {
	if !j.cfg.SSH.HolderEnabled() {
		return false, nil
	}
	mach, err := j.m.Store.Record(name)
	if err != nil {
		return false, nil // the direct path reports it
	}
	tag, err := sshexec.NewTag()
	if err != nil {
		return true, exitcodes.System(err)
	}
	stopInGuest, err := holder.RunStage(ctx, j.m.HolderSocket(name), holder.Stage{
		Tag: tag, Shell: mach.Shell, Script: script, Stdout: e.Stdout, Stderr: e.Stderr, Span: span,
	})
	if errors.Is(err, holder.ErrUnavailable) {
		fmt.Fprintf(e.Stderr, "libvirt-executor: %v; this stage connects directly\n", err)
		j.log.Warn("stage connects directly", "err", err)
		return false, nil
	}
	if stopInGuest {
		// The holder ended during the stage: the script may still run in
		// the guest. Stop it over a connection of our own (bounded), so
		// that nothing of the stage outlives it.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer cancel()
		_, c, cerr := j.m.Connect(sctx, name)
		if cerr == nil {
			cerr = c.StopStage(sctx, tag, 5*time.Second)
			_ = c.Close()
		}
		if cerr != nil {
			err = fmt.Errorf("%w; stopping the stage in the guest failed: %v", err, cerr)
		} else {
			err = fmt.Errorf("%w; the stage was stopped in the guest", err)
		}
		err = exitcodes.System(err)
	}
	return true, err
}

// runDirect runs the stage over a connection of its own.
func runDirect(ctx context.Context, e Env, j *job, name string, script []byte, stage string, span *time.Duration) error {
	mach, client, err := j.m.Connect(ctx, name)
	if err != nil {
		return exitcodes.System(err)
	}
	defer client.Close()
	j.log.Debug("running stage", "stage", stage, "address", mach.Address)
	return client.Run(ctx, script, sshexec.RunOptions{Shell: mach.Shell, Stdout: e.Stdout, Stderr: e.Stderr, Span: span})
}

// explained adds to err what libvirt says became of the job's machine
// (gone, shut off, paused after a failed disk write), if it can tell within
// a few seconds and before ctx ends: through e.Explain if set, else
// lifecycle.Manager.Explain.
func explained(ctx context.Context, e Env, j *job, name string, err error) error {
	explain := j.m.Explain
	if e.Explain != nil {
		explain = e.Explain
	}
	if why := explain(ctx, name); why != "" {
		return fmt.Errorf("%w; %s", err, why)
	}
	return err
}

// Cleanup is the cleanup stage: it removes everything of the job's machine.
// It runs on its own deadline, also after a cancel.
func Cleanup(ctx context.Context, e Env, cfg *config.Config) error {
	j, err := e.load(cfg)
	if err != nil {
		return err
	}
	defer j.m.Close()
	defer func() { e.Report.Reconnects(j.m.Reconnects()) }()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.Timeouts.Cleanup.D())
	defer cancel()
	m := j.m
	if err := m.Dial(ctx); err != nil {
		return err
	}
	if e.Getenv("CUSTOM_ENV_CI_JOB_STATUS") == "failed" && keepRequested(e.Getenv) && cfg.Debug.AllowKeepOnFailure {
		until := time.Now().Add(cfg.Debug.KeepMaxAge.D())
		jm, err := m.MachineOf(j.name)
		if err == nil {
			err = m.Keep(ctx, jm.Name, until)
		}
		if err == nil {
			j.log.Warn("kept the failed job's VM for debugging", "until", until.UTC().Format(time.RFC3339))
			return nil
		}
		if !errors.Is(err, vm.ErrNotFound) {
			j.log.Error("could not keep the VM; removing it", "err", err)
		}
	}
	t0 := time.Now()
	jm, ended, err := m.EndJob(ctx, j.name)
	e.Report.Step("stop", time.Since(t0), err)
	if jm.Name != "" {
		if mach, rerr := m.Store.Record(jm.Name); rerr == nil {
			e.Report.Machine(jm.Name, mach.Image)
		}
	}
	// The machine runs nothing any more and nothing of the job can reach
	// it; the slow rest (QEMU's exit, undefine, volumes) goes to a reaper
	// of its own, so the job ends now. A machine marked ended goes to the
	// reaper also when ending the job failed after that (its pause, or
	// another machine of the job): it destroys what still runs.
	reaper := len(ended) > 0
	if reaper {
		t1 := time.Now()
		serr := m.StartReaper(ended)
		e.Report.Step("start reaper", time.Since(t1), serr)
		if serr != nil {
			j.log.Warn("no reaper; removing the VM here", "err", serr)
			reaper = false
			err = errors.Join(err, m.Reap(ctx, ended))
		}
	}
	if err != nil {
		j.log.Error("cleanup incomplete", "vm", jm.Name, "reaper", reaper, "err", err)
		return exitcodes.System(err)
	}
	j.log.Info("cleaned up", "vm", jm.Name, "warm", jm.Warm, "reaper", reaper, "took", vm.Round(time.Since(t0)).String(), "job_status", e.Getenv("CUSTOM_ENV_CI_JOB_STATUS"))
	if !reaper {
		m.OpportunisticSweep(ctx, j.log)
	}
	return nil
}
