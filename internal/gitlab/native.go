package gitlab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/stepsvc"
)

// stepStages are the names the runner gives the stage whose script its
// shim fills with `step-runner ci` for a run: job (the Custom executor gets
// build_script for step_script).
var stepStages = []string{"build_script", "step_script"}

// maxSteps bounds a job's run: as the driver reads it (GitLab's own limit
// on a job definition is far smaller).
const maxSteps = 4 << 20

// nativeSteps says whether this stage runs the job's steps natively: a
// run: job's step stage with gitlab.steps = "native". Without the payload
// (insecure_job_id_from_env) the runner's shim runs them.
func nativeSteps(cfg *config.Config, j *job, stage string) bool {
	return slices.Contains(stepStages, stage) && cfg.GitLab.Steps == config.StepsNative && j.job.Steps && j.job.FromPayload
}

// stepsPayload is what native steps read of JOB_RESPONSE_FILE: the job's
// run: and its variables (secrets among them: kept in memory, handed to
// the service in the guest, never logged).
type stepsPayload struct {
	ID        int64         `json:"id"`
	Run       string        `json:"run"`
	Variables []jobVariable `json:"variables"`
}

// stepsRequest builds the service's Request: the job's run:, its build
// directory, and the job's variables as the runner's shim would export
// them (every CUSTOM_ENV_* the runner gives the stage), with file
// variables as the paths the service writes them at.
func stepsRequest(e Env, dir string) (stepsvc.Request, []string, error) {
	path := e.Getenv("JOB_RESPONSE_FILE")
	f, err := os.Open(path)
	if err != nil {
		return stepsvc.Request{}, nil, exitcodes.System(fmt.Errorf("JOB_RESPONSE_FILE: %w", err))
	}
	defer f.Close()
	var p stepsPayload
	if err := json.NewDecoder(io.LimitReader(f, 64<<20)).Decode(&p); err != nil {
		return stepsvc.Request{}, nil, exitcodes.System(fmt.Errorf("JOB_RESPONSE_FILE %s: cannot decode the job payload: %v", path, err))
	}
	if len(p.Run) > maxSteps {
		return stepsvc.Request{}, nil, exitcodes.Userf("the job's run: is %d bytes; at most %d are allowed", len(p.Run), maxSteps)
	}
	if !json.Valid([]byte(p.Run)) {
		return stepsvc.Request{}, nil, exitcodes.Userf("the job's run: is not valid JSON in the job payload")
	}
	id := strconv.FormatInt(p.ID, 10)
	req := stepsvc.Request{ID: id, Steps: p.Run, Env: map[string]string{},
		BuildDir: e.Getenv("CUSTOM_ENV_CI_PROJECT_DIR")}
	if req.BuildDir == "" {
		// The steps would run in the service's private directory.
		return stepsvc.Request{}, nil, exitcodes.System(errors.New("CUSTOM_ENV_CI_PROJECT_DIR is empty: the runner gives every run stage the job's project directory"))
	}
	var skipped []string
	environ := e.Environ
	if environ == nil {
		environ = os.Environ
	}
	for _, kv := range environ() {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(k, customEnvPrefix) {
			continue
		}
		req.Env[strings.TrimPrefix(k, customEnvPrefix)] = v
	}
	for _, v := range p.Variables {
		if !stepsvc.ValidKey(v.Key) {
			skipped = append(skipped, v.Key)
			delete(req.Env, v.Key)
			continue
		}
		req.Variables = append(req.Variables, stepsvc.Variable{Key: v.Key, Value: v.Value, File: v.File, Masked: v.Masked})
		if v.File {
			req.Env[v.Key] = stepsvc.FilePath(dir, id, v.Key)
		}
	}
	if _, set := req.Env["TMPDIR"]; !set {
		// The service runs with its own directory as TMPDIR; the steps
		// get the guest's usual one.
		req.Env["TMPDIR"] = "/tmp"
	}
	return req, skipped, nil
}

const customEnvPrefix = "CUSTOM_ENV_"

// runNative runs the job's steps through the step-runner service in the
// guest (docs/steps.md, "Native mode").
func runNative(ctx context.Context, e Env, j *job, sess *jobvm.Session, span *time.Duration) error {
	req, skipped, err := stepsRequest(e, stepsvc.DefaultDir)
	if exitcodes.Classify(err) == exitcodes.BuildClass {
		// The job's own run: is wrong: a script failure, as the shim's
		// step-runner ci would fail on it.
		fmt.Fprintf(e.Stderr, "libvirt-executor: %v\n", err)
		return &exitcodes.ScriptError{Code: 1}
	}
	if err != nil {
		return err
	}
	if len(skipped) > 0 {
		names := make([]string, 0, min(len(skipped), 10))
		for _, k := range skipped[:min(len(skipped), 10)] {
			names = append(names, shown(k))
		}
		more := ""
		if len(skipped) > 10 {
			more = fmt.Sprintf(" and %d more", len(skipped)-10)
		}
		fmt.Fprintf(e.Stderr, "libvirt-executor: variables not handed to the steps (a name must be letters, digits and '_'): %s%s\n", strings.Join(names, ", "), more)
	}
	e.say("Running the steps natively: step-runner serve in the VM, reached over the job's SSH connection (gitlab.steps = \"native\")")
	t0 := time.Now()
	r := &stepsvc.Runner{
		Stream: func(ctx context.Context, cmd string, stdin io.Reader, stdout io.Writer) error {
			return sess.Stream(ctx, cmd, stdin, stdout, e.Stderr)
		},
		Out: e.Stdout, Log: j.log,
		Note: func(format string, args ...any) { fmt.Fprintf(e.Stderr, format+"\n", args...) },
	}
	err = r.Run(ctx, req)
	*span = time.Since(t0)
	outcome := "succeeded"
	if err != nil {
		outcome = "failed"
	}
	fmt.Fprintf(e.Stderr, "libvirt-executor: steps %s; the step stage took %s\n", outcome, span.Round(10*time.Millisecond))
	if errors.Is(err, stepsvc.ErrNoStepRunner) {
		err = exitcodes.System(fmt.Errorf("%w: set [guest_tools] step_runner in the driver configuration, or install step-runner in the image (docs/steps.md)", err))
	}
	return err
}
