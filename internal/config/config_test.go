package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLoadValid(t *testing.T) {
	c, err := Load("testdata/valid.toml")
	require.NoError(t, err)
	require.Equal(t, "testdata/valid.toml", c.Path)
	require.Equal(t, DomainQEMU, c.DomainType)
	require.Equal(t, "lve", c.NamePrefix, "default prefix")
	require.Equal(t, 90*time.Second, c.Timeouts.Boot.D())
	require.Equal(t, 2*time.Minute, c.Timeouts.Cleanup.D(), "default cleanup timeout")
	require.Equal(t, 4, c.SSH.KeepaliveCount)
	require.Equal(t, 1, c.Debug.KeepMaxPerProject, "default: one kept VM per project")
	require.Equal(t, 2, c.Debug.KeepMax, "default: two kept VMs on the host")
	require.Equal(t, []string{"cloud", "debian-12", "tiny"}, c.ImageNames())

	img, ok := c.Image("debian-12")
	require.True(t, ok)
	require.Equal(t, "debian-12", img.Name)
	require.Equal(t, "root", img.User)
	require.Equal(t, "bash", img.Shell)
	require.Equal(t, InjectSMBIOS, img.KeyInjection)
	require.Equal(t, BootDisk, img.Boot)
	require.Equal(t, "pc", img.Machine)

	_, ok = c.Image("../etc/passwd")
	require.False(t, ok)
}

func TestLoadErrors(t *testing.T) {
	_, err := Load("testdata/unknown-key.toml")
	require.ErrorContains(t, err, "testdata/unknown-key.toml")
	require.ErrorContains(t, err, `line 2 column 1: unknown key "storage_pol"`)

	_, err = Load("testdata/bad-syntax.toml")
	require.ErrorContains(t, err, "testdata/bad-syntax.toml")
	require.ErrorContains(t, err, "line 3")

	_, err = Load(filepath.Join(t.TempDir(), "missing.toml"))
	require.ErrorContains(t, err, "no such file")
	require.ErrorContains(t, err, EnvPath)
}

