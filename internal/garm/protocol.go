// Package garm is the garm external provider front end: garm
// (github.com/cloudbase/garm) runs the provider executable once per
// operation with the operation in GARM_COMMAND, its ids in the
// environment, a BootstrapInstance on stdin for CreateInstance, and reads
// JSON from stdout and the exit code (0, 30 not found, 31 duplicate, else
// error). This file is the interface as garm calls it, both interface
// versions (v0.1.0, v0.1.1); provider.go does the work on the VM engine.
// Everything garm sends can be set by garm's users (pool settings, instance
// names, extra specs): it is validated here and never reaches a shell or
// XML string.
package garm

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
)

// Commands garm sends in GARM_COMMAND.
const (
	CmdCreate          = "CreateInstance"
	CmdDelete          = "DeleteInstance"
	CmdGet             = "GetInstance"
	CmdList            = "ListInstances"
	CmdRemoveAll       = "RemoveAllInstances"
	CmdStart           = "StartInstance"
	CmdStop            = "StopInstance"
	CmdVersion         = "GetVersion"
	CmdVersions        = "GetSupportedInterfaceVersions"
	CmdValidate        = "ValidatePoolInfo"
	CmdConfigSchema    = "GetConfigJSONSchema"
	CmdExtraSpecSchema = "GetExtraSpecsJSONSchema"
)

// Interface versions.
const (
	V010 = "v0.1.0"
	V011 = "v0.1.1"
)

// Versions lists the interface versions this provider speaks.
var Versions = []string{V010, V011}

var commandsV010 = []string{CmdCreate, CmdDelete, CmdGet, CmdList, CmdRemoveAll, CmdStart, CmdStop, CmdVersion}
var commandsV011 = append(slices.Clone(commandsV010), CmdVersions, CmdValidate, CmdConfigSchema, CmdExtraSpecSchema)

// Exit codes garm reads.
const (
	ExitOK        = 0
	ExitError     = 1
	ExitNotFound  = 30
	ExitDuplicate = 31
)

// ErrNotFound and ErrDuplicate are the failures with their own exit codes.
var (
	ErrNotFound  = errors.New("instance not found")
	ErrDuplicate = errors.New("instance already exists")
)

// ExitCode is the exit code for err.
func ExitCode(err error) int {
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, ErrNotFound):
		return ExitNotFound
	case errors.Is(err, ErrDuplicate):
		return ExitDuplicate
	}
	return ExitError
}

// Env is what garm put in the environment for one call.
type Env struct {
	Command      string
	Version      string
	ControllerID string
	PoolID       string
	InstanceID   string
	ConfigFile   string
	ExtraSpecs   json.RawMessage
}

