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

// CacheOptions is one run of the cache benchmark: jobs through a real
// gitlab-runner (run-single) against the project's fake job API, with a
// cache of MiB random bytes, kept by the runner's distributed cache (the
// fake API's S3 endpoint) and by the host cache, side by side.
type CacheOptions struct {
	Config string // the driver configuration (the rig's)
	Bin    string // the stage executables
	Runner string // gitlab-runner
	Listen string // host:port for the fake job API, reachable by the guests
	MiB    int
	Runs   int
	Log    io.Writer // progress; nil: none
}

// CacheMode is one way of keeping the cache.
type CacheMode struct {
	Name string
	// Save, Restore and Plain are the wall times (s) of the jobs that
	// archive the cache (policy push), extract it (policy pull) and of a
	// job without cache:, one per run.
	Save, Restore, Plain []float64
	// HostSave and HostRestore are the host cache's own copies (s), as the
	// job log reports them (host cache only).
	HostSave, HostRestore []float64
	// Zip is the save job's runner making the archive in the guest (the
	// same work in both modes, and most of the save job under TCG);
	// AfterZip is the rest of its archive_cache stage (the upload to S3,
	// or the host cache's copy); SaveLessZip is Save without Zip. From the
	// runner's own timestamps (FF_TIMESTAMPS), see saveSplit.
	Zip, AfterZip, SaveLessZip []float64
	// Copy is the copy after the zip on one clock each: with S3 from
	// "Uploading cache.zip" to "Created cache" (the upload), with the host
	// cache from "No URL provided" to "Created cache" (the rest of the
	// runner's script) plus HostSave (the host cache's copy, on the host's
	// clock). The guest's gitlab-runner stamps the lines its script
	// writes with the guest's clock, the runner on the host stamps the
	// rest (section markers, the driver's lines) with the host's: the two
	// differ by a few hundred milliseconds under TCG, which put AfterZip,
	// from one clock to the other, off by as much (it even came out
	// negative).
	Copy []float64
}

// CacheReport is the benchmark's result.
type CacheReport struct {
	MiB   int
	Runs  int
	Modes []CacheMode
}

var archiveEndRE = regexp.MustCompile(`section_end:[0-9]+:archive_cache\b`)

var hostCopyRE = regexp.MustCompile(`Host cache: (restored|kept) .* in ([0-9][0-9.hmsuµn]*)(?:\x1b\[[0-9;]*m)*\s*$`)

// hostCopy is the kind ("restored" or "kept") and the duration of the
// host cache's copy in a job log's line, as the driver writes it (Go's
// duration format: "625ms", "4.7s", "1m5s").
func hostCopy(trace string) (kind string, took time.Duration, line string, ok bool) {
	for _, l := range strings.Split(trace, "\n") {
		m := hostCopyRE.FindStringSubmatch(strings.TrimRight(l, "\r"))
		if m == nil {
			continue
		}
		d, err := time.ParseDuration(m[2])
		if err != nil {
			continue
		}
		return m[1], d, m[0], true
	}
	return "", 0, "", false
}

// CacheRound runs the benchmark: for each mode, Runs rounds of three jobs
// (save, restore, no cache) on fresh VMs.
func CacheRound(ctx context.Context, o CacheOptions) (*CacheReport, error) {
	if o.MiB <= 0 || o.Runs <= 0 {
		return nil, fmt.Errorf("cache bench: --cache-mib and --cache-runs must be > 0")
	}
	base, err := os.ReadFile(o.Config)
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "lve-bench-cache-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	rep := &CacheReport{MiB: o.MiB, Runs: o.Runs}
	for _, host := range []bool{false, true} {
		mode := CacheMode{Name: "distributed cache (S3, the fake job API's)"}
		cfgText := string(base)
		if host {
			mode.Name = "host cache ([cache] dir)"
			cfgText += fmt.Sprintf("\n[cache]\ndir = %q\nproject_limit_mib = %d\ntotal_limit_mib = %d\n", filepath.Join(tmp, "host-cache"), 4*o.MiB, 8*o.MiB)
		}
		cfgPath := filepath.Join(tmp, fmt.Sprintf("config-%v.toml", host))
		if err := os.WriteFile(cfgPath, []byte(cfgText), 0o600); err != nil {
			return nil, err
		}
		for i := range o.Runs {
			if err := cacheRun(ctx, o, cfgPath, host, i, &mode); err != nil {
				return rep, fmt.Errorf("%s, run %d: %w", mode.Name, i+1, err)
			}
		}
		rep.Modes = append(rep.Modes, mode)
	}
	return rep, nil
}

