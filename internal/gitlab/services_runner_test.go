package gitlab

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// driverModeEnv carries gitlab.services to the driver that
// TestRealRunnerServices runs: this test binary, in a process of its own
// (TestServicesDriverProcess).
const driverModeEnv = "LVE_TEST_SERVICES_DRIVER_MODE"

// TestServicesDriverProcess is the Custom executor driver of
// TestRealRunnerServices: the real config and prepare stages, with a
// hypervisor that cannot be reached (nothing boots), and a cleanup that
// has nothing to do. Skipped unless started as the driver.
func TestServicesDriverProcess(t *testing.T) {
	mode := config.ServicesWarn
	switch os.Getenv(driverModeEnv) {
	case "":
		t.Skip("the driver of TestRealRunnerServices")
	case config.ServicesFail:
		mode = config.ServicesFail
	}
	os.Exit(servicesDriver(mode, flag.Args()))
}

func servicesDriver(mode string, args []string) int {
	codes := exitcodes.FromEnv(os.Getenv)
	dir, err := os.MkdirTemp("", "lve-services-driver-")
	if err != nil || len(args) == 0 {
		fmt.Fprintln(os.Stderr, "driver:", err, args)
		return codes.System
	}
	defer func() { _ = os.RemoveAll(dir) }()
	cfg, err := config.Parse([]byte(fmt.Sprintf("state_dir = %q\n[gitlab]\nservices = %q\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n", dir, mode)))
	if err != nil {
		fmt.Fprintln(os.Stderr, "driver:", err)
		return codes.System
	}
	e := Env{
		Getenv: os.Getenv, Stdout: os.Stdout, Stderr: os.Stderr,
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
		Connect: func(context.Context, string) (vm.Hypervisor, error) {
			return nil, errors.New("no hypervisor: this test boots no VM")
		},
	}
	ctx := context.Background()
	switch args[0] {
	case "config":
		err = Config(ctx, e, cfg)
	case "prepare":
		err = Prepare(ctx, e, cfg)
	case "cleanup":
	default:
		err = fmt.Errorf("stage %q is not expected in this test", args[0])
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "libvirt-executor-%s: %v\n", args[0], err)
	}
	return codes.Resolve(err)
}

// TestRealRunnerServices: an unmodified gitlab-runner hands a job with
// `services:` to the driver's config and prepare stages. The payload the
// runner writes names them (their variables expanded); with
// gitlab.services = "fail" the job fails in prepare as a build failure
// naming them, and no hypervisor is asked for anything; with "warn" the
// job log names them before the machine is prepared. Skipped without a
// gitlab-runner ($LVE_E2E_GITLAB_RUNNER or on PATH) unless
// LVE_E2E_REQUIRED is set.
func TestRealRunnerServices(t *testing.T) {
	bin, why := jobapi.RunnerBinary()
	if bin == "" {
		if os.Getenv("LVE_E2E_REQUIRED") != "" {
			t.Fatalf("LVE_E2E_REQUIRED is set but %s", why)
		}
		t.Skip(why)
	}
	self, err := os.Executable()
	require.NoError(t, err)
	const secret = "s3cr3t-Value-9f2c"
	job := jobapi.Job{
		Name: "with-services", Script: []string{"echo SCRIPT-RAN"},
		Variables: []jobapi.Variable{{Key: "PGVER", Value: "15", Public: true}, {Key: "MY_SECRET", Value: secret, Masked: true}},
		Services: []jobapi.Service{
			{Name: "postgres:$PGVER", Alias: "db"},
			{Name: "redis:7", Entrypoint: []string{"redis-server"}, Command: []string{"--port", "6380"}},
			{Name: "registry.example/$MY_SECRET"},
		},
	}
	run := func(t *testing.T, mode string) jobapi.Result {
		dir := t.TempDir()
		srv, err := jobapi.Start(context.Background(), jobapi.Options{Listen: "127.0.0.1:0"})
		require.NoError(t, err)
		defer func() { require.NoError(t, srv.Close()) }()
		id := srv.Enqueue(job)
		args := []string{"-test.run=^TestServicesDriverProcess$", "--"}
		stage := func(name string) []string { return append(args[:len(args):len(args)], name) }
		var out strings.Builder
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		require.NoError(t, jobapi.RunSingle(ctx, jobapi.RunSingleOptions{
			Binary: bin, URL: srv.URL(), Token: srv.RunnerToken(), Executor: "custom",
			Custom: &jobapi.CustomConfig{
				ConfigExec: self, ConfigArgs: stage("config"), PrepareExec: self, PrepareArgs: stage("prepare"),
				RunExec: self, RunArgs: stage("run"), CleanupExec: self, CleanupArgs: stage("cleanup"),
			},
			BuildsDir: filepath.Join(dir, "builds"), CacheDir: filepath.Join(dir, "cache"),
			MaxBuilds: 1, WaitTimeout: 30 * time.Second,
			Env:    []string{"HOME=" + dir, "PATH=" + os.Getenv("PATH"), driverModeEnv + "=" + mode},
			Stdout: &out, Stderr: &out,
		}), out.String())
		res, err := srv.Wait(ctx, id)
		require.NoError(t, err)
		require.NotContains(t, res.Trace, secret)
		require.NotContains(t, res.Trace, "SCRIPT-RAN")
		return res
	}
	const named = `"postgres:15" (alias "db"), "redis:7", 1 not named here`

	t.Run("fail", func(t *testing.T) {
		res := run(t, config.ServicesFail)
		require.Equal(t, jobapi.StateFailed, res.State, res.Trace)
		require.Equal(t, "script_failure", res.FailureReason, "a build failure, not the runner's system failure")
		require.Contains(t, res.Trace, `gitlab.services = "fail"`, res.Trace)
		require.Contains(t, res.Trace, "the job asks for 3 services: "+named)
		require.NotContains(t, res.Trace, "no hypervisor", "failed before any VM was asked for")
		require.NotContains(t, res.Trace, "Preparing a fresh")
	})
	t.Run("warn", func(t *testing.T) {
		res := run(t, config.ServicesWarn)
		require.Equal(t, jobapi.StateFailed, res.State, res.Trace)
		require.Contains(t, res.Trace, "Warning: this runner does not provide services: 3 services of the job will not be started", res.Trace)
		require.Contains(t, res.Trace, named)
		require.Contains(t, res.Trace, "no hypervisor", "warn goes on to prepare the VM")
	})
}
