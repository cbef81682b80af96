// Package selftest runs sample jobs through an installed gitlab-runner and
// this host's driver configuration, against an in-process fake GitLab job
// API (internal/jobapi): no GitLab instance and no runner token needed. It
// proves what an admin needs before pointing GitLab at the host: the four
// executables start VMs, run stages and clean up; the guest's gitlab-runner
// uploads and downloads artifacts and archives and restores a cache. It
// ends with a short verdict: timings, and what to fix.
package selftest

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/syncbuf"
)

// Options configure one self test.
type Options struct {
	// Config is the driver configuration file the stages get (--config).
	Config string
	// BinDir holds libvirt-executor-{config,prepare,run,cleanup}.
	BinDir string
	// Runner is the gitlab-runner binary that runs the jobs.
	Runner string
	// Listen is where the fake job API listens: an address the guests
	// reach (artifacts and the cache go from the guest straight to it).
	Listen string
	// Image is the job's image ("" for the configuration's default).
	Image string
	// Steps adds a GitLab Steps job (run:), run through `gitlab-runner
	// run` (the only mode that converts run: jobs), in a fresh VM.
	Steps bool
	// Services, if set, adds a job with this image as its one service
	// (alias ServiceAlias), in a fresh VM of ServicesImage ("" for Image):
	// the driver pulls and starts the service in the job's VM, and the
	// job's script finds it by its alias and reaches it on its port
	// (ServicePort, if set; the driver's own wait covers the image's
	// exposed ports).
	Services, ServicesImage string
	ServicePort             int
	// SkipSamples leaves out the two sample jobs (artifacts and a cache,
	// and the GitLab probe in the first): only Steps and Services run.
	SkipSamples bool
	// GitLabURL, if set, is the GitLab the runner is registered with (its
	// config.toml's url: RunnerGitLab, or --url): the first job probes it
	// from the guest (name, route, TLS and certificate) and the report
	// says which is wrong. GitLabCA is the CA file the runner trusts for
	// it (tls-ca-file; "" for the system store).
	GitLabURL, GitLabCA string
	// Timeout bounds the whole test.
	Timeout time.Duration
	// Progress receives one line per step; Log the fake API's logs.
	Progress io.Writer
	Log      *slog.Logger
}

// JobReport is what one sample job did.
type JobReport struct {
	Name, State, FailureReason string
	ExitCode                   int
	// Took is from the runner picking the job up to its final update;
	// Ready is prepare's "Machine ready in" (0 if not found).
	Took, Ready time.Duration
	Trace       string
	// Services is the services job's finding: "" when its service
	// started and answered, else what went wrong (servicesVerdict).
	Services string
}

// Report is the self test's outcome.
type Report struct {
	Runner, Version, Listen string
	// GitLab is the GitLab probe's one line ("" without a GitLab URL).
	GitLab string
	Jobs   []JobReport
	// Fixes say what to do about what failed; empty when all passed.
	Fixes []string
	// Wall is the whole test's time.
	Wall time.Duration
}

// OK is true when every sample job passed.
func (r *Report) OK() bool { return len(r.Fixes) == 0 }

// The two sample jobs: the first makes an artifact and a cache, the second
// (a new VM) downloads the artifact (dependencies) and restores the cache.
const (
	produceName = "selftest-produce"
	consumeName = "selftest-consume"
	stepsName   = "selftest-steps"
	svcName     = "selftest-services"
	// ServiceAlias is the alias the services job gives its service.
	ServiceAlias = "selftest-service"
	cacheKey     = "libvirt-executor-selftest"
	// skipped is the second job's state when the first failed.
	skipped = "skipped"
)

