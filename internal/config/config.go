// Package config loads and validates the administrator's driver configuration
// (TOML). Decoding is strict: an unknown key is an error, so a typo never
// silently falls back to a default.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"
)

// DefaultPath is where the executables look when neither the --config flag
// nor the LIBVIRT_EXECUTOR_CONFIG environment variable names a file.
const DefaultPath = "/etc/libvirt-executor/config.toml"

// EnvPath names the environment variable that overrides DefaultPath.
const EnvPath = "LIBVIRT_EXECUTOR_CONFIG"

// Domain types.
const (
	DomainKVM  = "kvm"
	DomainQEMU = "qemu"
	DomainAuto = "auto"
)

// Key injection methods.
const (
	InjectSMBIOS    = "smbios"
	InjectCloudInit = "cloud-init"
)

// Boot modes.
const (
	BootDisk   = "disk"
	BootKernel = "kernel"
)

// Host key policies.
const (
	HostKeyPinned = "pinned"
	// HostKeyInsecureIgnore skips host key verification. Loudly named on
	// purpose: it lets anyone who answers on the guest's address receive the
	// job's script.
	HostKeyInsecureIgnore = "insecure-ignore-host-key"
)

// Config is the whole driver configuration.
type Config struct {
	// LibvirtURI is the libvirt connection URI. Default "qemu:///system".
	LibvirtURI string `toml:"libvirt_uri"`
	// DomainType is "kvm", "qemu" (software emulation, TCG) or "auto": kvm
	// when libvirt reports it available for the host architecture, else qemu.
	DomainType string `toml:"domain_type"`
	// StoragePool is the libvirt storage pool that receives each job's
	// overlay disk and seed volume. Default "default".
	StoragePool string `toml:"storage_pool"`
	// Network is the libvirt network the job VMs attach to; its DHCP leases
	// give the guest address. Default "default".
	Network string `toml:"network"`
	// NamePrefix starts the name of everything the driver creates: domains,
	// volumes, state directories. Lower-case letters, digits and '-', 1-16
	// characters, starting with a letter. Default "lve". Give each runner
	// entry that shares a host with another GitLab instance its own prefix.
	NamePrefix string `toml:"name_prefix"`
	// StateDir holds per-job state (address, pinned host key, client key) in
	// 0700 directories, and the controller identity. Default
	// "/var/lib/libvirt-executor".
	StateDir string `toml:"state_dir"`
	// DefaultImage is the image used when a job does not ask for one. Must be
	// a key of Images.
	DefaultImage string `toml:"default_image"`
	// IsolateGuests puts each job VM's network port in isolated mode, so job
	// VMs on one bridge cannot reach each other (libvirt <port isolated>).
	// Default true.
	IsolateGuests *bool `toml:"isolate_guests"`
	// L2Filter puts the project's libvirt network filter (vm.FilterName, or
	// vm.FilterEgressName for an image with egress_allow) on every VM's
	// interface: a VM can send only from its own MAC and from the address
	// the network's DHCP gave it, ARP only for that address, and a GitLab
	// job VM cannot reach garm's endpoint port on the host. The engine
	// defines the filters on first use; they need libvirt's clean-traffic
	// (docs/security.md; doctor checks). Default true.
	L2Filter *bool `toml:"l2_filter"`
	// StaticAddresses gives every VM a static DHCP host entry of its own on
	// the network (its MAC to a free address, named after it), added before
	// its domain is defined and removed with it: the filter carries the
	// address from the first packet, and on a network without a dynamic
	// range a guest gets no second lease whatever client identifier it
	// sends. A network without libvirt's DHCP is left alone. Default true.
	StaticAddresses *bool `toml:"static_addresses"`
	// HostKeyPolicy is "pinned" (default: the per-job host key must match) or
	// "insecure-ignore-host-key" (no verification; for debugging images only).
	HostKeyPolicy string `toml:"host_key_policy"`
	// InsecureJobIDFromEnv lets the stages take the job id from
	// CUSTOM_ENV_CI_JOB_ID when the runner provides no JOB_RESPONSE_FILE.
	// Default false: without the file every stage fails as a system failure.
	// Loudly named on purpose: CUSTOM_ENV_* values can be set by the job
	// itself, so a job could take over another job's VM name (and have it
	// removed, or run in it). Every GitLab Runner that runs a Custom executor
	// provides the file; enable this only for a runner that does not, with
	// trusted jobs only.
	InsecureJobIDFromEnv bool `toml:"insecure_job_id_from_env"`

	Defaults Defaults `toml:"defaults"`
	Limits   Limits   `toml:"limits"`
	Capacity Capacity `toml:"capacity"`
	Debug    Debug    `toml:"debug"`
	Timeouts Timeouts `toml:"timeouts"`
	SSH      SSH      `toml:"ssh"`
	// Serve configures libvirt-executor serve (the standby pool service).
	Serve PoolService `toml:"serve"`
	// GuestTools are host programs every job VM gets on a read-only disk.
	GuestTools GuestTools `toml:"guest_tools"`
	// Log configures the stages' structured log on the host.
	Log Log `toml:"log"`
	// Garm configures the garm external provider (libvirt-executor-garm).
	Garm Garm `toml:"garm"`
	// GitLab configures what the GitLab Runner front end does with job
	// keywords the driver does not implement.
	GitLab GitLab `toml:"gitlab"`
	// Cache configures the host cache (off unless cache.dir is set).
	Cache Cache `toml:"cache"`
	// Registry is where images with a source come from ([registry]).
	Registry Registry `toml:"registry"`
	// Services configures a job's services in its VM ([services]).
	Services Services `toml:"services"`
	// GitHubHooks configures libvirt-executor-hooks, the GitHub Actions
	// runner's container hook ([github_hooks]).
	GitHubHooks GitHubHooks `toml:"github_hooks"`
	// Images maps an image name (what a job's `image:` selects) to its
	// definition. Names: lower-case letters, digits, '.', '_' and '-', 1-63
	// characters, starting with a letter or digit.
	Images map[string]*Image `toml:"images"`

	// Path is the file the configuration was read from (not a TOML key).
	Path string `toml:"-"`
	// Text is the TOML it was parsed from: the driver's helper processes
	// (connection holder, reaper) get it on stdin, so they work with the
	// very configuration of the stage that started them.
	Text []byte `toml:"-"`
}

