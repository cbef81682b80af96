package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghjob"
)

func TestExitCode(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int
	}{
		{nil, 0},
		{&ghjob.ExitError{Code: 3}, 3},
		{fmt.Errorf("step: %w", &ghjob.ExitError{Code: 127}), 127},
		{&ghjob.ExitError{Code: 300}, 1},
		{errors.New("the job's VM: no room"), 1},
	} {
		require.Equal(t, tc.want, exitCode(tc.err), "%v", tc.err)
	}
}

func TestRunSaysWhatFailed(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, os.WriteFile(cfg, []byte("[images.podman]\nbase = \"/p.qcow2\"\n"), 0o600))
	getenv := func(k string) string {
		if k == "LIBVIRT_EXECUTOR_CONFIG" {
			return cfg
		}
		return ""
	}
	var out, errb bytes.Buffer
	code := run(context.Background(), getenv, strings.NewReader(`{"command":"cleanup_job","state":{}}`), &out, &errb, nil)
	require.Equal(t, 1, code)
	require.Contains(t, errb.String(), "libvirt-executor-hooks: [github_hooks] vm_image is not set in "+cfg)
	require.Empty(t, out.String(), "stdout is the steps' alone")

	errb.Reset()
	code = run(context.Background(), func(string) string { return "/nonexistent/config.toml" }, strings.NewReader(`{}`), &out, &errb, nil)
	require.Equal(t, 1, code)
	require.Contains(t, errb.String(), "config /nonexistent/config.toml")
}
