//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

func TestPassingJob(t *testing.T) {
	r := setup(t)
	url, sha := r.repo(t)
	opts, lw := r.options(t)
	res, err := harness.RunJob(context.Background(), opts, harness.Job{
		RepoURL: url, SHA: sha,
		Script:      []string{"cat README.md", "./build.sh", "echo job-output-$((6*7))", "uname -n"},
		AfterScript: []string{"echo after-script-ran"},
	})
	require.NoError(t, err)
	require.Equal(t, harness.StateSuccess, res.State, "%s: %s", res.FailureReason, res.Message)
	log := lw.buf.String()
	require.Contains(t, log, "job-output-42")
	require.Contains(t, log, "after-script-ran")
	for _, want := range []string{"Created ", "Booted, address ", "SSH ready as root@", "Machine ready in"} {
		require.Contains(t, log, want, "prepare tells the job log what it does")
	}
	require.Equal(t, 1, res.PrepareAttempts)
	require.Equal(t, []string{"prepare_script", "get_sources", "build_script", "after_script"}, runStages(res))
	require.Equal(t, 0, stageExit(t, res, "cleanup").ExitCode)
}

func runStages(res *harness.Result) []string {
	var out []string
	for _, s := range res.Stages {
		if s.Exec == "run" {
			out = append(out, s.Name)
		}
	}
	return out
}

func TestFailingJobKeepsScriptCodeAndRunsAfterScriptInSameVM(t *testing.T) {
	r := setup(t)
	opts, lw := r.options(t)
	res, err := harness.RunJob(context.Background(), opts, harness.Job{
		Script:      []string{"echo same-vm-$$ > /tmp/marker", "echo about to exit 3", "exit 3"},
		AfterScript: []string{"echo after:$(cat /tmp/marker | cut -d- -f1,2)", `echo status=$CI_JOB_STATUS`},
	})
	require.NoError(t, err)
	require.Equal(t, harness.StateFailed, res.State)
	require.Equal(t, harness.ReasonScriptFailure, res.FailureReason, res.Message)
	require.Equal(t, 1, stageExit(t, res, "build_script").ExitCode, "run exits BUILD_FAILURE")
	require.Equal(t, 3, res.ScriptExitCode, "the script's own code reaches BUILD_EXIT_CODE_FILE")
	require.Equal(t, 0, stageExit(t, res, "after_script").ExitCode)
	log := lw.buf.String()
	require.Contains(t, log, "after:same-vm", "after_script sees build_script's file: same VM")
	require.Contains(t, log, "status=failed")
}

