package stepsvc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// Job is a GitLab job's steps to run natively (gitlab.steps = "native"):
// what the run stage hands over (package gitlab decides when; the run
// stage's executable calls RunJob).
type Job struct {
	// PayloadPath is the runner's job payload (JOB_RESPONSE_FILE): the
	// job's id, its run: and its variables are read from it.
	PayloadPath string
	// Environ is the stage's environment: every CUSTOM_ENV_* in it (the
	// job's variables as the runner exports them) goes to the steps.
	Environ []string
	// Stream runs a fixed command in the job's guest (the job's session).
	Stream StreamFunc
	// Stdout gets the steps' output and this package's lines for the job
	// log; Stderr its notes.
	Stdout, Stderr io.Writer
	Log            *slog.Logger
	// Span, if set, gets how long the steps ran.
	Span *time.Duration
}

// maxRun bounds a job's run: as it is read (GitLab's own limit on a job
// definition is far smaller).
const maxRun = 4 << 20

// maxPayload bounds how much of the payload is read.
const maxPayload = 64 << 20

const customEnvPrefix = "CUSTOM_ENV_"

// payload is what native steps read of the job payload: the job's run:
// and its variables (secrets among them: kept in memory, handed to the
// service in the guest, never logged).
type payload struct {
	ID        int64  `json:"id"`
	Run       string `json:"run"`
	Variables []struct {
		Key    string `json:"key"`
		Value  string `json:"value"`
		Masked bool   `json:"masked"`
		File   bool   `json:"file"`
	} `json:"variables"`
}

// RunJob runs the job's steps through the step-runner service in the
// guest (docs/steps.md, "Native mode"). A run: that is not valid is the
// job's script failure (status 1, as the shim's step-runner ci would fail
// on it); a guest without step-runner is a system failure naming the fix.
func RunJob(ctx context.Context, j Job) error {
	req, skipped, err := request(j, DefaultDir)
	if exitcodes.Classify(err) == exitcodes.BuildClass {
		fmt.Fprintf(j.Stderr, "libvirt-executor: %v\n", err)
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
		fmt.Fprintf(j.Stderr, "libvirt-executor: variables not handed to the steps (a name must be letters, digits and '_'): %s%s\n", strings.Join(names, ", "), more)
	}
	fmt.Fprintf(j.Stdout, "Running the steps natively: step-runner serve in the VM, reached over the job's SSH connection (gitlab.steps = \"native\")\n")
	t0 := time.Now()
	r := &Runner{
		Stream: j.Stream, Out: j.Stdout, Log: j.Log,
		Note: func(format string, args ...any) { fmt.Fprintf(j.Stderr, format+"\n", args...) },
	}
	err = r.Run(ctx, req)
	span := time.Since(t0)
	if j.Span != nil {
		*j.Span = span
	}
	outcome := "succeeded"
	if err != nil {
		outcome = "failed"
	}
	fmt.Fprintf(j.Stderr, "libvirt-executor: steps %s; the step stage took %s\n", outcome, span.Round(10*time.Millisecond))
	if errors.Is(err, ErrNoStepRunner) {
		err = exitcodes.System(fmt.Errorf("%w: set [guest_tools] step_runner in the driver configuration, or install step-runner in the image (docs/steps.md)", err))
	}
	return err
}

// request builds the service's Request: the job's run:, its build
// directory, and the job's variables as the runner's shim would export
// them (every CUSTOM_ENV_* the runner gives the stage), with file
// variables as the paths the service writes them at (under dir). skipped
// are the variables whose names cannot be handed over.
func request(j Job, dir string) (Request, []string, error) {
	f, err := os.Open(j.PayloadPath)
	if err != nil {
		return Request{}, nil, exitcodes.System(fmt.Errorf("JOB_RESPONSE_FILE: %w", err))
	}
	defer f.Close()
	var p payload
	if err := json.NewDecoder(io.LimitReader(f, maxPayload)).Decode(&p); err != nil {
		return Request{}, nil, exitcodes.System(fmt.Errorf("JOB_RESPONSE_FILE %s: cannot decode the job payload: %v", j.PayloadPath, err))
	}
	if len(p.Run) > maxRun {
		return Request{}, nil, exitcodes.Userf("the job's run: is %d bytes; at most %d are allowed", len(p.Run), maxRun)
	}
	if !json.Valid([]byte(p.Run)) {
		return Request{}, nil, exitcodes.Userf("the job's run: is not valid JSON in the job payload")
	}
	id := strconv.FormatInt(p.ID, 10)
	req := Request{ID: id, Steps: p.Run, Env: map[string]string{}}
	for _, kv := range j.Environ {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !strings.HasPrefix(k, customEnvPrefix) {
			continue
		}
		req.Env[strings.TrimPrefix(k, customEnvPrefix)] = v
	}
	if req.BuildDir = req.Env["CI_PROJECT_DIR"]; req.BuildDir == "" {
		// The steps would run in the service's private directory.
		return Request{}, nil, exitcodes.System(errors.New("CUSTOM_ENV_CI_PROJECT_DIR is empty: the runner gives every run stage the job's project directory"))
	}
	var skipped []string
	for _, v := range p.Variables {
		if !ValidKey(v.Key) {
			skipped = append(skipped, v.Key)
			delete(req.Env, v.Key)
			continue
		}
		req.Variables = append(req.Variables, Variable{Key: v.Key, Value: v.Value, File: v.File, Masked: v.Masked})
		if v.File {
			req.Env[v.Key] = FilePath(dir, id, v.Key)
		}
	}
	if _, set := req.Env["TMPDIR"]; !set {
		// The service runs with its own directory as TMPDIR; the steps
		// get the guest's usual one.
		req.Env["TMPDIR"] = "/tmp"
	}
	return req, skipped, nil
}

// shown is a variable name as a message shows it: quoted, cut short.
func shown(s string) string {
	if len(s) > 32 {
		s = s[:32] + "..."
	}
	return strconv.Quote(s)
}