// Defaults are the resources a job VM gets.
type Defaults struct {
	// VCPUs per job VM. Default 2, allowed 1-64.
	VCPUs int `toml:"vcpus"`
	// MemoryMiB per job VM. Default 2048, allowed 128-262144.
	MemoryMiB int `toml:"memory_mib"`
	// DiskGiB is the job disk's virtual size; 0 keeps the base image's size.
	// A value smaller than the base image is raised to the base size.
	// Allowed 0-4096.
	DiskGiB int `toml:"disk_gib"`
}

// Limits bound what a job may request. Jobs ask through the CI variables
// LIBVIRT_EXECUTOR_VCPUS, LIBVIRT_EXECUTOR_MEMORY and LIBVIRT_EXECUTOR_DISK;
// without AllowJobOverrides such a request fails the job with a clear message.
type Limits struct {
	// AllowJobOverrides lets jobs request their own vCPUs, memory and disk
	// within the maximums below. Default false.
	AllowJobOverrides bool `toml:"allow_job_overrides"`
	// MaxVCPUs bounds a job's vCPU request. Default: defaults.vcpus.
	MaxVCPUs int `toml:"max_vcpus"`
	// MaxMemoryMiB bounds a job's memory request. Default: defaults.memory_mib.
	MaxMemoryMiB int `toml:"max_memory_mib"`
	// MaxDiskGiB bounds a job's disk request. Default: defaults.disk_gib.
	MaxDiskGiB int `toml:"max_disk_gib"`
}

// Capacity bounds what this installation runs at once on the host. When a
// new job would exceed it, prepare waits (telling the job log) instead of
// overcommitting the host.
type Capacity struct {
	// MaxVMs is the most job VMs at once; 0 means no limit.
	MaxVMs int `toml:"max_vms"`
	// MemoryBudgetMiB is the most memory all job VMs may have together; 0
	// means no limit.
	MemoryBudgetMiB int `toml:"memory_budget_mib"`
	// Wait bounds how long prepare waits for room. Default "30m"; then the
	// attempt fails as a system failure (and the runner retries it).
	Wait Duration `toml:"wait"`
}

// Debug is the escape hatch for debugging failed jobs.
type Debug struct {
	// AllowKeepOnFailure lets a job keep its VM after it failed, by setting
	// the CI variable LIBVIRT_EXECUTOR_KEEP_ON_FAILURE=true. Default false.
	AllowKeepOnFailure bool `toml:"allow_keep_on_failure"`
	// KeepMaxAge is how long a kept VM lives; then the sweep removes it.
	// Default "2h".
	KeepMaxAge Duration `toml:"keep_max_age"`
	// KeepMaxPerProject is how many kept VMs one project (a GitLab
	// instance's project) holds at most: keeping one more removes that
	// project's oldest kept VM. Default 1, allowed 1-16.
	KeepMaxPerProject int `toml:"keep_max_per_project"`
	// KeepMax is how many kept VMs the host holds at most, all projects
	// together: at the cap, a failed job's VM is not kept (another
	// project's is never removed for it). Default 2, allowed 1-64.
	KeepMax int `toml:"keep_max"`
}

// Timeouts bound the waits.
type Timeouts struct {
	// Boot bounds the time from domain start until SSH is ready. Default "5m".
	Boot Duration `toml:"boot"`
	// Cleanup bounds cleanup, and the undo of a failed prepare, which run on
	// a fresh deadline even after a cancel. Default "2m".
	Cleanup Duration `toml:"cleanup"`
	// JobSlack is added to the job's timeout to form the deadline recorded
	// in each VM's ownership metadata, after which a sweep may remove it.
	// Default "30m".
	JobSlack Duration `toml:"job_slack"`
}

// SSH settings for the connection to the guest.
type SSH struct {
	// KeepaliveInterval is how often a keepalive is sent. Default "3s".
	KeepaliveInterval Duration `toml:"keepalive_interval"`
	// KeepaliveCount is how many intervals may pass without a reply before
	// the guest is declared dead (a system failure). Default 3: a dead guest
	// is noticed 9-12 s after its last reply.
	KeepaliveCount int `toml:"keepalive_count"`
	// ConnectTimeout bounds one TCP connect + handshake attempt. Default "5s".
	ConnectTimeout Duration `toml:"connect_timeout"`
	// ConnectionHolder: prepare leaves one SSH connection per job, kept by
	// a small per-job process, and every run stage uses it instead of a
	// new connection of its own (docs/design.md, "Connection holder").
	// Default true; false makes every stage connect directly.
	ConnectionHolder *bool `toml:"connection_holder"`
}

// GuestTools are host programs made available, read-only, in every job VM
// (docs/images.md, "The guest tools disk").
type GuestTools struct {
	// GitLabRunner is the gitlab-runner binary the guests get at
	// /opt/libvirt-executor/bin/gitlab-runner (the images link
	// /usr/local/bin/gitlab-runner to it): the runner's scripts call it in
	// the guest for caches and artifacts. "auto" (default): the
	// gitlab-runner on the stage's PATH, if there is one; "none": no
	// binary; else the absolute path of a linux/amd64 gitlab-runner.
	GitLabRunner string `toml:"gitlab_runner"`
	// StepRunner is the step-runner binary (GitLab Steps: the runner runs
	// a run: job's steps with `step-runner ci` in the guest) the guests
	// get at /opt/libvirt-executor/bin/step-runner (the images link
	// /usr/local/bin/step-runner to it). "auto" (default): the step-runner
	// on the stage's PATH, if there is one; "none": no binary (run: jobs
	// then need one in the image); else the absolute path of a linux/amd64
	// step-runner.
	StepRunner string `toml:"step_runner"`
	// Agent is the guest agent (lve-agent, a static program built with
	// the driver) the guests get at /opt/libvirt-executor/bin/lve-agent:
	// the job's connection holder starts it once per job and runs every
	// stage through it (one fork in the guest per stage instead of an SSH
	// session and the stage wrapper's processes). "auto" (default): the
	// one installed with these executables (next to them, or in
	// ../lib/libvirt-executor/); "none": no agent (stages use the
	// wrapper); else the absolute path of an lve-agent binary of this
	// version.
	Agent string `toml:"agent"`
}

// Guest tools settings.
const (
	GuestToolsAuto = "auto"
	GuestToolsNone = "none"
)

// HolderEnabled reports whether stages go through the job's connection
// holder (SSH.ConnectionHolder, default true).
func (s SSH) HolderEnabled() bool { return s.ConnectionHolder == nil || *s.ConnectionHolder }

