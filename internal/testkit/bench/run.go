// Package bench is the benchmark behind `make bench` (cmd/lve-bench): it runs
// no-op jobs through the runner-faithful harness (internal/harness) against
// the driver's real executables and real VMs, boots the same image itself to
// measure the floor (domain start to first SSH login), and reports where a
// job's time, disk and memory go, with medians over repeated runs and the
// project's performance targets. See docs/performance.md.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"libvirt.org/go/libvirt"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm"
)

// Options configure a benchmark run.
type Options struct {
	// ConfigPath is the driver configuration the executables get (--config).
	ConfigPath string
	// BinDir holds libvirt-executor-{config,prepare,run,cleanup}.
	BinDir string
	// Images to measure; empty means the configuration's default image.
	Images []string
	// Runs is how many sequential jobs and floor boots per image (default 5).
	Runs int
	// Concurrency is how many jobs run at once in the concurrent round
	// (default 2; negative skips the round).
	Concurrency int
	// Poll is the floor's SSH (and lease) polling interval (default 50ms).
	Poll time.Duration
	// SkipWarm skips the warm round (jobs on standby VMs that
	// libvirt-executor serve keeps) after each image's cold jobs.
	SkipWarm bool
	// DirectRuns is how many jobs per image run with a copy of the
	// configuration with [ssh] connection_holder = false (every stage on
	// a connection of its own), interleaved with the cold jobs, for the
	// before/after comparison (default: Runs; negative skips them).
	DirectRuns int
	// WrapperRuns is how many jobs per image run with a copy of the
	// configuration with [guest_tools] agent = "none" (through the holder,
	// each stage a session and the stage wrapper), interleaved the same
	// way: before and after the guest agent (default: Runs; negative
	// skips them).
	WrapperRuns int
	// Progress receives one line per job and floor boot; JobLog, if set,
	// every job log. Nil discards.
	Progress, JobLog io.Writer
}

