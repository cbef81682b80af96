// Package ghjob is libvirt-executor-hooks' front end (issue #47): the
// GitHub Actions runner's container hook commands (internal/ghhooks reads
// and checks them) carried out on the engine through the job layer
// (jobvm, front end "github-hooks"). prepare_job starts a virtiofsd of the
// job's own for the runner's _work directory (share.go), acquires a cold
// VM of [github_hooks] vm_image with that share, mounts it in the guest at
// the same absolute path and starts the job container there with podman;
// run_script_step runs a step in it with podman exec; cleanup_job releases
// the VM and stops virtiofsd. Every guest command is a fixed argument
// vector (sshexec's Exec), the job's variables travel as its environment,
// never on a command line.
package ghjob

import (
	"context"
	"crypto/rand"
	"encoding/binary"
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

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghhooks"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghshare"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Frontend is the ownership record's front end of the hook's machines.
const Frontend = "github-hooks"

// WorkTag is the virtiofs tag the guest mounts the work directory by,
// ExtTag the one of the runner's externals directory (read-only).
const (
	WorkTag = "lve-work"
	ExtTag  = "lve-ext"
)

// Env is what the hook gets from its process.
type Env struct {
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	Log            *slog.Logger
	// Connect opens the hypervisor; nil means libvirt.
	Connect jobvm.Connector
	// Euid is the hook's effective user id (os.Geteuid).
	Euid int
	// PPID is the hook's parent: the runner's worker, or a process under
	// it (ghshare.FindWorker), recorded at prepare_job for the sweep.
	PPID int
}

// ExitError carries a step's exit status: the hook exits with it.
type ExitError struct{ Code int }

func (e *ExitError) Error() string { return fmt.Sprintf("the step exited with status %d", e.Code) }

// podman is the guest's podman, by its path: a step's PATH never decides
// which program runs.
const podman = "/usr/bin/podman"

// defaultPath is the job container's PATH when it names none.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Run carries out one hook call read from e.Stdin under cfg. A step's own
// non-zero status is an *ExitError.
func Run(ctx context.Context, e Env, cfg *config.Config) error {
	in, err := ghhooks.Decode(e.Stdin)
	if err != nil {
		return err
	}
	g := cfg.GitHubHooks
	if !g.Enabled() {
		return fmt.Errorf("[github_hooks] vm_image is not set in %s: the hook runs no job (docs/github-hooks.md)", cfg.Path)
	}
	if !cfg.LocalLibvirt() {
		return fmt.Errorf("libvirt_uri %q is another host's libvirt: the hook shares the runner's _work with its VM, which must run on this host", cfg.LibvirtURI)
	}
	allow, err := services.NewAllowlist(g.AllowedImages)
	if err != nil {
		return fmt.Errorf("github_hooks.allowed_images: %w", err)
	}
	opts := ghhooks.Options{WorkDir: g.WorkDir, Externals: g.ExternalsDir, Images: allow}
	h := &hook{e: e, cfg: cfg, g: g, opts: opts, say: func(format string, args ...any) {
		fmt.Fprintf(e.Stderr, format+"\n", args...)
	}}
	switch in.Command {
	case ghhooks.PrepareJob:
		return h.prepare(ctx, in)
	case ghhooks.RunScriptStep:
		return h.script(ctx, in)
	case ghhooks.CleanupJob:
		return h.cleanup(ctx, in)
	case ghhooks.RunContainerStep:
		return h.containerStep(ctx, in)
	}
	return fmt.Errorf("command %q is not handled", in.Command)
}

type hook struct {
	e    Env
	cfg  *config.Config
	g    config.GitHubHooks
	opts ghhooks.Options
	say  func(string, ...any)
	// extShared: the runner's externals are in the job's VM, read-only
	// (prepare_job shared them; a later call reads it from the share's
	// record).
	extShared bool
	// pulled are the images this call pulled into the job's VM: a
	// service of the job's image is not pulled twice.
	pulled map[string]bool
}

// startShares starts the job's virtiofsd for the work directory and, when
// the externals directory exists, a read-only one for it (ghshare), and
// returns the shares for the job's VM.
func (h *hook) startShares(ctx context.Context, share *ghshare.Share, su *ghshare.User) ([]vm.SharedDir, error) {
	h.extShared = false
	t := time.Now()
	if err := ghshare.Start(ctx, h.g, h.cfg.StateDir, share, su); err != nil {
		return nil, err
	}
	h.say("Started virtiofsd for %s (as %s, in a user namespace) in %s", h.g.WorkDir, su.Name, vm.Round(time.Since(t)))
	dirs := []vm.SharedDir{{Socket: share.Socket(), Tag: WorkTag}}
	if h.g.ExternalsDir == "" {
		return dirs, nil
	}
	if _, err := os.Stat(h.g.ExternalsDir); errors.Is(err, os.ErrNotExist) {
		h.say("Not shared with the VM: the runner's externals directory %s does not exist (JavaScript actions need it)", h.g.ExternalsDir)
		return dirs, nil
	}
	t = time.Now()
	if err := ghshare.StartExternals(ctx, h.g, h.cfg.StateDir, share, su); err != nil {
		return nil, err
	}
	h.extShared = true
	h.say("Started a read-only virtiofsd for %s (as a subordinate id of %s) in %s", h.g.ExternalsDir, su.Name, vm.Round(time.Since(t)))
	return append(dirs, vm.SharedDir{Socket: share.ExtSocket(), Tag: ExtTag}), nil
}

// instance is the instance tag of the hook's machines on this host: one
// runner (its work directory).
func (h *hook) instance() string { return jobvm.InstanceTag(Frontend, h.g.WorkDir) }

// open opens the job layer and the job's handle.
func (h *hook) open(id int64) (*jobvm.Jobs, *jobvm.Job, error) {
	jobs, err := jobvm.OpenJobs(h.cfg, jobvm.Options{Connect: h.e.Connect, Log: h.e.Log, Say: h.say})
	if err != nil {
		return nil, nil, err
	}
	j, err := jobs.Job(jobvm.JobRef{Frontend: Frontend, Instance: h.instance(), ID: id}, h.e.Log)
	if err != nil {
		_ = jobs.Close()
		return nil, nil, err
	}
	return jobs, j, nil
}

// newJobID is a fresh random job id (positive, 62 bits): the runner names
// its job to the hook by nothing the hook could trust as unique.
func newJobID() (int64, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, err
	}
	return int64(binary.BigEndian.Uint64(b[:]) >> 2), nil //nolint:gosec // G115: 62 bits
}

