package bench

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// NoopMarker starts the line the benchmark's no-op build script prints.
const NoopMarker = "LVB_NOOP"

// NoopCommand is build_script's no-op (NoopCommandIn).
var NoopCommand = NoopCommandIn("build_script")

// NoopCommandIn is the benchmark job's whole script of one run stage: a
// no-op between two readings of the guest's clock, printed on one line
// with the stage's name. bash >= 5 reads $EPOCHREALTIME without forking;
// older shells fall back to date(1). stage must be a bare word
// ([A-Za-z0-9_]).
func NoopCommandIn(stage string) string {
	return `lvb_t0=${EPOCHREALTIME:-$(date +%s.%N)}; :; lvb_t1=${EPOCHREALTIME:-$(date +%s.%N)}; echo "` + NoopMarker + ` $lvb_t0 $lvb_t1 ` + stage + `"`
}

// noopLine is a marker line: the two clock readings and, since the job has
// several no-op stages, the stage that printed it (absent in older logs).
var noopLine = regexp.MustCompile(`(?m)^` + NoopMarker + ` (\S+) (\S+)(?: (\w+))?\r?$`)

// ParseNoop returns the time the first no-op in a job log took inside the
// guest, from its marker line (the echoed command line does not match: it
// starts with the runner's colour code and "$ "). This figure stays parsed
// from the job log: it is the benchmark script's own output, not the
// driver's, and the guest has no other way to hand it over.
func ParseNoop(log string) (time.Duration, error) {
	m := noopLine.FindStringSubmatch(log)
	if m == nil {
		return 0, fmt.Errorf("no %s line in the job log", NoopMarker)
	}
	return noopGuest(m)
}

// Noop is one no-op stage's own time inside the guest.
type Noop struct {
	// Stage is the stage that printed the marker line ("" for a line
	// without one).
	Stage string
	Guest time.Duration
}

// ParseNoops returns every marker line of a job log in order, and an error
// naming the lines that could not be read (those are left out).
func ParseNoops(log string) ([]Noop, error) {
	var out []Noop
	var errs []error
	for _, m := range noopLine.FindAllStringSubmatch(log, -1) {
		d, err := noopGuest(m)
		if err != nil {
			if m[3] != "" {
				err = fmt.Errorf("%s: %w", m[3], err)
			}
			errs = append(errs, err)
			continue
		}
		out = append(out, Noop{Stage: m[3], Guest: d})
	}
	return out, errors.Join(errs...)
}

// noopGuest reads the time between the two readings of a marker line.
func noopGuest(m []string) (time.Duration, error) {
	t0, err := parseEpoch(m[1])
	if err != nil {
		return 0, err
	}
	t1, err := parseEpoch(m[2])
	if err != nil {
		return 0, err
	}
	if t1 < t0 {
		return 0, fmt.Errorf("%s: guest clock went backwards (%s > %s)", NoopMarker, m[1], m[2])
	}
	return time.Duration(t1 - t0), nil
}

// parseEpoch reads "seconds[.fraction]" (a comma also separates the fraction,
// as $EPOCHREALTIME prints it in some locales) into nanoseconds, exactly.
func parseEpoch(s string) (int64, error) {
	sec, frac, _ := strings.Cut(strings.Replace(s, ",", ".", 1), ".")
	secs, err := strconv.ParseInt(sec, 10, 64)
	if err != nil || !digits(sec) {
		return 0, fmt.Errorf("guest time %q: not seconds.fraction (does the guest's date support %%N?)", s)
	}
	if len(frac) > 9 {
		frac = frac[:9]
	}
	var ns int64
	if frac != "" {
		n, err := strconv.ParseInt(frac, 10, 64)
		if err != nil || !digits(frac) {
			return 0, fmt.Errorf("guest time %q: bad fraction", s)
		}
		ns = n
		for i := len(frac); i < 9; i++ {
			ns *= 10
		}
	}
	return secs*1e9 + ns, nil
}

func digits(s string) bool {
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return s != ""
}