// Image is one base image jobs may use.
type Image struct {
	// Base is the absolute path of the base disk image (readable by libvirt).
	// The job disk is a linked clone: a qcow2 overlay with Base as backing file.
	Base string `toml:"base"`
	// Source, instead of Base, names the image in an OCI registry:
	// "oci://HOST/REPO:TAG" or "oci://HOST/REPO@sha256:HEX" ([registry];
	// docs/fleet.md). Base, Kernel and Initrd are then the files of the
	// image the host's store has for it (filled in when the configuration
	// is loaded), Digest its manifest's digest.
	Source string `toml:"source"`
	Digest string `toml:"-"`
	// SharedMemory: the image's machines boot with shared guest memory
	// (memfd), so that a virtiofs share can be hot-plugged into one: the
	// standby machines of github_hooks.vm_image can then take a hook job,
	// whose runner's directories they get when claimed (a warm start).
	// Default false: hook jobs on the image boot cold. It is part of the
	// image's machine spec: every configuration file of the host (the pool
	// service's, each runner's) must say the same.
	SharedMemory bool `toml:"shared_memory"`
	// Snapshot: a job of the image that finds no idle standby machine
	// starts as a clone of the image's memory snapshot, when there is a
	// current one, instead of booting (issue #48, docs/pool.md): the pool
	// service, or `libvirt-executor image snapshot NAME`, makes it. Needs
	// boot = "kernel", key_injection = "smbios", address_source =
	// "lease", no shared_memory, and a guest that waits for its
	// credentials disk when booted with lve.snapshot=template (the
	// project's tiny and Debian images). Default false.
	Snapshot bool `toml:"snapshot"`
	// Format of Base: "qcow2" (default) or "raw".
	Format string `toml:"format"`
	// User is the guest account that runs jobs. Default "root". Images using
	// key_injection "smbios" must use "root".
	User string `toml:"user"`
	// Shell runs the job scripts; GitLab's scripts need "bash" (default).
	Shell string `toml:"shell"`
	// BuildsDir is the guest directory for builds. Default "/builds".
	BuildsDir string `toml:"builds_dir"`
	// CacheDir is the guest directory for caches. Default "/cache".
	CacheDir string `toml:"cache_dir"`
	// KeyInjection is how the per-job keys reach the guest: "smbios"
	// (systemd >= 252 credentials, or the image's own init reading them) or
	// "cloud-init" (a NoCloud seed volume labelled cidata). Default "smbios".
	KeyInjection string `toml:"key_injection"`
	// Boot is "disk" (firmware boots the disk; default) or "kernel" (direct
	// kernel boot with Kernel, Initrd and Cmdline).
	Boot string `toml:"boot"`
	// Kernel is the absolute path of the kernel for boot = "kernel".
	Kernel string `toml:"kernel"`
	// Initrd is the absolute path of the initrd for boot = "kernel" (optional).
	Initrd string `toml:"initrd"`
	// Cmdline is the kernel command line for boot = "kernel".
	Cmdline string `toml:"cmdline"`
	// AddressSource is where the guest's address comes from: "lease" (the
	// libvirt network's DHCP lease for the VM's MAC; default) or "agent"
	// (qemu-guest-agent in the guest, for networks whose DHCP server is not
	// libvirt's; the domain then gets the agent channel).
	AddressSource string `toml:"address_source"`
	// Machine is the QEMU machine type. Default "pc".
	Machine string `toml:"machine"`
	// CacheVia is how the host cache ([cache]) goes into and out of this
	// image's guests: "disk" (default) hot-plugs a read-only disk holding
	// the project's cache for the restore and an empty one the guest writes
	// its cache to for the save, so nothing is encrypted on the way (it
	// needs PCI hot plug, as Debian's kernels have, and a user that can
	// read and write the disks or sudo without a password); "ssh" copies
	// over the job's SSH connection. "disk" falls back to "ssh" for a job
	// whose guest does not see or cannot use a disk within 10 s.
	// docs/caching.md.
	CacheVia string `toml:"cache_via"`
	// EgressAllow, when set, is the only destinations this image's VMs
	// reach besides the network's own address (DHCP, DNS and the host
	// services the guard opens): "CIDR" or "IP" (any protocol and port)
	// and "CIDR:PORT" or "IP:PORT" (TCP and UDP to that port), IPv4 only.
	// An empty list allows the network's address only. Unset: no limit.
	// Needs l2_filter (enforced by the lve-vm-egress filter).
	EgressAllow []string `toml:"egress_allow"`
	// VCPUs and MemoryMiB override Defaults for this image (0 = use defaults).
	VCPUs     int `toml:"vcpus"`
	MemoryMiB int `toml:"memory_mib"`
	// DiskGiB overrides Defaults.DiskGiB for this image (0 = use defaults).
	DiskGiB int `toml:"disk_gib"`
	// Pool, if set, keeps booted VMs of this image (at its default size)
	// idle for jobs to claim: a warm start (libvirt-executor serve keeps it;
	// docs/pool.md).
	Pool *Pool `toml:"pool"`

	// Name is the image's key in [images] (not a TOML key).
	Name string `toml:"-"`
}

// Pool is an image's standby pool: idle VMs booted ahead of the jobs.
type Pool struct {
	// IdleCount is how many idle VMs (booted and SSH-verified, or booting)
	// the service keeps at least. Allowed 0-64; 0 keeps none except as
	// demand asks (MaxIdle).
	IdleCount int `toml:"idle_count"`
	// MaxIdle bounds the idle VMs when recent demand asks for more than
	// IdleCount: the target is the number of claims in the last IdleTime,
	// at least IdleCount and at most MaxIdle. Default IdleCount; allowed
	// IdleCount-64.
	MaxIdle int `toml:"max_idle"`
	// IdleTime is how long an idle VM above IdleCount may wait for a job
	// before it is retired, and the window in which claims count as demand.
	// Default "10m".
	IdleTime Duration `toml:"idle_time"`
	// MaxAge is how old an idle VM may get; then it is retired and replaced
	// (a job never gets an older one). Default "1h".
	MaxAge Duration `toml:"max_age"`
	// Prepull are container images ([services], docs/services.md) the
	// service pulls into each idle VM of the image once it has booted,
	// before any job can claim it: a warm job's services and container
	// image with pull policy if-not-present pull nothing. Public images
	// only (an idle VM has no job's credentials). At most 16.
	Prepull []string `toml:"prepull"`
}

