// Package ghhooks is the GitHub Actions runner's container hook protocol
// (ACTIONS_RUNNER_CONTAINER_HOOKS), as libvirt-executor-hooks speaks it
// (issue #47): the runner calls the hook once per command with one JSON
// object on stdin (command, responseFile, args, state); prepare_job answers
// through the response file. This package reads and checks that input and
// writes the answer; it knows nothing of VMs. Everything in the input is
// untrusted: it is bounded, checked against the admin's allow-lists (images,
// create options, mounts), and turned into argument vectors, never into a
// shell or XML string.
package ghhooks

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// The hook's commands, as the runner names them.
const (
	PrepareJob       = "prepare_job"
	RunScriptStep    = "run_script_step"
	RunContainerStep = "run_container_step"
	CleanupJob       = "cleanup_job"
)

// Commands are the commands the hook accepts.
var Commands = []string{PrepareJob, RunScriptStep, RunContainerStep, CleanupJob}

// Bounds on what the runner sends.
const (
	// MaxInput bounds the whole JSON input (a job's environment can be
	// large: the runner sends every variable of a step).
	MaxInput = 4 << 20
	// MaxEnv bounds the variables of one container or step, and
	// MaxEnvValue one value.
	MaxEnv      = 4096
	MaxEnvValue = 128 << 10
	// MaxArgs bounds an entry point's arguments, MaxArg one of them.
	MaxArgs = 1024
	MaxArg  = 128 << 10
	// MaxServices bounds a job's service containers; MaxMounts the mounts
	// of one container; MaxPorts its port mappings.
	MaxServices = 16
	MaxMounts   = 64
	MaxPorts    = 64
	// MaxPath bounds a path or image name.
	MaxPath = 4096
)

// Input is one call of the hook.
type Input struct {
	Command      string          `json:"command"`
	ResponseFile *string         `json:"responseFile"`
	Args         json.RawMessage `json:"args"`
	State        json.RawMessage `json:"state"`
}

// Mount is a volume of a container: a host path (or a named volume, for a
// user mount) at a path in the container.
type Mount struct {
	Source   string `json:"sourceVolumePath"`
	Target   string `json:"targetVolumePath"`
	ReadOnly bool   `json:"readOnly"`
}

// Registry is a container's registry login.
type Registry struct {
	Username  string `json:"username"`
	Password  string `json:"password"`
	ServerURL string `json:"serverUrl"`
}

// Container is what the runner says about a container: the job's, a
// service's or a container step's.
type Container struct {
	Image          string            `json:"image"`
	ContextName    string            `json:"contextName"`
	EntryPoint     *string           `json:"entryPoint"`
	EntryPointArgs []string          `json:"entryPointArgs"`
	CreateOptions  string            `json:"createOptions"`
	Env            map[string]string `json:"environmentVariables"`
	UserMounts     []Mount           `json:"userMountVolumes"`
	SystemMounts   []Mount           `json:"systemMountVolumes"`
	Registry       *Registry         `json:"registry"`
	PortMappings   []string          `json:"portMappings"`
	WorkingDir     string            `json:"workingDirectory"`
	PrependPath    []string          `json:"prependPath"`
	Dockerfile     *string           `json:"dockerfile"`
}

// PrepareArgs are prepare_job's arguments.
type PrepareArgs struct {
	Container *Container  `json:"container"`
	Services  []Container `json:"services"`
}

// ScriptArgs are run_script_step's arguments.
type ScriptArgs struct {
	EntryPoint     string            `json:"entryPoint"`
	EntryPointArgs []string          `json:"entryPointArgs"`
	Env            map[string]string `json:"environmentVariables"`
	PrependPath    []string          `json:"prependPath"`
	WorkingDir     string            `json:"workingDirectory"`
}

// ErrNoJobContainer is prepare_job's answer to a job without `container:`:
// its steps would run on the runner's host, which this hook never allows.
var ErrNoJobContainer = errors.New("this job has no `container:`, and its steps would run on the runner's host: " +
	"libvirt-executor-hooks runs only container jobs (each in a VM of its own); set ACTIONS_RUNNER_REQUIRE_JOB_CONTAINER=true " +
	"in the runner's environment (its .env file) so that such jobs fail before they start, and give every job a `container:`")