func (o *Options) defaults() {
	if o.Runs == 0 {
		o.Runs = 5
	}
	if o.Concurrency == 0 {
		o.Concurrency = 2
	}
	if o.DirectRuns == 0 {
		o.DirectRuns = o.Runs
	}
	if o.WrapperRuns == 0 {
		o.WrapperRuns = o.Runs
	}
	if o.Poll == 0 {
		o.Poll = 50 * time.Millisecond
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
}

// Validate checks the options before anything is started.
func (o Options) Validate() error {
	o.defaults()
	var errs []error
	if o.ConfigPath == "" {
		errs = append(errs, errors.New("no driver configuration given"))
	}
	if o.BinDir == "" {
		errs = append(errs, errors.New("no directory with the driver's executables given"))
	}
	if o.Runs < 1 {
		errs = append(errs, fmt.Errorf("runs = %d: want at least 1", o.Runs))
	}
	if o.DirectRuns > 50 {
		errs = append(errs, fmt.Errorf("direct runs = %d: at most 50", o.DirectRuns))
	}
	if o.WrapperRuns > 50 {
		errs = append(errs, fmt.Errorf("wrapper runs = %d: at most 50", o.WrapperRuns))
	}
	if o.Concurrency > 8 {
		errs = append(errs, fmt.Errorf("concurrency = %d: at most 8 VMs at once", o.Concurrency))
	}
	if o.Poll < time.Millisecond || o.Poll > 5*time.Second {
		errs = append(errs, fmt.Errorf("poll interval %s: want 1ms .. 5s", o.Poll))
	}
	return errors.Join(errs...)
}

// bench is one Run.
type bench struct {
	opts  Options
	cfg   *config.Config
	store state.Store
	ctrl  string
	conn  *libvirt.Connect
	hv    *libvirtvm.Conn
	exec  harness.Executables
	// timings holds each job's timings file (lifecycle.TimingsEnv).
	timings string
	// startupSum is the executables' start (Report.Startup), for the targets.
	startupSum map[string]Summary
	// direct is the direct round's set-up; nil when there is none;
	// wrapper the wrapper round's.
	direct, wrapper *directRound
}

// Run measures every image and returns the report. The error is for setup
// problems only; failed jobs and boots are in the report.
func Run(ctx context.Context, o Options) (*Report, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	o.defaults()
	cfg, err := config.Load(o.ConfigPath)
	if err != nil {
		return nil, err
	}
	images := o.Images
	if len(images) == 0 {
		images = []string{cfg.DefaultImage}
	}
	for _, name := range images {
		if _, ok := cfg.Image(name); !ok {
			return nil, fmt.Errorf("image %q is not in %s (configured: %s)", name, o.ConfigPath, strings.Join(cfg.ImageNames(), ", "))
		}
	}
	b := &bench{opts: o, cfg: cfg, store: state.Store{Dir: cfg.StateDir}}
	args := []string{"--config", o.ConfigPath}
	b.exec = harness.Executables{ConfigArgs: args, PrepareArgs: args, RunArgs: args, CleanupArgs: args}
	for _, p := range []struct {
		dst  *string
		name string
	}{{&b.exec.Config, "config"}, {&b.exec.Prepare, "prepare"}, {&b.exec.Run, "run"}, {&b.exec.Cleanup, "cleanup"}} {
		*p.dst = filepath.Join(o.BinDir, "libvirt-executor-"+p.name)
		if _, err := os.Stat(*p.dst); err != nil {
			return nil, fmt.Errorf("driver executable: %w (build them first: make build)", err)
		}
	}
	if b.ctrl, err = b.store.ControllerID(); err != nil {
		return nil, err
	}
	if b.conn, err = libvirt.NewConnect(cfg.LibvirtURI); err != nil {
		return nil, fmt.Errorf("libvirt at %s: %w", cfg.LibvirtURI, err)
	}
	defer b.conn.Close()
	if b.hv, err = libvirtvm.Connect(ctx, cfg.LibvirtURI); err != nil {
		return nil, err
	}
	defer b.hv.Close()
	if b.timings, err = os.MkdirTemp("", "lve-bench-timings-"); err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(b.timings) }()
	if left := b.leftovers(ctx); len(left) > 0 {
		b.progress("warning: leftovers of this installation before the benchmark: %s", strings.Join(left, ", "))
	}
	host, _ := os.Hostname()
	rep := &Report{Started: time.Now(), Host: host, Config: o.ConfigPath, Runs: o.Runs, Concurrency: max(o.Concurrency, 0), WarmRound: !o.SkipWarm, PollMs: ms(o.Poll),
		ConnectionHolder: cfg.SSH.HolderEnabled()}
	switch {
	case o.DirectRuns < 1:
	case !rep.ConnectionHolder:
		b.progress("warning: %s turns the connection holder off ([ssh] connection_holder = false): every job connects per stage, no direct round to compare with", o.ConfigPath)
	default:
		// The jobs' reapers read the copy after cleanup: it stays until the
		// end (each job waits for its VM to be gone).
		dir, err := os.MkdirTemp("", "lve-bench-direct-")
		if err != nil {
			return nil, err
		}
		defer func() { _ = os.RemoveAll(dir) }()
		b.direct = b.setupDirect(dir)
		if b.direct.err != nil {
			b.progress("ERROR: %s", b.direct.err)
		} else {
			rep.DirectRuns = o.DirectRuns
		}
	}
	switch {
	case o.WrapperRuns < 1:
	case !rep.ConnectionHolder || cfg.GuestTools.Agent == config.GuestToolsNone:
		b.progress("warning: %s turns the connection holder or the guest agent off: no wrapper round to compare the agent with", o.ConfigPath)
	default:
		dir, err := os.MkdirTemp("", "lve-bench-wrapper-")
		if err != nil {
			return nil, err
		}
		defer func() { _ = os.RemoveAll(dir) }()
		b.wrapper = b.setupWrapper(dir)
		if b.wrapper.err != nil {
			b.progress("ERROR: %s", b.wrapper.err)
		} else {
			rep.WrapperRuns = o.WrapperRuns
		}
	}
	rep.Startup = b.startup(ctx, 15)
	b.startupSum = rep.Startup
	for _, name := range images {
		if ctx.Err() != nil {
			break
		}
		rep.Images = append(rep.Images, b.image(ctx, name))
	}
	rep.Leftovers = b.leftovers(context.WithoutCancel(ctx))
	return rep, ctx.Err()
}

