package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
)

// explain-machine, as the run stage calls it, against libvirt's in-process
// test driver: one sentence on stdout for a machine of this installation
// that is gone, a refusal for a name that is not of this installation.
func TestExplainMachineCommand(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte(`libvirt_uri = "test:///default"
state_dir = "`+filepath.Join(dir, "state")+`"
storage_pool = "default-pool"
[images.tiny]
base = "/img/tiny.qcow2"
`), 0o600))
	cfg, err := config.Load(cfgPath)
	require.NoError(t, err)
	m, err := jobvm.Open(cfg, lifecycle.Options{})
	require.NoError(t, err)
	name := lifecycle.MachineName(cfg.NamePrefix, m.Controller, lifecycle.InstanceTag("x"), 7)
	require.NoError(t, m.Close())

	out := captureStdout(t, func() {
		require.NoError(t, app().RunContext(context.Background(), []string{"libvirt-executor", "--config=" + cfgPath, lifecycle.ExplainCommand, "--", name}))
	})
	require.Equal(t, "VM "+name+" no longer exists\n", out)

	out = captureStdout(t, func() {
		err := app().RunContext(context.Background(), []string{"libvirt-executor", "--config=" + cfgPath, lifecycle.ExplainCommand, "--", "test"})
		require.ErrorContains(t, err, "not a machine of this installation")
	})
	require.Empty(t, out, "the test driver's own domain is not ours to explain")

	err = app().RunContext(context.Background(), []string{"libvirt-executor", "--config=" + cfgPath, lifecycle.ExplainCommand})
	require.ErrorContains(t, err, "takes one machine name")
}

// captureStdout returns what fn wrote to os.Stdout.
func captureStdout(t *testing.T, fn func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	saved := os.Stdout
	os.Stdout = w
	defer func() { os.Stdout = saved }()
	done := make(chan string)
	go func() {
		var b bytes.Buffer
		_, _ = b.ReadFrom(r)
		done <- b.String()
	}()
	fn()
	os.Stdout = saved
	require.NoError(t, w.Close())
	return <-done
}
