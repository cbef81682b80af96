package services

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	"github.com/pelletier/go-toml/v2"
)

// The podman argument vectors Start runs. Each is a list of separate
// arguments: no shell ever parses them. Values of variables are never
// among them (RunArgv passes names only; podman takes the values from its
// environment).

// Label marks what the driver creates in the guest, so that a sweep of a
// kept VM can find it.
const Label = "io.libvirt-executor.services=1"

// NetworkCreateArgv creates the job's network. netavark networks other
// than podman's default have DNS (aardvark-dns) on: each container's
// --network-alias answers there.
func NetworkCreateArgv(network string) []string {
	return []string{"podman", "network", "create", "--label", Label, network}
}

// ImageExistsArgv exits 0 when the image is in the guest's store, 1 when not.
func ImageExistsArgv(ref Ref) []string {
	return []string{"podman", "image", "exists", ref.String()}
}

// PullArgv pulls the image (quietly: stdout is the image id).
func PullArgv(ref Ref, authFile string) []string {
	argv := []string{"podman", "pull", "--quiet"}
	if authFile != "" {
		argv = append(argv, "--authfile", authFile)
	}
	return append(argv, ref.String())
}

// RemoveFileArgv removes a file the driver wrote (the credentials), and
// WriteFileArgv's temporary copy of it.
func RemoveFileArgv(path string) []string { return []string{"rm", "-f", "--", path, path + ".lve-tmp"} }

// ExposedPortsArgv prints the image's exposed ports as JSON
// ({"5432/tcp":{}}, or null).
func ExposedPortsArgv(ref Ref) []string {
	return []string{"podman", "image", "inspect", "--format", "{{json .Config.ExposedPorts}}", ref.String()}
}

// RunArgv starts the service detached on the job's network: one
// --network-alias per alias, the environment's names only (--env NAME
// takes the value from podman's own environment, which Start sets), the
// entrypoint as a JSON argument vector, the command as separate
// arguments after the image.
func RunArgv(network string, s Service) []string {
	// k8s-file: its logs can be followed (CI_DEBUG_SERVICES) whatever
	// the image's events backend; journald's cannot with the file one.
	argv := []string{"podman", "run", "--detach", "--pull", "never", "--name", s.Container,
		"--label", Label, "--log-driver", "k8s-file", "--network", network}
	for _, a := range s.Aliases {
		argv = append(argv, "--network-alias", a)
	}
	for _, kv := range s.Env {
		name, _, _ := strings.Cut(kv, "=")
		argv = append(argv, "--env", name)
	}
	if s.EntrypointSet {
		ep := ""
		if len(s.Entrypoint) > 0 {
			b, _ := json.Marshal(s.Entrypoint) // a []string always marshals
			ep = string(b)
		}
		argv = append(argv, "--entrypoint="+ep)
	}
	argv = append(argv, s.Ref.String())
	return append(argv, s.Command...)
}

// AddressArgv prints the container's networks as JSON (name ->
// {"IPAddress": ...}).
func AddressArgv(container string) []string {
	return []string{"podman", "container", "inspect", "--format", "{{json .NetworkSettings.Networks}}", container}
}

// LogsArgv prints the last n lines of the container's output.
func LogsArgv(container string, n int) []string {
	return []string{"podman", "logs", "--tail", strconv.Itoa(n), container}
}

// FollowLogsArgv streams the container's output until it ends; since, if
// set, is podman's --since (a duration before now, such as "1s").
func FollowLogsArgv(container, since string) []string {
	argv := []string{"podman", "logs", "--follow"}
	if since != "" {
		argv = append(argv, "--since", since)
	}
	return append(argv, container)
}

// ServiceContainersArgv lists the names of the running containers the
// driver labelled.
func ServiceContainersArgv() []string {
	return []string{"podman", "ps", "--filter", "label=" + Label, "--format", "{{.Names}}"}
}

// waitScript is the fixed probe of a TCP port, run with the address and
// port as its positional arguments ($1, $2): a connect attempt through
// bash's /dev/tcp every 200 ms until one succeeds; the caller bounds it
// with timeout(1).
const waitScript = `until (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; do sleep 0.2; done`

