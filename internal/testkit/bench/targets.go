package bench

// Target is one performance goal compared with a measured figure. Targets
// are printed, never asserted: these machines are too noisy (and run guests
// under TCG) for a hard limit.
type Target struct {
	Name  string  `json:"name"`
	Stat  string  `json:"stat"` // which statistic is compared: "median" or "max"
	Limit float64 `json:"limit"`
	Unit  string  `json:"unit"` // "ratio", "ms" or "bytes"
	Value float64 `json:"value"`
	Known bool    `json:"known"` // false: not measured (every sample failed)
	Pass  bool    `json:"pass"`
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
	TargetCleanupMs   = 1000.0   // cleanup wall
	TargetOverlay     = 1 << 20  // overlay bytes allocated at start
	TargetPeakRSS     = 30 << 20 // each executable's peak RSS
	statMedian        = "median"
	statMax           = "max"
	unitRatio, unitMs = "ratio", "ms"
	unitBytes         = "bytes"
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
	return out
}