func (b *bench) progress(format string, args ...any) {
	fmt.Fprintf(b.opts.Progress, "[lve-bench] "+format+"\n", args...)
}

// image measures one image: Runs sequential jobs, each paired with a floor
// boot (alternating which goes first, so neither always meets a warmer host),
// and DirectRuns jobs of the direct round (direct.go) between them (after
// the pair in odd runs, before it in even ones), then one round of
// concurrent jobs, then the warm round (warm.go).
func (b *bench) image(ctx context.Context, name string) ImageReport {
	img, _ := b.cfg.Image(name)
	res, _ := gitlab.ChooseResources(b.cfg, img, func(string) string { return "" })
	dt, err := (&vm.Engine{HV: b.hv}).ResolveDomainType(ctx, b.cfg.DomainType)
	if err != nil {
		dt = b.cfg.DomainType
	}
	r := ImageReport{Image: name, DomainType: dt, VCPUs: res.VCPUs, MemoryMiB: res.MemoryMiB}
	fe := floorEnv{cfg: b.cfg, hv: b.hv, store: b.store, controller: b.ctrl, poll: b.opts.Poll, domainXML: b.domainXML,
		overlay: func(name string) (*uint64, error) { vi := b.volumes(name); return vi.overlay, vi.err }}
	runs := b.opts.Runs
	if d := b.direct; d != nil {
		r.Direct = &DirectRound{Config: d.config}
		if d.err != nil {
			r.Direct.Errors = append(r.Direct.Errors, d.err.Error())
		} else {
			runs = max(runs, b.opts.DirectRuns)
		}
	}
	if w := b.wrapper; w != nil {
		r.Wrapper = &DirectRound{Config: w.config}
		if w.err != nil {
			r.Wrapper.Errors = append(r.Wrapper.Errors, w.err.Error())
		} else {
			runs = max(runs, b.opts.WrapperRuns)
		}
	}
	for run := 1; run <= runs && ctx.Err() == nil; run++ {
		job := func() {
			j := b.job(ctx, name, run)
			r.Jobs = append(r.Jobs, j)
			b.progress("%s run %d/%d: %s", name, run, b.opts.Runs, describeJob(j))
		}
		floor := func() {
			load := b.hostLoad()
			f := measureFloor(ctx, fe, img)
			f.Run, f.Host = run, load
			r.Floors = append(r.Floors, f)
			b.progress("%s run %d/%d: %s", name, run, b.opts.Runs, describeFloor(f))
		}
		direct := func() {
			j := b.runJob(ctx, name, run, b.direct.mode)
			r.Direct.Jobs = append(r.Direct.Jobs, j)
			b.progress("%s run %d/%d: direct (connection per stage) %s", name, run, b.opts.DirectRuns, describeJob(j))
		}
		var seq []func()
		if run <= b.opts.Runs {
			if run%2 == 1 {
				seq = append(seq, job, floor)
			} else {
				seq = append(seq, floor, job)
			}
		}
		if b.direct != nil && b.direct.err == nil && run <= b.opts.DirectRuns {
			if run%2 == 1 {
				seq = append(seq, direct)
			} else {
				seq = append([]func(){direct}, seq...)
			}
		}
		if b.wrapper != nil && b.wrapper.err == nil && run <= b.opts.WrapperRuns {
			wrapper := func() {
				j := b.runJob(ctx, name, run, b.wrapper.mode)
				r.Wrapper.Jobs = append(r.Wrapper.Jobs, j)
				b.progress("%s run %d/%d: wrapper (holder, no agent) %s", name, run, b.opts.WrapperRuns, describeJob(j))
			}
			if run%2 == 0 {
				seq = append(seq, wrapper)
			} else {
				seq = append([]func(){wrapper}, seq...)
			}
		}
		for _, step := range seq {
			if ctx.Err() == nil {
				step()
			}
		}
	}
	if b.opts.Concurrency > 0 && ctx.Err() == nil {
		c := b.concurrent(ctx, name, b.opts.Concurrency)
		r.Concurrent = &c
		b.progress("%s: %d concurrent jobs in %s, %d failed", name, c.N, fmtMs(c.WallMs), c.Failures)
	}
	if !b.opts.SkipWarm && ctx.Err() == nil {
		w := b.warmRound(ctx, name)
		r.Warm = &w
	}
	r.FloorSpec, r.FloorSpecDiff = compareSpecs(r.Jobs, r.Floors)
	if r.FloorSpec != "same" {
		b.progress("%s: WARNING: floor domain vs prepare's: %s %s", name, r.FloorSpec, strings.Join(r.FloorSpecDiff, " "))
	}
	r.Summary = r.Summarize()
	r.Targets = append(Evaluate(r.Summary), EvaluateStartup(b.startupSum)...)
	r.Targets = append(r.Targets, EvaluateTCG(r)...)
	return r
}

