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
	// ContainerJobs lets a job's `image:` name a container image, run
	// inside a VM of a configured image ([services.container_jobs]).
	ContainerJobs ContainerJobs `toml:"container_jobs"`
}

// ContainerJobs is [services.container_jobs]: jobs whose `image:` names no
// configured VM image but a container image the administrator allows run
// their scripts in a container of that image, inside a VM of the image
// VMImage names (docs/services.md, "Container jobs"). Needs
// services.enabled = true.
type ContainerJobs struct {
	// AllowedImages are the container images a job's `image:` may name,
	// as globs like services.allowed_images ("*" within a path component,
	// "**" across), matched against the name the job wrote and its fully
	// qualified form. Empty (the default): no container jobs; a name that
	// is no configured VM image is refused.
	AllowedImages []string `toml:"allowed_images"`
	// VMImage is the configured VM image (a key of [images]) whose VMs
	// host container jobs; it needs podman. Required with allowed_images.
	VMImage string `toml:"vm_image"`
	// VMImages overrides VMImage per allowed pattern: a key is one of
	// allowed_images as written, its value a configured VM image. A job
	// image is hosted by the entry of the first pattern of allowed_images
	// it matches, else by VMImage.
	VMImages map[string]string `toml:"vm_images"`
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

// validate checks [services.container_jobs] against the configured VM
// images (names) and whether services are on (enabled).
func (cj ContainerJobs) validate(p *problems, enabled bool, images []string) {
	if len(cj.AllowedImages) == 0 {
		if len(cj.VMImages) > 0 {
			p.bad("services.container_jobs.vm_images", "set without services.container_jobs.allowed_images (whose patterns it names)")
		}
		if cj.VMImage != "" && !slices.Contains(images, cj.VMImage) {
			p.bad("services.container_jobs.vm_image", "%q is not a configured image; use one of %s", cj.VMImage, quoteList(images))
		}
		return
	}
	if !enabled {
		p.bad("services.container_jobs.allowed_images", "container jobs need services.enabled = true (their containers run with podman, as services do)")
	}
	for _, pat := range cj.AllowedImages {
		if pat == "" || len(pat) > 512 || strings.ContainsAny(pat, " \t\n") {
			p.bad("services.container_jobs.allowed_images", "%q must be an image name or glob of 1 to 512 characters without white space (e.g. \"alpine:*\", \"registry.example:5000/ci/**\")", pat)
		}
	}
	switch {
	case cj.VMImage == "":
		p.bad("services.container_jobs.vm_image", "required with services.container_jobs.allowed_images: the VM image (with podman) that hosts container jobs; use one of %s", quoteList(images))
	case !slices.Contains(images, cj.VMImage):
		p.bad("services.container_jobs.vm_image", "%q is not a configured image; use one of %s", cj.VMImage, quoteList(images))
	}
	pats := make([]string, 0, len(cj.VMImages))
	for k := range cj.VMImages {
		pats = append(pats, k)
	}
	slices.Sort(pats)
	for _, k := range pats {
		if !slices.Contains(cj.AllowedImages, k) {
			p.bad("services.container_jobs.vm_images", "%q is not one of services.container_jobs.allowed_images (%s)", k, quoteList(cj.AllowedImages))
		}
		if v := cj.VMImages[k]; !slices.Contains(images, v) {
			p.bad("services.container_jobs.vm_images", "%q = %q: not a configured image; use one of %s", k, v, quoteList(images))
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
