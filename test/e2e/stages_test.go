//go:build e2e

package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func nextJobID() int64 { return 100000 + rand.Int64N(800000) }

// stageRunner invokes the executables one by one with the runner's
// environment, for tests that must act between stages.
type stageRunner struct {
	r       *rig
	dir     string
	env     []string
	config  map[string]any
	timeout int // job timeout in seconds written to the payload (0: 3600)
	// cred, if set, is the user the stages run as (else this process's).
	cred *syscall.Credential
}

type stageResult struct {
	code           int
	stdout, stderr string
}

func newStageRunner(t *testing.T, r *rig) *stageRunner {
	return newStageRunnerFor(t, r, nextJobID(), r.userDir(t))
}

// newStageRunnerFor is newStageRunner for job id in work directory dir.
func newStageRunnerFor(t *testing.T, r *rig, id int64, dir string) *stageRunner {
	writePayload(t, dir, id, 3600)
	env := append(os.Environ(),
		"BUILD_FAILURE_EXIT_CODE=1", "SYSTEM_FAILURE_EXIT_CODE=2", "TMPDIR="+dir,
		"JOB_RESPONSE_FILE="+filepath.Join(dir, "response.json"),
		fmt.Sprintf("CUSTOM_ENV_CI_JOB_ID=%d", id), "CUSTOM_ENV_CI_JOB_STATUS=running")
	s := &stageRunner{r: r, dir: dir, env: env}
	if r.user != nil {
		// As the runner's user (the confined mode), in a directory of its own.
		r.handOver(t, dir, filepath.Join(dir, "response.json"))
		s.cred = r.user.cred
	}
	return s
}

func writePayload(t *testing.T, dir string, id int64, timeout int) {
	payload := fmt.Sprintf(`{"id":%d,"token":"glcbt-e2e-secret","runner_info":{"timeout":%d},"image":{"name":""}}`, id, timeout)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "response.json"), []byte(payload), 0o600))
}

func (s *stageRunner) run(t *testing.T, stage string, args ...string) stageResult {
	t.Helper()
	if s.timeout != 0 && stage == "config" {
		var id int64
		for _, e := range s.env {
			if v, ok := strings.CutPrefix(e, "CUSTOM_ENV_CI_JOB_ID="); ok {
				_, _ = fmt.Sscan(v, &id)
			}
		}
		writePayload(t, s.dir, id, s.timeout)
	}
	s.handOverArgs(t, args)
	cmd := exec.Command(s.r.exe(stage), append([]string{"--config", s.r.cfgPath}, args...)...)
	cmd.Dir, cmd.Env = s.dir, s.env
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	res := stageResult{code: cmd.ProcessState.ExitCode(), stdout: out.String(), stderr: errb.String()}
	if err != nil && res.code < 0 {
		t.Fatalf("%s: %v", stage, err)
	}
	if stage == "config" && res.code == 0 {
		require.NoError(t, json.Unmarshal(out.Bytes(), &s.config))
	}
	t.Logf("%s exit %d\nstdout: %s\nstderr: %s", stage, res.code, strings.TrimSpace(res.stdout), strings.TrimSpace(res.stderr))
	return res
}

// prepareTogether runs config for each of ss, then their prepares at the
// same time (each VM has one vCPU, the host two cores: two boots take
// about as long as one), and requires each to succeed.
func prepareTogether(t *testing.T, ss ...*stageRunner) {
	t.Helper()
	rns := make([]*running, len(ss))
	for i, s := range ss {
		require.Equal(t, 0, s.run(t, "config").code)
		rns[i] = s.start(t, "prepare")
	}
	for _, rn := range rns {
		res := rn.wait(t, 5*time.Minute)
		require.Equal(t, 0, res.code, "prepare: %s", res.stderr)
	}
}

func (s *stageRunner) runScript(t *testing.T, stage, script string) stageResult {
	t.Helper()
	path := filepath.Join(s.dir, "script.")
	require.NoError(t, os.WriteFile(path, []byte(script), 0o700))
	return s.run(t, "run", path, stage)
}

// handOverArgs gives the files of the job's directory that a stage is
// handed (the run stage's script) to the stages' user, when it is not
// this process's: the runner writes them as its own user.
func (s *stageRunner) handOverArgs(t *testing.T, args []string) {
	t.Helper()
	if s.cred == nil {
		return
	}
	for _, a := range args {
		if !strings.HasPrefix(a, s.dir+string(filepath.Separator)) {
			continue
		}
		if _, err := os.Lstat(a); err == nil {
			require.NoError(t, os.Lchown(a, int(s.cred.Uid), int(s.cred.Gid)))
		}
	}
}

func (s *stageRunner) name(t *testing.T) string {
	t.Helper()
	name, _ := s.config["hostname"].(string)
	require.NotEmpty(t, name)
	return name
}
