package bench

import (
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
)

// WriteTable prints the report for people: per image, medians with their
// min-max range and sample count, then the targets with PASS/MISS.
func (r *Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "lve-bench %s on %s, config %s\n", r.Started.Format("2006-01-02 15:04:05Z07:00"), r.Host, r.Config)
	warm := "no warm round"
	if r.WarmRound {
		warm = "then a warm round (standby pool of 1 idle VM)"
	}
	fmt.Fprintf(tw, "%d run(s) per image, floor polled every %s, %d concurrent job(s), %s\n", r.Runs, fmtMs(r.PollMs), r.Concurrency, warm)
	switch {
	case !r.ConnectionHolder:
		fmt.Fprintf(tw, "stages: a connection per stage ([ssh] connection_holder = false in the configuration), no direct round\n")
	case r.DirectRuns > 0:
		fmt.Fprintf(tw, "stages: through the connection holder; plus %d direct job(s) per image ([ssh] connection_holder = false), interleaved\n", r.DirectRuns)
	default:
		fmt.Fprintf(tw, "stages: through the connection holder; no direct round\n")
	}
	if r.WrapperRuns > 0 {
		fmt.Fprintf(tw, "plus %d wrapper job(s) per image ([guest_tools] agent = \"none\": through the holder, each stage a session and the stage wrapper), interleaved\n", r.WrapperRuns)
	}
	if len(r.Startup) > 0 {
		fmt.Fprintf(tw, "\nexecutable start on the host (--version)\tmedian\tmin - max\tn\n")
		for _, exe := range Executables {
			if sum, ok := r.Startup[exe]; ok && sum.Known() {
				fmt.Fprintf(tw, "  libvirt-executor-%s\t%s\t%s - %s\t%d\n", exe, fmtMs(sum.Median), fmtMs(sum.Min), fmtMs(sum.Max), sum.N)
			}
		}
	}
	for i := range r.Images {
		writeImage(tw, &r.Images[i])
	}
	if len(r.Leftovers) > 0 {
		fmt.Fprintf(tw, "\nLEFTOVERS after the benchmark: %s\n", strings.Join(r.Leftovers, ", "))
	}
	return tw.Flush()
}

