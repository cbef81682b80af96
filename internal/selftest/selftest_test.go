package selftest

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
)

func TestMachineReady(t *testing.T) {
	require.Equal(t, 6300*time.Millisecond, machineReady("x\nMachine ready in 6.3s\n"))
	require.Equal(t, 25*time.Millisecond, machineReady("Machine ready in 25ms (warm)\n"))
	require.Zero(t, machineReady("no such line"))
}

func TestDiagnose(t *testing.T) {
	ok := JobReport{Name: produceName, State: jobapi.StateSuccess}
	for _, tc := range []struct {
		name, trace, reason, want string
		state                     string
	}{
		{"no runner in the guest", "Note: gitlab-runner is not on the guest's PATH: caches", "script_failure", "set [guest_tools] gitlab_runner", jobapi.StateFailed},
		{"runner says missing", "Missing gitlab-runner. Uploading artifacts is disabled.", "script_failure", "mounts the guest tools disk", jobapi.StateFailed},
		{"unreachable", "Uploading cache.zip to http://10.0.0.1:9/x\nWARNING: Retrying... error=Put \"http://10.0.0.1:9/x\" dial tcp 10.0.0.1:9: connect: connection refused", "script_failure", "cannot reach this host at 10.0.0.1:9", jobapi.StateFailed},
		{"prepare", "ERROR: Preparation failed: exit status 2", "runner_system_failure", "run libvirt-executor doctor", jobapi.StateFailed},
		{"not run", "", "", "never ran", "not run"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := &Report{Listen: "10.0.0.1:9", Jobs: []JobReport{ok, {Name: consumeName, State: tc.state, FailureReason: tc.reason, Trace: tc.trace}}}
			fixes := diagnose(rep, Options{}, nil, "runner output", nil)
			require.Len(t, fixes, 1)
			require.Contains(t, fixes[0], tc.want)
			rep.Fixes = fixes
			require.False(t, rep.OK())
			var out bytes.Buffer
			rep.Print(&out)
			require.Contains(t, out.String(), "FAILED. What to fix:")
			require.Contains(t, out.String(), tc.want)
		})
	}

	rep := &Report{Jobs: []JobReport{ok, {Name: consumeName, State: jobapi.StateSuccess}}}
	require.Empty(t, diagnose(rep, Options{}, nil, "", nil))
	var out bytes.Buffer
	rep.Print(&out)
	require.Contains(t, out.String(), "OK: VMs start")

	require.NotEmpty(t, diagnose(&Report{Jobs: []JobReport{ok}}, Options{}, errors.New("exit status 1"), "boom", nil), "a failed runner is reported even when its jobs passed")

	// A second job skipped after the first failed adds no fix of its own.
	failed := JobReport{Name: produceName, State: jobapi.StateFailed, FailureReason: "script_failure",
		Trace: "Uploading cache.zip to http://10.0.0.1:9/x\nWARNING: Retrying... error=Put \"http://10.0.0.1:9/x\" dial tcp 10.0.0.1:9: connect: connection refused"}
	rep = &Report{Listen: "10.0.0.1:9", Jobs: []JobReport{failed, {Name: consumeName, State: skipped}}}
	fixes := diagnose(rep, Options{}, nil, "", nil)
	require.Len(t, fixes, 1)
	require.Contains(t, fixes[0], "cannot reach this host at 10.0.0.1:9")
	rep.Fixes = fixes
	out.Reset()
	rep.Print(&out)
	require.Regexp(t, `selftest-consume +skipped`, out.String())
}

// The GitLab Steps job (selftest --steps): its own fixes, and the verdict
// says it ran.
func TestDiagnoseSteps(t *testing.T) {
	ok := JobReport{Name: produceName, State: jobapi.StateSuccess}
	noStepRunner := JobReport{Name: stepsName, State: jobapi.StateFailed, FailureReason: "runner_system_failure",
		Trace: "libvirt-executor-prepare: check: this run: job (GitLab Steps) needs step-runner in the guest\nERROR: Preparation failed: exit status 2"}
	fixes := diagnose(&Report{Jobs: []JobReport{ok, noStepRunner}}, Options{}, nil, "", nil)
	require.Len(t, fixes, 1)
	require.Contains(t, fixes[0], "set [guest_tools] step_runner")
	fixes = diagnose(&Report{Jobs: []JobReport{ok, {Name: stepsName, State: "no step output"}}}, Options{}, nil, "", nil)
	require.Len(t, fixes, 1)
	require.Contains(t, fixes[0], "passed without running its step")

	rep := &Report{Jobs: []JobReport{ok, {Name: stepsName, State: jobapi.StateSuccess}}}
	require.Empty(t, diagnose(rep, Options{}, nil, "", nil))
	var out bytes.Buffer
	rep.Print(&out)
	require.Contains(t, out.String(), "selftest-steps     success")
	require.Contains(t, out.String(), "; a GitLab Steps job ran its step with the guest's step-runner.")
	out.Reset()
	(&Report{Jobs: []JobReport{ok}}).Print(&out)
	require.NotContains(t, out.String(), "GitLab Steps", "without --steps the verdict does not claim it")
}
