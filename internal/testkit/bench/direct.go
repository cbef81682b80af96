package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// The connection holder against the path before it, in one run: the
// direct round runs the same cold jobs as the main ones, interleaved with
// them, with a copy of the configuration that sets [ssh] connection_holder
// = false, so that every run stage opens an SSH connection of its own.
// Each job of either kind runs several no-op stages (NoopStages), and
// after its cleanup the benchmark waits until its VM is really gone, which
// the detached reaper finishes after cleanup has returned (GoneMs).

// benchJob is the benchmark's no-op job: each of NoopStages runs the no-op
// (build_script as the job's script, after_script, and the rest as extra
// stages after it, as the runner runs its own after a successful script).
func benchJob(id int64, image string) harness.Job {
	j := harness.Job{ID: id, Image: image}
	for _, st := range NoopStages {
		cmds := []string{NoopCommandIn(st)}
		switch st {
		case "build_script":
			j.Script = cmds
		case "after_script":
			j.AfterScript = cmds
		default:
			j.ExtraStages = append(j.ExtraStages, harness.ExtraStage{Name: st, Commands: cmds})
		}
	}
	return j
}

// readNoops fills in the no-op stages' own guest time and run overhead from
// the marker lines of the job log (a line without a stage name is
// build_script's) and returns the no-op stages without both.
func (j *JobSample) readNoops(noops []Noop) (missing []string) {
	guest := map[string]float64{}
	for _, n := range noops {
		st := n.Stage
		if st == "" {
			st = "build_script"
		}
		if _, dup := guest[st]; !dup {
			guest[st] = ms(n.Guest)
		}
	}
	over := map[string]float64{}
	for _, st := range j.Stages {
		if g, ok := guest[st.Name]; ok && st.Exec == "run" {
			over[st.Name] = st.WallMs - g
		}
	}
	if len(guest) > 0 {
		j.StageGuestMs = guest
	}
	if len(over) > 0 {
		j.StageOverheadMs = over
	}
	if g, ok := guest["build_script"]; ok {
		j.BuildGuestMs = &g
	}
	if o, ok := over["build_script"]; ok {
		j.BuildOverheadMs = &o
	}
	for _, st := range NoopStages {
		if _, ok := over[st]; !ok {
			missing = append(missing, st)
		}
	}
	return missing
}

// What the driver says in the job log about the connection holder
// (internal/jobvm: startHolder in prepare, Session.Run in run).
var (
	holderStartedLine = regexp.MustCompile(`Connection holder (started in |of the standby VM kept)`)
	directStageLine   = regexp.MustCompile(`this stage connects directly`)
	agentLine         = regexp.MustCompile(`the stages run through the guest agent`)
)

// readHolder reads from a job log whether prepare started the connection
// holder and how many stages connected directly all the same.
func (j *JobSample) readHolder(log string) {
	j.HolderStarted = holderStartedLine.MatchString(log)
	j.DirectStages = len(directStageLine.FindAllStringIndex(log, -1))
	j.Agent = agentLine.MatchString(log)
}

// agentProblem is what is wrong with how a succeeded job of the holder
// path ran its stages: one of the wrapper round (wrapper) must not have
// used the guest agent; one of the other rounds must have, when the
// configuration gives the guests one (agentOn).
func (j *JobSample) agentProblem(wrapper, agentOn bool) string {
	switch {
	case !j.HolderStarted:
		return ""
	case wrapper && j.Agent:
		return "the wrapper round's job ran its stages through the guest agent ([guest_tools] agent = \"none\" did not take)"
	case !wrapper && agentOn && !j.Agent:
		return "the job's stages ran through the wrapper although the configuration gives the guests the agent (its log says why)"
	}
	return ""
}

// holderProblem is what is wrong with how a succeeded job reached its
// guest: a job of the direct round (direct) must not have started a
// holder; one of the holder path (holder: the configuration keeps the
// holder on) must have, and must have run every stage through it.
func (j *JobSample) holderProblem(direct, holder bool) string {
	switch {
	case direct && j.HolderStarted:
		return "the direct round's job started a connection holder ([ssh] connection_holder = false did not take)"
	case direct || !holder:
		return ""
	case !j.HolderStarted:
		return "prepare started no connection holder: the job's stages connected one by one"
	case j.DirectStages > 0:
		return fmt.Sprintf("%d stage(s) connected directly although the connection holder was started", j.DirectStages)
	}
	return ""
}

