package bench

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestStageTime(t *testing.T) {
	trace := "2026-11-27T10:00:00.100000Z 00O section_start:1795790739:prepare_executor\r\x1b[0Kx\n" +
		"2026-11-27T10:00:01.000000Z 00O section_start:1795790740:step_script\r\x1b[0K\x1b[0K\x1b[36;1mExecuting\n" +
		"2026-11-27T10:00:01.500000Z 01O $ step-runner ci\n" +
		"2026-11-27T10:00:02.250000Z 00O section_end:1795790741:step_script\r\x1b[0Ksection_start:1795790741:cleanup_file_variables\n"
	d, err := stageTime(trace)
	require.NoError(t, err)
	require.Equal(t, 1250*time.Millisecond, d)
	_, err = stageTime("section_start:1:step_script\nsection_end:2:step_script\n")
	require.ErrorContains(t, err, "FF_TIMESTAMPS", "without timestamps there is nothing to measure")
}

func TestStepsTable(t *testing.T) {
	r := &StepsReport{Runs: 3, Modes: []StepsMode{
		{Name: "script: true", Job: []float64{12, 11, 13}, Stage: []float64{0.3, 0.2, 0.4}},
		{Name: "run (shim)", Job: []float64{12.5, 12, 14}, Stage: []float64{0.9, 0.8, 1.0}},
	}}
	var b bytes.Buffer
	require.NoError(t, r.WriteTable(&b))
	require.Contains(t, b.String(), "12.00 (11.00-13.00)")
	require.Contains(t, b.String(), "shim mode's cost (medians): stage +0.60 s, job +0.50 s")
}

func TestStepsTableNative(t *testing.T) {
	r := &StepsReport{Runs: 3, Modes: []StepsMode{
		{Name: "script: true", Job: []float64{12, 11, 13}, Stage: []float64{0.3, 0.2, 0.4}},
		{Name: "run (shim)", Job: []float64{12.5, 12, 14}, Stage: []float64{0.9, 0.8, 1.0}},
		{Name: "run (native)", Job: []float64{14, 13, 15}, Stage: []float64{2.3, 2.2, 2.4}},
	}}
	var b bytes.Buffer
	require.NoError(t, r.WriteTable(&b))
	require.Regexp(t, `(?s)shim mode's cost \(medians\): stage \+0\.60 s, job \+0\.50 s\nnative mode's cost \(medians\): stage \+2\.00 s, job \+2\.00 s`, b.String())
}

func TestNativeStepsConfig(t *testing.T) {
	require.Equal(t, "a = 1\n\n[gitlab]\nsteps = \"native\"\n", NativeStepsConfig("a = 1\n"))
	got := NativeStepsConfig("a = 1\n[gitlab]\nservices = \"warn\"\nsteps = \"shim\"\n[cache]\n")
	require.Equal(t, "a = 1\n[gitlab]\nsteps = \"native\"\nservices = \"warn\"\n\n[cache]\n", got)
}
