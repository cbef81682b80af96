package admin

import (
	"bytes"
	"context"
	"errors"
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
	name := lifecycle.MachineName(cfg.NamePrefix, m.Manager().Controller, lifecycle.InstanceTag("x"), 7)
	require.NoError(t, m.Close())

	out := captureStdout(t, func() {
		require.NoError(t, App().RunContext(context.Background(), []string{"libvirt-executor", "--config=" + cfgPath, jobvm.ExplainCommand, "--", name}))
	})
	require.Equal(t, "VM "+name+" no longer exists\n", out)

	out = captureStdout(t, func() {
		err := App().RunContext(context.Background(), []string{"libvirt-executor", "--config=" + cfgPath, jobvm.ExplainCommand, "--", "test"})
		require.ErrorContains(t, err, "not a machine of this installation")
	})
	require.Empty(t, out, "the test driver's own domain is not ours to explain")

	err = App().RunContext(context.Background(), []string{"libvirt-executor", "--config=" + cfgPath, jobvm.ExplainCommand})
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

// Run as root on a state dir of another user (the runner's), gc and rm are
// refused with a message naming the owner and the fix, exit status
// ExitNotOwner, and create nothing there; list only looks: it runs (with
// the controller id that exists) and creates nothing either; doctor
// creates nothing (issue #22, item 7).
func TestAdminCommandsAsRootOnAnotherUsersStateDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown the state dir to another user")
	}
	dir := t.TempDir()
	stateDir := filepath.Join(dir, "state")
	cfgPath := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte(`libvirt_uri = "test:///default"
state_dir = "`+stateDir+`"
storage_pool = "default-pool"
[images.tiny]
base = "/img/tiny.qcow2"
`), 0o600))
	require.NoError(t, os.Mkdir(stateDir, 0o700))
	require.NoError(t, os.Chown(stateDir, 65534, 65534))
	run := func(args ...string) error {
		return App().RunContext(context.Background(), append([]string{"libvirt-executor", "--config=" + cfgPath}, args...))
	}
	empty := func(what string) {
		t.Helper()
		entries, err := os.ReadDir(stateDir)
		require.NoError(t, err)
		require.Empty(t, entries, "%s created something in another user's state dir", what)
	}

	for _, args := range [][]string{{"gc"}, {"gc", "--dry-run"}, {"rm", "lve-x"}, {"list"}} {
		err := run(args...)
		require.Error(t, err, "%v", args)
		require.Contains(t, err.Error(), "belongs to", "%v", args)
		require.Contains(t, err.Error(), "sudo -u ", "%v", args)
		require.Equal(t, ExitNotOwner, ExitCode(err), "%v", args)
		empty(args[0])
	}
	_ = captureStdout(t, func() { _ = run("doctor") })
	empty("doctor")

	// With the installation's controller id there, list looks and
	// changes nothing; gc is still refused.
	const id = "0f8e2c1a-5b7d-4e3f-9a1b-2c3d4e5f6a7b"
	idFile := filepath.Join(stateDir, "controller-id")
	require.NoError(t, os.WriteFile(idFile, []byte(id+"\n"), 0o600))
	require.NoError(t, os.Chown(idFile, 65534, 65534))
	out := captureStdout(t, func() { require.NoError(t, run("list")) })
	require.Contains(t, out, "no machines of controller "+id)
	err := run("gc")
	require.Equal(t, ExitNotOwner, ExitCode(err), "%v", err)
	entries, err := os.ReadDir(stateDir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the controller id")
	require.Equal(t, 1, ExitCode(errors.New("other")))
}

// image build's command line: the recipe's name is checked against the
// recipes' directory before anything runs, and options go before it.
func TestImageBuildCommand(t *testing.T) {
	recipes := filepath.Join("..", "..", "deploy", "images")
	out := t.TempDir()
	run := func(args ...string) error {
		return App().RunContext(context.Background(), append([]string{"libvirt-executor", "image", "build", "--recipes", recipes, "--output", out}, args...))
	}
	require.ErrorContains(t, run("bogus"), `image build "bogus": no such recipe in `+recipes+` (allowed: cloud, debian, podman, tiny)`)
	require.ErrorContains(t, run(), "image build needs the name of a recipe (allowed: cloud, debian, podman, tiny)")
	require.ErrorContains(t, run("tiny", "--force"), "image build takes one recipe name, got 2 arguments (options go before the name")
	err := App().RunContext(context.Background(), []string{"libvirt-executor", "image", "build", "--recipes", t.TempDir(), "tiny"})
	require.ErrorContains(t, err, "no build.sh there")
	err = App().RunContext(context.Background(), []string{"libvirt-executor", "image", "build", "--recipes", recipes, "--output", "rel", "tiny"})
	require.ErrorContains(t, err, `--output "rel": must be an absolute directory`)
	entries, err := os.ReadDir(out)
	require.NoError(t, err)
	require.Empty(t, entries, "nothing was built")
}