// SummarizePath summarizes jobs of one path stage by stage (PathSummary).
func SummarizePath(jobs []JobSample) PathSummary {
	p := PathSummary{Jobs: len(jobs), StageWall: map[string]Summary{}}
	var ok []*JobSample
	for i := range jobs {
		j := &jobs[i]
		if !j.OK {
			p.Failures++
			continue
		}
		ok = append(ok, j)
		if j.HolderStarted {
			p.HolderStarted++
		}
		if j.Agent {
			p.Agent++
		}
		p.DirectStages += j.DirectStages
	}
	col := func(f func(j *JobSample) float64) Summary {
		v := make([]float64, 0, len(ok))
		for _, j := range ok {
			v = append(v, f(j))
		}
		return Summarize(v)
	}
	p.ConfigWall = col(stageWallOf("config"))
	p.PrepareWall = col(func(j *JobSample) float64 { return j.PrepareWallMs })
	for _, name := range RunStages {
		p.StageWall[name] = col(stageWallOf(name))
	}
	p.RunStageWall = col(func(j *JobSample) float64 {
		if s := Summarize(runWalls(j)); s.Known() {
			return s.Median
		}
		return math.NaN()
	})
	p.RunStagesTotal = col(func(j *JobSample) float64 {
		w := runWalls(j)
		if len(w) == 0 {
			return math.NaN()
		}
		var sum float64
		for _, v := range w {
			sum += v
		}
		return sum
	})
	p.Overhead = col(func(j *JobSample) float64 { return orNaN(j.BuildOverheadMs) })
	var all []float64
	for _, j := range ok {
		if len(j.StageOverheadMs) == 0 && j.BuildOverheadMs != nil { // a sample of before the several no-op stages
			all = append(all, *j.BuildOverheadMs)
			continue
		}
		for _, name := range NoopStages {
			if v, found := j.StageOverheadMs[name]; found {
				all = append(all, v)
			}
		}
	}
	p.OverheadAll = Summarize(all)
	p.Cleanup = col(func(j *JobSample) float64 { return j.CleanupMs })
	p.VMGone = col(goneOf)
	p.JobWall = col(func(j *JobSample) float64 { return j.WallMs })
	p.AfterPrepare = col(func(j *JobSample) float64 {
		before, n := 0.0, 0
		for _, st := range j.Stages {
			if st.Exec == "config" || st.Exec == "prepare" {
				before += st.WallMs
				n++
			}
		}
		if n == 0 || j.WallMs <= 0 {
			return math.NaN()
		}
		return j.WallMs - before
	})
	return p
}

// stageWallOf reads a job's wall time of the stage named name (its last
// invocation), NaN if it did not run.
func stageWallOf(name string) func(j *JobSample) float64 {
	return func(j *JobSample) float64 {
		for i := len(j.Stages) - 1; i >= 0; i-- {
			if j.Stages[i].Name == name {
				return j.Stages[i].WallMs
			}
		}
		return math.NaN()
	}
}

// runWalls is the wall time of each of a job's run stages.
func runWalls(j *JobSample) []float64 {
	var v []float64
	for _, st := range j.Stages {
		if st.Exec == "run" {
			v = append(v, st.WallMs)
		}
	}
	return v
}

// goneOf is a job's cleanup -> VM gone, NaN if not seen.
func goneOf(j *JobSample) float64 {
	if j.Gone == nil {
		return math.NaN()
	}
	return orNaN(j.Gone.Gone)
}

// How the benchmark waits for a job's VM to be gone after cleanup.
const (
	GonePoll   = 20 * time.Millisecond
	GoneWithin = 60 * time.Second
)

// goneCheck looks once whether the VM's domain and its state directory are
// gone; err is a failure to tell (the look is repeated).
type goneCheck func(ctx context.Context) (domainGone, dirGone bool, err error)