// PoolService configures libvirt-executor serve, the service that keeps
// the standby pools.
type PoolService struct {
	// BootParallelism bounds how many pool VMs boot at once. Default 2,
	// allowed 1-32.
	BootParallelism int `toml:"boot_parallelism"`
	// Interval is how often the service looks at its pools (claims are
	// noticed within it). Default "250ms", allowed 50ms-10s.
	Interval Duration `toml:"interval"`
	// HealthInterval is how often each idle VM's libvirt state is checked.
	// Default "5s".
	HealthInterval Duration `toml:"health_interval"`
	// MetricsListen is the host:port the service serves Prometheus metrics
	// on (/metrics). Default "127.0.0.1:9451" (loopback only); "off" serves
	// none.
	MetricsListen string `toml:"metrics_listen"`
	// EventSpoolMiB bounds the spool of event records the stages leave for
	// the service (state_dir/events): when the service is down that long,
	// the oldest records go (counted as lost). Default 16, allowed 1-1024.
	EventSpoolMiB int `toml:"event_spool_mib"`
}

// GitLab configures the GitLab Runner Custom executor front end.
type GitLab struct {
	// Services is what prepare does with a job that asks for `services:`,
	// which the driver does not provide (docs/services.md): "warn"
	// (default: the job runs, and its log names the services that are not
	// started) or "fail" (the job fails in prepare, before any VM boots,
	// as a build failure naming them).
	Services string `toml:"services"`
	// Steps is how a GitLab Steps job's (`run:`) step stage runs
	// (docs/steps.md): "shim" (default: the runner's own script, which
	// runs `step-runner ci` in the guest) or "native" (the driver starts
	// `step-runner serve` in the guest and runs the steps through its gRPC
	// service over the job's SSH connection, re-attaching when that
	// drops).
	Steps string `toml:"steps"`
}

// gitlab.steps values.
const (
	StepsShim   = "shim"
	StepsNative = "native"
)

// gitlab.services values.
const (
	ServicesWarn = "warn"
	ServicesFail = "fail"
)

// Garm configures the garm external provider: what garm pools may ask for.
type Garm struct {
	// Images are the images a garm pool may name (its "image"); empty
	// means every configured image.
	Images []string `toml:"images"`
	// Flavors are the sizes a garm pool may name (its "flavor"). Without
	// any, the only flavor is "default": the image's default size.
	Flavors map[string]Size `toml:"flavors"`
	// ExtraSpecs are the extra_specs keys a pool may set: "vcpus",
	// "memory_mib", "disk_gib", each within limits.max_*. Default none.
	ExtraSpecs []string `toml:"extra_specs"`
	// MaxAge is how long a garm instance may live before the sweep removes
	// it (garm normally deletes it after its one job). Default "24h".
	MaxAge Duration `toml:"max_age"`
	// Endpoints are the origins (scheme://host[:port]) of garm's callback
	// and metadata URLs and of the runner download that the guests must
	// reach. When set, CreateInstance refuses callback and metadata URLs
	// of any other origin, and doctor checks that each answers and, for
	// the network's own address, that the guard lets the guests reach its
	// port. Default none (not checked).
	Endpoints []string `toml:"endpoints"`
	// OrphanAfter is how long garm may stay silent about a pool (no call
	// naming it: garm lists every pool's instances again and again) before
	// its instances are reported as orphans: by list, doctor, the sweep's
	// log and the metrics. They are still removed only at MaxAge. Default
	// "1h".
	OrphanAfter Duration `toml:"orphan_after"`
	// SeedKeep is how long an instance keeps its cloud-init seed (which
	// holds garm's instance token) at most: the provider removes the seed
	// once the guest's bootstrap says on the console that it is done, and
	// in any case once the instance is this old (cloud-init needs the seed
	// only in its first boot's init stage). Default "10m".
	SeedKeep Duration `toml:"seed_keep"`
}

// Origin is the origin (scheme://host:port, lower case, the port always
// written) of an http(s) URL, for comparing garm's URLs with
// garm.endpoints.
func Origin(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" || u.User != nil {
		return "", fmt.Errorf("%q is not an http(s) URL of a host (like \"http://192.168.122.1:9997\")", raw)
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	return u.Scheme + "://" + net.JoinHostPort(strings.ToLower(u.Hostname()), port), nil
}

// GarmExtraSpecKeys are the extra_specs keys an admin may permit.
var GarmExtraSpecKeys = []string{"vcpus", "memory_mib", "disk_gib"}

// MetricsOff is serve.metrics_listen's value for no metrics endpoint.
const MetricsOff = "off"

// Log configures the host-side structured log of the stages: one record
// per step (internal/obs.StepLog).
type Log struct {
	// Steps is where step records go: "auto" (default: the systemd journal
	// when its socket exists, else nowhere), "journald", "file" or "none".
	Steps string `toml:"steps"`
	// StepsFile is the JSON-lines file for Steps = "file". Default
	// state_dir/log/steps.jsonl.
	StepsFile string `toml:"steps_file"`
	// StepsFileMiB is when the file is rotated (one older file, .1, is
	// kept). Default 64, allowed 1-4096.
	StepsFileMiB int `toml:"steps_file_mib"`
}

// StepLogKinds are the allowed values of log.steps.
var StepLogKinds = []string{"auto", "journald", "file", "none"}

// Duration is a time.Duration written as a Go duration string ("90s", "5m").
type Duration time.Duration

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("%q is not a duration (examples: \"90s\", \"5m\")", string(b))
	}
	*d = Duration(v)
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// D returns the value as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// Resolve picks the configuration path: the flag value if set, else the
// environment variable, else DefaultPath.
func Resolve(flagValue string, getenv func(string) string) string {
	if flagValue != "" {
		return flagValue
	}
	if v := getenv(EnvPath); v != "" {
		return v
	}
	return DefaultPath
}

// Load reads, decodes and validates the file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w (set --config or %s to choose another file)", path, err, EnvPath)
	}
	c, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	c.Path = path
	return c, nil
}

// Parse decodes and validates TOML text.
func Parse(data []byte) (*Config, error) {
	var c Config
	dec := toml.NewDecoder(bytes.NewReader(data)).DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return nil, describeDecodeError(err)
	}
	c.applyDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	c.Registry.maxVirtual = c.MaxBaseBytes()
	c.resolveSources()
	c.Text = data
	return &c, nil
}

func describeDecodeError(err error) error {
	var strict *toml.StrictMissingError
	if errors.As(err, &strict) {
		var msgs []string
		for _, e := range strict.Errors {
			row, col := e.Position()
			msgs = append(msgs, fmt.Sprintf("line %d column %d: unknown key %q", row, col, strings.Join(e.Key(), ".")))
		}
		return fmt.Errorf("%s (see docs/configuration.md for the allowed keys)", strings.Join(msgs, "; "))
	}
	var de *toml.DecodeError
	if errors.As(err, &de) {
		row, col := de.Position()
		key := strings.Join(de.Key(), ".")
		if key != "" {
			return fmt.Errorf("line %d column %d: key %q: %s", row, col, key, de.Error())
		}
		return fmt.Errorf("line %d column %d: %s", row, col, de.Error())
	}
	return err
}