var (
	uuidRE = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)
	// instanceRE: garm's instance names ("garm-" + random letters and
	// digits) and our provider ids (domain names).
	instanceRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$`)
)

// ReadEnv reads and checks garm's environment. Every problem names the
// variable and what is allowed.
func ReadEnv(getenv func(string) string) (Env, error) {
	e := Env{
		Command: getenv("GARM_COMMAND"), Version: getenv("GARM_INTERFACE_VERSION"),
		ControllerID: getenv("GARM_CONTROLLER_ID"), PoolID: getenv("GARM_POOL_ID"),
		InstanceID: getenv("GARM_INSTANCE_ID"), ConfigFile: getenv("GARM_PROVIDER_CONFIG_FILE"),
	}
	if e.Version == "" {
		e.Version = V010
	}
	if !slices.Contains(Versions, e.Version) {
		return e, fmt.Errorf("GARM_INTERFACE_VERSION %q is not supported: use %s", cut(e.Version), strings.Join(Versions, " or "))
	}
	known := commandsV010
	if e.Version == V011 {
		known = commandsV011
	}
	if !slices.Contains(known, e.Command) {
		return e, fmt.Errorf("GARM_COMMAND %q is not a command of interface %s: one of %s", cut(e.Command), e.Version, strings.Join(known, ", "))
	}
	if e.Command == CmdVersion || e.Command == CmdVersions || e.Command == CmdConfigSchema || e.Command == CmdExtraSpecSchema {
		return e, nil // need nothing else
	}
	if e.ConfigFile == "" {
		return e, errors.New("GARM_PROVIDER_CONFIG_FILE is not set: it names this provider's TOML configuration")
	}
	if !uuidRE.MatchString(e.ControllerID) {
		return e, fmt.Errorf("GARM_CONTROLLER_ID %q is not a UUID", cut(e.ControllerID))
	}
	e.ControllerID = strings.ToLower(e.ControllerID)
	needPool := e.Command == CmdCreate || e.Command == CmdList ||
		(e.Version == V011 && (e.Command == CmdGet || e.Command == CmdDelete || e.Command == CmdStart || e.Command == CmdStop))
	if needPool && !uuidRE.MatchString(e.PoolID) {
		return e, fmt.Errorf("GARM_POOL_ID %q is not a UUID (%s needs it)", cut(e.PoolID), e.Command)
	}
	if e.PoolID != "" && !uuidRE.MatchString(e.PoolID) {
		return e, fmt.Errorf("GARM_POOL_ID %q is not a UUID", cut(e.PoolID))
	}
	e.PoolID = strings.ToLower(e.PoolID)
	switch e.Command {
	case CmdGet, CmdDelete, CmdStart, CmdStop:
		if !instanceRE.MatchString(e.InstanceID) {
			return e, fmt.Errorf("GARM_INSTANCE_ID %q is not an instance name or provider id (letters, digits, '.', '_', '-'; at most 80)", cut(e.InstanceID))
		}
	}
	if s := getenv("GARM_POOL_EXTRASPECS"); s != "" {
		b, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			return e, fmt.Errorf("GARM_POOL_EXTRASPECS is not base64: %v", err)
		}
		e.ExtraSpecs = b
	}
	return e, nil
}

// cut bounds a value quoted in an error.
func cut(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// Tool is one runner download garm offers.
type Tool struct {
	OS                string `json:"os"`
	Architecture      string `json:"architecture"`
	DownloadURL       string `json:"download_url"`
	Filename          string `json:"filename"`
	SHA256            string `json:"sha256_checksum"`
	TempDownloadToken string `json:"temp_download_token"`
}

// UserDataOptions are the pool's user data options.
type UserDataOptions struct {
	DisableUpdatesOnBoot bool     `json:"disable_updates_on_boot"`
	ExtraPackages        []string `json:"extra_packages"`
	EnableBootDebug      bool     `json:"enable_boot_debug"`
}

// ProxyConfig is the pool's proxy.
type ProxyConfig struct {
	HTTPProxy  string `json:"http_proxy"`
	HTTPSProxy string `json:"https_proxy"`
	NoProxy    string `json:"no_proxy"`
}

// Bootstrap is the BootstrapInstance garm sends to CreateInstance.
type Bootstrap struct {
	Name             string          `json:"name"`
	Tools            []Tool          `json:"tools"`
	RepoURL          string          `json:"repo_url"`
	CallbackURL      string          `json:"callback-url"`
	MetadataURL      string          `json:"metadata-url"`
	InstanceToken    string          `json:"instance-token"`
	SSHKeys          []string        `json:"ssh-keys"`
	ExtraSpecs       json.RawMessage `json:"extra_specs"`
	RunnerGroup      string          `json:"github-runner-group"`
	CACertBundle     []byte          `json:"ca-cert-bundle"`
	Arch             string          `json:"arch"`
	OSType           string          `json:"os_type"`
	Flavor           string          `json:"flavor"`
	Image            string          `json:"image"`
	Labels           []string        `json:"labels"`
	PoolID           string          `json:"pool_id"`
	UserDataOptions  UserDataOptions `json:"user_data_options"`
	JITConfigEnabled bool            `json:"jit_config_enabled"`
	ProxyConfig      ProxyConfig     `json:"proxy_config"`
}

// maxBootstrap bounds stdin (garm's are a few KiB; a CA bundle can be
// tens).
const maxBootstrap = 1 << 20

// ReadBootstrap decodes CreateInstance's stdin, bounded.
func ReadBootstrap(r io.Reader) (*Bootstrap, error) {
	b, err := readStdin(r)
	if err != nil {
		return nil, err
	}
	return decodeBootstrap(b)
}

// readStdin reads stdin, at most maxBootstrap bytes.
func readStdin(r io.Reader) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, maxBootstrap+1))
	if err != nil {
		return nil, fmt.Errorf("read the bootstrap parameters: %w", err)
	}
	if len(b) > maxBootstrap {
		return nil, fmt.Errorf("bootstrap parameters on stdin exceed %d bytes", maxBootstrap)
	}
	return b, nil
}

// decodeBootstrap decodes a BootstrapInstance, naming a field of the
// wrong type.
func decodeBootstrap(b []byte) (*Bootstrap, error) {
	var bs Bootstrap
	if err := json.Unmarshal(b, &bs); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return nil, fmt.Errorf("bootstrap parameters: field %q must be %s, not %s", te.Field, te.Type, te.Value)
		}
		return nil, fmt.Errorf("bootstrap parameters are not valid JSON: %v", err)
	}
	return &bs, nil
}

// Address is one of an instance's addresses.
type Address struct {
	Address string `json:"address"`
	Type    string `json:"type"`
}

// Instance statuses a provider reports.
const (
	StatusRunning = "running"
	StatusStopped = "stopped"
	StatusError   = "error"
	StatusUnknown = "unknown"
)

// Instance is the ProviderInstance garm reads.
type Instance struct {
	ProviderID    string    `json:"provider_id"`
	Name          string    `json:"name"`
	OSType        string    `json:"os_type,omitempty"`
	OSName        string    `json:"os_name,omitempty"`
	OSVersion     string    `json:"os_version,omitempty"`
	OSArch        string    `json:"os_arch,omitempty"`
	Addresses     []Address `json:"addresses,omitempty"`
	Status        string    `json:"status"`
	ProviderFault []byte    `json:"provider_fault,omitempty"`
}
