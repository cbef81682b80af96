package config

import (
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// GitHubHooks is [github_hooks]: libvirt-executor-hooks, the GitHub
// Actions runner's container hook (ACTIONS_RUNNER_CONTAINER_HOOKS), runs
// each container job in a VM of its own (docs/github-hooks.md). The hook
// refuses to run while vm_image is not set.
type GitHubHooks struct {
	// VMImage is the configured VM image (a key of [images], with podman)
	// whose VMs run the jobs' containers. Required to use the hook.
	VMImage string `toml:"vm_image"`
	// AllowedImages are the container images a job's `container:` may
	// name, as globs like services.allowed_images ("*" within a path
	// component, "**" across). Empty (the default): none, and every job
	// is refused naming this key.
	AllowedImages []string `toml:"allowed_images"`
	// WorkDir is the runner's _work directory: shared into the job's VM
	// at the same absolute path (virtiofs), and where the runner's
	// response file must lie. Required to use the hook.
	WorkDir string `toml:"work_dir"`
	// ExternalsDir is the runner's externals directory (a job container's
	// mount the runner always asks for). Default: "externals" beside
	// WorkDir, as the runner lays them out. Shared into the job's VM
	// read-only at the same path (a virtiofsd of its own).
	ExternalsDir string `toml:"externals_dir"`
	// ShareUser is the host user virtiofsd runs as, in a user namespace
	// of its own where it is root and its subordinate ids (/etc/subuid,
	// /etc/subgid) are the guest's other users: what the job writes in
	// WorkDir is this user's. Default: the user the hook runs as, which
	// must not be root then (virtiofsd never runs as root: a root guest
	// could make setuid-root files on the host).
	ShareUser string `toml:"share_user"`
	// QEMUGroup is the group QEMU's processes run with: the only one that
	// may reach a job's virtiofsd socket. Default "libvirt-qemu"
	// (Debian's).
	QEMUGroup string `toml:"qemu_group"`
	// Virtiofsd is the virtiofsd program. Default
	// "/usr/lib/qemu/virtiofsd" (QEMU 7.2's, Debian 12).
	Virtiofsd string `toml:"virtiofsd"`
	// RuntimeDir holds each job's virtiofsd socket, in a directory only
	// QEMU's group may enter. Default "/run/libvirt-executor-hooks".
	RuntimeDir string `toml:"runtime_dir"`
	// JobTimeout is how long a job may run before its VM's deadline (the
	// sweep removes it after that and timeouts.job_slack). Default "6h",
	// allowed 1m to 120h.
	JobTimeout Duration `toml:"job_timeout"`
	// AllowBuild lets a container step build its image from a Dockerfile
	// in WorkDir (podman build in the job's VM). Default false: a
	// Dockerfile's FROM and RUN are not held to AllowedImages.
	AllowBuild bool `toml:"allow_build"`
	// HealthTimeout bounds the wait, per service container with a health
	// check of its own, for it to answer healthy before prepare_job
	// answers (the runner's Docker hook waits too): one still unhealthy
	// then fails the job. Default "2m", allowed 1s to 30m.
	HealthTimeout Duration `toml:"health_timeout"`
}

// Enabled says whether the hook may run: a VM image is named.
func (g GitHubHooks) Enabled() bool { return g.VMImage != "" }

var unixName = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}\$?$`)

func (g *GitHubHooks) applyDefaults() {
	if g.ExternalsDir == "" && g.WorkDir != "" {
		g.ExternalsDir = filepath.Join(filepath.Dir(filepath.Clean(g.WorkDir)), "externals")
	}
	if g.QEMUGroup == "" {
		g.QEMUGroup = "libvirt-qemu"
	}
	if g.Virtiofsd == "" {
		g.Virtiofsd = "/usr/lib/qemu/virtiofsd"
	}
	if g.RuntimeDir == "" {
		g.RuntimeDir = "/run/libvirt-executor-hooks"
	}
	if g.JobTimeout == 0 {
		g.JobTimeout = Duration(6 * time.Hour)
	}
	if g.HealthTimeout == 0 {
		g.HealthTimeout = Duration(2 * time.Minute)
	}
}

// validate checks [github_hooks] against the configured VM images.
func (g GitHubHooks) validate(p *problems, images []string) {
	if g.VMImage != "" && !slices.Contains(images, g.VMImage) {
		p.bad("github_hooks.vm_image", "%q is not a configured image; use one of %s", g.VMImage, quoteList(images))
	}
	if g.VMImage != "" && g.WorkDir == "" {
		p.bad("github_hooks.work_dir", "required with github_hooks.vm_image: the runner's _work directory (e.g. \"/home/runner/actions-runner/_work\")")
	}
	for _, kv := range [][2]string{{"work_dir", g.WorkDir}, {"externals_dir", g.ExternalsDir}, {"virtiofsd", g.Virtiofsd}, {"runtime_dir", g.RuntimeDir}} {
		if v := kv[1]; v != "" && (!filepath.IsAbs(v) || filepath.Clean(v) != v || v == "/" || strings.ContainsAny(v, ",:\n")) {
			p.bad("github_hooks."+kv[0], "%q must be a clean absolute path other than / without ',', ':' or a newline", v)
		}
	}
	if len(g.RuntimeDir) > 40 {
		p.bad("github_hooks.runtime_dir", "%q is longer than 40 bytes (a socket's path there must stay under 108)", g.RuntimeDir)
	}
	for _, pat := range g.AllowedImages {
		if pat == "" || len(pat) > 512 || strings.ContainsAny(pat, " \t\n") {
			p.bad("github_hooks.allowed_images", "%q must be an image name or glob of 1 to 512 characters without white space (e.g. \"node:*\", \"registry.example:5000/ci/**\")", pat)
		}
	}
	for _, kv := range [][2]string{{"share_user", g.ShareUser}, {"qemu_group", g.QEMUGroup}} {
		if v := kv[1]; v != "" && !unixName.MatchString(v) {
			p.bad("github_hooks."+kv[0], "%q is not a user or group name (lower-case letters, digits, '_' and '-', at most 32)", v)
		}
	}
	if d := g.JobTimeout.D(); d < time.Minute || d > 120*time.Hour {
		p.bad("github_hooks.job_timeout", "%s must be 1m to 120h", d)
	}
	if w, e := g.WorkDir, g.ExternalsDir; w != "" && e != "" && (within(e, w) || within(w, e)) {
		p.bad("github_hooks.externals_dir", "%q and work_dir %q must not contain one another (the work directory is shared writable, the externals read-only)", e, w)
	}
	if d := g.HealthTimeout.D(); d < time.Second || d > 30*time.Minute {
		p.bad("github_hooks.health_timeout", "%s must be 1s to 30m", d)
	}
}

// within says whether the clean absolute path p is dir or lies under it.
func within(p, dir string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}