func (h *hook) prepare(ctx context.Context, in *ghhooks.Input) (err error) {
	args, err := in.Prepare(h.opts)
	if err != nil {
		return err
	}
	c := args.Container
	createArgs, err := h.opts.CreateArgs("container", c.CreateOptions)
	if err != nil {
		return err
	}
	svcArgs := make([][]string, len(args.Services))
	for i, s := range args.Services {
		if svcArgs[i], err = h.opts.CreateArgs(fmt.Sprintf("services[%d]", i), s.CreateOptions); err != nil {
			return err
		}
	}
	img, ok := h.cfg.Images[h.g.VMImage]
	if !ok {
		return fmt.Errorf("github_hooks.vm_image %q is not a configured image", h.g.VMImage)
	}
	su, err := ghshare.ResolveUser(h.g, h.e.Euid)
	if err != nil {
		return err
	}
	if ghshare.SetuidReachable(h.g.WorkDir) {
		h.say("Warning: every local user can reach %s, on a filesystem that honours setuid bits: a root guest can leave a program there that runs as %s for whoever starts it; close a directory above it to others (chmod o-x), or mount it nosuid", h.g.WorkDir, su.Name)
	}
	svcOpts, err := services.OptionsFrom(h.cfg.Services, 0, img.Name, img.User)
	if err != nil {
		return fmt.Errorf("the registry mirrors of [services]: %w", err)
	}
	id, err := newJobID()
	if err != nil {
		return err
	}
	jobs, j, err := h.open(id)
	if err != nil {
		return err
	}
	defer jobs.Close()
	name := j.Name()
	log := h.e.Log.With("job", id, "domain", name)
	j.SetLog(log)
	began := time.Now()
	h.say("Preparing a fresh %s VM %s for this job (libvirt-executor-hooks)", img.Name, name)

	share := &ghshare.Share{Machine: name, JobID: id, At: time.Now().UTC()}
	// The runner's worker, if the hook runs under one: the sweep removes
	// the job once it is gone without a cleanup_job.
	share.RunnerPID, share.RunnerStart = ghshare.FindWorker(h.e.PPID)
	// From here on, every error removes what the job has.
	defer func() {
		if err == nil {
			return
		}
		cctx, cancel := detachctx.WithTimeout(ctx, h.cfg.Timeouts.Cleanup.D())
		defer cancel()
		if _, rerr := j.Release(cctx, jobvm.Observer{}); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove the job's VM: %w", rerr))
		}
		if serr := ghshare.Stop(h.cfg.StateDir, share); serr != nil {
			err = errors.Join(err, fmt.Errorf("stop the job's virtiofsd: %w", serr))
		}
	}()
	dirs, err := h.startShares(ctx, share, su)
	if err != nil {
		return err
	}

	// Warm when the image's pool has an idle machine with shared memory
	// (the job's directories are hot-plugged into it), else cold.
	im := *img
	if im.Pool != nil && !im.SharedMemory {
		im.Pool = nil
		h.say("Cold start: the standby VMs of %s have no shared memory for the job's directories (set shared_memory = true in [images.%s] of every configuration file of this host for warm starts)", img.Name, img.Name)
	}
	req := jobvm.AcquireRequest{
		Request: jobvm.Request{Frontend: Frontend, Job: strconv.FormatInt(id, 10), Image: &im, Lifetime: h.g.JobTimeout.D(),
			Dirs: dirs},
		Size: h.cfg.ImageSize(img), Log: log,
	}
	a, err := j.Acquire(ctx, req)
	if refused := (*jobvm.SharesRefusedError)(nil); errors.As(err, &refused) {
		// The refused plug spent the servers' one connection each: new
		// servers, then a cold VM.
		if err := ghshare.Stop(h.cfg.StateDir, share); err != nil {
			return fmt.Errorf("stop the job's virtiofsd: %w", err)
		}
		if req.Dirs, err = h.startShares(ctx, share, su); err != nil {
			return err
		}
		cold := im
		cold.Pool = nil
		req.Image = &cold
		h.say("Cold start: %v", refused)
		a, err = j.Acquire(ctx, req)
	}
	if err != nil {
		return fmt.Errorf("the job's VM: %w", err)
	}
	if err := ghshare.SetVM(h.cfg.StateDir, share, a.Name); err != nil {
		return fmt.Errorf("record the job's VM: %w", err)
	}
	start := "cold"
	if a.Warm {
		start = "warm"
	}
	g, closeGuest, err := jobGuest(ctx, j)
	if err != nil {
		return err
	}
	defer closeGuest()
	t := time.Now()
	if _, err := g.must(ctx, "make "+h.g.WorkDir+" in the VM", []string{"mkdir", "-p", "--", h.g.WorkDir}, nil); err != nil {
		return err
	}
	if _, err := g.must(ctx, "mount the runner's work directory in the VM (virtiofs)", []string{"mount", "-t", "virtiofs", WorkTag, h.g.WorkDir}, nil); err != nil {
		return err
	}
	h.say("Mounted %s in the VM at the same path (virtiofs) in %s", h.g.WorkDir, vm.Round(time.Since(t)))
	if h.extShared {
		t = time.Now()
		if _, err := g.must(ctx, "make "+h.g.ExternalsDir+" in the VM", []string{"mkdir", "-p", "--", h.g.ExternalsDir}, nil); err != nil {
			return err
		}
		if _, err := g.must(ctx, "mount the runner's externals in the VM (virtiofs, read-only)", []string{"mount", "-t", "virtiofs", "-o", "ro", ExtTag, h.g.ExternalsDir}, nil); err != nil {
			return err
		}
		h.say("Mounted %s in the VM at the same path, read-only, in %s", h.g.ExternalsDir, vm.Round(time.Since(t)))
	}

	st := ghhooks.State{Machine: name, Job: strconv.FormatInt(id, 10), Network: "lve-gh-" + strconv.FormatInt(id, 10), Container: "lve-gh-" + strconv.FormatInt(id, 10) + "-job"}
	id2, path, alpine, err := h.startContainer(ctx, g, c, createArgs, st, svcOpts)
	if err != nil {
		return err
	}
	st.Path = path
	var resp ghhooks.Response
	resp.Context.Container = ghhooks.ContainerContext{ID: id2, Network: st.Network}
	if len(c.PortMappings) > 0 {
		if resp.Context.Container.Ports, err = h.ports(ctx, g, st.Container); err != nil {
			return err
		}
	}
	if resp.Context.Services, err = h.startServices(ctx, g, args.Services, svcArgs, &st); err != nil {
		return err
	}
	resp.State = st
	resp.IsAlpine = alpine
	if err := ghhooks.WriteResponse(h.g.WorkDir, *in.ResponseFile, &resp); err != nil {
		return err
	}
	log.Info("prepared", "took", vm.Round(time.Since(began)).String(), "start", start)
	h.say("Job container %s ready in %s (%s start)", st.Container, vm.Round(time.Since(began)), start)
	return nil
}

