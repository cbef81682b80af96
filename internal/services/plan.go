package services

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
)

// Bounds of a job's services.
const (
	// MaxServices bounds how many services a job may ask for.
	MaxServices = 16
	// MaxArgs bounds a service's entrypoint plus command.
	MaxArgs = 256
	// MaxArgBytes bounds the total size of a service's entrypoint and
	// command.
	MaxArgBytes = 64 << 10
	// MaxEnvBytes bounds a service's environment (the job's public
	// variables and its own).
	MaxEnvBytes = 512 << 10
	// maxExpanded bounds a value after variable expansion.
	maxExpanded = 64 << 10
	// minSecretLen: shorter secret values are not looked for in names
	// (a flag like "1" would hide every name).
	minSecretLen = 4
)

// Pull policies (GitLab's pull_policy values).
const (
	PullAlways       = "always"
	PullIfNotPresent = "if-not-present"
	PullNever        = "never"
)

// PullPolicies are the values pull_policy accepts.
var PullPolicies = []string{PullAlways, PullIfNotPresent, PullNever}

// Options are the administrator's settings for a job's services (the
// [services] section of the configuration).
type Options struct {
	// JobID names the job's network (NetworkName).
	JobID int64
	// WaitTimeout bounds the wait for each service's ports; 0: no wait.
	WaitTimeout time.Duration
	// Allowed are the service images jobs may use (nil: any).
	Allowed *Allowlist
	// DefaultPullPolicy is the policy of a service that names none.
	DefaultPullPolicy string
	// AllowedPullPolicies are those a job may ask for (empty: all).
	AllowedPullPolicies []string
	// Sudo runs podman through "sudo -n" (a login user that is not root).
	Sudo bool
	// Registries is the registries.conf drop-in to write before pulling
	// (RegistriesConf); empty writes none.
	Registries []byte
	// VMImage names the job's VM image in messages.
	VMImage string
}

// Plan is what Start does for a job: its network and its services, each
// checked, in the job's order.
type Plan struct {
	Network  string
	Services []Service
	// Notes are job-log lines about what the plan left out (a duplicate
	// alias, a service none of whose aliases was free).
	Notes []string
	// Debug is the job's CI_DEBUG_SERVICES: stream the services' logs.
	Debug bool
	// Job is a container job's container (NewJobContainer), started
	// after the services on their network; nil for a job on the VM's OS.
	Job *JobContainer
	// Auth is the registry credentials of the job's pulls (AuthFile), nil
	// for none: a secret, written to the guest at AuthPath for the pulls
	// only, never shown.
	Auth []byte
}

// String never shows Auth.
func (p *Plan) String() string {
	return fmt.Sprintf("services plan (network %s, %d services, container job %v, registry credentials %v)",
		p.Network, len(p.Services), p.Job != nil, len(p.Auth) > 0)
}

// Service is one service to start.
type Service struct {
	// Index is its place in the job's services: list (0-based).
	Index int
	// Shown is how messages name it: the image name as expanded, or
	// "services[i]" when that would show a secret's value.
	Shown string
	// Ref is the image, fully qualified.
	Ref Ref
	// Hidden says the image name holds a secret's value (a masked or
	// non-public variable went into it): neither it nor podman's messages
	// about it are shown.
	Hidden bool
	// Container is its podman container's name.
	Container string
	// Aliases are its host names on the job's network and in /etc/hosts.
	Aliases []string
	// Entrypoint replaces the image's when set; EntrypointSet with an
	// empty Entrypoint clears it (the job's entrypoint: [""]).
	Entrypoint    []string
	EntrypointSet bool
	// Command replaces the image's command when not empty.
	Command []string
	// Env is the container's environment (NAME=VALUE): the job's public
	// variables, then the service's own, expanded. It reaches podman only
	// as its process environment.
	Env []string
	// HealthPort is HEALTHCHECK_TCP_PORT when the service sets it: the
	// only port waited for.
	HealthPort int
	// PullPolicies are tried in order.
	PullPolicies []string
}

// NewPlan checks the payload's services against o and plans their start.
// A job error (a name that is no image reference, an image the allow-list
// refuses, a pull policy not allowed, too many services, oversized
// arguments) is a build failure (exitcodes.User) naming the service and
// what is allowed; nothing of the payload is trusted.
func NewPlan(p *Payload, o Options) (*Plan, error) {
	if len(p.Services) > MaxServices {
		return nil, exitcodes.Userf("the job asks for %d services: at most %d", len(p.Services), MaxServices)
	}
	pl := &Plan{Network: NetworkName(o.JobID)}
	auth, notes, err := AuthFile(p)
	if err != nil {
		return nil, err
	}
	pl.Auth, pl.Notes = auth, notes
	vars := p.Variables
	for _, v := range vars {
		if v.Key == "CI_DEBUG_SERVICES" {
			pl.Debug = v.Value == "true" || v.Value == "1"
		}
	}
	public := publicEnv(vars)
	taken := map[string]int{}
	for i, img := range p.Services {
		s, notes, err := planOne(i, img, vars, public, o, taken)
		pl.Notes = append(pl.Notes, notes...)
		if err != nil {
			return nil, err
		}
		if s != nil {
			pl.Services = append(pl.Services, *s)
		}
	}
	return pl, nil
}

