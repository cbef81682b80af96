package gitlab

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

func TestNativeStepsOnlyForTheStepStage(t *testing.T) {
	cfg := &config.Config{}
	cfg.GitLab.Steps = config.StepsNative
	j := &job{job: &Job{Steps: true, FromPayload: true}}
	require.True(t, nativeSteps(cfg, j, "build_script"))
	require.True(t, nativeSteps(cfg, j, "step_script"))
	require.False(t, nativeSteps(cfg, j, "after_script"))
	require.False(t, nativeSteps(cfg, &job{job: &Job{Steps: false, FromPayload: true}}, "build_script"), "not a run: job")
	require.False(t, nativeSteps(cfg, &job{job: &Job{Steps: true}}, "build_script"), "without the payload the shim runs them")
	cfg.GitLab.Steps = config.StepsShim
	require.False(t, nativeSteps(cfg, j, "build_script"))
}

// The step stage of a run: job with gitlab.steps = "native" hands over to
// Env.Steps: the payload, the stage's environment, the job session's
// stream into the guest, the span; without Env.Steps it is a system
// failure that says which executable runs them.
func TestNativeStepsHandOver(t *testing.T) {
	j := preparedJob(t)
	j.cfg.GitLab.Steps = config.StepsNative
	payload := filepath.Join(t.TempDir(), "job.json")
	require.NoError(t, os.WriteFile(payload, []byte(`{"id":1000,"run":"[{\"name\":\"a\",\"script\":\"echo hi\"}]","variables":[],"image":{"name":"tiny"}}`), 0o600))
	env := map[string]string{"JOB_RESPONSE_FILE": payload, "BUILD_EXIT_CODE_FILE": j.exitFile}
	j.e.Getenv = envOf(env)
	j.e.Environ = func() []string { return []string{"CUSTOM_ENV_CI_PROJECT_DIR=/builds/p", "PATH=/usr/bin"} }
	script := filepath.Join(t.TempDir(), "script")
	// The runner's shim script: run, it would fail the stage.
	require.NoError(t, os.WriteFile(script, []byte("exit 3\n"), 0o700))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	err := Run(ctx, j.e, j.cfg, script, "build_script")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "does not run GitLab Steps natively")

	var got StepsJob
	var streamed bytes.Buffer
	j.e.Steps = func(ctx context.Context, s StepsJob) error {
		got = s
		*s.Span = 42 * time.Millisecond
		return s.Stream(ctx, "cat", strings.NewReader("through the job's session"), &streamed)
	}
	require.NoError(t, Run(ctx, j.e, j.cfg, script, "build_script"), "the steps ran, not the runner's script")
	require.Equal(t, payload, got.PayloadPath)
	require.Contains(t, got.Environ, "CUSTOM_ENV_CI_PROJECT_DIR=/builds/p")
	require.Equal(t, "through the job's session", streamed.String())

}