func (b *bench) concurrent(ctx context.Context, image string, n int) ConcurrentSample {
	c := ConcurrentSample{N: n, Jobs: make([]JobSample, n)}
	var wg sync.WaitGroup
	t0 := time.Now()
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.Jobs[i] = b.job(ctx, image, 0)
		}()
	}
	wg.Wait()
	c.WallMs = ms(time.Since(t0))
	for _, j := range c.Jobs {
		if !j.OK {
			c.Failures++
		}
	}
	return c
}

// job runs one no-op job of the cold rounds through the harness and collects
// its figures.
func (b *bench) job(ctx context.Context, image string, run int) JobSample {
	return b.runJob(ctx, image, run, jobMode{exec: b.exec})
}

// jobMode is how a job runs: the executables (and their configuration),
// whether it belongs to the warm round, where prepare may claim a
// standby VM instead of booting the job's own, and whether to the direct
// round, whose configuration turns the connection holder off.
type jobMode struct {
	exec    harness.Executables
	warm    bool
	direct  bool
	wrapper bool
}

// runJob runs one no-op job through the harness and collects its figures.
func (b *bench) runJob(ctx context.Context, image string, run int, mode jobMode) JobSample {
	id := 100000 + rand.Int64N(900000)
	j := JobSample{Run: run, JobID: id, PeakRSS: map[string]int64{}, RusageMaxRSS: map[string]int64{}}
	machine := lifecycle.MachineName(b.cfg.NamePrefix, b.ctrl, gitlab.InstanceOf(harness.ServerURL, harness.RunnerID), id)
	var (
		wg     sync.WaitGroup
		vols   volumeInfo
		domXML string
		served = machine // the VM that serves the job (a warm job's: the standby VM it claimed)
	)
	var debug syncbuf.Buffer
	var launch, cleanupLaunch time.Time
	// The driver's own figures: prepare appends its timings record to the
	// file the runner host's environment names.
	timings := filepath.Join(b.timings, fmt.Sprintf("%d.jsonl", id))
	opts := harness.Options{
		Env:               append(os.Environ(), lifecycle.TimingsEnv+"="+timings),
		Exec:              mode.exec,
		BuildExitCodeFile: true,
		GracefulKill:      30 * time.Second,
		ForceKill:         5 * time.Second,
		RetryPause:        time.Second,
		StageTimeouts:     harness.StageTimeouts{Prepare: b.cfg.Timeouts.Boot.D() + 2*time.Minute, Cleanup: 2 * time.Minute},
		DebugLog:          &debug,
		SampleRSS:         5 * time.Millisecond,
		OnStage: func(stage string, _ int) {
			switch stage {
			case "prepare":
				launch = time.Now() // the last attempt's
			case "cleanup":
				cleanupLaunch = time.Now() // the last one's
			}
			if stage == RunStages[0] { // prepare has just succeeded
				wg.Add(1)
				go func() {
					defer wg.Done()
					vmName := machine
					if mode.warm {
						vmName = b.machineOfJob(machine)
					}
					served = vmName
					vols = b.volumes(vmName)
					domXML, _ = b.domainXML(vmName)
				}()
			}
		},
	}
	j.Host = b.hostLoad()
	t0 := time.Now()
	res, err := harness.RunJob(ctx, opts, benchJob(id, image))
	j.WallMs = ms(time.Since(t0))
	wg.Wait()
	var cleanupExit time.Time
	if err == nil {
		if c := res.Stage("cleanup"); len(c) > 0 && !cleanupLaunch.IsZero() {
			cleanupExit = cleanupLaunch.Add(c[len(c)-1].Duration)
		}
	}
	if !cleanupExit.IsZero() {
		// Cleanup left the VM to its reaper: wait until it is gone (so that
		// the next job does not meet the reaper's work, and nothing is left).
		j.Gone = waitGone(ctx, served, cleanupExit, GonePoll, GoneWithin, b.vmGone(served))
	}
	if err != nil {
		j.Error = err.Error()
		return j
	}
	if b.opts.JobLog != nil {
		fmt.Fprintf(b.opts.JobLog, "=== job %d (%s)\n%s", id, image, res.Log)
	}
	var prepareExit time.Time
	for _, s := range res.Stages {
		j.Stages = append(j.Stages, StageSample{Name: s.Name, Exec: s.Exec, WallMs: ms(s.Duration), ExitCode: s.ExitCode,
			RSSBytes: s.PeakRSSKiB << 10, RusageMaxRSS: s.MaxRSSKiB << 10})
		j.PeakRSS[s.Exec] = max(j.PeakRSS[s.Exec], s.PeakRSSKiB<<10)
		j.RusageMaxRSS[s.Exec] = max(j.RusageMaxRSS[s.Exec], s.MaxRSSKiB<<10)
		switch s.Exec {
		case "prepare":
			j.PrepareWallMs = ms(s.Duration) // the last attempt's
			prepareExit = launch.Add(s.Duration)
		case "cleanup":
			j.CleanupMs = ms(s.Duration)
		}
	}
	j.OverlayBytes, j.OverlayCapacity, j.SeedBytes = vols.overlay, vols.capacity, vols.seed
	j.domainXML = domXML
	var problems []string
	if j.Error != "" {
		problems = append(problems, j.Error)
	}
	if res.State != harness.StateSuccess {
		problems = append(problems, fmt.Sprintf("job %s: %s: %s", res.State, res.FailureReason, res.Message))
	}
	if res.PrepareAttempts > 1 {
		problems = append(problems, fmt.Sprintf("prepare needed %d attempts", res.PrepareAttempts))
	}
	if c := res.Stage("cleanup"); len(c) == 0 || c[len(c)-1].ExitCode != 0 {
		problems = append(problems, "cleanup failed: "+tail(debug.String(), 5))
	}
	var readErr error
	if mode.warm {
		readErr = j.readWarm(timings, res.Log, machine, launch, prepareExit)
	} else {
		readErr = j.readPrepare(timings, machine, launch, prepareExit)
	}
	if readErr != nil {
		problems = append(problems, readErr.Error())
	}
	noops, nerr := ParseNoops(res.Log)
	if nerr != nil {
		problems = append(problems, nerr.Error())
	}
	if missing := j.readNoops(noops); len(missing) > 0 && res.State == harness.StateSuccess {
		problems = append(problems, fmt.Sprintf("no %s line of %s in the job log", NoopMarker, strings.Join(missing, ", ")))
	}
	j.readHolder(res.Log)
	if res.State == harness.StateSuccess {
		if p := j.holderProblem(mode.direct, b.cfg.SSH.HolderEnabled()); p != "" {
			problems = append(problems, p)
		}
		if p := j.agentProblem(mode.wrapper, b.cfg.GuestTools.Agent != config.GuestToolsNone); p != "" {
			problems = append(problems, p)
		}
	}
	if j.Gone != nil && j.Gone.Error != "" {
		problems = append(problems, j.Gone.Error)
	}
	if vols.err != nil {
		problems = append(problems, vols.err.Error())
	}
	j.OK = res.State == harness.StateSuccess && res.PrepareAttempts == 1
	if len(problems) > 0 {
		j.Error = strings.Join(problems, "; ")
		if res.State != harness.StateSuccess {
			j.Error += "\n" + tail(res.Log, 15)
		}
	}
	return j
}