func planOne(i int, img Image, vars []Variable, public []Variable, o Options, taken map[string]int) (*Service, []string, error) {
	x := expander{vars: vars}
	name := x.expand(img.Name)
	label := fmt.Sprintf("services[%d]", i)
	shown := label
	if !x.secret && !x.tooLong {
		shown = strconv.Quote(name) + " (" + label + ")"
	}
	if x.tooLong {
		return nil, nil, exitcodes.Userf("%s: its name grows beyond %d bytes once variables are expanded", label, maxExpanded)
	}
	ref, err := ParseRef(name)
	if err != nil {
		return nil, nil, exitcodes.Userf("service %s: %v", shown, err)
	}
	if !o.Allowed.Allows(name, ref) {
		return nil, nil, exitcodes.Userf("service %s is not among the images this runner allows for services (services.allowed_images: %s)",
			shown, quoteList(o.Allowed.Patterns()))
	}
	s := &Service{Index: i, Shown: shown, Ref: ref, Hidden: x.secret, Container: containerName(i)}

	var notes []string
	candidates := DerivedAliases(name)
	for _, a := range UserAliases(img.Alias) {
		if !slices.Contains(candidates, a) {
			candidates = append(candidates, a)
		}
	}
	if len(candidates) > MaxAliases {
		return nil, nil, exitcodes.Userf("service %s has %d aliases: at most %d", shown, len(candidates), MaxAliases)
	}
	for _, a := range candidates {
		switch {
		case !ValidAlias(a):
			notes = append(notes, fmt.Sprintf("Skipping an alias of service %s: %s is not a host name (letters, digits, '.', '_' and '-', at most %d characters)",
				shown, quoteShown(a, vars), MaxAlias))
		case taken[a] != 0:
			notes = append(notes, fmt.Sprintf("Skipping alias %s for service %s: services[%d] already has it",
				quoteShown(a, vars), shown, taken[a]-1))
		default:
			s.Aliases = append(s.Aliases, a)
		}
	}
	if len(s.Aliases) == 0 {
		notes = append(notes, fmt.Sprintf("Not starting service %s: none of its aliases is free", shown))
		return nil, notes, nil
	}
	for _, a := range s.Aliases {
		taken[a] = i + 1
	}

	if len(img.Entrypoint)+len(img.Command) > MaxArgs {
		return nil, nil, exitcodes.Userf("service %s: an entrypoint and command of %d arguments (at most %d)", shown, len(img.Entrypoint)+len(img.Command), MaxArgs)
	}
	size := 0
	for _, a := range slices.Concat(img.Entrypoint, img.Command) {
		size += len(a) + 1
		if strings.IndexByte(a, 0) >= 0 {
			return nil, nil, exitcodes.Userf("service %s: an entrypoint or command argument holds a NUL byte", shown)
		}
	}
	if size > MaxArgBytes {
		return nil, nil, exitcodes.Userf("service %s: an entrypoint and command of %d bytes (at most %d)", shown, size, MaxArgBytes)
	}
	if len(img.Entrypoint) > 0 {
		s.EntrypointSet = true
		if len(img.Entrypoint) != 1 || img.Entrypoint[0] != "" {
			s.Entrypoint = slices.Clone(img.Entrypoint)
		}
	}
	s.Command = slices.Clone(img.Command)

	env, health, err := serviceEnv(shown, public, img.Variables, vars)
	if err != nil {
		return nil, nil, err
	}
	s.Env, s.HealthPort = env, health

	s.PullPolicies, err = pullPolicies("service "+shown, img.PullPolicy, o)
	if err != nil {
		return nil, nil, err
	}
	return s, notes, nil
}

// image is how messages name the service's image.
func (s Service) image() string {
	if s.Hidden {
		return "(its image name holds a secret's value: not shown)"
	}
	return s.Ref.String()
}

// guestText is how messages show what podman said about the service.
func (s Service) guestText(t string) string {
	if s.Hidden {
		return "(podman's message not shown)"
	}
	return strconv.Quote(t)
}

// publicEnv are the job variables a service gets, as GitLab Runner's Docker
// executor gives them: the public ones (never a masked or protected
// setting, never the job token), file variables included with their
// content as the value. The last entry of a name wins.
func publicEnv(vars []Variable) []Variable {
	var out []Variable
	for _, v := range vars {
		if v.Public && !v.Masked && sshexec.ValidEnvName(v.Key) {
			out = append(out, v)
		}
	}
	return out
}

