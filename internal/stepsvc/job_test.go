package stepsvc

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

func TestJobRequest(t *testing.T) {
	dir := t.TempDir()
	payload := filepath.Join(dir, "job.json")
	require.NoError(t, os.WriteFile(payload, []byte(`{"id": 77, "run": "[{\"name\":\"a\",\"script\":\"echo hi\"}]",
		"variables": [
			{"key": "CI_JOB_TOKEN", "value": "tok", "masked": true},
			{"key": "KUBECONFIG", "value": "file-body", "file": true},
			{"key": "../escape", "value": "x", "file": true},
			{"key": "PLAIN", "value": "from-payload"}
		]}`), 0o600))
	j := Job{PayloadPath: payload, Environ: []string{"PATH=/usr/bin", "CUSTOM_ENV_PLAIN=from-env", "CUSTOM_ENV_CI_PROJECT_DIR=/builds/g/p",
		"CUSTOM_ENV_KUBECONFIG=file-body", "CUSTOM_ENV_../escape=x", "JOB_RESPONSE_FILE=" + payload}}
	req, skipped, err := request(j, "/tmp/svc")
	require.NoError(t, err)
	require.Equal(t, "77", req.ID)
	require.Equal(t, "/builds/g/p", req.BuildDir)
	require.JSONEq(t, `[{"name":"a","script":"echo hi"}]`, req.Steps)
	require.Equal(t, []string{"../escape"}, skipped, "a name that would write a file elsewhere is not handed over")
	require.Equal(t, map[string]string{
		"PLAIN": "from-env", "CI_PROJECT_DIR": "/builds/g/p", "TMPDIR": "/tmp",
		"KUBECONFIG": "/tmp/svc/step-runner-output-77/KUBECONFIG", // a file variable is its path, as the shim exports it
	}, req.Env, "the runner's stage environment without CUSTOM_ENV_, nothing of the driver's own")
	require.Len(t, req.Variables, 3)
	require.True(t, req.Variables[0].Masked)
	require.True(t, req.Variables[1].File)

	// Without the project directory the steps would run in the service's
	// own directory: refused.
	noDir := j
	noDir.Environ = []string{"CUSTOM_ENV_PLAIN=from-env", "CUSTOM_ENV_CI_PROJECT_DIR="}
	_, _, err = request(noDir, "/tmp/svc")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)

	// A run: that is not JSON is the job's fault.
	require.NoError(t, os.WriteFile(payload, []byte(`{"id": 77, "run": "[{not json"}`), 0o600))
	_, _, err = request(j, "/tmp/svc")
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "%v", err)
}