// cacheRun runs one round of three jobs through one run-single.
func cacheRun(ctx context.Context, o CacheOptions, cfgPath string, host bool, run int, mode *CacheMode) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	api := jobapi.Options{Listen: o.Listen}
	if !host {
		api.CacheBucket = "lve-bench"
	}
	srv, err := jobapi.Start(sctx, api)
	if err != nil {
		return err
	}
	defer func() { _ = srv.Close() }()
	key := fmt.Sprintf("bench-%d", run)
	// The runner stamps every line of the save job's log: the zip and what
	// follows it are then told apart (saveSplit).
	timestamps := jobapi.Variable{Key: "FF_TIMESTAMPS", Value: "true"}
	blob := fmt.Sprintf("mkdir -p vendor && head -c %d /dev/urandom > vendor/blob", o.MiB<<20)
	ids := []int64{
		srv.Enqueue(jobapi.Job{Name: "save", Cache: &jobapi.Cache{Key: key, Paths: []string{"vendor/"}, Policy: "push"}, Script: []string{blob},
			Variables: []jobapi.Variable{timestamps}}),
		srv.Enqueue(jobapi.Job{Name: "restore", Cache: &jobapi.Cache{Key: key, Paths: []string{"vendor/"}, Policy: "pull"},
			Script: []string{fmt.Sprintf(`test "$(wc -c < vendor/blob)" = %d`, o.MiB<<20)}}),
		srv.Enqueue(jobapi.Job{Name: "plain", Script: []string{"true"}}),
	}
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir()}
	if !host {
		env = append(env, srv.CacheEnv()...)
	}
	var out syncbuf.Buffer
	err = jobapi.RunSingle(sctx, jobapi.RunSingleOptions{
		Binary: o.Runner, URL: srv.URL(), Token: srv.RunnerToken(), Executor: "custom",
		Custom:    jobapi.DriverStages(o.Bin, cfgPath),
		BuildsDir: "/builds", CacheDir: "/cache", MaxBuilds: len(ids), WaitTimeout: 5 * time.Minute,
		Env: env, Stdout: &out, Stderr: &out,
	})
	if err != nil {
		return fmt.Errorf("gitlab-runner run-single: %w\n%s", err, out.String())
	}
	var res [3]jobapi.Result
	for i, id := range ids {
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		res[i], err = srv.Wait(wctx, id)
		wcancel()
		if err != nil {
			return err
		}
		if res[i].State != jobapi.StateSuccess {
			return fmt.Errorf("job %s: %s %s\n%s", []string{"save", "restore", "plain"}[i], res[i].State, res[i].FailureReason, res[i].Trace)
		}
	}
	zip, after, cp, err := saveSplit(res[0].Trace)
	if err != nil {
		return fmt.Errorf("save job: %w\n%s", err, res[0].Trace)
	}
	mode.Zip = append(mode.Zip, zip.Seconds())
	mode.AfterZip = append(mode.AfterZip, after.Seconds())
	mode.SaveLessZip = append(mode.SaveLessZip, res[0].Duration.Seconds()-zip.Seconds())
	mode.Save = append(mode.Save, res[0].Duration.Seconds())
	mode.Restore = append(mode.Restore, res[1].Duration.Seconds())
	mode.Plain = append(mode.Plain, res[2].Duration.Seconds())
	copied := cp.Seconds()
	if host {
		for i, tr := range []string{res[0].Trace, res[1].Trace} {
			kind, took, line, ok := hostCopy(tr)
			if !ok {
				return fmt.Errorf("no host cache copy in the %s job's log:\n%s", []string{"save", "restore"}[i], tr)
			}
			if kind == "kept" {
				mode.HostSave = append(mode.HostSave, took.Seconds())
				copied += took.Seconds()
			} else {
				mode.HostRestore = append(mode.HostRestore, took.Seconds())
			}
			if o.Log != nil {
				fmt.Fprintf(o.Log, "[lve-bench] cache %s run %d: %s\n", mode.Name, run+1, strings.TrimSpace(line))
			}
		}
	}
	mode.Copy = append(mode.Copy, copied)
	if o.Log != nil {
		fmt.Fprintf(o.Log, "[lve-bench] cache %s run %d: save job %.1fs (zip %.1fs, then %.1fs; the copy %.2fs), restore job %.1fs, job without cache %.1fs\n",
			mode.Name, run+1, mode.Save[run], mode.Zip[run], mode.AfterZip[run], mode.Copy[run], mode.Restore[run], mode.Plain[run])
	}
	return nil
}