// startContainer starts the job container in the VM: the registry mirrors
// of [services], the job's network, the image's pull (with the job's
// registry login, written for the pull only), then the container,
// detached, with the job's mounts (those under the work directory at
// their paths in the VM, named volumes), variables, options and entry
// point. It returns the container's id and PATH and whether it is
// Alpine.
func (h *hook) startContainer(ctx context.Context, g *guest, c *ghhooks.Container, createArgs []string, st ghhooks.State, so services.Options) (id, path string, alpine bool, err error) {
	t := time.Now()
	if _, err := g.must(ctx, "check for podman in the VM", []string{podman, "--version"}, nil); err != nil {
		return "", "", false, err
	}
	if len(so.Registries) > 0 {
		if _, err := g.mustIn(ctx, "write the registry mirrors", services.WriteFileArgv(services.RegistriesPath, "0644"), nil, strings.NewReader(string(so.Registries))); err != nil {
			return "", "", false, err
		}
	}
	if _, err := g.must(ctx, "create the job's network", services.NetworkCreateArgv(st.Network), nil); err != nil {
		return "", "", false, err
	}
	ref, err := services.ParseRef(c.Image)
	if err != nil {
		return "", "", false, fmt.Errorf("container.image: %w", err)
	}
	if err := h.pull(ctx, g, ref, c.Registry); err != nil {
		return "", "", false, err
	}
	h.say("Pulled %s in the VM in %s", ref.String(), vm.Round(time.Since(t)))

	argv, env := h.runArgv([]string{podman, "run", "--detach", "--pull=never"}, c, st.Container, st.Network, nil, createArgs)
	ep := []string{"sh", "-c", `trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done`}
	var cmd []string
	if c.EntryPoint != nil && *c.EntryPoint != "" {
		ep, cmd = []string{*c.EntryPoint}, c.EntryPointArgs
	}
	b, _ := json.Marshal(ep)
	argv = append(argv, "--entrypoint="+string(b), ref.String())
	argv = append(argv, cmd...)
	t = time.Now()
	out, err := g.must(ctx, "start the job container", argv, env)
	if err != nil {
		return "", "", false, err
	}
	id = strings.TrimSpace(string(out))
	h.say("Started the job container %s (%s) in %s", st.Container, ref.String(), vm.Round(time.Since(t)))
	out, err = g.must(ctx, "read the job container's PATH", []string{podman, "exec", st.Container, "sh", "-c", `printf %s "$PATH"`}, nil)
	if err != nil {
		return "", "", false, err
	}
	path = strings.TrimSpace(string(out))
	// Alpine's /etc/os-release says ID=alpine (the runner then runs
	// actions' Alpine builds).
	code, osr, _, err := g.exec(ctx, []string{podman, "exec", st.Container, "cat", "/etc/os-release"}, nil, nil)
	if err != nil {
		return "", "", false, err
	}
	if code == 0 {
		for _, l := range strings.Split(string(osr), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "ID="); ok && strings.Trim(v, `"'`) == "alpine" {
				alpine = true
			}
		}
	}
	return id, path, alpine, nil
}