// Decode reads one hook call from r: bounded, one JSON object, a known
// command, a response file where the command needs one.
func Decode(r io.Reader) (*Input, error) {
	b, err := io.ReadAll(io.LimitReader(r, MaxInput+1))
	if err != nil {
		return nil, fmt.Errorf("hook input: %w", err)
	}
	if len(b) > MaxInput {
		return nil, fmt.Errorf("hook input: more than %d bytes", MaxInput)
	}
	var in Input
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&in); err != nil {
		return nil, fmt.Errorf("hook input: not a JSON object of the runner's hook protocol: %w", err)
	}
	if err := dec.Decode(&json.RawMessage{}); err != io.EOF {
		return nil, errors.New("hook input: more than one JSON value, or text after it")
	}
	if !slices.Contains(Commands, in.Command) {
		return nil, fmt.Errorf("hook input: command %q is not one of %s", cut(in.Command, 64), strings.Join(Commands, ", "))
	}
	if in.Command == PrepareJob {
		if in.ResponseFile == nil || *in.ResponseFile == "" {
			return nil, errors.New("hook input: prepare_job has no responseFile (the runner names the file its answer goes to)")
		}
		if err := checkPath("responseFile", *in.ResponseFile); err != nil {
			return nil, err
		}
	}
	return &in, nil
}

// Prepare decodes and checks prepare_job's arguments against o.
func (in *Input) Prepare(o Options) (*PrepareArgs, error) {
	var a PrepareArgs
	if err := decodeArgs(in.Args, &a); err != nil {
		return nil, err
	}
	if a.Container == nil || a.Container.Image == "" {
		return nil, ErrNoJobContainer
	}
	if err := o.checkContainer("container", a.Container, true); err != nil {
		return nil, err
	}
	a.Container.SystemMounts = withoutDockerSocket(a.Container.SystemMounts)
	if len(a.Services) > MaxServices {
		return nil, fmt.Errorf("services: %d service containers (at most %d)", len(a.Services), MaxServices)
	}
	seen := map[string]bool{}
	for i := range a.Services {
		s := &a.Services[i]
		what := fmt.Sprintf("services[%d]", i)
		if !validName.MatchString(s.ContextName) {
			return nil, fmt.Errorf("%s: contextName %q is not a name (letters, digits, '_', '-' and '.', 1 to 63 characters, starting with a letter or digit)", what, cut(s.ContextName, 64))
		}
		if seen[s.ContextName] {
			return nil, fmt.Errorf("%s: contextName %q is used twice", what, s.ContextName)
		}
		seen[s.ContextName] = true
		if err := o.checkContainer(what, s, false); err != nil {
			return nil, err
		}
	}
	return &a, nil
}

// Script decodes and checks run_script_step's arguments.
func (in *Input) Script() (*ScriptArgs, error) {
	var a ScriptArgs
	if err := decodeArgs(in.Args, &a); err != nil {
		return nil, err
	}
	if a.EntryPoint == "" {
		return nil, errors.New("args.entryPoint: empty (the program the step runs)")
	}
	if err := checkArgv("args", a.EntryPoint, a.EntryPointArgs); err != nil {
		return nil, err
	}
	if err := checkEnv("args.environmentVariables", a.Env); err != nil {
		return nil, err
	}
	if err := checkPrependPath("args.prependPath", a.PrependPath); err != nil {
		return nil, err
	}
	if a.WorkingDir != "" {
		if err := checkPath("args.workingDirectory", a.WorkingDir); err != nil {
			return nil, err
		}
	}
	return &a, nil
}

