package garm

import (
	"bytes"
	"context"
	_ "embed" // the guest's bootstrap script
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/failure"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Frontend is the ownership record's front end of garm's instances.
const Frontend = jobvm.FrontendGarm

// Tag keys of the ownership record.
const (
	TagController = "garm-controller-id"
	TagPool       = "garm-pool-id"
	TagName       = "garm-instance-name"
	// TagImage is the configured image the instance was made of.
	TagImage = "image"
)

//go:embed bootstrap.py
var bootstrapScript []byte

// Paths in the guest, and the parameters' name on the seed.
const (
	bootstrapPath = "/usr/local/sbin/lve-garm-bootstrap"
	caPath        = "/usr/local/share/ca-certificates/garm-ca-bundle.crt"
	// seedParams is the bootstrap's parameter file (garm's instance token
	// in it) on the seed's filesystem, not in the user-data: cloud-init
	// never reads it, so no copy of it reaches the guest's disk; the
	// bootstrap reads it from the seed device (guestinit.WritableSeedSerial)
	// into its memory and overwrites the device with zeros.
	seedParams = "lve-garm.json"
)

// Provider runs one garm command on the engine.
type Provider struct {
	M   *lifecycle.Manager
	Cfg *config.Config
	Env Env
	Out io.Writer
	// Log gets what the host's admin should know (nil: slog's default).
	Log *slog.Logger
}

// Operations recorded as events (obs.KindInstance) and step records, as
// GitLab's stages are: the metrics count garm's instances created,
// deleted and failed, by reason.
const (
	OpCreate = obs.OpCreate
	OpDelete = obs.OpDelete
)

// observe runs one operation on the instance's machine and records it
// with its steps, result and failure reason.
func (p *Provider) observe(ctx context.Context, op, machine string, fn func(r *obs.Report) error) error {
	r := &obs.Report{Kind: obs.KindInstance, Stage: op}
	r.Identify(p.Env.InstanceID, p.Env.ControllerID, machine)
	r.Machine(machine, "")
	t0 := time.Now()
	err := fn(r)
	end := time.Now()
	log := p.Log
	if log == nil {
		log = slog.Default()
	}
	lifecycle.RecordReport(p.Cfg, log, r, obs.Outcome{Err: err, Cancelled: err != nil && ctx.Err() != nil, Took: end.Sub(t0), End: end, Classify: classify})
	return err
}

// classify is an operation's result class and failure reason.
func classify(err error, cancelled bool) (result, reason string) {
	result = obs.ResultSuccess
	if err != nil || cancelled {
		result = obs.ResultSystem
	}
	return result, failure.Classify(err, cancelled)
}

// teardown removes an instance's machine on a deadline of its own
// (timeouts.cleanup), detached from the signal that may end the command:
// garm's delete, like GitLab's cleanup, is never cut short half-way by a
// SIGTERM (a machine half removed would stay until a sweep).
func (p *Provider) teardown(ctx context.Context, o lifecycle.Owned) error {
	return p.observe(ctx, OpDelete, o.Name, func(r *obs.Report) error {
		r.Machine(o.Name, o.Owner.Tag(TagImage))
		tctx, cancel := detachctx.WithTimeout(ctx, p.Cfg.Timeouts.Cleanup.D())
		defer cancel()
		t0 := time.Now()
		err := p.M.Machine(o.Name).Teardown(tctx)
		r.Step("teardown", time.Since(t0), err)
		return err
	})
}

// Run runs the command of p.Env; stdin is CreateInstance's input.
func (p *Provider) Run(ctx context.Context, stdin io.Reader) error {
	if p.Env.PoolID != "" && p.Cfg != nil {
		// garm named this pool: it is alive (see Orphan).
		if err := MarkPoolSeen(p.Cfg.StateDir, p.Env.ControllerID, p.Env.PoolID, time.Now()); err != nil {
			slog.Warn("cannot note that garm named the pool", "pool", p.Env.PoolID, "err", err)
		}
	}
	switch p.Env.Command {
	case CmdVersion:
		_, err := fmt.Fprintln(p.Out, buildinfo.Version)
		return err
	case CmdVersions:
		return p.json(Versions)
	case CmdConfigSchema:
		_, err := io.WriteString(p.Out, ConfigSchema)
		return err
	case CmdExtraSpecSchema:
		_, err := io.WriteString(p.Out, ExtraSpecsSchema)
		return err
	case CmdValidate:
		// garm passes the pool's extra specs (GARM_POOL_EXTRASPECS); its
		// image and flavor only where stdin carries them (as a
		// BootstrapInstance). Without an image, every image garm pools may
		// use must take the specs.
		in, err := readPoolInfo(stdin)
		if err != nil {
			return err
		}
		in.ExtraSpecs = p.Env.ExtraSpecs
		if in.Image != "" {
			_, err := p.resolve(in)
			return err
		}
		for _, img := range p.Cfg.GarmImages() {
			in.Image = img
			if _, err := p.resolve(in); err != nil {
				return err
			}
		}
		return nil
	case CmdCreate:
		bs, err := ReadBootstrap(stdin)
		if err != nil {
			return err
		}
		var inst *Instance
		err = p.observe(ctx, OpCreate, MachineName(p.Cfg, p.M.Controller, p.Env.ControllerID, bs.Name), func(r *obs.Report) error {
			var err error
			inst, err = p.create(ctx, bs, r)
			return err
		})
		if err != nil {
			return err
		}
		return p.json(inst)
	case CmdGet:
		o, err := p.find(ctx)
		if err != nil {
			return err
		}
		p.pinAddresses(ctx, []lifecycle.Owned{o})
		p.dropSeeds(ctx, []lifecycle.Owned{o})
		return p.json(instanceOf(o))
	case CmdList:
		all, err := p.M.OwnedBy(ctx, Frontend, func(o vm.Owner) bool {
			return o.Tag(TagController) == p.Env.ControllerID && o.Tag(TagPool) == p.Env.PoolID
		})
		if err != nil {
			return err
		}
		out := make([]Instance, 0, len(all))
		for _, o := range all {
			out = append(out, instanceOf(o))
		}
		p.pinAddresses(ctx, all)
		p.dropSeeds(ctx, all)
		return p.json(out)
	case CmdDelete:
		o, err := p.find(ctx)
		if errors.Is(err, ErrNotFound) {
			return nil // gone already, or never made: success
		}
		if err != nil {
			return err
		}
		return p.teardown(ctx, o)
	case CmdRemoveAll:
		all, err := p.M.OwnedBy(ctx, Frontend, func(o vm.Owner) bool { return o.Tag(TagController) == p.Env.ControllerID })
		if err != nil {
			return err
		}
		var errs []error
		for _, o := range all {
			if err := p.teardown(ctx, o); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", o.Name, err))
			}
		}
		return errors.Join(errs...)
	case CmdStart, CmdStop:
		o, err := p.find(ctx)
		if err != nil {
			return err
		}
		if p.Env.Command == CmdStart {
			if o.State.Running {
				return nil
			}
			return p.M.Machine(o.Name).Start(ctx)
		}
		if !o.State.Running {
			return nil
		}
		return p.M.Machine(o.Name).Stop(ctx)
	}
	return fmt.Errorf("command %q not implemented", p.Env.Command)
}