// Run runs the self test. An error means it could not run at all (no
// runner, no listener); a Report with Fixes means it ran and something
// failed.
func Run(ctx context.Context, o Options) (*Report, error) {
	if o.Timeout <= 0 {
		o.Timeout = 15 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	say := func(format string, args ...any) {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, format+"\n", args...)
		}
	}
	rep := &Report{Runner: o.Runner, Version: runnerVersion(ctx, o.Runner)}
	for _, s := range []string{"config", "prepare", "run", "cleanup"} {
		p := filepath.Join(o.BinDir, "libvirt-executor-"+s)
		if st, err := os.Stat(p); err != nil || st.Mode()&0o111 == 0 {
			return nil, fmt.Errorf("the %s executable %s is missing or not executable (install the driver: make install)", s, p)
		}
	}
	apiCtx, stopAPI := context.WithCancel(context.WithoutCancel(ctx))
	defer stopAPI()
	api, err := jobapi.Start(apiCtx, jobapi.Options{Listen: o.Listen, Logger: o.Log, CacheBucket: "lve-selftest-cache"})
	if err != nil {
		return nil, fmt.Errorf("fake job API: %w (pass --listen with an address of this host the guests reach)", err)
	}
	defer func() { _ = api.Close() }()
	rep.Listen = strings.TrimSuffix(strings.TrimPrefix(api.URL(), "http://"), "/")
	say("fake GitLab job API at %s; gitlab-runner %s (%s)", api.URL(), rep.Version, o.Runner)

	work, err := os.MkdirTemp("", "libvirt-executor-selftest-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(work) }()
	var runnerOut syncbuf.Buffer
	// runOne lets gitlab-runner run-single take one job.
	runOne := func() error {
		return jobapi.RunSingle(ctx, jobapi.RunSingleOptions{
			Binary: o.Runner, URL: api.URL(), Token: api.RunnerToken(), Executor: "custom",
			Custom:    jobapi.DriverStages(o.BinDir, o.Config),
			MaxBuilds: 1, WaitTimeout: o.Timeout,
			// A curated environment: the runner passes its own to the stages.
			Env:    append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + work, "TMPDIR=" + work}, api.CacheEnv()...),
			Dir:    work,
			Stdout: &runnerOut, Stderr: &runnerOut,
		})
	}
	report := func(name string, id int64) JobReport {
		wctx, wcancel := detachctx.WithTimeout(ctx, 5*time.Second)
		defer wcancel()
		res, err := api.Wait(wctx, id)
		if err != nil {
			return JobReport{Name: name, State: "not run"}
		}
		return JobReport{Name: name, State: res.State, FailureReason: res.FailureReason, ExitCode: res.ExitCode,
			Took: res.Duration, Ready: machineReady(res.Trace), Trace: res.Trace}
	}
	var runErr error
	var first JobReport
	if !o.SkipSamples {
		var probeVariables []jobapi.Variable
		var probe []string
		if o.GitLabURL != "" {
			if probeVariables, err = probeVars(o.GitLabURL, o.GitLabCA); err != nil {
				return nil, err
			}
			probe = probeScript
			say("the first job also asks %s from the guest (DNS, route, TLS, certificate)", o.GitLabURL)
		}
		produce := api.Enqueue(jobapi.Job{
			Name: produceName, Stage: "build", Image: o.Image, Variables: probeVariables,
			Script: append(probe,
				`echo "selftest: running in $(uname -srm) as $(id -un) on $(cat /etc/hostname 2>/dev/null)"`,
				"mkdir -p out vendor",
				`echo "artifact-of-$CI_JOB_ID" > out/proof.txt`,
				`echo "cache-of-$CI_JOB_ID" > vendor/proof.txt`,
			),
			Artifacts: &jobapi.Artifacts{Name: "selftest", Paths: []string{"out/"}, ExpireIn: "1 hour"},
			Cache:     &jobapi.Cache{Key: cacheKey, Paths: []string{"vendor/"}, Policy: "push"},
		})

		say("running 2 sample jobs (artifacts and a cache from the first to the second, each in a fresh VM) ...")
		t0 := time.Now()
		runErr = runOne()
		first = report(produceName, produce)
		rep.Jobs = append(rep.Jobs, first)
		probeFailed := false
		if o.GitLabURL != "" {
			if out, ok := probeOutput(first.Trace); ok && ClassifyProbe(out, o.GitLabURL) != ProbeOK {
				// The verdict below names the fix; the runner's jobs cannot
				// fetch their sources until it is made.
				say("the second sample job is not run: the probe of %s from the first job's guest failed (the fix is below)", o.GitLabURL)
				probeFailed = true
			}
		}
		if first.State == jobapi.StateSuccess && ctx.Err() == nil && !probeFailed {
			consume := api.Enqueue(jobapi.Job{
				Name: consumeName, Stage: "test", Image: o.Image, Dependencies: []int64{produce},
				Script: []string{
					fmt.Sprintf(`test "$(cat out/proof.txt)" = "artifact-of-%d" && echo "selftest: artifact downloaded"`, produce),
					fmt.Sprintf(`test "$(cat vendor/proof.txt)" = "cache-of-%d" && echo "selftest: cache restored"`, produce),
				},
				Cache: &jobapi.Cache{Key: cacheKey, Paths: []string{"vendor/"}, Policy: "pull"},
			})
			runErr = errors.Join(runErr, runOne())
			rep.Jobs = append(rep.Jobs, report(consumeName, consume))
		} else {
			// It needs the first job's artifact and cache: what failed there
			// is the fix, and a second VM would only fail the same way. Or
			// the guest could not reach GitLab: that is the fix first.
			rep.Jobs = append(rep.Jobs, JobReport{Name: consumeName, State: skipped})
		}
		rep.Wall = time.Since(t0)
	}
	if o.Steps && ctx.Err() == nil {
		var stepsErr error
		t1 := time.Now()
		stepsErr = runSteps(ctx, o, api, work, say, rep, &runnerOut)
		rep.Wall += time.Since(t1)
		runErr = errors.Join(runErr, stepsErr)
	}
	if o.Services != "" && ctx.Err() == nil {
		t1 := time.Now()
		say("running a job with the service %s (alias %s) in a fresh VM of image %s ...", o.Services, ServiceAlias, cmp.Or(o.ServicesImage, o.Image, "(the default image)"))
		id := api.Enqueue(servicesJob(o))
		runErr = errors.Join(runErr, runOne())
		jr := report(svcName, id)
		jr.Services = servicesVerdict(jr, o)
		rep.Jobs = append(rep.Jobs, jr)
		rep.Wall += time.Since(t1)
	}
	rep.Fixes = diagnose(rep, o, runErr, runnerOut.String(), ctx.Err())
	if o.GitLabURL != "" && !o.SkipSamples && first.Trace != "" {
		if out, ok := probeOutput(first.Trace); ok {
			line, fix := probeVerdict(ClassifyProbe(out, o.GitLabURL), o.GitLabURL, o.GitLabCA, out)
			rep.GitLab = line
			if fix != "" {
				rep.Fixes = append(rep.Fixes, fix)
			}
		} else if first.State == jobapi.StateSuccess {
			rep.Fixes = append(rep.Fixes, errNoProbe.Error())
		}
	}
	return rep, nil
}