// WaitPortArgv waits until addr:port accepts a connection, at most
// timeout (whole seconds, at least 1); timeout(1) ends it with status 124.
func WaitPortArgv(addr netip.Addr, port int, seconds int) []string {
	return []string{"timeout", strconv.Itoa(max(1, seconds)), "bash", "-c", waitScript, "lve-wait", addr.String(), strconv.Itoa(port)}
}

// writeFileScript replaces a file with stdin atomically (a temporary file
// beside it, renamed over it), mode $2; $1 is the path.
const writeFileScript = `umask 077 && t="$1.lve-tmp" && cat >"$t" && chmod "$2" "$t" && mv -f "$t" "$1"`

// WriteFileArgv replaces path with the command's stdin, with mode (octal).
// path and mode are the driver's own constants, never the job's.
func WriteFileArgv(path, mode string) []string {
	return []string{"sh", "-c", writeFileScript, "lve-write", path, mode}
}

// ReadFileArgv prints a file.
func ReadFileArgv(path string) []string { return []string{"cat", "--", path} }

// HostsPath is the guest's hosts file; RegistriesPath the drop-in the
// registry mirrors go to.
const (
	HostsPath      = "/etc/hosts"
	RegistriesPath = "/etc/containers/registries.conf.d/50-libvirt-executor.conf"
)

// ParseExposedPorts reads ExposedPortsArgv's output: the TCP ports,
// sorted, at most 64 of them. UDP ports are not waited for.
func ParseExposedPorts(out []byte) ([]int, error) {
	s := strings.TrimSpace(string(out))
	if s == "" || s == "null" {
		return nil, nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		return nil, fmt.Errorf("the image's exposed ports are not JSON: %v", err)
	}
	var ports []int
	for k := range m {
		num, proto, _ := strings.Cut(k, "/")
		if proto != "" && proto != "tcp" {
			continue
		}
		p, err := strconv.Atoi(num)
		if err != nil || p < 1 || p > 65535 {
			continue
		}
		ports = append(ports, p)
	}
	sort.Ints(ports)
	if len(ports) > 64 {
		ports = ports[:64]
	}
	return ports, nil
}

// ParseAddress reads AddressArgv's output: the container's address on
// network.
func ParseAddress(out []byte, network string) (netip.Addr, error) {
	var m map[string]struct {
		IPAddress string `json:"IPAddress"`
	}
	if err := json.Unmarshal([]byte(strings.TrimSpace(string(out))), &m); err != nil {
		return netip.Addr{}, fmt.Errorf("the container's networks are not JSON: %v", err)
	}
	n, ok := m[network]
	if !ok {
		return netip.Addr{}, fmt.Errorf("the container is not on network %s", network)
	}
	a, err := netip.ParseAddr(n.IPAddress)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("the container's address %q on %s: %v", cutText(n.IPAddress, 64), network, err)
	}
	return a, nil
}

// Mirror is a registry's pull-through mirrors for the guest's
// registries.conf.
type Mirror struct {
	// Registry is the prefix they stand in for ("docker.io",
	// "registry.example:5000").
	Registry string
	// Locations are the mirrors, tried in order before the registry.
	Locations []MirrorLocation
}

// MirrorLocation is one mirror.
type MirrorLocation struct {
	// Location is HOST[:PORT][/PATH].
	Location string
	// Insecure: it speaks plain HTTP (a cache on the host's network).
	Insecure bool
}

// RegistriesConf is the registries.conf drop-in (containers-registries.conf
// version 2) that points each registry at its mirrors, marshalled from
// typed values (never a template).
func RegistriesConf(mirrors []Mirror) ([]byte, error) {
	type loc struct {
		Location string `toml:"location"`
		Insecure bool   `toml:"insecure,omitempty"`
	}
	type reg struct {
		Prefix   string `toml:"prefix"`
		Location string `toml:"location"`
		Mirror   []loc  `toml:"mirror"`
	}
	var doc struct {
		Registry []reg `toml:"registry"`
	}
	for _, m := range mirrors {
		r := reg{Prefix: m.Registry, Location: m.Registry}
		for _, l := range m.Locations {
			r.Mirror = append(r.Mirror, loc(l))
		}
		doc.Registry = append(doc.Registry, r)
	}
	if len(doc.Registry) == 0 {
		return nil, nil
	}
	b, err := toml.Marshal(doc)
	if err != nil {
		return nil, err
	}
	return append([]byte("# written by libvirt-executor for this job's services ([services] mirrors)\n"), b...), nil
}