// readPoolInfo reads ValidatePoolInfo's optional stdin: a JSON object
// with the pool's image and flavor (garm's BootstrapInstance shape), or
// nothing.
func readPoolInfo(stdin io.Reader) (ValidateInput, error) {
	var in ValidateInput
	if stdin == nil {
		return in, nil
	}
	b, err := readStdin(stdin)
	if err != nil || len(bytes.TrimSpace(b)) == 0 {
		return in, err
	}
	bs, err := decodeBootstrap(b)
	if err != nil {
		return in, fmt.Errorf("stdin is not a JSON object with image and flavor: %v", err)
	}
	in.Image, in.Flavor = bs.Image, bs.Flavor
	return in, nil
}

func (p *Provider) json(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(p.Out, "%s\n", b)
	return err
}

// MachineName is the provider id of garm's instance name under controller:
// this installation's machine prefix and a hash (garm's names have capitals;
// domain names of this installation do not).
func MachineName(cfg *config.Config, controller, garmController, name string) string {
	return lifecycle.InstanceName(cfg.NamePrefix, controller, "garm", garmController, name)
}

// find is the instance GARM_INSTANCE_ID names (a provider id or, after a
// failed create, garm's instance name) of this garm controller (and, from
// v0.1.1 on, of GARM_POOL_ID).
func (p *Provider) find(ctx context.Context) (lifecycle.Owned, error) {
	id := p.Env.InstanceID
	// Instance names are unique per controller: the pool is not asked
	// (a v0.1.1 call with another pool id must still find, and delete, it).
	all, err := p.M.OwnedBy(ctx, Frontend, func(o vm.Owner) bool { return o.Tag(TagController) == p.Env.ControllerID })
	if err != nil {
		return lifecycle.Owned{}, err
	}
	for _, o := range all {
		if o.Name == id || o.Owner.Tag(TagName) == id {
			return o, nil
		}
	}
	return lifecycle.Owned{}, fmt.Errorf("%w: %s", ErrNotFound, id)
}

