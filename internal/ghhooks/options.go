package ghhooks

import (
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/mattn/go-shellwords"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

// Options are the admin's rules for what a job may ask of the hook.
type Options struct {
	// WorkDir is the runner's _work directory and Externals its externals
	// directory: the host paths shared into the job's VM at the same
	// absolute paths (Externals read-only). A system mount must lie in
	// one of them.
	WorkDir, Externals string
	// Images allows the job's, services' and steps' container images; an
	// empty or nil list allows none.
	Images *services.Allowlist
	// CreateOptions are the flags of a container's `options:` this hook
	// passes on to podman (each takes one value unless it is in
	// CreateSwitches); any other flag is refused.
	CreateOptions, CreateSwitches []string
	// AllowBuild lets container steps build from the repository's
	// Dockerfile (its FROM and RUN are not held to Images).
	AllowBuild bool
}

// DefaultCreateOptions are the `options:` flags allowed when the admin
// names none: resource limits and health checks, nothing that reaches
// the VM's host side (no --privileged, --volume, --device, --network,
// --cap-add, --security-opt, --pid or --userns).
var DefaultCreateOptions = []string{
	"--cpus", "--memory", "--memory-swap", "--shm-size", "--pids-limit", "--ulimit",
	"--health-cmd", "--health-interval", "--health-timeout", "--health-retries", "--health-start-period",
	"--env", "-e", "--workdir", "-w", "--user", "-u", "--hostname", "--label", "--tmpfs",
}

// DefaultCreateSwitches are the allowed flags that take no value.
var DefaultCreateSwitches = []string{"--init", "--no-healthcheck", "--read-only"}

// CreateArgs turns a container's `options:` text into podman arguments:
// split as a shell would split words (quotes, backslashes; no expansion,
// no command substitution), every flag allowed by o, each valued flag with
// its value ("--flag value" or "--flag=value").
func (o Options) CreateArgs(what, text string) ([]string, error) {
	if strings.TrimSpace(text) == "" {
		return nil, nil
	}
	if len(text) > MaxArg {
		return nil, fmt.Errorf("%s.createOptions: longer than %d bytes", what, MaxArg)
	}
	p := shellwords.NewParser()
	p.ParseEnv, p.ParseBacktick = false, false
	words, err := p.Parse(text)
	if err != nil {
		return nil, fmt.Errorf("%s.createOptions: %w", what, err)
	}
	if p.Position >= 0 {
		return nil, fmt.Errorf("%s.createOptions: a shell operator (';', '|', '&', '<', '>') is not an option", what)
	}
	allowed := o.CreateOptions
	switches := o.CreateSwitches
	if allowed == nil && switches == nil {
		allowed, switches = DefaultCreateOptions, DefaultCreateSwitches
	}
	var out []string
	for i := 0; i < len(words); i++ {
		w := words[i]
		flag, value, hasValue := strings.Cut(w, "=")
		if !strings.HasPrefix(flag, "-") {
			return nil, fmt.Errorf("%s.createOptions: %q is not an option (a container's options are flags with their values)", what, cut(w, 64))
		}
		switch {
		case slices.Contains(switches, flag):
			if hasValue {
				return nil, fmt.Errorf("%s.createOptions: %s takes no value", what, flag)
			}
			out = append(out, flag)
		case slices.Contains(allowed, flag):
			if !hasValue {
				if i+1 >= len(words) {
					return nil, fmt.Errorf("%s.createOptions: %s needs a value", what, flag)
				}
				i++
				value = words[i]
			}
			if strings.ContainsRune(value, 0) {
				return nil, fmt.Errorf("%s.createOptions: the value of %s holds a NUL byte", what, flag)
			}
			if err := checkOptionValue(what, flag, value); err != nil {
				return nil, err
			}
			out = append(out, flag+"="+value)
		default:
			return nil, fmt.Errorf("%s.createOptions: %s is not allowed (allowed: %s; with no value: %s)", what, cut(flag, 64),
				strings.Join(allowed, " "), strings.Join(switches, " "))
		}
	}
	return out, nil
}

// checkOptionValue checks the values of the flags whose values matter
// beyond the container: a variable is NAME=VALUE (a bare NAME or a
// pattern would copy podman's own environment, the guest login's, into
// the container), and a label never is the driver's own (what the sweep
// of the job's VM goes by).
func checkOptionValue(what, flag, value string) error {
	switch flag {
	case "-e", "--env":
		name, v, ok := strings.Cut(value, "=")
		if !ok || !validEnv.MatchString(name) {
			return fmt.Errorf("%s.createOptions: %s wants NAME=VALUE with NAME a variable name (a bare name or a pattern would copy the VM's own environment), not %q", what, flag, cut(name, 64))
		}
		if len(v) > MaxEnvValue {
			return fmt.Errorf("%s.createOptions: the value of %s %s is longer than %d bytes", what, flag, name, MaxEnvValue)
		}
	case "--label":
		key, _, _ := strings.Cut(value, "=")
		if own, _, _ := strings.Cut(services.Label, "="); key == own {
			return fmt.Errorf("%s.createOptions: --label %s is the driver's own", what, own)
		}
	}
	return nil
}

// checkContainer checks a container's image (allowed), and the rest
// (checkContainerBody); job is the job's container, whose working
// directory is required.
func (o Options) checkContainer(what string, c *Container, job bool) error {
	if len(c.Image) > MaxPath {
		return fmt.Errorf("%s.image: longer than %d bytes", what, MaxPath)
	}
	ref, err := services.ParseRef(c.Image)
	if err != nil {
		return fmt.Errorf("%s.image %q: %w", what, cut(c.Image, 256), err)
	}
	// Match, not Allows: for the hook an empty list allows nothing.
	if _, ok := o.Images.Match(c.Image, ref); o.Images == nil || !ok {
		pats := "none configured"
		if o.Images != nil && len(o.Images.Patterns()) > 0 {
			pats = strings.Join(o.Images.Patterns(), ", ")
		}
		return fmt.Errorf("%s.image %q is not among the images this runner allows (allowed_images: %s)", what, cut(c.Image, 256), pats)
	}
	if job && c.WorkingDir == "" {
		return fmt.Errorf("%s.workingDirectory: empty", what)
	}
	return o.checkContainerBody(what, c)
}

// checkContainerBody checks what a container asks besides its image.
func (o Options) checkContainerBody(what string, c *Container) error {
	entry := ""
	if c.EntryPoint != nil {
		entry = *c.EntryPoint
	}
	if err := checkArgv(what, entry, c.EntryPointArgs); err != nil {
		return err
	}
	if err := checkEnv(what+".environmentVariables", c.Env); err != nil {
		return err
	}
	if err := checkPrependPath(what+".prependPath", c.PrependPath); err != nil {
		return err
	}
	if c.WorkingDir != "" {
		if err := checkPath(what+".workingDirectory", c.WorkingDir); err != nil {
			return err
		}
	}
	if _, err := o.CreateArgs(what, c.CreateOptions); err != nil {
		return err
	}
	if len(c.UserMounts)+len(c.SystemMounts) > MaxMounts {
		return fmt.Errorf("%s: %d mounts (at most %d)", what, len(c.UserMounts)+len(c.SystemMounts), MaxMounts)
	}
	for i, m := range c.SystemMounts {
		if err := o.checkMount(fmt.Sprintf("%s.systemMountVolumes[%d]", what, i), m, true); err != nil {
			return err
		}
	}
	for i, m := range c.UserMounts {
		if err := o.checkMount(fmt.Sprintf("%s.userMountVolumes[%d]", what, i), m, false); err != nil {
			return err
		}
	}
	if len(c.PortMappings) > MaxPorts {
		return fmt.Errorf("%s.portMappings: %d mappings (at most %d)", what, len(c.PortMappings), MaxPorts)
	}
	for i, p := range c.PortMappings {
		if _, err := ParsePort(p); err != nil {
			return fmt.Errorf("%s.portMappings[%d]: %w", what, i, err)
		}
	}
	if r := c.Registry; r != nil {
		if err := checkRegistry(what+".registry", r); err != nil {
			return err
		}
	}
	return nil
}

// registryHost is a registry's host with an optional port.
var registryHost = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})(:[0-9]{1,5})?$`)

// checkRegistry: a login's fields are bounded and free of control
// characters, and its server is a registry host (with a scheme and a
// path, as the runner writes docker.io's), never something a command
// could take for a flag. Its password is never in a message.
func checkRegistry(what string, r *Registry) error {
	if len(r.Username) > 4096 || len(r.Password) > 4096 || len(r.ServerURL) > 1024 {
		return fmt.Errorf("%s: a field longer than allowed (user name and password 4096 bytes, serverUrl 1024)", what)
	}
	if strings.IndexFunc(r.Username, isControl) >= 0 || strings.IndexFunc(r.Password, isControl) >= 0 {
		return fmt.Errorf("%s: the user name or password holds a control character", what)
	}
	if strings.HasPrefix(r.Username, "-") {
		return fmt.Errorf("%s: the user name starts with '-'", what)
	}
	if RegistryHost(r.ServerURL) == "" {
		return fmt.Errorf("%s.serverUrl %q: not a registry (HOST[:PORT], optionally with https:// and a path)", what, cut(r.ServerURL, 128))
	}
	return nil
}

// RegistryHost is the host[:port] of a registry login's serverUrl
// ("https://index.docker.io/v1" is docker.io's), "" when it names none.
func RegistryHost(serverURL string) string {
	h := serverURL
	for _, scheme := range []string{"https://", "http://"} {
		h = strings.TrimPrefix(h, scheme)
	}
	h, _, _ = strings.Cut(h, "/")
	if !registryHost.MatchString(h) {
		return ""
	}
	if h == "index.docker.io" || h == "registry-1.docker.io" {
		return "docker.io"
	}
	return h
}

// The docker socket the runner adds to every job container's system
// mounts: a VM has none, and the hook never shares the host's (Prepare
// drops it).
const dockerSocket = "/var/run/docker.sock"

// checkMount: a system mount is a host path under the shared directories
// (the docker socket aside: skipped, see Mounts); a user mount is a named
// volume (made in the VM) or a host path under the shared directories.
func (o Options) checkMount(what string, m Mount, system bool) error {
	if err := checkPath(what+".targetVolumePath", m.Target); err != nil {
		return err
	}
	// podman's --mount splits its value at ',' (a path holding one would
	// add options of the job's choosing).
	if strings.Contains(m.Source, ",") || strings.Contains(m.Target, ",") {
		return fmt.Errorf("%s: a path holds ',' (podman's --mount separator)", what)
	}
	if m.Source == dockerSocket {
		if !system {
			return fmt.Errorf("%s: the docker socket is not shared with a job (the job's VM runs podman; the runner's host's socket never goes in)", what)
		}
		return nil // dropped by Prepare
	}
	if !system && validName.MatchString(m.Source) {
		return nil // a named volume, in the job's VM
	}
	if err := checkPath(what+".sourceVolumePath", cleanDouble(m.Source)); err != nil {
		return err
	}
	if !o.underShared(cleanDouble(m.Source)) {
		return fmt.Errorf("%s: %q is not under the runner's directories shared with the job's VM (%s, %s)", what, cut(m.Source, 256), o.WorkDir, o.Externals)
	}
	return nil
}

// cleanDouble drops a leading "//" the runner writes on some paths.
func cleanDouble(p string) string {
	for strings.HasPrefix(p, "//") {
		p = p[1:]
	}
	return p
}

// underShared reports whether p is the work or externals directory or
// lies under one of them.
func (o Options) underShared(p string) bool {
	for _, d := range []string{o.WorkDir, o.Externals} {
		if d == "" {
			continue
		}
		if rel, err := filepath.Rel(d, p); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			return true
		}
	}
	return false
}

// Port is one port mapping: the container's port and, if given, the VM's.
type Port struct {
	VM, Container int
	Proto         string
}

var portRE = regexp.MustCompile(`^(?:([0-9]{1,5}):)?([0-9]{1,5})(?:/(tcp|udp))?$`)

// ParsePort reads "HOST:CONTAINER[/PROTO]" or "CONTAINER[/PROTO]" (an
// address to bind is not accepted: the VM's ports are on its own network).
func ParsePort(s string) (Port, error) {
	m := portRE.FindStringSubmatch(s)
	if m == nil {
		return Port{}, fmt.Errorf("%q is not a port mapping (PORT, VMPORT:PORT, with /tcp or /udp)", cut(s, 64))
	}
	p := Port{Proto: "tcp"}
	if m[3] != "" {
		p.Proto = m[3]
	}
	var err error
	if p.Container, err = port(m[2]); err != nil {
		return Port{}, fmt.Errorf("%q: %w", s, err)
	}
	if m[1] != "" {
		if p.VM, err = port(m[1]); err != nil {
			return Port{}, fmt.Errorf("%q: %w", s, err)
		}
	}
	return p, nil
}

func port(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, fmt.Errorf("port %s is not 1 to 65535", s)
	}
	return n, nil
}

// HostPath is a mount's host path as the hook uses it: the runner writes
// some with a leading "//".
func HostPath(p string) string { return cleanDouble(p) }

// UnderShared reports whether the host path p is the work or externals
// directory or lies under one of them.
func (o Options) UnderShared(p string) bool { return o.underShared(p) }
