package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"
)

// StepsOptions is the GitLab Steps benchmark: a no-op run: job (shim mode:
// one stage running step-runner ci) beside a no-op script: job, both on the
// default image, cold, through a real `gitlab-runner run` (multi-runner
// mode, the only one that converts run: jobs) against the fake job API.
type StepsOptions struct {
	Config string // the driver configuration (the rig's; guest_tools.step_runner set)
	Bin    string // the stage executables
	Runner string // gitlab-runner
	Listen string // host:port for the fake job API ("" : 127.0.0.1, any port)
	Runs   int
	Log    io.Writer // progress; nil: none
}

// StepsMode is one kind of job.
type StepsMode struct {
	Name string
	// Job is the wall time of each job (s), from the runner taking it to
	// its final update; Stage the step_script section's (the one stage
	// that runs the job's script or steps), from the runner's timestamps.
	Job, Stage []float64
}

// StepsReport is the benchmark's result.
type StepsReport struct {
	Runs  int
	Modes []StepsMode
}

var (
	stepScriptStartRE = regexp.MustCompile(`section_start:[0-9]+:step_script\b`)
	stepScriptEndRE   = regexp.MustCompile(`section_end:[0-9]+:step_script\b`)
)

// stageTime is how long the step_script section of a job log stamped by
// FF_TIMESTAMPS took.
func stageTime(trace string) (time.Duration, error) {
	var start, end time.Time
	for _, line := range strings.Split(trace, "\n") {
		stamp, rest, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, stamp)
		if err != nil {
			continue
		}
		if start.IsZero() && stepScriptStartRE.MatchString(rest) {
			start = t
		}
		if !start.IsZero() && stepScriptEndRE.MatchString(rest) {
			end = t
		}
	}
	if start.IsZero() || end.IsZero() {
		return 0, fmt.Errorf("no timestamped start and end of step_script in the log (FF_TIMESTAMPS)")
	}
	return end.Sub(start), nil
}

// StepsRound runs o.Runs rounds of a no-op script: job and a no-op run: job
// (the order alternating between rounds), one `gitlab-runner run` per round.
func StepsRound(ctx context.Context, o StepsOptions) (*StepsReport, error) {
	if o.Runs <= 0 {
		return nil, fmt.Errorf("steps bench: --runs must be > 0")
	}
	rep := &StepsReport{Runs: o.Runs, Modes: []StepsMode{{Name: "script: true"}, {Name: `run: [{script: "true"}] (shim)`}, {Name: `run: [{script: "true"}] (native)`}}}
	b, err := os.ReadFile(o.Config)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "lve-bench-steps")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	native := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(native, []byte(NativeStepsConfig(string(b))), 0o600); err != nil {
		return nil, err
	}
	for i := range o.Runs {
		// Shim and script: jobs in one gitlab-runner run; the native job
		// in one of its own (another driver configuration), the order
		// alternating between rounds.
		first, second := func() error { return stepsRun(ctx, o, o.Config, i, rep, 0, 1) }, func() error { return stepsRun(ctx, o, native, i, rep, 2) }
		if i%2 == 1 {
			first, second = second, first
		}
		if err := first(); err != nil {
			return rep, fmt.Errorf("run %d: %w", i+1, err)
		}
		if err := second(); err != nil {
			return rep, fmt.Errorf("run %d: %w", i+1, err)
		}
	}
	return rep, nil
}

// NativeStepsConfig is a driver configuration with gitlab.steps = "native".
func NativeStepsConfig(cfg string) string {
	re := regexp.MustCompile(`(?m)^\[gitlab\]\s*$`)
	if re.MatchString(cfg) {
		cfg = regexp.MustCompile(`(?m)^steps = "[a-z]*"\s*$`).ReplaceAllString(cfg, "")
		return re.ReplaceAllString(cfg, "[gitlab]\nsteps = \"native\"")
	}
	return cfg + "\n[gitlab]\nsteps = \"native\"\n"
}

// stepsJobs are the benchmark's jobs, one per StepsMode.
var stepsJobs = func() []jobapi.Job {
	timestamps := []jobapi.Variable{{Key: "FF_TIMESTAMPS", Value: "true"}}
	return []jobapi.Job{
		{Name: "script-noop", Script: []string{"true"}, Variables: timestamps},
		{Name: "steps-noop", Run: `[{"name":"noop","script":"true"}]`, Variables: timestamps},
		{Name: "steps-native-noop", Run: `[{"name":"noop","script":"true"}]`, Variables: timestamps},
	}
}()