func writeImage(tw io.Writer, img *ImageReport) {
	s := img.Summary
	fmt.Fprintf(tw, "\n== image %s (%s, %d vCPU, %d MiB): %d job(s), %d failed; %d floor boot(s), %d failed\n",
		img.Image, img.DomainType, img.VCPUs, img.MemoryMiB, len(img.Jobs), s.JobFailures, len(img.Floors), s.FloorFailures)
	if img.FloorSpec != "same" {
		fmt.Fprintf(tw, "WARNING: the floor's domain definition vs prepare's: %s\n", img.FloorSpec)
		for _, l := range img.FloorSpecDiff {
			fmt.Fprintf(tw, "  %s\n", l)
		}
	}
	fmt.Fprintf(tw, "figure\tmedian\tmin - max\tn\n")
	row := func(label string, sum Summary, f func(float64) string) {
		if !sum.Known() {
			fmt.Fprintf(tw, "%s\t-\t-\t0\n", label)
			return
		}
		fmt.Fprintf(tw, "%s\t%s\t%s - %s\t%d\n", label, f(sum.Median), f(sum.Min), f(sum.Max), sum.N)
	}
	fmt.Fprintf(tw, "prepare: the driver's figures (its timings record)\t\t\t\n")
	row("  clone disk", s.Clone, fmtMs)
	row("  seed volume (create+upload)", s.Seed, fmtMs)
	row("  DHCP host entry (a spare taken over)", s.Entry, fmtMs)
	row("  define+start", s.DefineStart, fmtMs)
	row("  created (clone..start)", s.Created, fmtMs)
	row("  address found (after start)", s.Address, fmtMs)
	row("  SSH ready (after address)", s.SSH, fmtMs)
	row("  machine ready (total inside)", s.Ready, fmtMs)
	fmt.Fprintf(tw, "prepare: timeline (moments in that record)\t\t\t\n")
	row("  exec, config, job (to first line)", s.TLLaunch, fmtMs)
	row("  leftovers..clone, define, start", s.TLToStart, fmtMs)
	row("  domain started -> address", s.TLToAddr, fmtMs)
	row("  address -> SSH login", s.TLToSSH, fmtMs)
	row("  SSH login -> exit (tool check, record)", s.TLAfterSSH, fmtMs)
	row("  start call -> SSH login (cf. floor)", s.TLStartToSSH, fmtMs)
	row("  prepare wall (runner's view)", s.PrepareWall, fmtMs)
	fmt.Fprintf(tw, "floor (benchmark's own boot)\t\t\t\n")
	row("  start call", s.FloorStartCall, fmtMs)
	row("  DHCP host entry added (before spares; not in the floor)", s.FloorEntry, fmtMs)
	row("  start -> address", s.FloorAddress, fmtMs)
	row("  start -> first SSH login = FLOOR", s.Floor, fmtMs)
	row("PREPARE / FLOOR (paired)", s.Ratio, fmtRatio)
	row("prepare / its own VM's start->SSH", s.OwnBootRatio, fmtRatio)
	row("prepare outside its VM's boot", s.OutsideBoot, fmtMs)
	fmt.Fprintf(tw, "run stages (run_exec wall)\t\t\t\n")
	for _, name := range RunStages {
		row("  "+name, s.StageWall[name], fmtMs)
	}
	row("  run stage wall (median of a job's stages)", s.HolderPath.RunStageWall, fmtMs)
	row("  no-op's own time in guest", s.BuildGuest, fmtMs)
	row("  overhead per stage (build_script)", s.Overhead, fmtMs)
	row(fmt.Sprintf("  overhead per stage (all %d no-op stages)", len(NoopStages)), s.OverheadAll, fmtMs)
	row("  of which: SSH connect+handshake+login", s.Handshake, fmtMs)
	row("  of which: one session exec (one per stage)", s.Exec, fmtMs)
	row("  the stage wrapper, script `exit 0` by sh (session included)", s.WrapperSh, fmtMs)
	row("  the stage wrapper, script `exit 0` by bash (session included)", s.WrapperBash, fmtMs)
	row("  the guest agent, script `exit 0` by sh", s.AgentSh, fmtMs)
	row("  the guest agent, script `exit 0` by bash", s.AgentBash, fmtMs)
	row("cleanup wall", s.Cleanup, fmtMs)
	row("  cleanup -> VM gone (domain, state dir)", s.VMGone, fmtMs)
	row("  floor VM: destroy call", s.FloorDestroy, fmtMs)
	row("  floor VM: destroy+undefine+volumes", s.FloorRemove, fmtMs)
	row("job wall (config..cleanup)", s.JobWall, fmtMs)
	fmt.Fprintf(tw, "allocated at start\t\t\t\n")
	row("  overlay", s.Overlay, fmtBytes)
	row("  overlay at creation (floor VM)", s.FloorOverlayAtCreate, fmtBytes)
	row("  seed volume", s.SeedVol, fmtBytes)
	fmt.Fprintf(tw, "peak RSS\t\t\t\n")
	for _, exe := range Executables {
		row("  libvirt-executor-"+exe, s.PeakRSS[exe], fmtBytes)
	}
	if c := img.Concurrent; c != nil {
		seq := "-"
		if s.JobWall.Known() {
			seq = fmtMs(s.JobWall.Median * float64(c.N))
		}
		fmt.Fprintf(tw, "concurrent: %d jobs at once\t%s\t(sequential: %s)\t%d failed\n", c.N, fmtMs(c.WallMs), seq, c.Failures)
	}
	if s.DirectPath != nil {
		writePaths(tw, *s.DirectPath, s.HolderPath)
	}
	if s.WrapperPath != nil {
		writeAgentPaths(tw, *s.WrapperPath, s.HolderPath)
	}
	if img.Warm != nil && s.Warm != nil {
		writeWarm(tw, img.Warm, s, row)
	}
	fmt.Fprintf(tw, "target\tlimit\tvalue\tverdict\n")
	for _, t := range img.Targets {
		val := "-"
		if t.Known {
			val = fmtUnit(t.Unit, t.Value) + " (" + t.Stat + ")"
		}
		fmt.Fprintf(tw, "%s\t%s %s\t%s\t%s\n", t.Name, t.Op(), fmtUnit(t.Unit, t.Limit), val, t.Verdict())
	}
	if img.Direct != nil {
		writeDirectNotes(tw, img.Direct)
	}
	if img.Wrapper != nil {
		writeRoundNotes(tw, "wrapper", img.Wrapper)
	}
	if img.Warm != nil {
		writeWarmNotes(tw, img.Warm)
	}
}