// stepsScript is the selftest's GitLab Steps job: one script step.
const stepsScript = `echo "selftest: step ran in $(uname -srm)"`

// runSteps runs the GitLab Steps job through `gitlab-runner run` and adds
// its report; the error is the runner's.
func runSteps(ctx context.Context, o Options, api *jobapi.Server, work string, say func(string, ...any), rep *Report, runnerOut *syncbuf.Buffer) error {
	run, err := json.Marshal([]map[string]string{{"name": "selftest", "script": stepsScript}})
	if err != nil {
		return err
	}
	id := api.Enqueue(jobapi.Job{Name: stepsName, Stage: "test", Image: o.Image, Run: string(run)})
	say("running a GitLab Steps job (run:) through gitlab-runner run, in a fresh VM ...")
	rctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	done := make(chan error, 1)
	go func() {
		done <- jobapi.RunMulti(rctx, jobapi.RunMultiOptions{
			Binary: o.Runner, URL: api.URL(), Token: api.RunnerToken(), Executor: "custom",
			Custom: jobapi.DriverStages(o.BinDir, o.Config),
			Env:    []string{"PATH=" + os.Getenv("PATH"), "HOME=" + work, "TMPDIR=" + work},
			Dir:    work, Stdout: runnerOut, Stderr: runnerOut,
		})
	}()
	res, werr := api.Wait(ctx, id) // ctx: the whole test's timeout
	stop()                         // the job is done (or the time is up): the runner stops after it
	runErr := <-done
	jr := JobReport{Name: stepsName, State: "not run"}
	if werr == nil {
		jr = JobReport{Name: stepsName, State: res.State, FailureReason: res.FailureReason, ExitCode: res.ExitCode,
			Took: res.Duration, Ready: machineReady(res.Trace), Trace: res.Trace}
		if res.State == jobapi.StateSuccess && !strings.Contains(res.Trace, "selftest: step ran in ") {
			jr.State, jr.FailureReason = "no step output", "the job passed without running its step"
		}
	}
	rep.Jobs = append(rep.Jobs, jr)
	return runErr
}

// unreachableRE: the guest's gitlab-runner could not connect to the job
// API or the cache endpoint.
var unreachableRE = regexp.MustCompile(`dial tcp [^ ]+: (connect: )?(connection refused|no route to host|network is unreachable|i/o timeout)`)

var readyRE = regexp.MustCompile(`Machine ready in ([0-9.]+(?:ms|s|m[0-9.]*s?))`)

// machineReady is prepare's "Machine ready in X" from a job log.
func machineReady(trace string) time.Duration {
	m := readyRE.FindStringSubmatch(trace)
	if m == nil {
		return 0
	}
	d, _ := time.ParseDuration(m[1])
	return d
}