// readPrepare fills in the prepare stage's own figures and its timeline from
// the record it wrote for machine, launched at launch and done at exit.
func (j *JobSample) readPrepare(timings, machine string, launch, exit time.Time) error {
	rec, err := readTimings(timings, machine)
	if err != nil {
		return err
	}
	if j.Prepare, err = prepareMs(rec); err != nil {
		return err
	}
	tl, err := prepareTimeline(rec, launch, exit)
	if err != nil {
		return err
	}
	j.Timeline = toTimelineMs(tl)
	return nil
}

func describeJob(j JobSample) string {
	if !j.OK {
		return "job FAILED: " + firstLine(j.Error)
	}
	s := fmt.Sprintf("job %d: prepare %s", j.JobID, fmtMs(j.PrepareWallMs))
	switch c := j.Claim; {
	case c != nil:
		s += fmt.Sprintf(" (WARM: VM %s, claim %s)", c.VM, fmtMs(c.Claim))
	case j.Warm:
		s += " (WARM)"
	case j.ColdStart != "":
		s += " (started COLD: " + j.ColdStart + ")"
	}
	if j.BuildOverheadMs != nil {
		s += ", no-op stage overhead " + fmtMs(*j.BuildOverheadMs)
	}
	switch {
	case j.HolderStarted && j.DirectStages == 0 && j.Agent:
		s += " (holder, agent)"
	case j.HolderStarted && j.DirectStages == 0:
		s += " (holder)"
	case j.HolderStarted:
		s += fmt.Sprintf(" (holder, %d stage(s) direct)", j.DirectStages)
	default:
		s += " (direct)"
	}
	s += ", cleanup " + fmtMs(j.CleanupMs)
	if g := j.Gone; g != nil && g.Gone != nil {
		s += ", VM gone +" + fmtMs(*g.Gone)
	}
	if c := j.Claim; c != nil && c.Refill != nil {
		s += ", job " + fmtMs(j.WallMs) + ", refill " + fmtMs(*c.Refill)
	}
	s += j.Host.String()
	if j.Error != "" {
		s += " (" + firstLine(j.Error) + ")"
	}
	return s
}