// instanceOf is what garm is told of a machine.
func instanceOf(o lifecycle.Owned) Instance {
	in := Instance{ProviderID: o.Name, Name: o.Owner.Tag(TagName), OSType: "linux", OSArch: "amd64"}
	switch {
	case o.State.Running:
		in.Status = StatusRunning
	case o.State.Code == vm.StateShutOff:
		in.Status = StatusStopped
	case o.State.Code == vm.StatePaused, o.State.Code == vm.StateCrashed:
		in.Status = StatusError
		in.ProviderFault = []byte("libvirt: " + o.State.Summary)
	default:
		in.Status = StatusUnknown
	}
	if o.Address != "" {
		in.Addresses = []Address{{Address: o.Address, Type: "private"}}
	}
	return in
}

// nameRE bounds garm's instance names.
var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// create launches the instance of bs and returns at once.
func (p *Provider) create(ctx context.Context, bs *Bootstrap, rep *obs.Report) (*Instance, error) {
	if !nameRE.MatchString(bs.Name) {
		return nil, fmt.Errorf("instance name %q refused: 1-63 letters, digits, '.', '_' or '-'", cut(bs.Name))
	}
	if bs.OSType != "linux" {
		return nil, fmt.Errorf("os_type %q is not supported: linux only (Windows guests are not supported yet)", cut(bs.OSType))
	}
	if bs.Arch != "amd64" {
		return nil, fmt.Errorf("arch %q is not supported on this host: amd64", cut(bs.Arch))
	}
	if bs.PoolID != "" && !strings.EqualFold(bs.PoolID, p.Env.PoolID) {
		return nil, fmt.Errorf("pool_id %q differs from GARM_POOL_ID %q", cut(bs.PoolID), p.Env.PoolID)
	}
	r, err := p.resolve(ValidateInput{Image: bs.Image, Flavor: bs.Flavor, ExtraSpecs: bs.ExtraSpecs})
	if err != nil {
		return nil, err
	}
	rep.Machine(MachineName(p.Cfg, p.M.Controller, p.Env.ControllerID, bs.Name), r.Image.Name)
	params, err := guestParams(bs)
	if err != nil {
		return nil, err
	}
	if err := p.checkEndpoints(bs); err != nil {
		return nil, err
	}
	name := MachineName(p.Cfg, p.M.Controller, p.Env.ControllerID, bs.Name)
	ci := guestinit.CloudInit{
		InstanceID: name, Hostname: name, User: r.Image.User, ExtraKeys: sshKeys(bs.SSHKeys),
		Files: []guestinit.File{
			{Path: bootstrapPath, Content: bootstrapScript, Permissions: "0755"},
		},
		Extra: []guestinit.File{{Path: seedParams, Content: params}},
		// cloud-init's "init" stage runs in every image (runcmd needs its
		// "final" stage, which lean images mask): bootcmd queues the
		// bootstrap as a transient unit of its own (--no-block: cloud-init
		// runs before sysinit.target, which the unit's start waits for).
		// It starts once cloud-init's init stage is done (write_files has
		// written the script) and the network is online. It reads its
		// parameters from the seed device (attached writable, SeedWritable)
		// and wipes the device at once; it starts the runner service last,
		// once nothing uses the token any more (docs/garm.md, "The
		// bootstrap"). Its output goes to the journal and the console (the
		// host keeps the console in the machine's console.log; it never
		// prints a token). Its last line is SeedDoneMarker, after which
		// Get/List detach and delete the (zeroed) seed (dropSeeds). On
		// later boots cloud-init, without its seed, does not find its
		// datasource and runs no bootcmd at all; a bootstrap that runs finds
		// no parameters and does nothing. Not a timer (--on-active): a
		// transient timer queued this early hung the boot (seen on Debian
		// 12, systemd 252). python3 runs the script: systemd-run resolves
		// the executable at once, before write_files.
		BootCmd: [][]string{{"systemd-run", "--no-block", "--unit=lve-garm-bootstrap",
			"--property=After=cloud-init.service", "--property=After=network-online.target", "--property=Wants=network-online.target",
			"--property=StandardOutput=journal+console", "--property=StandardError=journal+console",
			"python3", bootstrapPath}},
	}
	if len(bs.CACertBundle) > 0 {
		ci.Files = append(ci.Files, guestinit.File{Path: caPath, Content: bs.CACertBundle, Permissions: "0644"})
	}
	req := lifecycle.Request{
		Name: name, Image: r.Image, VCPUs: r.Size.VCPUs, MemoryMiB: r.Size.MemoryMiB, DiskGiB: r.Size.DiskGiB,
		Frontend: Frontend, Job: bs.Name, Lifetime: p.Cfg.Garm.MaxAge.D(), NoWait: true, MakeRoom: true, ReachServicePorts: true,
		Tags: []vm.Tag{{Key: TagController, Value: p.Env.ControllerID}, {Key: TagPool, Value: p.Env.PoolID}, {Key: TagName, Value: bs.Name},
			{Key: TagImage, Value: r.Image.Name}},
		OnStep:       rep.Step,
		SeedWritable: true,
		Seed:         func(keys *guestinit.Keys, dir string) ([]byte, error) { return ci.SeedISO(keys, name, dir) },
	}
	if _, err := p.M.Launch(ctx, req); err != nil {
		if errors.Is(err, lifecycle.ErrExists) {
			return nil, fmt.Errorf("%w: %s (%s)", ErrDuplicate, bs.Name, name)
		}
		return nil, err
	}
	return &Instance{ProviderID: name, Name: bs.Name, OSType: "linux", OSArch: "amd64", Status: StatusRunning}, nil
}