// saveSplit finds in a save job's log (lines stamped by the runner's
// FF_TIMESTAMPS) how long the runner took to make the cache archive (from
// "Creating cache" to the line it prints when the archive is complete:
// "Uploading cache.zip" with a distributed cache, "No URL provided" without)
// and how long the archive_cache stage went on after that; and cp, from
// that line to "Created cache", both stamped by the guest's runner (S3:
// the upload; host cache: the end of the runner's script, before the
// host cache's copy: CacheMode.Copy).
func saveSplit(trace string) (zip, after, cp time.Duration, err error) {
	var created, zipped, end, copied time.Time
	for _, line := range strings.Split(trace, "\n") {
		stamp, rest, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		t, perr := time.Parse(time.RFC3339Nano, stamp)
		if perr != nil {
			continue
		}
		switch {
		case created.IsZero() && strings.Contains(rest, "Creating cache "):
			created = t
		case !created.IsZero() && zipped.IsZero() && (strings.Contains(rest, "Uploading cache.zip") || strings.Contains(rest, "No URL provided")):
			zipped = t
		case !zipped.IsZero() && copied.IsZero() && strings.Contains(rest, "Created cache"):
			copied = t
		case !zipped.IsZero() && archiveEndRE.MatchString(rest):
			end = t
		}
	}
	if created.IsZero() || zipped.IsZero() || end.IsZero() || copied.IsZero() {
		return 0, 0, 0, fmt.Errorf("no timestamped \"Creating cache\", end of the archive, \"Created cache\" and end of archive_cache in the log (FF_TIMESTAMPS)")
	}
	return zipped.Sub(created), end.Sub(zipped), copied.Sub(zipped), nil
}

// WriteTable prints the medians (and ranges) side by side.
func (r *CacheReport) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "\nCache of %d MiB, %d run(s) per mode, jobs through gitlab-runner run-single (median, min-max, seconds):\n", r.MiB, r.Runs)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODE\tSAVE JOB\tRESTORE JOB\tJOB WITHOUT CACHE\tHOST COPY OUT\tHOST COPY IN\tSAVE: ZIP\tSAVE: AFTER THE ZIP\tSAVE: COPY AFTER THE ZIP\tSAVE JOB LESS ZIP")
	cell := func(v []float64) string {
		if len(v) == 0 {
			return "-"
		}
		s := slices.Clone(v)
		slices.Sort(s)
		return fmt.Sprintf("%.2f (%.2f-%.2f)", s[len(s)/2], s[0], s[len(s)-1])
	}
	for _, m := range r.Modes {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m.Name, cell(m.Save), cell(m.Restore), cell(m.Plain), cell(m.HostSave), cell(m.HostRestore),
			cell(m.Zip), cell(m.AfterZip), cell(m.Copy), cell(m.SaveLessZip))
	}
	return tw.Flush()
}