func describeFloor(f FloorSample) string {
	if !f.OK {
		return "floor FAILED: " + firstLine(f.Error)
	}
	return fmt.Sprintf("floor: start -> SSH login %s (%d attempts), handshake %s, session %s",
		fmtMs(f.SSHMs), f.Attempts, fmtMs(f.HandshakeMs), fmtMs(f.ExecMs)) + f.Host.String()
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// hostLoad reads the load average and counts the running domains.
func (b *bench) hostLoad() HostLoad {
	var h HostLoad
	if data, err := os.ReadFile("/proc/loadavg"); err == nil {
		_, _ = fmt.Sscanf(string(data), "%g", &h.Load1) // 0 when unreadable
	}
	if doms, err := b.conn.ListAllDomains(libvirt.CONNECT_LIST_DOMAINS_ACTIVE); err == nil {
		h.OtherVMs = len(doms)
		for _, d := range doms {
			_ = d.Free()
		}
	}
	return h
}

// startup times `<exe> --version` n times per executable: process start,
// dynamic linking, Go runtime and CLI setup, before any work.
func (b *bench) startup(ctx context.Context, n int) map[string]Summary {
	out := map[string]Summary{}
	for _, exe := range Executables {
		path := filepath.Join(b.opts.BinDir, "libvirt-executor-"+exe)
		var v []float64
		for range n {
			t := time.Now()
			if err := exec.CommandContext(ctx, path, "--version").Run(); err != nil {
				break
			}
			v = append(v, ms(time.Since(t)))
		}
		out[exe] = Summarize(v)
	}
	return out
}

// domainXML returns the persistent definition of a domain.
func (b *bench) domainXML(name string) (string, error) {
	d, err := b.conn.LookupDomainByName(name)
	if err != nil {
		return "", err
	}
	defer d.Free()
	return d.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE)
}

