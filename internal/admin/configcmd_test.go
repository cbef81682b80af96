package admin

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

func writeConfig(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, os.WriteFile(path, []byte(text), 0o600))
	return path
}

func runAdmin(args ...string) error {
	return App().RunContext(context.Background(), append([]string{"libvirt-executor"}, args...))
}

// config check: "OK: FILE" for a valid configuration; else each problem
// as FILE:LINE: KEY: message with what is allowed, an unknown key among
// them, and exit status ExitConfigInvalid. A file it cannot read is exit
// status 1.
func TestConfigCheck(t *testing.T) {
	t.Setenv(config.EnvPath, "")
	good := writeConfig(t, "[images.tiny]\nbase = \"/img/tiny.qcow2\"\n")
	out := captureStdout(t, func() { require.NoError(t, runAdmin("config", "check", "--config", good)) })
	require.Equal(t, "OK: "+good+"\n", out)

	bad := writeConfig(t, "domain_type = \"kvmm\"\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\nbot = \"disk\"\n")
	var err error
	out = captureStdout(t, func() { err = runAdmin("--config", bad, "config", "check") })
	require.Equal(t, bad+`:4: images.tiny.bot: unknown key "bot" in [images.tiny]; it allows base, source, shared_memory, snapshot, format, user, shell, builds_dir, cache_dir, key_injection, boot, kernel, initrd, cmdline, address_source, machine, cache_via, egress_allow, vcpus, memory_mib, disk_gib, pool (docs/configuration.md)
`+bad+`:1: domain_type: "kvmm" is not allowed; use one of "auto", "kvm", "qemu"
`, out)
	require.EqualError(t, err, "config "+bad+": 2 problems")
	require.Equal(t, ExitConfigInvalid, ExitCode(err))

	err = runAdmin("config", "check", "--config", filepath.Join(t.TempDir(), "none.toml"))
	require.ErrorContains(t, err, "no such file")
	require.Equal(t, 1, ExitCode(err))
}

// config show: every key with its value and source, as a table and as one
// JSON object.
func TestConfigShow(t *testing.T) {
	path := writeConfig(t, "[limits]\nmax_vcpus = 2\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n")
	out := captureStdout(t, func() { require.NoError(t, runAdmin("config", "show", "--config", path)) })
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 1+len(config.Keys())-5-3, "a header and every key, but the 5 of [images.NAME.pool] and the 3 of [garm.flavors.NAME]: no such table")
	require.Regexp(t, `^KEY +VALUE +SOURCE$`, lines[0])
	require.Contains(t, out, "\nlimits.max_vcpus ")
	for _, want := range []string{
		`(?m)^libvirt_uri +"qemu:///system" +default$`,
		`(?m)^limits\.max_vcpus +2 +file$`,
		`(?m)^images\.tiny\.base +"/img/tiny\.qcow2" +file$`,
		`(?m)^images\.tiny\.egress_allow +unset +default$`,
		`(?m)^default_image +"tiny" +default$`,
		`(?m)^timeouts\.boot +"5m0s" +default$`,
	} {
		require.Regexp(t, want, out)
	}

	out = captureStdout(t, func() { require.NoError(t, runAdmin("--config", path, "config", "show", "--json")) })
	var doc struct {
		File     string           `json:"file"`
		Settings []config.Setting `json:"settings"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &doc))
	require.Equal(t, path, doc.File)
	require.Len(t, doc.Settings, len(lines)-1)
	require.Equal(t, config.Setting{Key: "limits.max_vcpus", Value: 2.0, Source: config.SourceFile}, setting(doc.Settings, "limits.max_vcpus"))

	bad := writeConfig(t, "nope = 1\n")
	err := runAdmin("config", "show", "--config", bad)
	require.ErrorContains(t, err, "config check lists every problem")
}

// --config is taken after any command as before it; the one after the
// command wins, and either wins over $LIBVIRT_EXECUTOR_CONFIG.
func TestConfigFlagAfterTheCommand(t *testing.T) {
	var walk func(path string, cmds []*cli.Command)
	walk = func(path string, cmds []*cli.Command) {
		for _, c := range cmds {
			has := false
			for _, f := range c.Flags {
				for _, n := range f.Names() {
					has = has || n == "config"
				}
			}
			require.True(t, has, "%s%s has no --config", path, c.Name)
			walk(path+c.Name+" ", c.Subcommands)
		}
	}
	walk("", App().Commands)

	a := writeConfig(t, "name_prefix = \"aaa\"\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n")
	b := writeConfig(t, "name_prefix = \"bbb\"\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n")
	env := writeConfig(t, "name_prefix = \"env\"\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n")
	prefix := func(args ...string) string {
		t.Helper()
		out := captureStdout(t, func() { require.NoError(t, runAdmin(append(args, "config", "show", "--json")...)) })
		var doc struct{ Settings []config.Setting }
		require.NoError(t, json.Unmarshal([]byte(out), &doc), out)
		return setting(doc.Settings, "name_prefix").Value.(string)
	}
	t.Setenv(config.EnvPath, env)
	require.Equal(t, "env", prefix())
	require.Equal(t, "aaa", prefix("--config", a))

	show := func(args ...string) string {
		t.Helper()
		return captureStdout(t, func() { require.NoError(t, runAdmin(args...)) })
	}
	require.Contains(t, show("config", "show", "--config", a), `"aaa"`)
	require.Contains(t, show("config", "--config", a, "show"), `"aaa"`)
	require.Contains(t, show("--config", b, "config", "show", "--config", a), `"aaa"`)
	require.Contains(t, show("--config", b, "config", "show"), `"bbb"`)
	require.Contains(t, show("--config", b, "config", "--config", a, "show"), `"aaa"`)
	// A command that is not config's: polkit-rules names the prefix.
	require.Contains(t, show("polkit-rules", "--config", a), `"aaa-"`)
	require.Contains(t, show("--config", b, "polkit-rules"), `"bbb-"`)
	require.Contains(t, show("polkit-rules"), `"env-"`)
}

// setting is the setting of key in settings.
func setting(settings []config.Setting, key string) config.Setting {
	for _, s := range settings {
		if s.Key == key {
			return s
		}
	}
	return config.Setting{}
}