func (c *Config) applyDefaults() {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&c.LibvirtURI, "qemu:///system")
	def(&c.DomainType, DomainAuto)
	def(&c.StoragePool, "default")
	def(&c.Network, "default")
	def(&c.NamePrefix, "lve")
	def(&c.StateDir, DefaultStateDir)
	def(&c.HostKeyPolicy, HostKeyPinned)
	def(&c.GuestTools.GitLabRunner, GuestToolsAuto)
	def(&c.GuestTools.StepRunner, GuestToolsAuto)
	def(&c.GuestTools.Agent, GuestToolsAuto)
	if c.IsolateGuests == nil {
		yes := true
		c.IsolateGuests = &yes
	}
	if c.L2Filter == nil {
		yes := true
		c.L2Filter = &yes
	}
	if c.StaticAddresses == nil {
		yes := true
		c.StaticAddresses = &yes
	}
	if c.Defaults.VCPUs == 0 {
		c.Defaults.VCPUs = 2
	}
	if c.Defaults.MemoryMiB == 0 {
		c.Defaults.MemoryMiB = 2048
	}
	if c.Limits.MaxVCPUs == 0 {
		c.Limits.MaxVCPUs = c.Defaults.VCPUs
	}
	if c.Limits.MaxMemoryMiB == 0 {
		c.Limits.MaxMemoryMiB = c.Defaults.MemoryMiB
	}
	if c.Limits.MaxDiskGiB == 0 {
		c.Limits.MaxDiskGiB = c.Defaults.DiskGiB
	}
	if c.Debug.KeepMaxAge == 0 {
		c.Debug.KeepMaxAge = Duration(2 * time.Hour)
	}
	if c.Debug.KeepMaxPerProject == 0 {
		c.Debug.KeepMaxPerProject = 1
	}
	if c.Debug.KeepMax == 0 {
		c.Debug.KeepMax = 2
	}
	if c.Capacity.Wait == 0 {
		c.Capacity.Wait = Duration(30 * time.Minute)
	}
	if c.Timeouts.Boot == 0 {
		c.Timeouts.Boot = Duration(5 * time.Minute)
	}
	if c.Timeouts.Cleanup == 0 {
		c.Timeouts.Cleanup = Duration(2 * time.Minute)
	}
	if c.Timeouts.JobSlack == 0 {
		c.Timeouts.JobSlack = Duration(30 * time.Minute)
	}
	if c.SSH.KeepaliveInterval == 0 {
		c.SSH.KeepaliveInterval = Duration(3 * time.Second)
	}
	if c.SSH.KeepaliveCount == 0 {
		c.SSH.KeepaliveCount = 3
	}
	if c.SSH.ConnectTimeout == 0 {
		c.SSH.ConnectTimeout = Duration(5 * time.Second)
	}
	if c.Serve.BootParallelism == 0 {
		c.Serve.BootParallelism = 2
	}
	if c.Serve.Interval == 0 {
		c.Serve.Interval = Duration(250 * time.Millisecond)
	}
	if c.Serve.HealthInterval == 0 {
		c.Serve.HealthInterval = Duration(5 * time.Second)
	}
	def(&c.Serve.MetricsListen, "127.0.0.1:9451")
	if c.Serve.EventSpoolMiB == 0 {
		c.Serve.EventSpoolMiB = 16
	}
	if c.Garm.MaxAge == 0 {
		c.Garm.MaxAge = Duration(24 * time.Hour)
	}
	if c.Garm.OrphanAfter == 0 {
		c.Garm.OrphanAfter = Duration(time.Hour)
	}
	if c.Garm.SeedKeep == 0 {
		c.Garm.SeedKeep = Duration(10 * time.Minute)
	}
	def(&c.GitLab.Services, ServicesWarn)
	def(&c.GitLab.Steps, StepsShim)
	c.Cache.applyDefaults()
	c.Registry.applyDefaults()
	c.Services.applyDefaults()
	c.GitHubHooks.applyDefaults()
	def(&c.Log.Steps, "auto")
	def(&c.Log.StepsFile, filepath.Join(c.StateDir, "log", "steps.jsonl"))
	if c.Log.StepsFileMiB == 0 {
		c.Log.StepsFileMiB = 64
	}
	for name, img := range c.Images {
		if img == nil {
			continue
		}
		img.Name = name
		if p := img.Pool; p != nil {
			if p.MaxIdle == 0 {
				p.MaxIdle = p.IdleCount
			}
			if p.IdleTime == 0 {
				p.IdleTime = Duration(10 * time.Minute)
			}
			if p.MaxAge == 0 {
				p.MaxAge = Duration(time.Hour)
			}
		}
		def(&img.Format, "qcow2")
		def(&img.User, "root")
		def(&img.Shell, "bash")
		def(&img.BuildsDir, "/builds")
		def(&img.CacheDir, "/cache")
		def(&img.KeyInjection, InjectSMBIOS)
		def(&img.Boot, BootDisk)
		def(&img.Machine, "pc")
		def(&img.AddressSource, "lease")
		def(&img.CacheVia, CacheViaDisk)
	}
}

var (
	prefixRE    = regexp.MustCompile(`^[a-z][a-z0-9-]{0,15}$`)
	imageNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
	// libvirt object names chosen by the admin: conservative, no path parts.
	libvirtNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)
	userRE        = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)
	shellRE       = regexp.MustCompile(`^(bash|sh|/[A-Za-z0-9/._-]+)$`)
	guestPathRE   = regexp.MustCompile(`^/[A-Za-z0-9/._-]*$`)
)

// ValidImageName reports whether s has the shape of an image name. Job input
// is matched against configured names; this only rejects nonsense early.
func ValidImageName(s string) bool { return imageNameRE.MatchString(s) }

