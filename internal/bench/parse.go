package bench

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// PrepareTimes are the durations the prepare stage prints into the job log
// (internal/vm.Engine.Create's "<step> done in", internal/lifecycle's
// "Created", "Booted", "SSH ready" and "Machine ready" lines). The driver
// rounds them for people: to the millisecond below a second, to 100 ms above.
type PrepareTimes struct {
	Clone       time.Duration // overlay volume (linked clone)
	SeedCreate  time.Duration // seed volume created (0 if the image needs none)
	SeedUpload  time.Duration // seed content uploaded
	Define      time.Duration
	Start       time.Duration
	Created     time.Duration // clone .. start, as one figure
	Address     time.Duration // after start: until the DHCP lease (or agent) names an address
	SSH         time.Duration // after the address: until the pinned-key handshake and login succeed
	SSHAttempts int
	Ready       time.Duration // "Machine ready": the whole provisioning, leftovers check included
}

var (
	stepLine    = regexp.MustCompile(`^\s+(clone disk|create seed volume|upload seed|define|start) done in (\S+)$`)
	createdLine = regexp.MustCompile(`^Created \S+ from image .* in (\S+)$`)
	bootedLine  = regexp.MustCompile(`^Booted, address \S+ .* in (\S+)$`)
	sshLine     = regexp.MustCompile(`^SSH ready as \S+ .* in (\S+) \((\d+) attempts?\)$`)
	readyLine   = regexp.MustCompile(`^Machine ready in (\S+)$`)
)

// ParsePrepareLog reads the prepare stage's timing lines from a job log. When
// prepare was attempted more than once, the last attempt's lines win. Every
// figure but the seed steps is required: a missing one is an error naming it,
// so a change of the driver's wording shows up instead of a silent zero.
func ParsePrepareLog(log string) (PrepareTimes, error) {
	var p PrepareTimes
	seen := map[string]bool{}
	var errs []string
	dur := func(what, s string) time.Duration {
		d, err := time.ParseDuration(s)
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: bad duration %q", what, s))
			return 0
		}
		seen[what] = true
		return d
	}
	for _, line := range strings.Split(log, "\n") {
		line = strings.TrimRight(line, "\r")
		if m := stepLine.FindStringSubmatch(line); m != nil {
			d := dur(m[1], m[2])
			switch m[1] {
			case "clone disk":
				p.Clone = d
			case "create seed volume":
				p.SeedCreate = d
			case "upload seed":
				p.SeedUpload = d
			case "define":
				p.Define = d
			case "start":
				p.Start = d
			}
		} else if m := createdLine.FindStringSubmatch(line); m != nil {
			p.Created = dur("created", m[1])
		} else if m := bootedLine.FindStringSubmatch(line); m != nil {
			p.Address = dur("address", m[1])
		} else if m := sshLine.FindStringSubmatch(line); m != nil {
			p.SSH = dur("ssh", m[1])
			p.SSHAttempts, _ = strconv.Atoi(m[2])
		} else if m := readyLine.FindStringSubmatch(line); m != nil {
			p.Ready = dur("ready", m[1])
		}
	}
	for _, want := range []string{"clone disk", "define", "start", "created", "address", "ssh", "ready"} {
		if !seen[want] {
			errs = append(errs, want+" line missing")
		}
	}
	if len(errs) > 0 {
		return p, fmt.Errorf("prepare log: %s", strings.Join(errs, "; "))
	}
	return p, nil
}

// NoopMarker starts the line the benchmark's no-op build script prints.
const NoopMarker = "LVB_NOOP"

// NoopCommand is the benchmark job's whole script: a no-op between two
// readings of the guest's clock, printed on one line. bash >= 5 reads
// $EPOCHREALTIME without forking; older shells fall back to date(1).
const NoopCommand = `lvb_t0=${EPOCHREALTIME:-$(date +%s.%N)}; :; lvb_t1=${EPOCHREALTIME:-$(date +%s.%N)}; echo "` + NoopMarker + ` $lvb_t0 $lvb_t1"`

var noopLine = regexp.MustCompile(`(?m)^` + NoopMarker + ` (\S+) (\S+)\r?$`)

// ParseNoop returns the time the no-op took inside the guest, from the
// marker line in a job log (the echoed command line does not match: it starts
// with the runner's colour code and "$ ").
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
