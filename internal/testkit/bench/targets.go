package bench

// Target is one performance goal compared with a measured figure. Targets
// are printed, never asserted: these machines are too noisy (and run guests
// under TCG) for a hard limit.
type Target struct {
	Name  string  `json:"name"`
	Stat  string  `json:"stat"` // which statistic is compared: "median", "max", or "medians" (a ratio of two)
	Limit float64 `json:"limit"`
	Unit  string  `json:"unit"` // "ratio", "ms" or "bytes"
	Value float64 `json:"value"`
	Known bool    `json:"known"` // false: not measured (every sample failed)
	Pass  bool    `json:"pass"`
	// AtLeast: the value must reach the limit (value >= limit) rather than
	// stay within it (value <= limit).
	AtLeast bool `json:"at_least,omitempty"`
}

// Op is the comparison the target asks for: "<=" or ">=".
func (t Target) Op() string {
	if t.AtLeast {
		return ">="
	}
	return "<="
}

// Verdict is PASS, MISS, or N/A for a figure that was not measured.
func (t Target) Verdict() string {
	switch {
	case !t.Known:
		return "N/A"
	case t.Pass:
		return "PASS"
	default:
		return "MISS"
	}
}

// The goals. Times are compared on the median (robust to one slow run),
// sizes on the maximum (a size is a budget: the worst job must fit).
const (
	TargetRatio       = 1.03     // prepare wall <= 1.03 x the floor
	TargetOverheadMs  = 20.0     // run_exec overhead per stage
	TargetCleanupMs   = 300.0    // cleanup wall
	TargetOverlay     = 1 << 20  // overlay bytes allocated at start
	TargetPeakRSS     = 30 << 20 // each executable's peak RSS
	statMedian        = "median"
	statMax           = "max"
	unitRatio, unitMs = "ratio", "ms"
	unitBytes         = "bytes"
)

// TargetStartupMs is the goal for the start of the executables that every
// run stage and every job starts (config, run): `--version`, median.
const TargetStartupMs = 5.0

// StartupTargets are the executables TargetStartupMs applies to.
var StartupTargets = []string{"config", "run"}

// The warm start's goals (standby pool): a claimed VM's prepare, how much
// faster that is than a cold one, and how soon the pool starts replacing
// the claimed VM.
const (
	TargetWarmPrepareMs = 500.0  // warm prepare wall
	TargetColdWarm      = 10.0   // cold prepare / warm prepare (medians), at least
	TargetRefillMs      = 1000.0 // claim -> the replacement's boot starts
	statMedians         = "medians"
)

func compare(name, stat, unit string, limit float64, s Summary) Target {
	t := Target{Name: name, Stat: stat, Limit: limit, Unit: unit, Known: s.Known()}
	if !t.Known {
		return t
	}
	t.Value = s.Median
	if stat == statMax {
		t.Value = s.Max
	}
	t.Pass = t.Value <= limit
	return t
}

// Evaluate compares an image's summary with the targets.
func Evaluate(s ImageSummary) []Target {
	out := []Target{
		compare("prepare / floor", statMedian, unitRatio, TargetRatio, s.Ratio),
		compare("run overhead per stage (no-op)", statMedian, unitMs, TargetOverheadMs, s.Overhead),
		compare("cleanup", statMedian, unitMs, TargetCleanupMs, s.Cleanup),
		compare("overlay allocated at start", statMax, unitBytes, TargetOverlay, s.Overlay),
	}
	for _, exe := range Executables {
		out = append(out, compare("peak RSS libvirt-executor-"+exe, statMax, unitBytes, TargetPeakRSS, s.PeakRSS[exe]))
	}
	if w := s.Warm; w != nil {
		ratio := Target{Name: "cold / warm prepare", Stat: statMedians, Limit: TargetColdWarm, Unit: unitRatio, AtLeast: true}
		if w.ColdWarm != nil {
			ratio.Known, ratio.Value = true, *w.ColdWarm
			ratio.Pass = ratio.Value >= ratio.Limit
		}
		out = append(out,
			compare("warm prepare (standby VM)", statMedian, unitMs, TargetWarmPrepareMs, w.PrepareWall),
			ratio,
			compare("refill (claim -> replacement boot)", statMedian, unitMs, TargetRefillMs, w.Refill))
	}
	return out
}

// The guest agent's goals under TCG (#27): a no-op stage's overhead
// (all no-op stages of a job) on the tiny guest and on the others (Debian
// and cloud, whose sshd and login are heavier), and a whole warm no-op job
// on the tiny guest, in the harness.
const (
	TargetTCGStageTinyMs  = 100.0
	TargetTCGStageOtherMs = 250.0
	TargetTCGWarmJobMs    = 1500.0
	tinyImage             = "tiny"
	tcgDomainType         = "qemu"
)

// EvaluateTCG compares an image's figures with the goals under TCG (none
// for a KVM run: there the 20 ms goal of Evaluate applies).
func EvaluateTCG(r ImageReport) []Target {
	if r.DomainType != tcgDomainType {
		return nil
	}
	limit := TargetTCGStageOtherMs
	if r.Image == tinyImage {
		limit = TargetTCGStageTinyMs
	}
	out := []Target{compare("run overhead per stage, all no-op stages (TCG goal)", statMedian, unitMs, limit, r.Summary.OverheadAll)}
	if w := r.Summary.Warm; w != nil && r.Image == tinyImage {
		out = append(out, compare("warm no-op job wall, tiny (TCG goal)", statMedian, unitMs, TargetTCGWarmJobMs, w.JobWall))
	}
	return out
}

// EvaluateStartup compares the executables' start on the host (the
// benchmark's `--version` figures, Report.Startup) with TargetStartupMs.
func EvaluateStartup(startup map[string]Summary) []Target {
	out := make([]Target, 0, len(StartupTargets))
	for _, exe := range StartupTargets {
		out = append(out, compare("executable start libvirt-executor-"+exe+" (--version)", statMedian, unitMs, TargetStartupMs, startup[exe]))
	}
	return out
}