// Validate checks every value and reports all problems at once, each naming
// the key and what is allowed. The sections are checked in a fixed order
// (the top-level keys, then each table, images and default_image last), so
// the message is the same every time.
// A configuration with one image and no default_image gets that image as
// its default.
func (c *Config) Validate() error {
	var p problems
	c.validateTop(&p)
	c.GuestTools.validate(&p)
	c.Defaults.validate(&p)
	c.Limits.validate(&p)
	c.Capacity.validate(&p, c.Limits)
	c.Debug.validate(&p)
	c.Timeouts.validate(&p)
	c.SSH.validate(&p)
	c.Serve.validate(&p)
	c.Log.validate(&p)
	c.Garm.validate(&p, c)
	c.GitLab.validate(&p)
	c.Cache.validate(&p, c)
	c.Registry.validate(&p)
	c.Services.validate(&p)
	c.Services.ContainerJobs.validate(&p, c.Services.Enabled, c.ImageNames())
	c.GitHubHooks.validate(&p, c.ImageNames())
	for _, n := range c.ImageNames() {
		if img := c.Images[n]; img.Pool != nil && len(img.Pool.Prepull) > 0 && !c.Services.Enabled {
			p.bad("images."+n+".pool.prepull", "pulls container images for [services], which is off: set [services] enabled = true, or remove prepull")
		}
	}
	c.validateImages(&p)
	c.validateDefaultImage(&p)
	return p.err()
}

// problems collects what Validate finds, each "key: what is wrong".
type problems struct{ errs []string }

func (p *problems) bad(key, format string, args ...any) {
	p.errs = append(p.errs, fmt.Sprintf("%s: %s", key, fmt.Sprintf(format, args...)))
}

// oneOf reports v unless it is one of allowed.
func (p *problems) oneOf(key, v string, allowed ...string) {
	if !slices.Contains(allowed, v) {
		p.bad(key, "%q is not allowed; use one of %s", v, quoteList(allowed))
	}
}

// inRange reports v unless lo <= v <= hi.
func (p *problems) inRange(key string, v, lo, hi int) {
	if v < lo || v > hi {
		p.bad(key, "%d is out of range %d-%d", v, lo, hi)
	}
}

// positive reports d unless it is above zero.
func (p *problems) positive(key string, d Duration) {
	if d <= 0 {
		p.bad(key, "must be a positive duration")
	}
}

// size checks a VM size (an image's, a flavor's) under key.
func (p *problems) size(key string, s Size) {
	p.inRange(key+".vcpus", s.VCPUs, 1, 64)
	p.inRange(key+".memory_mib", s.MemoryMiB, 128, 262144)
	p.inRange(key+".disk_gib", s.DiskGiB, 0, 4096)
}

// err is every problem in one error, or nil for none.
func (p *problems) err() error {
	if len(p.errs) == 0 {
		return nil
	}
	return &invalidError{errs: p.errs}
}

// DefaultStateDir is state_dir's default.
const DefaultStateDir = "/var/lib/libvirt-executor"

// validateRemote checks a libvirt_uri of another host: a transport that
// authenticates the host and keeps the traffic private (garm's instance
// token travels in the seed volume), its host verification left on
// (validateHostVerification), and a state directory of the configuration's
// own (the default one is this host's runner's).
func (c *Config) validateRemote(p *problems) {
	u, err := url.Parse(c.LibvirtURI)
	if err != nil {
		p.bad("libvirt_uri", "%q does not parse: %v", c.LibvirtURI, err)
		return
	}
	_, transport, _ := strings.Cut(strings.ToLower(u.Scheme), "+")
	switch transport {
	case "ssh", "libssh", "libssh2", "tls", "":
	default:
		p.bad("libvirt_uri", "transport %q to another host is not allowed: use qemu+ssh:// or qemu+tls:// (the connection carries garm's instance token)", transport)
	}
	validateHostVerification(p, u, true)
	if c.StateDir == DefaultStateDir {
		p.bad("state_dir", "libvirt_uri names another host's libvirt: give this configuration a state_dir of its own (one per host, e.g. /var/lib/libvirt-executor-garm/%s); %s is this host's", u.Hostname(), DefaultStateDir)
	}
}

// validateTop checks the top-level keys but default_image (which needs the
// images checked first).
func (c *Config) validateTop(p *problems) {
	if !strings.Contains(c.LibvirtURI, ":") {
		p.bad("libvirt_uri", "%q is not a libvirt URI (example: \"qemu:///system\")", c.LibvirtURI)
	} else if !c.LocalLibvirt() {
		c.validateRemote(p)
	} else if u, err := url.Parse(c.LibvirtURI); err == nil {
		validateHostVerification(p, u, false)
	}
	p.oneOf("domain_type", c.DomainType, DomainAuto, DomainKVM, DomainQEMU)
	p.oneOf("host_key_policy", c.HostKeyPolicy, HostKeyPinned, HostKeyInsecureIgnore)
	if !libvirtNameRE.MatchString(c.StoragePool) {
		p.bad("storage_pool", "%q is not a valid pool name (letters, digits, '.', '_', '-')", c.StoragePool)
	}
	if !libvirtNameRE.MatchString(c.Network) {
		p.bad("network", "%q is not a valid network name (letters, digits, '.', '_', '-')", c.Network)
	}
	if !prefixRE.MatchString(c.NamePrefix) {
		p.bad("name_prefix", "%q is not allowed: 1-16 lower-case letters, digits or '-', starting with a letter", c.NamePrefix)
	}
	if !filepath.IsAbs(c.StateDir) || filepath.Clean(c.StateDir) == "/" {
		p.bad("state_dir", "%q must be an absolute path other than /", c.StateDir)
	}
}

// validate checks [guest_tools].
func (g GuestTools) validate(p *problems) {
	if r := g.GitLabRunner; r != GuestToolsAuto && r != GuestToolsNone && !filepath.IsAbs(r) {
		p.bad("guest_tools.gitlab_runner", "%q is not allowed; use \"auto\" (the gitlab-runner on PATH), \"none\" or the absolute path of a gitlab-runner binary", r)
	}
	if r := g.StepRunner; r != GuestToolsAuto && r != GuestToolsNone && !filepath.IsAbs(r) {
		p.bad("guest_tools.step_runner", "%q is not allowed; use \"auto\" (the step-runner on PATH), \"none\" or the absolute path of a step-runner binary", r)
	}
	if r := g.Agent; r != GuestToolsAuto && r != GuestToolsNone && !filepath.IsAbs(r) {
		p.bad("guest_tools.agent", "%q is not allowed; use \"auto\" (the lve-agent installed with these executables), \"none\" (stages use the wrapper) or the absolute path of an lve-agent binary", r)
	}
}

// validate checks [defaults].
func (d Defaults) validate(p *problems) {
	p.size("defaults", Size(d))
}

// validate checks [limits].
func (l Limits) validate(p *problems) {
	p.inRange("limits.max_vcpus", l.MaxVCPUs, 1, 64)
	p.inRange("limits.max_memory_mib", l.MaxMemoryMiB, 128, 262144)
	p.inRange("limits.max_disk_gib", l.MaxDiskGiB, 0, 4096)
}

