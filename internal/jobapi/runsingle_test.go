package jobapi

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRunnerBinary(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "gitlab-runner")
	require.NoError(t, os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755))
	plain := filepath.Join(dir, "plain")
	require.NoError(t, os.WriteFile(plain, nil, 0o644))

	t.Setenv(RunnerBinaryEnv, exe)
	path, why := RunnerBinary()
	assert.Equal(t, exe, path)
	assert.Empty(t, why)

	for _, bad := range []string{filepath.Join(dir, "missing"), plain, dir} {
		t.Setenv(RunnerBinaryEnv, bad)
		path, why = RunnerBinary()
		assert.Empty(t, path)
		assert.Contains(t, why, RunnerBinaryEnv+"="+bad)
	}

	t.Setenv(RunnerBinaryEnv, "")
	t.Setenv("PATH", dir)
	path, _ = RunnerBinary()
	assert.Equal(t, exe, path, "found on PATH")
	t.Setenv("PATH", t.TempDir())
	path, why = RunnerBinary()
	assert.Empty(t, path)
	assert.Contains(t, why, "not on PATH")
}

// A stand-in runner that prints its argv and whether it got the token.
func TestRunSingleArguments(t *testing.T) {
	fake := filepath.Join(t.TempDir(), "gitlab-runner")
	require.NoError(t, os.WriteFile(fake, []byte(`#!/bin/sh
for a in "$@"; do echo "arg=$a"; done
echo "token=$CI_SERVER_TOKEN"
echo "home=$HOME"
`), 0o755))
	var out bytes.Buffer
	err := RunSingle(t.Context(), RunSingleOptions{
		Binary: fake, URL: "http://127.0.0.1:1/", Token: "sekrit", Executor: "custom",
		BuildsDir: "/b", CacheDir: "/c", MaxBuilds: 2, WaitTimeout: 10 * time.Second,
		Custom: &CustomConfig{
			ConfigExec: "/d/config", ConfigArgs: []string{"config", "--x"}, PrepareExec: "/d/prepare",
			RunExec: "/d/run", RunArgs: []string{"run"}, CleanupExec: "/d/cleanup", CleanupExecTimeout: 60,
			GracefulKillTimeout: 5,
		},
		Env:    []string{"HOME=/h", "PATH=/usr/bin:/bin"},
		Stdout: &out,
	})
	require.NoError(t, err)
	assert.Equal(t, strings.Join([]string{
		"arg=run-single", "arg=--url", "arg=http://127.0.0.1:1/", "arg=--executor", "arg=custom",
		"arg=--max-builds", "arg=2", "arg=--wait-timeout", "arg=10", "arg=--builds-dir", "arg=/b",
		"arg=--cache-dir", "arg=/c",
		"arg=--custom-config-exec", "arg=/d/config", "arg=--custom-config-args", "arg=config",
		"arg=--custom-config-args", "arg=--x",
		"arg=--custom-prepare-exec", "arg=/d/prepare",
		"arg=--custom-run-exec", "arg=/d/run", "arg=--custom-run-args", "arg=run",
		"arg=--custom-cleanup-exec", "arg=/d/cleanup", "arg=--custom-cleanup-exec-timeout", "arg=60",
		"arg=--custom-graceful-kill-timeout", "arg=5",
		"token=sekrit", "home=/h", "",
	}, "\n"), out.String(), "the token goes by environment, not argv")

	err = RunSingle(t.Context(), RunSingleOptions{Binary: fake, URL: "u", Token: "t", Executor: "shell", Custom: &CustomConfig{}})
	assert.ErrorContains(t, err, "Custom")
	err = RunSingle(t.Context(), RunSingleOptions{Binary: fake, URL: "u", Executor: "shell"})
	assert.ErrorContains(t, err, "needs")
}

func TestRunSingleStopsWithContext(t *testing.T) {
	fake := filepath.Join(t.TempDir(), "gitlab-runner")
	require.NoError(t, os.WriteFile(fake, []byte("#!/bin/sh\ntrap 'echo got TERM; exit 0' TERM\nwhile :; do sleep 0.1; done\n"), 0o755))
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	var out bytes.Buffer
	start := time.Now()
	err := RunSingle(ctx, RunSingleOptions{Binary: fake, URL: "u", Token: "t", Executor: "shell", Stdout: &out})
	assert.Error(t, err, "a runner stopped by ctx is an error")
	assert.Contains(t, out.String(), "got TERM", "the runner gets SIGTERM to abort its job cleanly")
	assert.Less(t, time.Since(start), 10*time.Second)
}

func TestDriverStages(t *testing.T) {
	c := DriverStages("/opt/lve/bin", "/etc/lve/config.toml")
	assert.Equal(t, "/opt/lve/bin/libvirt-executor-prepare", c.PrepareExec)
	assert.Equal(t, "/opt/lve/bin/libvirt-executor-cleanup", c.CleanupExec)
	assert.Equal(t, []string{"--config", "/etc/lve/config.toml"}, c.RunArgs)
	assert.Equal(t, c.ConfigArgs, c.CleanupArgs)
}