// writePaths prints the direct round's jobs (a connection per stage, the
// path before the connection holder) beside the holder jobs of the same
// run, stage by stage: medians [min - max], and the holder's change.
func writePaths(tw io.Writer, direct, holder PathSummary) {
	fmt.Fprintf(tw, "direct vs connection holder (same run)\tdirect (old)\tholder (new)\tholder - direct\n")
	writePathRows(tw, direct, holder)
}

// writeAgentPaths prints the wrapper round's jobs (through the holder,
// each stage a session and the stage wrapper: the path before the guest
// agent) beside the jobs of the same run, which used the agent.
func writeAgentPaths(tw io.Writer, wrapper, agent PathSummary) {
	fmt.Fprintf(tw, "wrapper vs guest agent (same run)\twrapper (old)\tagent (new)\tagent - wrapper\n")
	writePathRows(tw, wrapper, agent)
}

func writePathRows(tw io.Writer, direct, holder PathSummary) {
	fmt.Fprintf(tw, "  jobs: succeeded (failed)\t%d (%d)\t%d (%d)\t\n", direct.Jobs-direct.Failures, direct.Failures, holder.Jobs-holder.Failures, holder.Failures)
	fmt.Fprintf(tw, "  holder started / stages connected directly\t%d / %d\t%d / %d\t\n", direct.HolderStarted, direct.DirectStages, holder.HolderStarted, holder.DirectStages)
	fmt.Fprintf(tw, "  jobs whose stages ran through the guest agent\t%d\t%d\t\n", direct.Agent, holder.Agent)
	row := func(label string, d, h Summary) {
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", label, fmtCell(d), fmtCell(h), fmtDelta(d, h))
	}
	row("config wall", direct.ConfigWall, holder.ConfigWall)
	row("prepare wall", direct.PrepareWall, holder.PrepareWall)
	for _, name := range RunStages {
		row(name, direct.StageWall[name], holder.StageWall[name])
	}
	row("run stage wall (median of a job's stages)", direct.RunStageWall, holder.RunStageWall)
	row("run stages together", direct.RunStagesTotal, holder.RunStagesTotal)
	row("overhead per stage (build_script)", direct.Overhead, holder.Overhead)
	row(fmt.Sprintf("overhead per stage (all %d no-op stages)", len(NoopStages)), direct.OverheadAll, holder.OverheadAll)
	row("cleanup wall", direct.Cleanup, holder.Cleanup)
	row("cleanup -> VM gone", direct.VMGone, holder.VMGone)
	row("job wall (config..cleanup)", direct.JobWall, holder.JobWall)
	row("job wall without config, prepare", direct.AfterPrepare, holder.AfterPrepare)
}

// fmtCell is a time's median [min - max], or "-" if not measured.
func fmtCell(s Summary) string {
	if !s.Known() {
		return "-"
	}
	if s.N == 1 {
		return fmtMs(s.Median)
	}
	return fmt.Sprintf("%s [%s - %s]", fmtMs(s.Median), fmtMs(s.Min), fmtMs(s.Max))
}

// fmtDelta is h's median minus d's, signed, or "-".
func fmtDelta(d, h Summary) string {
	if !d.Known() || !h.Known() {
		return "-"
	}
	v := h.Median - d.Median
	sign := "+"
	switch {
	case v < 0:
		sign = "-"
	case v == 0:
		sign = ""
	}
	return sign + fmtMs(math.Abs(v))
}

// writeDirectNotes lists the direct round's own errors and its jobs that
// failed or did not run as they should (after the targets).
func writeDirectNotes(tw io.Writer, d *DirectRound) { writeRoundNotes(tw, "direct", d) }