// stepsRun runs the jobs of modes (indexes of rep.Modes) through one
// gitlab-runner run with the driver configuration cfg.
func stepsRun(ctx context.Context, o StepsOptions, cfg string, run int, rep *StepsReport, modes ...int) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	srv, err := jobapi.Start(sctx, jobapi.Options{Listen: o.Listen})
	if err != nil {
		return err
	}
	defer func() { _ = srv.Close() }()
	jobs := make([]jobapi.Job, len(modes))
	for k, m := range modes {
		jobs[k] = stepsJobs[m]
	}
	order := make([]int, len(jobs))
	for k := range order {
		order[k] = k
	}
	if run%2 == 1 {
		slices.Reverse(order)
	}
	ids := make([]int64, len(jobs))
	for _, k := range order {
		ids[k] = srv.Enqueue(jobs[k])
	}
	var out syncbuf.Buffer
	done := make(chan error, 1)
	rctx, stop := context.WithCancel(sctx)
	defer stop()
	go func() {
		done <- jobapi.RunMulti(rctx, jobapi.RunMultiOptions{
			Binary: o.Runner, URL: srv.URL(), Token: srv.RunnerToken(), Executor: "custom",
			Custom:    jobapi.DriverStages(o.Bin, cfg),
			BuildsDir: "/builds", CacheDir: "/cache", Concurrent: 1,
			Env: []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir()}, Stdout: &out, Stderr: &out,
		})
	}()
	res := make([]jobapi.Result, len(jobs))
	for k, id := range ids {
		wctx, wcancel := context.WithTimeout(ctx, 5*time.Minute)
		res[k], err = srv.Wait(wctx, id)
		wcancel()
		if err != nil {
			stop()
			if rerr := <-done; rerr != nil {
				err = fmt.Errorf("%w (and gitlab-runner run: %v)", err, rerr)
			}
			return fmt.Errorf("job %s: %w\n%s", jobs[k].Name, err, out.String())
		}
	}
	stop()
	if err := <-done; err != nil {
		return fmt.Errorf("gitlab-runner run: %w\n%s", err, out.String())
	}
	for k := range jobs {
		if res[k].State != jobapi.StateSuccess {
			return fmt.Errorf("job %s: %s %s\n%s", jobs[k].Name, res[k].State, res[k].FailureReason, res[k].Trace)
		}
		st, err := stageTime(res[k].Trace)
		if err != nil {
			return fmt.Errorf("job %s: %w\n%s", jobs[k].Name, err, res[k].Trace)
		}
		m := &rep.Modes[modes[k]]
		m.Job = append(m.Job, res[k].Duration.Seconds())
		m.Stage = append(m.Stage, st.Seconds())
		if o.Log != nil {
			fmt.Fprintf(o.Log, "[lve-bench] steps run %d: %s: job %.2fs, step_script %.2fs\n", run+1, jobs[k].Name, res[k].Duration.Seconds(), st.Seconds())
		}
	}
	return nil
}

// WriteTable prints the medians (and ranges) side by side, and the shim's
// cost: the run: job's median less the script: job's.
func (r *StepsReport) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "\nGitLab Steps: no-op jobs on the default image, cold, %d run(s) each, through gitlab-runner run (median, min-max, seconds):\n", r.Runs)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tWHOLE JOB\tSTEP_SCRIPT STAGE")
	median := func(v []float64) float64 {
		s := slices.Clone(v)
		slices.Sort(s)
		return s[len(s)/2]
	}
	cell := func(v []float64) string {
		if len(v) == 0 {
			return "-"
		}
		s := slices.Clone(v)
		slices.Sort(s)
		return fmt.Sprintf("%.2f (%.2f-%.2f)", median(v), s[0], s[len(s)-1])
	}
	for _, m := range r.Modes {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", m.Name, cell(m.Job), cell(m.Stage))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for i, what := range []string{1: "shim", 2: "native"} {
		if i == 0 {
			continue
		}
		if len(r.Modes) > i && len(r.Modes[0].Stage) > 0 && len(r.Modes[i].Stage) > 0 {
			fmt.Fprintf(w, "%s mode's cost (medians): stage %+.2f s, job %+.2f s\n", what,
				median(r.Modes[i].Stage)-median(r.Modes[0].Stage), median(r.Modes[i].Job)-median(r.Modes[0].Job))
		}
	}
	return nil
}