// validate checks [capacity]: its memory budget must hold the largest job
// that limits allows.
func (cp Capacity) validate(p *problems, limits Limits) {
	p.inRange("capacity.max_vms", cp.MaxVMs, 0, 10000)
	p.inRange("capacity.memory_budget_mib", cp.MemoryBudgetMiB, 0, 1<<24)
	if cp.MemoryBudgetMiB != 0 && cp.MemoryBudgetMiB < limits.MaxMemoryMiB {
		p.bad("capacity.memory_budget_mib", "%d is smaller than one job may ask for (limits.max_memory_mib = %d)", cp.MemoryBudgetMiB, limits.MaxMemoryMiB)
	}
}

// validate checks [debug].
func (d Debug) validate(p *problems) {
	p.positive("debug.keep_max_age", d.KeepMaxAge)
	p.inRange("debug.keep_max_per_project", d.KeepMaxPerProject, 1, 16)
	p.inRange("debug.keep_max", d.KeepMax, 1, 64)
	if d.KeepMaxPerProject > d.KeepMax {
		p.bad("debug.keep_max_per_project", "%d is more than the host keeps at all (debug.keep_max = %d)", d.KeepMaxPerProject, d.KeepMax)
	}
}

// validate checks [timeouts].
func (t Timeouts) validate(p *problems) {
	p.positive("timeouts.boot", t.Boot)
	p.positive("timeouts.cleanup", t.Cleanup)
	p.positive("timeouts.job_slack", t.JobSlack)
}

// validate checks [ssh].
func (s SSH) validate(p *problems) {
	p.positive("ssh.keepalive_interval", s.KeepaliveInterval)
	p.positive("ssh.connect_timeout", s.ConnectTimeout)
	p.inRange("ssh.keepalive_count", s.KeepaliveCount, 1, 100)
}

// validate checks [serve].
func (s PoolService) validate(p *problems) {
	p.inRange("serve.boot_parallelism", s.BootParallelism, 1, 32)
	if d := s.Interval.D(); d < 50*time.Millisecond || d > 10*time.Second {
		p.bad("serve.interval", "%s is out of range 50ms-10s", d)
	}
	p.positive("serve.health_interval", s.HealthInterval)
	if l := s.MetricsListen; l != MetricsOff {
		if _, port, err := net.SplitHostPort(l); err != nil || port == "" {
			p.bad("serve.metrics_listen", "%q is not host:port (e.g. \"127.0.0.1:9451\"), or \"off\"", l)
		}
	}
	p.inRange("serve.event_spool_mib", s.EventSpoolMiB, 1, 1024)
}

// validate checks [log].
func (l Log) validate(p *problems) {
	if !slices.Contains(StepLogKinds, l.Steps) {
		p.bad("log.steps", "%q is not allowed: use %s", l.Steps, quoteList(StepLogKinds))
	}
	if !filepath.IsAbs(l.StepsFile) {
		p.bad("log.steps_file", "%q must be an absolute path", l.StepsFile)
	}
	p.inRange("log.steps_file_mib", l.StepsFileMiB, 1, 4096)
}

// validate checks [garm]; its images must be configured in c.
func (g Garm) validate(p *problems, c *Config) {
	p.positive("garm.max_age", g.MaxAge)
	p.positive("garm.orphan_after", g.OrphanAfter)
	p.positive("garm.seed_keep", g.SeedKeep)
	for _, e := range g.Endpoints {
		if _, err := Origin(e); err != nil {
			p.bad("garm.endpoints", "%s", err)
		}
	}
	for _, name := range g.Images {
		if _, ok := c.Images[name]; !ok {
			p.bad("garm.images", "%q is not a configured image; use one of %s", name, quoteList(c.ImageNames()))
		}
	}
	for _, k := range g.ExtraSpecs {
		if !slices.Contains(GarmExtraSpecKeys, k) {
			p.bad("garm.extra_specs", "%q is not allowed: use %s", k, quoteList(GarmExtraSpecKeys))
		}
	}
	for _, name := range sortedKeys(g.Flavors) {
		key := "garm.flavors." + name
		if !imageNameRE.MatchString(name) {
			p.bad(key, "flavor name %q is not allowed: 1-63 lower-case letters, digits, '.', '_' or '-'", name)
		}
		p.size(key, g.Flavors[name])
	}
}

// validate checks [gitlab].
func (g GitLab) validate(p *problems) {
	p.oneOf("gitlab.services", g.Services, ServicesWarn, ServicesFail)
	p.oneOf("gitlab.steps", g.Steps, StepsShim, StepsNative)
}

// validateImages checks the [images.NAME] tables, in name order.
func (c *Config) validateImages(p *problems) {
	if len(c.Images) == 0 {
		p.bad("images", "at least one [images.NAME] table is required")
	}
	for _, name := range c.ImageNames() {
		key := "images." + name
		if !imageNameRE.MatchString(name) {
			p.bad(key, "image name %q is not allowed: 1-63 lower-case letters, digits, '.', '_' or '-', starting with a letter or digit", name)
		}
		if img := c.Images[name]; img != nil {
			img.validate(p, key, c.LocalLibvirt(), c.LibvirtURI)
			if img.EgressAllow != nil && c.L2Filter != nil && !*c.L2Filter {
				p.bad(key+".egress_allow", "needs l2_filter = true (the lve-vm-egress network filter enforces it)")
			}
		}
	}
}

// validate checks one image's table, named key.
func (img *Image) validate(p *problems, key string, local bool, uri string) {
	if len(img.EgressAllow) > maxEgress {
		p.bad(key+".egress_allow", "%d entries: at most %d (use wider CIDRs)", len(img.EgressAllow), maxEgress)
	}
	for i, e := range img.EgressAllow {
		if _, err := ParseEgress(e); err != nil {
			p.bad(fmt.Sprintf("%s.egress_allow[%d]", key, i), "%v", err)
		}
	}
	if img.Source != "" {
		img.validateSource(p, key, local, uri)
	} else if !filepath.IsAbs(img.Base) {
		p.bad(key+".base", "%q must be an absolute path to the base disk image (or set source = \"oci://...\")", img.Base)
	}
	p.oneOf(key+".format", img.Format, "qcow2", "raw")
	img.validateGuest(p, key)
	img.validateBoot(p, key)
	if !libvirtNameRE.MatchString(img.Machine) {
		p.bad(key+".machine", "%q is not a valid machine type", img.Machine)
	}
	if img.VCPUs != 0 {
		p.inRange(key+".vcpus", img.VCPUs, 1, 64)
	}
	if img.MemoryMiB != 0 {
		p.inRange(key+".memory_mib", img.MemoryMiB, 128, 262144)
	}
	p.inRange(key+".disk_gib", img.DiskGiB, 0, 4096)
	if img.Pool != nil {
		img.Pool.validate(p, key+".pool")
	}
}

