package gitlab

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// The driver starts no `services:` (docs/services.md). A job that asks for
// them is told so in its log (gitlab.services = "warn"), or fails in
// prepare before any VM boots ("fail"), instead of running as if its
// database were there.

const (
	// maxServicesShown bounds how many services a message names; the
	// rest are counted.
	maxServicesShown = 8
	// maxServiceName bounds a name or alias in a message (bytes).
	maxServiceName = 96
	// maxServicesEnv bounds CUSTOM_ENV_CI_JOB_SERVICES when it is read.
	maxServicesEnv = 64 << 10
	// minSecretLen: values shorter than this are not looked for in the
	// names (GitLab masks only values of 8 characters or more; a shorter
	// non-public value is a flag like "1" or "yes", found in any name).
	minSecretLen = 4
)

// Services are the job's `services:`: what its messages may show of them.
type Services struct {
	// Shown are the first entries (at most maxServicesShown), cut short.
	Shown []Service
	// Count is how many entries the job has.
	Count int
}

// Service is one of the job's services as a message may show it.
type Service struct {
	// Name and Alias are cut to maxServiceName bytes; shown quoted.
	Name, Alias string
	// Hidden says neither may be shown: the runner writes the names with
	// the job's variables expanded, and this one contains the value of a
	// masked or non-public variable (or cannot be checked for one).
	Hidden bool
}

// payloadService is the part of a payload's services entry the driver
// reads: never entrypoint, command or variables.
type payloadService struct {
	Name  string `json:"name"`
	Alias string `json:"alias"`
}

// servicesOf bounds the payload's services for messages, hiding each that
// contains the value of a masked or non-public variable.
func servicesOf(list []payloadService, vars []jobVariable) Services {
	s := Services{Count: len(list)}
	for _, p := range list[:min(len(list), maxServicesShown)] {
		if containsSecret(p.Name, vars) || containsSecret(p.Alias, vars) {
			s.Shown = append(s.Shown, Service{Hidden: true})
			continue
		}
		s.Shown = append(s.Shown, Service{Name: cutName(p.Name), Alias: cutName(p.Alias)})
	}
	return s
}

// servicesFromEnv reads CUSTOM_ENV_CI_JOB_SERVICES (the runner's JSON list
// of the job's services) when there is no payload file. Which variables
// are secret is not known then, so no name is shown; what cannot be read
// counts as one service.
func servicesFromEnv(v string) Services {
	v = strings.TrimSpace(v)
	if v == "" || v == "null" || v == "[]" {
		return Services{}
	}
	var list []payloadService
	if len(v) > maxServicesEnv || json.Unmarshal([]byte(v), &list) != nil {
		return Services{Shown: []Service{{Hidden: true}}, Count: 1}
	}
	s := Services{Count: len(list)}
	for range min(len(list), maxServicesShown) {
		s.Shown = append(s.Shown, Service{Hidden: true})
	}
	return s
}

// containsSecret reports whether s contains the value of a masked or
// non-public variable (a secret, or a CI/CD setting).
func containsSecret(s string, vars []jobVariable) bool {
	for _, v := range vars {
		if (v.Masked || !v.Public) && len(v.Value) >= minSecretLen && strings.Contains(s, v.Value) {
			return true
		}
	}
	return false
}

// cutName shortens a job-controlled name at a character boundary.
func cutName(s string) string {
	if len(s) <= maxServiceName {
		return s
	}
	i := maxServiceName
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "..."
}

// String lists the services for the job log: each name and alias quoted
// (control characters escaped), at most maxServicesShown, then counts.
func (s Services) String() string {
	parts := make([]string, 0, len(s.Shown)+2)
	hidden := 0
	for _, sv := range s.Shown {
		switch {
		case sv.Hidden:
			hidden++
		case sv.Alias != "":
			parts = append(parts, strconv.Quote(sv.Name)+" (alias "+strconv.Quote(sv.Alias)+")")
		default:
			parts = append(parts, strconv.Quote(sv.Name))
		}
	}
	if hidden > 0 {
		parts = append(parts, fmt.Sprintf("%d not named here (a name that may hold a masked or non-public variable's value is not shown)", hidden))
	}
	if more := s.Count - len(s.Shown); more > 0 {
		parts = append(parts, fmt.Sprintf("%d more", more))
	}
	return strings.Join(parts, ", ")
}

// checkServices is prepare's answer to a job with `services:`, before any
// machine is touched: with gitlab.services = "fail" a build failure naming
// them, else a warning in the job log.
func checkServices(cfg *config.Config, s Services, say func(string, ...any)) error {
	if s.Count == 0 {
		return nil
	}
	what := "service"
	if s.Count != 1 {
		what = "services"
	}
	if cfg.GitLab.Services == config.ServicesFail {
		return exitcodes.Userf("this runner does not provide services, and fails jobs that ask for them (gitlab.services = %q): "+
			"the job asks for %d %s: %s. Install and start what the job needs in its image or in its script "+
			"(docs/services.md in the libvirt-executor documentation)", config.ServicesFail, s.Count, what, s)
	}
	say("Warning: this runner does not provide services: %d %s of the job will not be started, and nothing answers at their names or aliases: %s. "+
		"Install and start what the job needs in its image or in its script (docs/services.md in the libvirt-executor documentation)",
		s.Count, what, s)
	return nil
}