// pull pulls an image of the job (once per hook call); a registry login
// is written for the pull only (0600, through stdin) and removed after it,
// also when it failed.
func (h *hook) pull(ctx context.Context, g *guest, ref services.Ref, r *ghhooks.Registry) (err error) {
	if h.pulled[ref.String()] {
		return nil
	}
	defer func() {
		if err == nil {
			if h.pulled == nil {
				h.pulled = map[string]bool{}
			}
			h.pulled[ref.String()] = true
		}
	}()
	authFile := ""
	if r != nil && r.Username != "" {
		host := ghhooks.RegistryHost(r.ServerURL)
		b, jerr := json.Marshal(map[string]any{"auths": map[string]any{host: map[string]string{
			"auth": base64Std(r.Username + ":" + r.Password)}}})
		if jerr != nil {
			return jerr
		}
		defer func() {
			rctx, cancel := detachctx.WithTimeout(ctx, 15*time.Second)
			defer cancel()
			if _, rerr := g.must(rctx, "remove the job's registry login", services.RemoveFileArgv(services.AuthPath), nil); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}()
		if _, err := g.mustIn(ctx, "write the job's registry login", services.WriteFileArgv(services.AuthPath, "0600"), nil, strings.NewReader(string(b))); err != nil {
			return err
		}
		authFile = services.AuthPath
	}
	argv := services.PullArgv(ref, authFile)
	argv[0] = podman
	_, err = g.must(ctx, "pull "+ref.String(), argv, nil)
	return err
}