// validateGuest checks how jobs run in the image's guest: the user, the
// shell, the guest directories and how the keys get there.
func (img *Image) validateGuest(p *problems, key string) {
	if !userRE.MatchString(img.User) {
		p.bad(key+".user", "%q is not a valid user name", img.User)
	}
	if !shellRE.MatchString(img.Shell) {
		p.bad(key+".shell", "%q is not allowed: \"bash\", \"sh\" or an absolute path", img.Shell)
	}
	for _, d := range []struct{ key, path string }{{"builds_dir", img.BuildsDir}, {"cache_dir", img.CacheDir}} {
		if !guestPathRE.MatchString(d.path) || filepath.Clean(d.path) == "/" {
			p.bad(key+"."+d.key, "%q must be an absolute guest path other than / (letters, digits, '/', '.', '_', '-')", d.path)
		}
	}
	p.oneOf(key+".key_injection", img.KeyInjection, InjectSMBIOS, InjectCloudInit)
	if img.KeyInjection == InjectSMBIOS && img.User != "root" {
		p.bad(key+".user", "%q: key_injection \"smbios\" provisions root's key only; use user = \"root\" or key_injection = \"cloud-init\"", img.User)
	}
}

// validateBoot checks how the image boots and where its address comes from.
func (img *Image) validateBoot(p *problems, key string) {
	p.oneOf(key+".boot", img.Boot, BootDisk, BootKernel)
	p.oneOf(key+".address_source", img.AddressSource, "lease", "agent")
	p.oneOf(key+".cache_via", img.CacheVia, CacheViaDisk, CacheViaSSH)
	if img.Boot == BootKernel && img.Source == "" {
		if !filepath.IsAbs(img.Kernel) {
			p.bad(key+".kernel", "boot = \"kernel\" needs an absolute kernel path, got %q", img.Kernel)
		}
		if img.Initrd != "" && !filepath.IsAbs(img.Initrd) {
			p.bad(key+".initrd", "%q must be an absolute path", img.Initrd)
		}
	} else if img.Boot != BootKernel && (img.Kernel != "" || img.Initrd != "" || img.Cmdline != "") {
		p.bad(key+".boot", "kernel, initrd and cmdline need boot = \"kernel\"")
	}
	if img.Snapshot {
		switch {
		case img.Boot != BootKernel:
			p.bad(key+".snapshot", "needs boot = \"kernel\" (the template's guest is told by its kernel command line), got boot = %q", img.Boot)
		case img.KeyInjection != InjectSMBIOS:
			p.bad(key+".snapshot", "needs key_injection = \"smbios\" (a clone's keys arrive on a hot-plugged credentials disk), got %q", img.KeyInjection)
		case img.AddressSource != "lease":
			p.bad(key+".snapshot", "needs address_source = \"lease\", got %q", img.AddressSource)
		case img.SharedMemory:
			p.bad(key+".snapshot", "cannot go with shared_memory = true (a snapshot template has no shared memory)")
		}
	}
}

// validate checks an image's [images.NAME.pool] table, named key.
func (pl *Pool) validate(p *problems, key string) {
	p.inRange(key+".idle_count", pl.IdleCount, 0, 64)
	p.inRange(key+".max_idle", pl.MaxIdle, max(pl.IdleCount, 1), 64)
	p.positive(key+".idle_time", pl.IdleTime)
	if pl.MaxAge.D() < time.Minute {
		p.bad(key+".max_age", "%s is too short: at least 1m (an idle VM must live long enough to be claimed)", pl.MaxAge.D())
	}
	if len(pl.Prepull) > 16 {
		p.bad(key+".prepull", "%d images: at most 16", len(pl.Prepull))
	}
	for _, n := range pl.Prepull {
		if n == "" || len(n) > 512 || strings.ContainsAny(n, " \t\n\x00$") {
			p.bad(key+".prepull", "%q must be a container image name of 1 to 512 characters, without white space or variables (e.g. \"postgres:15\", \"registry.example:5000/team/app:1\")", n)
		}
	}
}

// validateDefaultImage checks default_image against the images; with one
// image and no default_image, that image becomes the default.
func (c *Config) validateDefaultImage(p *problems) {
	if c.DefaultImage == "" {
		if len(c.Images) == 1 {
			c.DefaultImage = c.ImageNames()[0]
		} else {
			p.bad("default_image", "must name one of the configured images: %s", quoteList(c.ImageNames()))
		}
	} else if _, ok := c.Images[c.DefaultImage]; !ok {
		p.bad("default_image", "%q is not configured; use one of %s", c.DefaultImage, quoteList(c.ImageNames()))
	}
}

// ImageNames returns the configured image names, sorted.
func (c *Config) ImageNames() []string {
	names := make([]string, 0, len(c.Images))
	for n := range c.Images {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Image looks an image up by name. The name is only ever compared with the
// configured keys; it is never used as a path.
func (c *Config) Image(name string) (*Image, bool) {
	img, ok := c.Images[name]
	return img, ok && img != nil
}

func quoteList(items []string) string {
	q := make([]string, len(items))
	for i, s := range items {
		q[i] = fmt.Sprintf("%q", s)
	}
	return strings.Join(q, ", ")
}

// Size is what a VM gets: vCPUs, memory and disk.
type Size struct {
	VCPUs     int `toml:"vcpus"`
	MemoryMiB int `toml:"memory_mib"`
	DiskGiB   int `toml:"disk_gib"`
}

// ImageSize is the size of img's VMs when a job asks for nothing else: the
// image's own values where set, else the defaults. A pool keeps VMs of
// this size.
func (c *Config) ImageSize(img *Image) Size {
	pick := func(override, def int) int {
		if override != 0 {
			return override
		}
		return def
	}
	return Size{VCPUs: pick(img.VCPUs, c.Defaults.VCPUs), MemoryMiB: pick(img.MemoryMiB, c.Defaults.MemoryMiB), DiskGiB: pick(img.DiskGiB, c.Defaults.DiskGiB)}
}

// Pooled lists the images that have a standby pool, sorted by name.
func (c *Config) Pooled() []*Image {
	var out []*Image
	for _, n := range c.ImageNames() {
		if img := c.Images[n]; img != nil && img.Pool != nil {
			out = append(out, img)
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
