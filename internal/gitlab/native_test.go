package gitlab

import (
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
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