func TestCancelStopsRemoteProcessAndLeavesNothing(t *testing.T) {
	r := setup(t)
	opts, lw := r.options(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	started := make(chan struct{})
	opts.OnStage = func(name string, pid int) {
		if name == "build_script" {
			close(started)
		}
	}
	go func() {
		<-started
		// Cancel once the script has started its background child in the
		// guest (its next line is in the job log).
		logSays(lw, "long-job-started", 2*time.Minute)
		cancel()
	}()
	res, err := harness.RunJob(ctx, opts, harness.Job{
		Script: []string{"sleep 600 & echo $! > /tmp/sleeper.pid", "echo long-job-started", "wait"},
		AfterScript: []string{
			`if kill -0 "$(cat /tmp/sleeper.pid)" 2>/dev/null; then echo SLEEPER-ALIVE; else echo SLEEPER-GONE; fi`,
		},
	})
	require.NoError(t, err)
	build := stageExit(t, res, "build_script")
	require.Equal(t, "canceled", build.Stopped)
	require.Equal(t, 2, build.ExitCode, "run exits SYSTEM_FAILURE on SIGTERM")
	require.False(t, build.SIGKILLed, "run exited promptly after SIGTERM")
	log := lw.buf.String()
	require.Contains(t, log, "long-job-started")
	require.Regexp(t, `(?m)^SLEEPER-GONE\r?$`, log, "the script's background process is gone in the guest")
	require.NotRegexp(t, `(?m)^SLEEPER-ALIVE\r?$`, log)
}

func TestVMDestroyedDuringBuildIsSystemFailure(t *testing.T) {
	r := setup(t)
	opts, lw := r.options(t)
	destroyed := make(chan error, 1)
	var destroyAt time.Duration // after the stage's start
	opts.OnStage = func(stage string, pid int) {
		if stage != "build_script" {
			return
		}
		t0 := time.Now()
		go func() {
			// The script runs in the guest (its first line is in the job
			// log) when its VM is destroyed.
			logSays(lw, "build-is-running", 2*time.Minute)
			destroyAt = time.Since(t0)
			destroyed <- r.destroyJobDomain()
		}()
	}
	res, err := harness.RunJob(context.Background(), opts, harness.Job{
		Script: []string{"echo build-is-running", "sleep 600"},
	})
	require.NoError(t, err)
	require.NoError(t, <-destroyed)
	build := stageExit(t, res, "build_script")
	require.Equal(t, 2, build.ExitCode, "a vanished VM is a system failure, never BUILD_FAILURE")
	require.Equal(t, harness.ReasonSystemFailure, res.FailureReason)
	// Keepalive bound: interval x count, plus one interval of slack and the
	// time before the domain was destroyed.
	bound := time.Duration(r.cfg.SSH.KeepaliveCount+1)*r.cfg.SSH.KeepaliveInterval.D() + destroyAt
	require.Less(t, build.Duration, bound+5*time.Second, "noticed within the keepalive bound (%s), not at the job timeout", bound)
	t.Logf("build_script ended %s after start (domain destroyed at %s)", build.Duration, destroyAt.Round(time.Millisecond))
}

func TestHostKeyMismatchSendsNoScript(t *testing.T) {
	r := setup(t)
	s := newStageRunner(t, r)
	require.Equal(t, 0, s.run(t, "config").code)
	require.Equal(t, 0, s.run(t, "prepare").code)
	defer func() { require.Equal(t, 0, s.run(t, "cleanup").code) }()

	// The job's connection holder verified the pinned key when it connected;
	// its connection stays trusted whatever the record says later (the
	// holder's own check of a mismatching key is a unit test of
	// internal/holder). So the holder is connected first (one stage through
	// it) and then stopped: the stage below connects on its own and checks
	// the key it reads from the record. Without this the test raced the
	// holder's start-up.
	require.Equal(t, 0, s.runScript(t, "prepare_script", "true\n").code)
	killHolder(t, s.holderPID(t))

	// Pin a different host key: the guest now presents a key other than the
	// expected one, as an impostor at the recorded address would.
	recPath := filepath.Join(r.cfg.StateDir, "machines", s.name(t), "machine.json")
	orig, err := os.ReadFile(recPath)
	require.NoError(t, err)
	var rec map[string]any
	require.NoError(t, json.Unmarshal(orig, &rec))
	other, err := guestinit.NewKeys("impostor")
	require.NoError(t, err)
	rec["host_key"] = strings.TrimSpace(string(ssh.MarshalAuthorizedKey(other.Host)))
	b, err := json.Marshal(rec)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(recPath, b, 0o600))

	res := s.runScript(t, "build_script", "#!/usr/bin/env bash\ntouch /tmp/script-was-sent\necho SENT\n")
	require.Equal(t, 2, res.code, "host-key mismatch is a system failure")
	require.Contains(t, res.stderr, "host key mismatch")
	require.Contains(t, res.stderr, "connects directly", "the stage took the direct path this test is about")
	require.NotContains(t, res.stdout, "SENT")

	// With the right key back, the guest shows the script never arrived.
	require.NoError(t, os.WriteFile(recPath, orig, 0o600))
	res = s.runScript(t, "after_script", "#!/usr/bin/env bash\nif [ -e /tmp/script-was-sent ]; then echo WAS-SENT; else echo NEVER-SENT; fi\n")
	require.Equal(t, 0, res.code, res.stderr)
	require.Contains(t, res.stdout, "NEVER-SENT")
}

// otherImages are the images the rig configured besides the default one;
// every image LVE_E2E_IMAGES names must be among them.
func otherImages(t *testing.T, r *rig) []string {
	t.Helper()
	var others []string
	for _, name := range r.cfg.ImageNames() {
		if name != r.cfg.DefaultImage {
			others = append(others, name)
		}
	}
	if want := os.Getenv("LVE_E2E_IMAGES"); want != "" {
		for _, img := range strings.Split(want, ",") {
			require.Contains(t, others, img, "LVE_E2E_IMAGES names an image the rig did not configure")
		}
	}
	return others
}

// logSays waits until the job log has a line containing what, at most
// within (a goroutine's wait: it cannot fail the test; the test's own
// assertions then say what did not happen).
func logSays(lw *logWriter, what string, within time.Duration) {
	deadline := time.Now().Add(within)
	for !strings.Contains(lw.buf.String(), what) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond) // the poll's interval
	}
}
