package bench

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// NoopMarker starts the line the benchmark's no-op build script prints.
const NoopMarker = "LVB_NOOP"

// NoopCommand is the benchmark job's whole script: a no-op between two
// readings of the guest's clock, printed on one line. bash >= 5 reads
// $EPOCHREALTIME without forking; older shells fall back to date(1).
const NoopCommand = `lvb_t0=${EPOCHREALTIME:-$(date +%s.%N)}; :; lvb_t1=${EPOCHREALTIME:-$(date +%s.%N)}; echo "` + NoopMarker + ` $lvb_t0 $lvb_t1"`

var noopLine = regexp.MustCompile(`(?m)^` + NoopMarker + ` (\S+) (\S+)\r?$`)

// ParseNoop returns the time the no-op took inside the guest, from the
// marker line in a job log (the echoed command line does not match: it starts
// with the runner's colour code and "$ "). This figure stays parsed from the
// job log: it is the benchmark script's own output, not the driver's, and
// the guest has no other way to hand it over.
func ParseNoop(log string) (time.Duration, error) {
	m := noopLine.FindStringSubmatch(log)
	if m == nil {
		return 0, fmt.Errorf("no %s line in the job log", NoopMarker)
	}
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