func (h *hook) underWork(p string) bool {
	return ghhooks.Options{WorkDir: h.g.WorkDir}.UnderShared(p)
}

// inVM says whether the host path p is in the job's VM at the same path
// (under the work directory, or under the externals when they are
// shared) and whether it is there read-only (the externals).
func (h *hook) inVM(p string) (shared, readOnly bool) {
	if h.underWork(p) {
		return true, false
	}
	if h.extShared && (ghhooks.Options{WorkDir: h.g.ExternalsDir}).UnderShared(p) {
		return true, true
	}
	return false, false
}

func roOpt(ro bool) string {
	if ro {
		return ",readonly=true"
	}
	return ""
}

// jobOf finds the job the state names: its handle, checked to be the
// machine the state names.
func (h *hook) jobOf(st *ghhooks.State) (*jobvm.Jobs, *jobvm.Job, error) {
	id, err := strconv.ParseInt(st.Job, 10, 64)
	if err != nil || id <= 0 {
		return nil, nil, fmt.Errorf("state: job %q is not a job of this hook", st.Job)
	}
	jobs, j, err := h.open(id)
	if err != nil {
		return nil, nil, err
	}
	if j.Name() != st.Machine {
		_ = jobs.Close()
		return nil, nil, fmt.Errorf("state: machine %q is not job %d's of this runner (%s)", st.Machine, id, j.Name())
	}
	return jobs, j, nil
}

// jobGuest opens the guest connection of job j (its Session: the one way
// into the job's VM) for the hook's commands, through sudo -n where the
// login is not root; closeGuest ends it.
func jobGuest(ctx context.Context, j *jobvm.Job) (g *guest, closeGuest func(), err error) {
	sess := j.Session()
	rec, cl, err := sess.Client(ctx)
	if err != nil {
		sess.Close()
		return nil, nil, fmt.Errorf("the job's VM: %w", err)
	}
	return &guest{c: cl, sudo: rec.User != "" && rec.User != "root"}, sess.Close, nil
}