// writeRoundNotes lists a comparison round's own errors and its jobs that
// failed or did not run as they should.
func writeRoundNotes(tw io.Writer, name string, d *DirectRound) {
	for _, e := range d.Errors {
		fmt.Fprintf(tw, "%s ROUND ERROR: %s\n", strings.ToUpper(name), firstLine(e))
	}
	for _, j := range d.Jobs {
		switch {
		case !j.OK:
			fmt.Fprintf(tw, "%s run %d FAILED: %s\n", name, j.Run, firstLine(j.Error))
		case j.Error != "":
			fmt.Fprintf(tw, "%s run %d: %s\n", name, j.Run, firstLine(j.Error))
		}
	}
}

// writeWarm prints the warm round next to the cold jobs' figures: only the
// jobs that started warm are in the warm figures (writeWarmNotes lists the
// others).
func writeWarm(tw io.Writer, w *WarmRound, s ImageSummary, row func(string, Summary, func(float64) string)) {
	ws := s.Warm
	fmt.Fprintf(tw, "warm round: %d job(s)\t%d warm\t%d started cold\t%d failed\n", ws.Jobs, ws.WarmStarts, ws.ColdStarts, ws.Failures)
	first := "-"
	if w.FirstIdleMs > 0 {
		first = fmtMs(w.FirstIdleMs)
	}
	fmt.Fprintf(tw, "  service start -> first standby VM idle\t%s\t\t\n", first)
	row("  warm prepare wall (runner's view)", ws.PrepareWall, fmtMs)
	row("    claim (driver's record)", ws.Claim, fmtMs)
	row("    first line -> machine ready (record)", ws.Ready, fmtMs)
	row("  cold prepare wall (runner's view)", s.PrepareWall, fmtMs)
	if ws.ColdWarm != nil {
		fmt.Fprintf(tw, "COLD / WARM prepare (medians)\t%s\t%s / %s\t\n", fmtRatio(*ws.ColdWarm), fmtMs(s.PrepareWall.Median), fmtMs(ws.PrepareWall.Median))
	} else {
		fmt.Fprintf(tw, "COLD / WARM prepare (medians)\t-\t-\t\n")
	}
	row("  warm job wall (config..cleanup)", ws.JobWall, fmtMs)
	row("  cold job wall (config..cleanup)", s.JobWall, fmtMs)
	row("  warm overhead per stage (build_script)", ws.Overhead, fmtMs)
	row("  warm cleanup wall", ws.Cleanup, fmtMs)
	row("  warm cleanup -> VM gone", ws.VMGone, fmtMs)
	row("  warm peak RSS libvirt-executor-prepare", ws.PeakRSS["prepare"], fmtBytes)
	row("refill: claim -> replacement's boot began", ws.Refill, fmtMs)
}

// writeWarmNotes lists the warm round's own errors and its jobs that failed
// or started cold (after the targets: long lines would widen the columns).
func writeWarmNotes(tw io.Writer, w *WarmRound) {
	for _, e := range w.Errors {
		fmt.Fprintf(tw, "WARM ROUND ERROR: %s\n", firstLine(e))
	}
	for _, j := range w.Jobs {
		switch {
		case !j.OK:
			fmt.Fprintf(tw, "warm run %d FAILED: %s\n", j.Run, firstLine(j.Error))
		case !j.Warm:
			why := j.ColdStart
			if why == "" {
				why = "how it started is unknown: " + j.Error
			}
			fmt.Fprintf(tw, "warm run %d started COLD (left out of the warm figures): %s\n", j.Run, firstLine(why))
		}
	}
}

func fmtUnit(unit string, v float64) string {
	switch unit {
	case unitRatio:
		return fmtRatio(v)
	case unitBytes:
		return fmtBytes(v)
	default:
		return fmtMs(v)
	}
}

func fmtMs(v float64) string {
	switch {
	case v < 10:
		return fmt.Sprintf("%.1f ms", v)
	case v < 1000:
		return fmt.Sprintf("%.0f ms", v)
	default:
		return fmt.Sprintf("%.2f s", v/1000)
	}
}

func fmtRatio(v float64) string { return fmt.Sprintf("%.3f", v) }

func fmtBytes(v float64) string {
	switch {
	case v < 1<<10:
		return fmt.Sprintf("%.0f B", v)
	case v < 1<<20:
		return fmt.Sprintf("%.0f KiB", v/(1<<10))
	default:
		return fmt.Sprintf("%.1f MiB", v/(1<<20))
	}
}
