package config

import (
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Services is [services]: a job's `services:` started as containers in its
// own VM with podman (docs/services.md). Off by default: then
// gitlab.services says what a job that asks for services gets.
type Services struct {
	// Enabled starts a job's services in its VM, which must have podman
	// (deploy/images/build.sh podman). Default false.
	Enabled bool `toml:"enabled"`
	// WaitTimeout bounds the wait for each service's ports before the
	// first script; on expiry the job log gets a warning with the
	// service's last log lines and the job goes on. Default 30s (GitLab
	// Runner's wait_for_services_timeout), allowed 1s to 10m.
	WaitTimeout Duration `toml:"wait_timeout"`
	// AllowedImages are the images a service may use, as globs on the
	// name the job wrote or its fully qualified form ("postgres:*",
	// "registry.example:5000/**"; "*" within a path component, "**"
	// across). Empty: any image.
	AllowedImages []string `toml:"allowed_images"`
	// PullPolicy is the pull policy of a service that names none:
	// "if-not-present" (default: an image already in the VM image or a
	// warm VM is used as it is), "always" or "never".
	PullPolicy string `toml:"pull_policy"`
	// AllowedPullPolicies are those a job's pull_policy may name; empty:
	// all three.
	AllowedPullPolicies []string `toml:"allowed_pull_policies"`
	// Mirrors maps a registry ("docker.io", "registry.example:5000") to
	// its pull-through mirrors (HOST[:PORT][/PATH], tried in order before
	// the registry), written to the guest's registries.conf.d before the
	// first pull.
	Mirrors map[string][]string `toml:"mirrors"`
	// PlainHTTP lists the mirrors (as written in mirrors) reached over
	// plain HTTP (a cache on the host's network); others over HTTPS.
	PlainHTTP []string `toml:"plain_http"`
}

// The pull policies a service may have (GitLab's pull_policy values).
var servicePullPolicies = []string{"always", "if-not-present", "never"}

var (
	// a registry as images name it: a host name or address, and a port
	registryRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$`)
	// a mirror location: a registry, then an optional path
	mirrorRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?(/[a-z0-9._/-]+)?$`)
)

func (s *Services) applyDefaults() {
	if s.WaitTimeout == 0 {
		s.WaitTimeout = Duration(30 * time.Second)
	}
	if s.PullPolicy == "" {
		s.PullPolicy = "if-not-present"
	}
}

func (s Services) validate(p *problems) {
	if s.WaitTimeout.D() < time.Second || s.WaitTimeout.D() > 10*time.Minute {
		p.bad("services.wait_timeout", "%s must be 1s to 10m", s.WaitTimeout.D())
	}
	for _, pat := range s.AllowedImages {
		if pat == "" || len(pat) > 512 || strings.ContainsAny(pat, " \t\n") {
			p.bad("services.allowed_images", "%q must be an image name or glob of 1 to 512 characters without white space (e.g. \"postgres:*\", \"registry.example:5000/**\")", pat)
		}
	}
	if !slices.Contains(servicePullPolicies, s.PullPolicy) {
		p.bad("services.pull_policy", "%q must be one of %s", s.PullPolicy, strings.Join(servicePullPolicies, ", "))
	}
	for _, pp := range s.AllowedPullPolicies {
		if !slices.Contains(servicePullPolicies, pp) {
			p.bad("services.allowed_pull_policies", "%q must be one of %s", pp, strings.Join(servicePullPolicies, ", "))
		}
	}
	if len(s.AllowedPullPolicies) > 0 && slices.Contains(servicePullPolicies, s.PullPolicy) && !slices.Contains(s.AllowedPullPolicies, s.PullPolicy) {
		p.bad("services.pull_policy", "%q is not among services.allowed_pull_policies (%s)", s.PullPolicy, strings.Join(s.AllowedPullPolicies, ", "))
	}
	regs := make([]string, 0, len(s.Mirrors))
	for r := range s.Mirrors {
		regs = append(regs, r)
	}
	slices.Sort(regs)
	var all []string
	for _, r := range regs {
		if !validHostPort(r, registryRE) {
			p.bad("services.mirrors", "registry %q must be a host name or address with an optional port (e.g. \"docker.io\", \"registry.example:5000\")", r)
		}
		locs := s.Mirrors[r]
		if len(locs) == 0 || len(locs) > 8 {
			p.bad("services.mirrors", "registry %q: give 1 to 8 mirrors", r)
		}
		for _, l := range locs {
			if !validHostPort(l, mirrorRE) {
				p.bad("services.mirrors", "mirror %q of %q must be HOST[:PORT][/PATH] without a scheme (e.g. \"10.0.0.1:5000\")", l, r)
			}
			all = append(all, l)
		}
	}
	for _, h := range s.PlainHTTP {
		if !slices.Contains(all, h) {
			p.bad("services.plain_http", "%q is none of the mirrors in services.mirrors", h)
		}
	}
}

// validHostPort checks a registry or mirror location: the pattern, and a
// port (if any) of 1-65535.
func validHostPort(s string, re *regexp.Regexp) bool {
	if !re.MatchString(s) || len(s) > 255 {
		return false
	}
	hostPort, _, _ := strings.Cut(s, "/")
	if _, port, err := net.SplitHostPort(hostPort); err == nil {
		n, err := strconv.Atoi(port)
		return err == nil && n >= 1 && n <= 65535
	}
	return true
}