// ContainerStep decodes and checks run_container_step's arguments.
func (in *Input) ContainerStep(o Options) (*Container, error) {
	var c Container
	if err := decodeArgs(in.Args, &c); err != nil {
		return nil, err
	}
	if c.Image == "" && (c.Dockerfile == nil || *c.Dockerfile == "") {
		return nil, errors.New("args: neither image nor dockerfile (a container step runs one of them)")
	}
	if c.Image != "" {
		if err := o.checkContainer("args", &c, false); err != nil {
			return nil, err
		}
	} else if err := o.checkContainerBody("args", &c); err != nil {
		return nil, err
	}
	if c.Dockerfile != nil && *c.Dockerfile != "" {
		if !o.AllowBuild {
			// A repository's own Dockerfile names any base image and
			// runs any command at build time: the image allow-list
			// would not hold.
			return nil, errors.New("args.dockerfile: this runner does not build container steps from a Dockerfile " +
				"(a Dockerfile's FROM and RUN would bypass the allowed images); use an allowed image, or set allow_build = true")
		}
		if err := checkPath("args.dockerfile", *c.Dockerfile); err != nil {
			return nil, err
		}
		if !o.underShared(*c.Dockerfile) {
			return nil, fmt.Errorf("args.dockerfile %q: not under the runner's directories shared with the job's VM (%s, %s)", cut(*c.Dockerfile, 256), o.WorkDir, o.Externals)
		}
	}
	return &c, nil
}

// withoutDockerSocket is mounts less the docker socket.
func withoutDockerSocket(mounts []Mount) []Mount {
	var out []Mount
	for _, m := range mounts {
		if m.Source != dockerSocket {
			out = append(out, m)
		}
	}
	return out
}

// decodeArgs decodes args into v. Fields this hook does not know are
// ignored (a newer runner may send more); the known ones are checked by
// the caller.
func decodeArgs(raw json.RawMessage, v any) error {
	if len(raw) == 0 || string(raw) == "null" {
		return errors.New("args: missing")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("args: %w", err)
	}
	return nil
}

var (
	validName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`)
	validEnv  = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,254}$`)
)

func checkPath(what, p string) error {
	switch {
	case len(p) > MaxPath:
		return fmt.Errorf("%s: longer than %d bytes", what, MaxPath)
	case !filepath.IsAbs(p):
		return fmt.Errorf("%s %q: not an absolute path", what, cut(p, 256))
	case strings.IndexFunc(p, isControl) >= 0:
		return fmt.Errorf("%s %q: holds a control character", what, cut(p, 256))
	case filepath.Clean(p) != p && filepath.Clean(p)+"/" != p:
		return fmt.Errorf("%s %q: not a clean path (no '..', '.' or '//')", what, cut(p, 256))
	}
	return nil
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

func checkArgv(what, entry string, args []string) error {
	if len(args) > MaxArgs {
		return fmt.Errorf("%s.entryPointArgs: %d arguments (at most %d)", what, len(args), MaxArgs)
	}
	for i, a := range append([]string{entry}, args...) {
		if len(a) > MaxArg {
			if i == 0 {
				return fmt.Errorf("%s.entryPoint: longer than %d bytes", what, MaxArg)
			}
			return fmt.Errorf("%s.entryPointArgs[%d]: longer than %d bytes", what, i-1, MaxArg)
		}
		if strings.ContainsRune(a, 0) {
			return fmt.Errorf("%s: an argument holds a NUL byte", what)
		}
	}
	return nil
}

func checkEnv(what string, env map[string]string) error {
	if len(env) > MaxEnv {
		return fmt.Errorf("%s: %d variables (at most %d)", what, len(env), MaxEnv)
	}
	for _, k := range slices.Sorted(maps.Keys(env)) {
		if !validEnv.MatchString(k) {
			// The name only: a value may be a secret.
			return fmt.Errorf("%s: %q is not a variable name (letters, digits and '_', not starting with a digit)", what, cut(k, 64))
		}
		if v := env[k]; len(v) > MaxEnvValue || strings.ContainsRune(v, 0) {
			return fmt.Errorf("%s: the value of %s is longer than %d bytes or holds a NUL byte", what, k, MaxEnvValue)
		}
	}
	return nil
}

func checkPrependPath(what string, dirs []string) error {
	if len(dirs) > MaxArgs {
		return fmt.Errorf("%s: %d entries (at most %d)", what, len(dirs), MaxArgs)
	}
	for i, d := range dirs {
		if d == "" || len(d) > MaxPath || strings.ContainsAny(d, ":\x00\n") {
			return fmt.Errorf("%s[%d]: not a directory for PATH (no ':' or control characters, 1 to %d bytes)", what, i, MaxPath)
		}
	}
	return nil
}

// cut shortens untrusted text for a message.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