func TestValidateMessages(t *testing.T) {
	base := "[images.a]\nbase = \"/a.qcow2\"\n"
	tests := []struct {
		name, toml, want string
	}{
		{"domain type", "domain_type = \"xen\"\n" + base, `domain_type: "xen" is not allowed; use one of "auto", "kvm", "qemu"`},
		{"prefix", "name_prefix = \"Bad_Prefix\"\n" + base, `name_prefix: "Bad_Prefix" is not allowed`},
		{"relative state dir", "state_dir = \"state\"\n" + base, `state_dir: "state" must be an absolute path`},
		{"vcpus", "[defaults]\nvcpus = 1000\n" + base, "defaults.vcpus: 1000 is out of range 1-64"},
		{"duration", "[timeouts]\nboot = \"soon\"\n" + base, `"soon" is not a duration`},
		{"no images", "", "images: at least one [images.NAME] table is required"},
		{"image name", "[images.\"../x\"]\nbase = \"/a\"\n", `image name "../x" is not allowed`},
		{"relative base", "[images.a]\nbase = \"a.qcow2\"\n", `images.a.base: "a.qcow2" must be an absolute path`},
		{"kernel missing", "[images.a]\nbase = \"/a\"\nboot = \"kernel\"\n", `images.a.kernel: boot = "kernel" needs an absolute kernel path`},
		{"smbios non-root", "[images.a]\nbase = \"/a\"\nuser = \"debian\"\n", `key_injection "smbios" provisions root's key only`},
		{"shell", "[images.a]\nbase = \"/a\"\nshell = \"bash -c\"\n", `images.a.shell: "bash -c" is not allowed`},
		{"default image", "default_image = \"nope\"\n" + base, `default_image: "nope" is not configured; use one of "a"`},
		{"two images no default", base + "[images.b]\nbase = \"/b\"\n", `default_image: must name one of the configured images: "a", "b"`},
		{"address source", "[images.a]\nbase = \"/a\"\naddress_source = \"arp\"\n", `images.a.address_source: "arp" is not allowed; use one of "lease", "agent"`},
		{"host key policy", "host_key_policy = \"tofu\"\n" + base, `host_key_policy: "tofu" is not allowed`},
		{"metrics listen", "[serve]\nmetrics_listen = \"9451\"\n" + base, `serve.metrics_listen: "9451" is not host:port (e.g. "127.0.0.1:9451"), or "off"`},
		{"event spool", "[serve]\nevent_spool_mib = 5000\n" + base, "serve.event_spool_mib: 5000 is out of range 1-1024"},
		{"step log", "[log]\nsteps = \"syslog\"\n" + base, `log.steps: "syslog" is not allowed: use "auto", "journald", "file", "none"`},
		{"step log file", "[log]\nsteps_file = \"steps.jsonl\"\n" + base, `log.steps_file: "steps.jsonl" must be an absolute path`},
		{"garm endpoint", "[garm]\nendpoints = [\"10.0.0.1:9997\"]\n" + base, `garm.endpoints: "10.0.0.1:9997" is not an http(s) URL of a host`},
		{"garm orphan after", "[garm]\norphan_after = \"-1h\"\n" + base, `garm.orphan_after`},
		{"garm image", "[garm]\nimages = [\"b\"]\n" + base, `garm.images: "b" is not a configured image; use one of "a"`},
		{"garm extra spec", "[garm]\nextra_specs = [\"gpus\"]\n" + base, `garm.extra_specs: "gpus" is not allowed: use "vcpus", "memory_mib", "disk_gib"`},
		{"cache dir relative", "[cache]\ndir = \"cache\"\n" + base, `cache.dir: "cache" must be a clean absolute path`},
		{"cache dir root", "[cache]\ndir = \"/\"\n" + base, `cache.dir: "/" must be a clean absolute path`},
		{"cache limits", "[cache]\ndir = \"/c\"\nproject_limit_mib = 2048\ntotal_limit_mib = 1024\n" + base, `cache.project_limit_mib: 2048 is above cache.total_limit_mib (1024)`},
		{"cache negative", "[cache]\nproject_limit_mib = -1\n" + base, `cache.project_limit_mib: -1 is out of range 1-1048576`},
		{"cache disk min", "[cache]\ndisk_min_mib = -1\n" + base, `cache.disk_min_mib: -1 is out of range 0-1048576`},
		{"cache via", "[images.x]\nbase = \"/x\"\ncache_via = \"9p\"\n" + base, `images.x.cache_via: "9p" is not allowed`},
		{"cache image", "[cache]\ndir = \"/c\"\nimages = [\"b\"]\n" + base, `cache.images: "b" is not a configured image; use one of "a"`},
		{"keep per project", "[debug]\nkeep_max_per_project = 100\n" + base, "debug.keep_max_per_project: 100 is out of range 1-16"},
		{"keep max", "[debug]\nkeep_max = -1\n" + base, "debug.keep_max: -1 is out of range 1-64"},
		{"keep per project over host", "[debug]\nkeep_max_per_project = 4\nkeep_max = 3\n" + base, "debug.keep_max_per_project: 4 is more than the host keeps at all (debug.keep_max = 3)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.toml))
			require.Error(t, err)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestOrigin(t *testing.T) {
	for in, want := range map[string]string{
		"http://10.0.0.1:9997/api/v1/callbacks": "http://10.0.0.1:9997",
		"https://GitHub.com":                    "https://github.com:443",
		"http://[fd00::1]/x":                    "http://[fd00::1]:80",
	} {
		got, err := Origin(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"", "10.0.0.1:9997", "ftp://x", "http://", "http://u:p@host"} {
		_, err := Origin(bad)
		require.Error(t, err, bad)
	}
}

// TestDeployGarmExampleIsValid: the garm example configuration loads, and
// docs/garm.md shows the same.
func TestDeployGarmExampleIsValid(t *testing.T) {
	c, err := Load("../../deploy/garm.example.toml")
	require.NoError(t, err)
	require.Equal(t, []string{"debian-12-cloud"}, c.Garm.Images)
	require.Equal(t, 8192, c.Garm.Flavors["large"].MemoryMiB)
	require.Len(t, c.Garm.Endpoints, 2)
	example, err := os.ReadFile("../../deploy/garm.example.toml")
	require.NoError(t, err)
	doc, err := os.ReadFile("../../docs/garm.md")
	require.NoError(t, err)
	_, body, ok := strings.Cut(string(example), "\nname_prefix")
	require.True(t, ok)
	require.Contains(t, string(doc), "```toml\nname_prefix"+body+"```", "docs/garm.md shows deploy/garm.example.toml")
}

func TestSingleImageIsDefault(t *testing.T) {
	c, err := Parse([]byte("[images.only]\nbase = \"/only.qcow2\"\n"))
	require.NoError(t, err)
	require.Equal(t, "only", c.DefaultImage)
}

func TestResolve(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	require.Equal(t, DefaultPath, Resolve("", getenv))
	env[EnvPath] = "/from/env.toml"
	require.Equal(t, "/from/env.toml", Resolve("", getenv))
	require.Equal(t, "/from/flag.toml", Resolve("/from/flag.toml", getenv))
}

func TestDeployExampleIsValid(t *testing.T) {
	path := filepath.Join("..", "..", "deploy", "config.example.toml")
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the documented example %s must exist: %v", path, err)
	}
	_, err := Load(path)
	require.NoError(t, err)
}

func TestInsecureJobIDFromEnv(t *testing.T) {
	base := "[images.a]\nbase = \"/a.qcow2\"\n"
	c, err := Parse([]byte(base))
	require.NoError(t, err)
	require.False(t, c.InsecureJobIDFromEnv, "off unless asked for")
	c, err = Parse([]byte("insecure_job_id_from_env = true\n" + base))
	require.NoError(t, err)
	require.True(t, c.InsecureJobIDFromEnv)
	_, err = Parse([]byte("insecure_job_id_from_env = \"yes\"\n" + base))
	require.ErrorContains(t, err, "insecure_job_id_from_env", "a boolean, nothing else")
	_, err = Parse([]byte("insecure_job_id_from_environment = true\n" + base))
	require.ErrorContains(t, err, "unknown key", "a misspelt key does not silently stay off")
}

func TestGuestToolsSetting(t *testing.T) {
	base := "default_image = \"tiny\"\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n"
	c, err := Parse([]byte(base))
	require.NoError(t, err)
	require.Equal(t, GuestToolsAuto, c.GuestTools.GitLabRunner, "default: the gitlab-runner on PATH")
	for _, ok := range []string{"none", "auto", "/usr/bin/gitlab-runner"} {
		_, err := Parse([]byte(base + "[guest_tools]\ngitlab_runner = \"" + ok + "\"\n"))
		require.NoError(t, err, ok)
	}
	_, err = Parse([]byte(base + "[guest_tools]\ngitlab_runner = \"gitlab-runner\"\n"))
	require.ErrorContains(t, err, `guest_tools.gitlab_runner: "gitlab-runner" is not allowed`)
	require.ErrorContains(t, err, `"auto"`)
}

func TestGitLabServicesSetting(t *testing.T) {
	base := "default_image = \"tiny\"\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n"
	c, err := Parse([]byte(base))
	require.NoError(t, err)
	require.Equal(t, ServicesWarn, c.GitLab.Services, "default: warn in the job log")
	for _, ok := range []string{ServicesWarn, ServicesFail} {
		c, err := Parse([]byte(base + "[gitlab]\nservices = \"" + ok + "\"\n"))
		require.NoError(t, err, ok)
		require.Equal(t, ok, c.GitLab.Services)
	}
	_, err = Parse([]byte(base + "[gitlab]\nservices = \"ignore\"\n"))
	require.ErrorContains(t, err, `gitlab.services: "ignore" is not allowed; use one of "warn", "fail"`)
	require.Equal(t, StepsShim, c.GitLab.Steps, "default: the runner's shim")
	c, err = Parse([]byte(base + "[gitlab]\nsteps = \"native\"\n"))
	require.NoError(t, err)
	require.Equal(t, StepsNative, c.GitLab.Steps)
	_, err = Parse([]byte(base + "[gitlab]\nsteps = \"grpc\"\n"))
	require.ErrorContains(t, err, `gitlab.steps: "grpc" is not allowed; use one of "shim", "native"`)
	_, err = Parse([]byte(base + "[gitlab]\nservice = \"fail\"\n"))
	require.ErrorContains(t, err, "unknown key", "a misspelt key does not silently stay warn")
}