// diagnose says what to fix, from the jobs' logs and the runner's output.
func diagnose(rep *Report, o Options, runErr error, runnerOut string, ctxErr error) []string {
	var fixes []string
	add := func(s string) {
		for _, f := range fixes {
			if f == s {
				return
			}
		}
		fixes = append(fixes, s)
	}
	if errors.Is(ctxErr, context.DeadlineExceeded) {
		add("the self test ran out of time (--timeout): the job logs below show where it stood")
	}
	for _, j := range rep.Jobs {
		if j.Services != "" {
			add(j.Services)
		}
		if j.State == jobapi.StateSuccess || j.State == skipped {
			continue
		}
		t := j.Trace
		svcFix := ""
		if j.Name == svcName {
			svcFix = servicesFix(j, o)
		}
		switch {
		case j.State == "not run":
			add(fmt.Sprintf("%s never ran: gitlab-runner did not take it (its output is below)", j.Name))
		case svcFix != "":
			add(svcFix)
		case j.Name == stepsName && strings.Contains(t, "needs step-runner"):
			add("the guest has no step-runner for GitLab Steps: set [guest_tools] step_runner to a linux/amd64 step-runner, or install one in the image (docs/steps.md)")
		case j.Name == stepsName && j.State == "no step output":
			add("the GitLab Steps job passed without running its step: the runner did not convert the run: job (a gitlab-runner older than 17.x?) (docs/steps.md)")
		case strings.Contains(t, "gitlab-runner is not on the guest's PATH") || strings.Contains(t, "Missing gitlab-runner"):
			add("the guest has no gitlab-runner: set [guest_tools] gitlab_runner to this host's gitlab-runner and use an image that mounts the guest tools disk (docs/images.md, \"The guest tools disk\")")
		case unreachableRE.MatchString(t):
			add(fmt.Sprintf("the guest cannot reach this host at %s: let the guests reach it (the network's firewall or guard) or pass --listen with an address and port they reach", rep.Listen))
		case strings.Contains(t, "Preparation failed") || j.FailureReason == "runner_system_failure" && j.Ready == 0:
			add("prepare failed (the job log below says why): run libvirt-executor doctor as the runner's user")
		case j.FailureReason == "script_failure" && j.Name == consumeName:
			add("the second job did not get the first one's artifact or cache (the job log below shows which)")
		default:
			add(fmt.Sprintf("%s: %s %s (the job log below says why)", j.Name, j.State, j.FailureReason))
		}
	}
	if runErr != nil && len(fixes) == 0 {
		add(fmt.Sprintf("gitlab-runner run-single failed: %v (its output is below)", runErr))
	}
	if len(fixes) > 0 && strings.TrimSpace(runnerOut) != "" {
		rep.Jobs = append(rep.Jobs, JobReport{Name: "gitlab-runner output", State: "log", Trace: runnerOut})
	}
	return fixes
}

// runnerVersion is the runner's "Version:" line, or "(version unknown)".
func runnerVersion(ctx context.Context, bin string) string {
	out, err := commandOutput(ctx, bin, "--version")
	if err != nil {
		return "(version unknown)"
	}
	for _, l := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(l, "Version:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "(version unknown)"
}

// Print writes the verdict: one line per job with its timings, then OK or
// what to fix, with the end of the logs of what failed.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintf(w, "\nlibvirt-executor selftest with gitlab-runner %s, job API at %s, %s in all\n", r.Version, r.Listen, r.Wall.Round(100*time.Millisecond))
	for _, j := range r.Jobs {
		if j.State == "log" {
			continue
		}
		line := fmt.Sprintf("  %-18s %-8s", j.Name, j.State)
		if j.FailureReason != "" {
			line += fmt.Sprintf(" (%s, exit %d)", j.FailureReason, j.ExitCode)
		}
		if j.Took > 0 {
			line += fmt.Sprintf("  job %s", j.Took.Round(100*time.Millisecond))
		}
		if j.Ready > 0 {
			line += fmt.Sprintf(", VM ready in %s", j.Ready)
		}
		fmt.Fprintln(w, line)
	}
	if r.GitLab != "" {
		fmt.Fprintln(w, "  "+r.GitLab)
	}
	if r.OK() {
		verdict := "OK: VMs start, run the stages and go"
		for _, j := range r.Jobs {
			if j.Name == produceName {
				verdict += "; the guest's gitlab-runner uploaded and downloaded an artifact and archived and restored a cache"
			}
		}
		for _, j := range r.Jobs {
			switch j.Name {
			case stepsName:
				verdict += "; a GitLab Steps job ran its step with the guest's step-runner"
			case svcName:
				verdict += "; a job's service container started in its VM and the job found it by its alias"
			}
		}
		fmt.Fprintln(w, verdict+".")
		return
	}
	fmt.Fprintln(w, "FAILED. What to fix:")
	for _, f := range r.Fixes {
		fmt.Fprintf(w, "  - %s\n", f)
	}
	for _, j := range r.Jobs {
		if (j.State == jobapi.StateSuccess && j.Services == "") || j.Trace == "" {
			continue
		}
		fmt.Fprintf(w, "\n--- last lines of %s ---\n%s\n", j.Name, lastLines(j.Trace, 40))
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func commandOutput(ctx context.Context, bin string, args ...string) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(cctx, bin, args...).Output() //nolint:gosec // G204: the admin's gitlab-runner binary
	return string(out), err
}