func (h *hook) script(ctx context.Context, in *ghhooks.Input) error {
	st, err := in.DecodeState()
	if err != nil {
		return err
	}
	args, err := in.Script()
	if err != nil {
		return err
	}
	jobs, j, err := h.jobOf(st)
	if err != nil {
		return err
	}
	defer jobs.Close()
	g, closeGuest, err := jobGuest(ctx, j)
	if err != nil {
		return err
	}
	defer closeGuest()
	argv, env := stepArgv(st, args)
	code, err := g.c.Exec(ctx, g.wrap(argv, env), env, nil, h.e.Stdout, h.e.Stderr)
	if ctx.Err() != nil {
		sctx, cancel := detachctx.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		_, _ = g.c.Exec(sctx, g.wrap(services.StopScriptsArgv(st.Container), nil), nil, nil, nil, nil)
		return fmt.Errorf("the step in the job container %s stopped: %w", st.Container, context.Cause(ctx))
	}
	if err != nil {
		return fmt.Errorf("the job container %s: %w", st.Container, err)
	}
	if code != 0 {
		return &ExitError{Code: code}
	}
	return nil
}

// stepArgv is the podman exec of a step: its working directory, its
// variables (names on the command line, values in the environment), PATH
// (prependPath before the step's PATH, else the container's), then its
// entry point and arguments.
func stepArgv(st *ghhooks.State, a *ghhooks.ScriptArgs) (argv, env []string) {
	argv = []string{podman, "exec"}
	if a.WorkingDir != "" {
		argv = append(argv, "--workdir", a.WorkingDir)
	}
	base, hasPath := a.Env["PATH"]
	if !hasPath {
		base = st.Path
	}
	if base == "" {
		base = defaultPath
	}
	if len(a.PrependPath) > 0 {
		argv = append(argv, "--env", "PATH="+strings.Join(a.PrependPath, ":")+":"+base)
	} else if hasPath {
		argv = append(argv, "--env", "PATH="+base)
	}
	for _, k := range slices.Sorted(mapsKeys(a.Env)) {
		if k == "PATH" {
			continue
		}
		argv = append(argv, "--env", k)
		env = append(env, k+"="+a.Env[k])
	}
	argv = append(argv, st.Container, a.EntryPoint)
	return append(argv, a.EntryPointArgs...), env
}

func (h *hook) cleanup(ctx context.Context, in *ghhooks.Input) error {
	st, err := in.DecodeState()
	if err != nil {
		// prepare_job failed (and removed what it made) or never ran.
		h.say("Nothing to clean up: %v", err)
		return nil
	}
	jobs, j, err := h.jobOf(st)
	if err != nil {
		return err
	}
	defer jobs.Close()
	ctx, cancel := detachctx.WithTimeout(ctx, h.cfg.Timeouts.Cleanup.D())
	defer cancel()
	if err := jobs.Dial(ctx); err != nil {
		return err
	}
	r, err := j.Release(ctx, jobvm.Observer{})
	if err != nil {
		err = fmt.Errorf("remove the job's VM %s: %w", st.Machine, err)
	}
	// virtiofsd is stopped also when the VM's removal failed (the sweep
	// removes the VM): it serves the runner's _work to nothing else.
	share, lerr := ghshare.Load(h.cfg.StateDir, st.Machine)
	if lerr != nil {
		return errors.Join(err, lerr)
	}
	if share != nil {
		if serr := ghshare.Stop(h.cfg.StateDir, share); serr != nil {
			err = errors.Join(err, fmt.Errorf("stop the job's virtiofsd: %w", serr))
		}
	}
	// The share's record goes first thing at prepare_job and last at
	// cleanup: without it, an earlier cleanup_job (or the sweep) ran.
	switch {
	case err != nil:
	case share != nil:
		h.say("Removed the job's VM %s and stopped its virtiofsd", r.Machine.Name)
	default:
		h.say("The job's VM %s was released before; no virtiofsd left", r.Machine.Name)
	}
	return err
}
