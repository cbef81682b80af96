package gitlab

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// The CI variables through which a job asks for resources. They are set by
// the job's author: parsed strictly, allowlisted by the administrator
// (limits.allow_job_overrides) and bounded by the limits.* maximums.
const (
	VarVCPUs  = "LIBVIRT_EXECUTOR_VCPUS"
	VarMemory = "LIBVIRT_EXECUTOR_MEMORY"
	VarDisk   = "LIBVIRT_EXECUTOR_DISK"
	// VarKeep asks to keep the VM after a failed job (debug.allow_keep_on_failure).
	VarKeep = "LIBVIRT_EXECUTOR_KEEP_ON_FAILURE"
)

// keepRequested reports whether the job asked to keep its VM on failure.
func keepRequested(getenv func(string) string) bool {
	switch strings.ToLower(getenv("CUSTOM_ENV_" + VarKeep)) {
	case "1", "true", "yes":
		return true
	}
	return false
}

// Resources is what a job's VM gets.
type Resources = config.Size

// sizeRE accepts a plain decimal count and an optional binary unit; nothing
// else (no sign, exponent, fraction, spaces or control bytes).
var sizeRE = regexp.MustCompile(`^([0-9]{1,7})([A-Za-z]{0,3})$`)

// ChooseResources starts from the image's values or the defaults and applies
// the job's requests where the administrator allows them. Bad or excessive
// requests are the user's mistake (BUILD_FAILURE), with the rule in the message.
func ChooseResources(cfg *config.Config, img *config.Image, getenv func(string) string) (Resources, error) {
	r := Resources(cfg.ImageSize(img))
	type request struct {
		name  string
		dst   *int
		units map[string]int // unit -> multiplier into the field's unit
		config.SizeBound
	}
	reqs := []request{
		{VarVCPUs, &r.VCPUs, map[string]int{"": 1}, cfg.VCPUBound()},
		{VarMemory, &r.MemoryMiB, map[string]int{"": 1, "M": 1, "MIB": 1, "G": 1024, "GIB": 1024}, cfg.MemoryBound()},
		{VarDisk, &r.DiskGiB, map[string]int{"": 1, "G": 1, "GIB": 1, "T": 1024, "TIB": 1024}, cfg.DiskBound()},
	}
	for _, q := range reqs {
		raw, set := lookup(getenv, "CUSTOM_ENV_"+q.name)
		if !set {
			continue
		}
		if !cfg.Limits.AllowJobOverrides {
			return r, exitcodes.Userf("%s is set, but this runner does not let jobs choose their VM size (limits.allow_job_overrides = false); remove the variable", q.name)
		}
		n, err := parseSize(raw, q.units)
		if err != nil {
			return r, exitcodes.Userf("%s = %s: %v; allowed: a whole number%s between %d and %d %s", q.name, shown(raw), err, unitHint(q.units), q.Min, q.Max, q.Unit)
		}
		if !q.Contains(n) {
			return r, exitcodes.Userf("%s = %s asks for %d %s; this runner allows %d to %d %s", q.name, shown(raw), n, q.Unit, q.Min, q.Max, q.Unit)
		}
		*q.dst = n
	}
	return r, nil
}

func lookup(getenv func(string) string, key string) (string, bool) {
	v := getenv(key)
	return v, v != ""
}

func parseSize(s string, units map[string]int) (int, error) {
	m := sizeRE.FindStringSubmatch(s)
	if m == nil {
		return 0, fmt.Errorf("not a size")
	}
	mult, ok := units[strings.ToUpper(m[2])]
	if !ok {
		return 0, fmt.Errorf("unknown unit %q", m[2])
	}
	n, err := strconv.Atoi(m[1])
	if err != nil {
		return 0, fmt.Errorf("not a size")
	}
	return n * mult, nil // at most 9,999,999 * 1024: no overflow
}

func unitHint(units map[string]int) string {
	if len(units) == 1 {
		return ""
	}
	var us []string
	for _, u := range []string{"M", "G", "T"} {
		if _, ok := units[u]; ok {
			us = append(us, u)
		}
	}
	return " with an optional unit (" + strings.Join(us, ", ") + ")"
}

// shown renders a job-controlled value safely for a message: quoted,
// escaped, and cut short.
func shown(s string) string {
	if len(s) > 32 {
		s = s[:32] + "..."
	}
	return strconv.Quote(s)
}