var pkgRE = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]{0,99}$`)

// sshKeys are the authorized keys garm asks for, each one line.
func sshKeys(keys []string) []string {
	var out []string
	for _, k := range keys {
		if k = strings.TrimSpace(k); k != "" && !strings.ContainsAny(k, "\r\n") {
			out = append(out, k)
		}
	}
	return out
}

// guestParams is the bootstrap's parameter file: garm's instance token and
// the rest of what the guest needs. It travels only inside the seed volume
// (seedParams), which the guest's bootstrap wipes once it has read it
// (and dropSeeds removes once the bootstrap is done).
func guestParams(bs *Bootstrap) ([]byte, error) {
	arch := map[string]string{"amd64": "x64"}[bs.Arch]
	var tool *Tool
	for i, t := range bs.Tools {
		if t.OS == "linux" && (t.Architecture == arch || t.Architecture == bs.Arch) {
			tool = &bs.Tools[i]
			break
		}
	}
	if tool == nil {
		return nil, fmt.Errorf("no runner tool for linux/%s among the %d garm offered", arch, len(bs.Tools))
	}
	for _, u := range []struct{ what, v string }{{"callback-url", bs.CallbackURL}, {"metadata-url", bs.MetadataURL}, {"tool download_url", tool.DownloadURL}} {
		if pu, err := url.Parse(u.v); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
			return nil, fmt.Errorf("%s %q is not an http(s) URL", u.what, cut(u.v))
		}
	}
	if !regexp.MustCompile(`^[0-9a-fA-F]{64}$`).MatchString(tool.SHA256) {
		return nil, fmt.Errorf("the runner tool's sha256_checksum %q is not 64 hex digits", cut(tool.SHA256))
	}
	if bs.InstanceToken == "" {
		return nil, errors.New("instance-token is empty")
	}
	for _, p := range bs.UserDataOptions.ExtraPackages {
		if !pkgRE.MatchString(p) {
			return nil, fmt.Errorf("extra package %q is not a Debian package name", cut(p))
		}
	}
	proxy := map[string]string{"HTTP_PROXY": bs.ProxyConfig.HTTPProxy, "HTTPS_PROXY": bs.ProxyConfig.HTTPSProxy, "NO_PROXY": bs.ProxyConfig.NoProxy}
	return json.Marshal(map[string]any{
		"name": bs.Name, "token": bs.InstanceToken, "callback_url": bs.CallbackURL, "metadata_url": bs.MetadataURL,
		"tool": tool, "repo_url": bs.RepoURL, "labels": bs.Labels, "runner_group": bs.RunnerGroup,
		"jit": bs.JITConfigEnabled, "ca_bundle": len(bs.CACertBundle) > 0, "proxy": proxy,
		"packages": bs.UserDataOptions.ExtraPackages,
	})
}

// checkEndpoints refuses callback and metadata URLs outside
// garm.endpoints, when the admin declared them: the guests may reach only
// what the guard lets through, and the admin said what that is for garm.
func (p *Provider) checkEndpoints(bs *Bootstrap) error {
	allowed := p.Cfg.Garm.Endpoints
	if len(allowed) == 0 {
		return nil
	}
	var origins []string
	for _, e := range allowed {
		if o, err := config.Origin(e); err == nil {
			origins = append(origins, o)
		}
	}
	for _, u := range []struct{ what, v string }{{"callback-url", bs.CallbackURL}, {"metadata-url", bs.MetadataURL}} {
		o, err := config.Origin(u.v)
		if err != nil || !slices.Contains(origins, o) {
			return fmt.Errorf("%s %q is not at a declared garm endpoint: use one of %s (garm.endpoints)", u.what, cut(u.v), strings.Join(allowed, ", "))
		}
	}
	return nil
}

// ValidateInput is what a pool asks for.
type ValidateInput struct {
	Image, Flavor string
	ExtraSpecs    json.RawMessage
}

// Resolved is what a pool gets.
type Resolved struct {
	Image *config.Image
	Size  config.Size
}

// resolve maps a pool's image, flavor and extra specs to an allowed image
// and size, or says what is not allowed and what is.
func (p *Provider) resolve(in ValidateInput) (Resolved, error) {
	cfg := p.Cfg
	allowed := cfg.GarmImages()
	img, ok := cfg.OfferedImage(in.Image, allowed)
	if !ok {
		return Resolved{}, fmt.Errorf("image %q is not offered to garm pools: use one of %s", cut(in.Image), strings.Join(allowed, ", "))
	}
	if img.KeyInjection != config.InjectCloudInit {
		return Resolved{}, fmt.Errorf("image %q does not take a cloud-init seed (key_injection = %q): garm's bootstrap needs cloud-init", img.Name, img.KeyInjection)
	}
	size := cfg.ImageSize(img)
	flavors := []string{"default"}
	for n := range cfg.Garm.Flavors {
		flavors = append(flavors, n)
	}
	slices.Sort(flavors)
	switch f, ok := cfg.Garm.Flavors[in.Flavor]; {
	case ok:
		size = f
		if size.DiskGiB == 0 {
			size.DiskGiB = cfg.ImageSize(img).DiskGiB
		}
	case in.Flavor == "" || in.Flavor == "default":
	default:
		return Resolved{}, fmt.Errorf("flavor %q is not defined: use one of %s ([garm.flavors])", cut(in.Flavor), strings.Join(flavors, ", "))
	}
	if len(in.ExtraSpecs) > 0 && string(in.ExtraSpecs) != "null" {
		var specs map[string]json.RawMessage
		if err := json.Unmarshal(in.ExtraSpecs, &specs); err != nil {
			return Resolved{}, fmt.Errorf("extra_specs must be a JSON object: %v", err)
		}
		keys := make([]string, 0, len(specs))
		for k := range specs {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			if !slices.Contains(cfg.Garm.ExtraSpecs, k) {
				return Resolved{}, fmt.Errorf("extra_specs key %q is not permitted: this provider permits %s (garm.extra_specs)", cut(k), orNone(cfg.Garm.ExtraSpecs))
			}
			var n int
			if err := json.Unmarshal(specs[k], &n); err != nil {
				return Resolved{}, fmt.Errorf("extra_specs %q must be an integer", k)
			}
			b, dst := cfg.VCPUBound(), &size.VCPUs
			switch k {
			case "memory_mib":
				b, dst = cfg.MemoryBound(), &size.MemoryMiB
			case "disk_gib":
				b, dst = cfg.DiskBound(), &size.DiskGiB
			}
			if !b.Contains(n) {
				return Resolved{}, fmt.Errorf("extra_specs %q = %d is out of range %d-%d (limits)", k, n, b.Min, b.Max)
			}
			*dst = n
		}
	}
	return Resolved{Image: img, Size: size}, nil
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}