// compareSpecs checks that the floor booted what prepare booted: the first
// job and floor boot that both have a definition are compared.
func compareSpecs(jobs []JobSample, floors []FloorSample) (string, []string) {
	var jx, fx string
	for _, j := range jobs {
		if j.domainXML != "" {
			jx = j.domainXML
			break
		}
	}
	for _, f := range floors {
		if f.domainXML != "" {
			fx = f.domainXML
			break
		}
	}
	if jx == "" || fx == "" {
		return "unchecked: no domain definition captured", nil
	}
	diff, err := domainDiff(jx, fx, 12)
	switch {
	case err != nil:
		return "unchecked: " + err.Error(), nil
	case len(diff) > 0:
		return "differs", diff
	}
	return "same", nil
}

// volumeInfo is a job's volumes as libvirt reports them.
type volumeInfo struct {
	overlay, capacity, seed *uint64
	err                     error
}

// volumes reads the allocation of machine's overlay and seed volumes (a
// seed-less image has none: nil, no error).
func (b *bench) volumes(machine string) volumeInfo {
	var vi volumeInfo
	pool, err := b.conn.LookupStoragePoolByName(b.cfg.StoragePool)
	if err != nil {
		vi.err = err
		return vi
	}
	defer pool.Free()
	info := func(name string) (*libvirt.StorageVolInfo, error) {
		v, err := pool.LookupStorageVolByName(name)
		if err != nil {
			return nil, err
		}
		defer v.Free()
		return v.GetInfo()
	}
	in, err := info(vm.DiskVolume(machine))
	if err != nil {
		vi.err = fmt.Errorf("overlay volume of %s: %w", machine, err)
		return vi
	}
	alloc, capa := in.Allocation, in.Capacity
	vi.overlay, vi.capacity = &alloc, &capa
	if in, err := info(vm.SeedVolume(machine)); err == nil {
		seed := in.Allocation
		vi.seed = &seed
	}
	return vi
}

// leftovers lists this installation's domains, volumes and state
// directories (every job and floor boot removes its own).
func (b *bench) leftovers(ctx context.Context) []string {
	prefix := lifecycle.MachinePrefix(b.cfg.NamePrefix, b.ctrl)
	var out []string
	if names, err := b.hv.DomainNames(ctx); err == nil {
		for _, n := range names {
			if strings.HasPrefix(n, prefix) {
				out = append(out, "domain "+n)
			}
		}
	}
	if pool, err := b.conn.LookupStoragePoolByName(b.cfg.StoragePool); err == nil {
		_ = pool.Refresh(0)
		if vols, err := pool.ListStorageVolumes(); err == nil {
			for _, v := range vols {
				if strings.HasPrefix(v, prefix) {
					out = append(out, "volume "+v)
				}
			}
		}
		_ = pool.Free()
	}
	if names, err := b.store.Names(); err == nil {
		for _, n := range names {
			if strings.HasPrefix(n, prefix) {
				out = append(out, "state "+n)
			}
		}
	}
	slices.Sort(out)
	return out
}
