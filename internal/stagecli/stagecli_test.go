package stagecli

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
)

func TestExitCodes(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.toml")
	require.NoError(t, os.WriteFile(good, []byte("[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	broken := filepath.Join(dir, "broken.toml")
	require.NoError(t, os.WriteFile(broken, []byte("[images.a]\nbase = \"/a.qcow2\"\nbogus = 1\n"), 0o600))
	env := map[string]string{"BUILD_FAILURE_EXIT_CODE": "11", "SYSTEM_FAILURE_EXIT_CODE": "12"}
	getenv := func(k string) string { return env[k] }

	tests := []struct {
		name  string
		argv  []string
		nargs int
		err   error
		want  int
		msg   string
	}{
		{"ok", []string{"x", "--config", good}, 0, nil, 0, ""},
		{"script failure", []string{"x", "--config", good}, 0, &exitcodes.ScriptError{Code: 3}, 11, "status 3"},
		{"user mistake", []string{"x", "--config", good}, 0, exitcodes.Userf("image nope"), 11, "image nope"},
		{"infrastructure", []string{"x", "--config", good}, 0, errors.New("libvirt down"), 12, "libvirt down"},
		{"broken config", []string{"x", "--config", broken}, 0, nil, 12, `broken.toml: line 3 column 1: unknown key "images.a.bogus"`},
		{"missing config", []string{"x", "--config", filepath.Join(dir, "none.toml")}, 0, nil, 12, "none.toml"},
		{"wrong arg count", []string{"x", "--config", good, "extra"}, 0, nil, 12, "takes 0 argument(s)"},
		{"unknown flag", []string{"x", "--nope"}, 0, nil, 12, "flag provided but not defined"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			called := false
			code := Run(tc.argv, getenv, &stdout, &stderr, "x", "", "", tc.nargs,
				func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
					called = true
					return tc.err
				})
			require.Equal(t, tc.want, code, stderr.String())
			if tc.msg != "" {
				require.Contains(t, stderr.String(), tc.msg)
			}
			require.Empty(t, stdout.String(), "stdout is reserved for protocol output")
			require.Equal(t, tc.err != nil || tc.name == "ok", called, "the stage runs only with a valid config and arguments")
		})
	}
}

func TestConfigFromEnvironment(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.toml")
	require.NoError(t, os.WriteFile(good, []byte("name_prefix = \"envcfg\"\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	env := map[string]string{config.EnvPath: good}
	t.Setenv(config.EnvPath, good) // urfave/cli reads EnvVars from the process
	var got string
	code := Run([]string{"x"}, func(k string) string { return env[k] }, &bytes.Buffer{}, &bytes.Buffer{}, "x", "", "", 0,
		func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
			got = cfg.NamePrefix
			return nil
		})
	require.Equal(t, 0, code)
	require.Equal(t, "envcfg", got)
}

// A stage that finishes its work although SIGTERM arrived still reports
// SYSTEM_FAILURE, so the exit code does not depend on which came first;
// cleanup, which runs to completion on purpose, reports its own result.
func TestSignalledStageIsSystemFailure(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "c.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte("[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	env := map[string]string{"BUILD_FAILURE_EXIT_CODE": "1", "SYSTEM_FAILURE_EXIT_CODE": "2"}
	endsAnyway := func(result error) Stage {
		return func(ctx context.Context, e gitlab.Env, cfg *config.Config, args []string) error {
			early <- syscall.SIGTERM
			<-ctx.Done()  // the signal arrived ...
			return result // ... but the work had ended
		}
	}
	for _, tc := range []struct {
		name   string
		result error
		opts   []Option
		want   int
	}{
		{"ordinary stage, work done", nil, nil, 2},
		{"ordinary stage, script failed", &exitcodes.ScriptError{Code: 3}, nil, 2},
		{"runs to completion", nil, []Option{RunsToCompletion()}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			code := Run([]string{"x", "--config", cfgPath}, func(k string) string { return env[k] }, &bytes.Buffer{}, &stderr, "x", "", "", 0, endsAnyway(tc.result), tc.opts...)
			require.Equal(t, tc.want, code, stderr.String())
			if tc.want == 2 {
				require.Contains(t, stderr.String(), "stopped: terminated signal received")
			}
		})
	}
}