// waitGone polls check every `every`, from now until both are gone or
// `within` after from (the cleanup stage's end) has passed, and returns when
// each was first seen gone, in ms after from (never negative: a VM gone
// before the first look counts as gone at that look).
func waitGone(ctx context.Context, name string, from time.Time, every, within time.Duration, check goneCheck) *GoneMs {
	g := &GoneMs{VM: name}
	deadline := from.Add(within)
	t := time.NewTicker(every)
	defer t.Stop()
	var lastErr error
	for {
		domain, dir, err := check(ctx)
		at := max(0, ms(time.Since(from)))
		g.Polls++
		if err != nil {
			lastErr = err
		}
		if domain && g.Domain == nil {
			g.Domain = &at
		}
		if dir && g.StateDir == nil {
			g.StateDir = &at
		}
		if g.Domain != nil && g.StateDir != nil {
			both := max(*g.Domain, *g.StateDir)
			g.Gone = &both
			return g
		}
		if !time.Now().Before(deadline) || ctx.Err() != nil {
			var left []string
			if g.Domain == nil {
				left = append(left, "its domain is still defined")
			}
			if g.StateDir == nil {
				left = append(left, "its state directory is still there")
			}
			why := fmt.Sprintf("%s after cleanup", within)
			if ctx.Err() != nil {
				why = "when the benchmark was stopped"
			}
			g.Error = fmt.Sprintf("VM %s not gone %s: %s", name, why, strings.Join(left, ", "))
			if lastErr != nil {
				g.Error += " (last look: " + lastErr.Error() + ")"
			}
			return g
		}
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
}

// vmGone is the goneCheck of machine name: libvirt does not know the
// domain, and its state directory does not exist.
func (b *bench) vmGone(name string) goneCheck {
	dir := b.store.MachineDir(name)
	return func(ctx context.Context) (bool, bool, error) {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := b.hv.State(cctx, name)
		domain := errors.Is(err, vm.ErrNotFound)
		if domain {
			err = nil
		}
		_, serr := os.Stat(dir)
		gone := errors.Is(serr, os.ErrNotExist)
		if !gone && serr != nil {
			err = errors.Join(err, serr)
		}
		return domain, gone, err
	}
}

var (
	sshTable   = regexp.MustCompile(`^[ \t]*\[[ \t]*"?ssh"?[ \t]*\][ \t]*(#.*)?$`)
	anyTable   = regexp.MustCompile(`^[ \t]*\[`)
	holderKey  = regexp.MustCompile(`^[ \t]*"?connection_holder"?[ \t]*=`)
	toolsTable = regexp.MustCompile(`^[ \t]*\[[ \t]*"?guest_tools"?[ \t]*\][ \t]*(#.*)?$`)
	agentKey   = regexp.MustCompile(`^[ \t]*"?agent"?[ \t]*=`)
)

// WithoutHolder is configuration text with [ssh] connection_holder = false:
// the key's value replaced if the [ssh] table has it, the key added to the
// table if it has not, the table added if there is none.
func WithoutHolder(text string) string {
	return withKey(text, "ssh", sshTable, holderKey, "connection_holder = false")
}

// WithoutAgent is configuration text with [guest_tools] agent = "none",
// as WithoutHolder.
func WithoutAgent(text string) string {
	return withKey(text, "guest_tools", toolsTable, agentKey, `agent = "none"`)
}

// withKey sets line in the table that tableRe finds (named name when it
// is added), in place of the key keyRe finds.
func withKey(text, name string, tableRe, keyRe *regexp.Regexp, line string) string {
	lines := strings.Split(text, "\n")
	in, header := false, -1
	for i, l := range lines {
		switch {
		case tableRe.MatchString(l):
			in, header = true, i
		case anyTable.MatchString(l):
			in = false
		case in && keyRe.MatchString(l):
			lines[i] = line
			return strings.Join(lines, "\n")
		}
	}
	if header >= 0 {
		lines = append(lines[:header+1], append([]string{line}, lines[header+1:]...)...)
		return strings.Join(lines, "\n")
	}
	return text + "\n[" + name + "]\n" + line + "\n"
}

// directRound is the direct round's set-up for every image: the
// configuration copy and the executables that get it.
type directRound struct {
	config string
	mode   jobMode
	err    error
}

// setupDirect writes the direct round's configuration copy into dir (which
// the caller removes after the benchmark: the reapers of the round's jobs
// read it) and checks that it loads and turns the holder off.
func (b *bench) setupDirect(dir string) *directRound {
	return b.setupRound(dir, "direct", "[ssh] connection_holder = false", WithoutHolder, func(cfg *config.Config) bool { return !cfg.SSH.HolderEnabled() },
		jobMode{exec: b.exec, direct: true})
}

// setupWrapper is setupDirect for the wrapper round: [guest_tools] agent =
// "none", the holder on.
func (b *bench) setupWrapper(dir string) *directRound {
	return b.setupRound(dir, "wrapper", `[guest_tools] agent = "none"`, WithoutAgent, func(cfg *config.Config) bool {
		return cfg.GuestTools.Agent == config.GuestToolsNone && cfg.SSH.HolderEnabled()
	}, jobMode{exec: b.exec, wrapper: true})
}

// setupRound writes a round's configuration copy (edit of the
// benchmark's, named by what) into dir and checks that it loads and
// does what it should (took).
func (b *bench) setupRound(dir, name, what string, edit func(string) string, took func(*config.Config) bool, mode jobMode) *directRound {
	d := &directRound{config: filepath.Join(dir, "config-"+name+".toml")}
	text, err := os.ReadFile(b.opts.ConfigPath)
	if err == nil {
		err = os.WriteFile(d.config, []byte(edit(string(text))), 0o600)
	}
	if err == nil {
		var cfg *config.Config
		if cfg, err = config.Load(d.config); err == nil && !took(cfg) {
			err = errors.New("it did not take")
		}
	}
	if err != nil {
		d.err = fmt.Errorf("the %s round's configuration (a copy with %s): %w", name, what, err)
		return d
	}
	d.mode = mode
	args := []string{"--config", d.config}
	d.mode.exec.ConfigArgs, d.mode.exec.PrepareArgs, d.mode.exec.RunArgs, d.mode.exec.CleanupArgs = args, args, args, args
	return d
}