// serviceEnv is a service's environment: the job's public variables, then
// the service's own with the job's (and earlier service) variables
// expanded in them; and HEALTHCHECK_TCP_PORT if the service sets it.
func serviceEnv(shown string, public, own, vars []Variable) ([]string, int, error) {
	idx := map[string]int{}
	var env []string
	set := func(k, v string) {
		if i, ok := idx[k]; ok {
			env[i] = k + "=" + v
			return
		}
		idx[k] = len(env)
		env = append(env, k+"="+v)
	}
	for _, v := range public {
		set(v.Key, v.Value)
	}
	all := slices.Clone(vars)
	health := 0
	for _, v := range own {
		if !sshexec.ValidEnvName(v.Key) {
			return nil, 0, exitcodes.Userf("service %s: variable name %q is not a name of letters, digits and _", shown, cutText(v.Key, 64))
		}
		val := v.Value
		if !v.Raw {
			x := expander{vars: all}
			val = x.expand(v.Value)
			if x.tooLong {
				return nil, 0, exitcodes.Userf("service %s: variable %s grows beyond %d bytes once expanded", shown, v.Key, maxExpanded)
			}
		}
		if strings.IndexByte(val, 0) >= 0 {
			return nil, 0, exitcodes.Userf("service %s: variable %s holds a NUL byte", shown, v.Key)
		}
		set(v.Key, val)
		all = append(all, Variable{Key: v.Key, Value: val, Public: true})
		if v.Key == "HEALTHCHECK_TCP_PORT" {
			p, err := strconv.Atoi(strings.TrimSpace(val))
			if err != nil || p < 1 || p > 65535 {
				return nil, 0, exitcodes.Userf("service %s: HEALTHCHECK_TCP_PORT %q is not a port (1-65535)", shown, cutText(val, 16))
			}
			health = p
		}
	}
	size := 0
	for _, kv := range env {
		size += len(kv) + 1
	}
	if size > MaxEnvBytes {
		return nil, 0, exitcodes.Userf("service %s: an environment of %d bytes (at most %d)", shown, size, MaxEnvBytes)
	}
	return env, health, nil
}

// pullPolicies are the policies of a service or the job's image (what
// names it in messages), checked against those allowed.
func pullPolicies(what string, asked []string, o Options) ([]string, error) {
	if len(asked) == 0 {
		def := o.DefaultPullPolicy
		if def == "" {
			def = PullIfNotPresent
		}
		return []string{def}, nil
	}
	if len(asked) > len(PullPolicies) {
		return nil, exitcodes.Userf("%s: %d pull policies (at most %d: %s)", what, len(asked), len(PullPolicies), quoteList(PullPolicies))
	}
	var out []string
	for _, p := range asked {
		if !slices.Contains(PullPolicies, p) {
			return nil, exitcodes.Userf("%s: pull_policy %q is not one of %s", what, cutText(p, 32), quoteList(PullPolicies))
		}
		if len(o.AllowedPullPolicies) > 0 && !slices.Contains(o.AllowedPullPolicies, p) {
			return nil, exitcodes.Userf("%s: pull_policy %q is not allowed by this runner (services.allowed_pull_policies: %s)",
				what, p, quoteList(o.AllowedPullPolicies))
		}
		if !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out, nil
}

// expander expands $VAR and ${VAR} in a payload string against the job's
// variables as GitLab Runner does ($$ is a dollar sign, an unknown
// variable is empty, the last entry of a name wins). It notes whether a
// secret's value went in (the result must then not be shown) and bounds
// the result.
type expander struct {
	vars    []Variable
	secret  bool
	tooLong bool
}

func (x *expander) expand(s string) string {
	n := 0
	out := os.Expand(s, func(key string) string {
		if key == "$" {
			return "$"
		}
		v, ok := lookup(x.vars, key)
		if !ok {
			return ""
		}
		if v.secret() {
			x.secret = true
		}
		if n += len(v.Value); n > maxExpanded {
			x.tooLong = true
			return ""
		}
		return v.Value
	})
	if len(out) > maxExpanded {
		x.tooLong = true
		out = out[:maxExpanded]
	}
	return out
}

func lookup(vars []Variable, key string) (Variable, bool) {
	for i := len(vars) - 1; i >= 0; i-- {
		if vars[i].Key == key {
			return vars[i], true
		}
	}
	return Variable{}, false
}

// containsSecret reports whether s holds the value of a masked or
// non-public variable.
func containsSecret(s string, vars []Variable) bool {
	for _, v := range vars {
		if v.secret() && len(v.Value) >= minSecretLen && strings.Contains(s, v.Value) {
			return true
		}
	}
	return false
}

// quoteShown quotes a job-controlled string for the job log, or says it is
// not shown when it holds a secret's value.
func quoteShown(s string, vars []Variable) string {
	if containsSecret(s, vars) {
		return "(not shown: it holds a secret's value)"
	}
	return strconv.Quote(cutText(s, 96))
}

func quoteList(l []string) string {
	q := make([]string, len(l))
	for i, s := range l {
		q[i] = strconv.Quote(s)
	}
	return strings.Join(q, ", ")
}

// cutText shortens s to at most n bytes on a character boundary.
func cutText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !isRuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }
