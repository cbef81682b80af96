package bench

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

func TestBenchJobRunsTheNoopInEveryNoopStage(t *testing.T) {
	j := benchJob(123456, "tiny")
	require.Equal(t, int64(123456), j.ID)
	require.Equal(t, "tiny", j.Image)
	require.Empty(t, j.RepoURL, "GIT_STRATEGY none: get_sources fetches nothing")
	got := map[string][]string{"build_script": j.Script, "after_script": j.AfterScript}
	order := []string{"build_script", "after_script"}
	for _, st := range j.ExtraStages {
		got[st.Name] = st.Commands
		order = append(order, st.Name)
	}
	require.Equal(t, NoopStages, order, "the harness runs them in this order")
	for _, st := range NoopStages {
		require.Equal(t, []string{NoopCommandIn(st)}, got[st], st)
		require.NotContains(t, NoopCommandIn(st), "\n", "one command: echoed once, one step")
	}
	require.Equal(t, NoopStages, RunStages[len(RunStages)-len(NoopStages):], "the run stages end with the no-op stages")
	require.Equal(t, NoopCommandIn("build_script"), NoopCommand)
}

func TestParseNoops(t *testing.T) {
	echo := func(st string) string { return "\x1b[32;1m$ " + NoopCommandIn(st) + "\x1b[0;m\n" }
	log := echo("build_script") + "LVB_NOOP 100.000100 100.000150 build_script\n" +
		"--- stage build_script (901ms, exit 0)\n" +
		echo("after_script") + "LVB_NOOP 101.5 101.502 after_script\r\n" +
		echo("archive_cache") + "LVB_NOOP 102.9 102.8 archive_cache\n" + // clock went backwards: left out, named
		"LVB_NOOP 103 103.25\n" // a line without a stage
	noops, err := ParseNoops(log)
	require.Error(t, err)
	require.Contains(t, err.Error(), "archive_cache: LVB_NOOP: guest clock went backwards")
	require.Equal(t, []Noop{
		{Stage: "build_script", Guest: 50 * time.Microsecond},
		{Stage: "after_script", Guest: 2 * time.Millisecond},
		{Stage: "", Guest: 250 * time.Millisecond},
	}, noops)

	d, err := ParseNoop(log)
	require.NoError(t, err)
	require.Equal(t, 50*time.Microsecond, d, "ParseNoop reads the first line, stage named or not")

	none, err := ParseNoops(echo("build_script"))
	require.NoError(t, err)
	require.Empty(t, none, "the echoed command is no marker line")
}

func TestReadNoops(t *testing.T) {
	j := JobSample{Stages: []StageSample{
		{Name: "config", Exec: "config", WallMs: 20},
		{Name: "prepare", Exec: "prepare", WallMs: 8000},
		{Name: "prepare_script", Exec: "run", WallMs: 30},
		{Name: "get_sources", Exec: "run", WallMs: 31},
		{Name: "build_script", Exec: "run", WallMs: 25},
		{Name: "after_script", Exec: "run", WallMs: 40},
		{Name: "archive_cache", Exec: "run", WallMs: 22.5},
		{Name: "cleanup", Exec: "cleanup", WallMs: 100},
	}}
	missing := j.readNoops([]Noop{
		{Stage: "", Guest: 5 * time.Millisecond}, // build_script's, from an older script
		{Stage: "after_script", Guest: 10 * time.Millisecond},
		{Stage: "archive_cache", Guest: 2500 * time.Microsecond},
		{Stage: "after_script", Guest: time.Second}, // a second line of a stage: the first counts
		{Stage: "cleanup", Guest: time.Millisecond}, // not a run stage
	})
	require.Equal(t, []string{"upload_artifacts_on_success"}, missing)
	require.Equal(t, map[string]float64{"build_script": 20, "after_script": 30, "archive_cache": 20}, j.StageOverheadMs)
	require.Equal(t, 5.0, *j.BuildGuestMs)
	require.Equal(t, 20.0, *j.BuildOverheadMs)
	require.Equal(t, 10.0, j.StageGuestMs["after_script"])

	var empty JobSample
	require.Equal(t, NoopStages, empty.readNoops(nil))
	require.Nil(t, empty.BuildOverheadMs)
	require.Nil(t, empty.StageOverheadMs)
}

func TestReadHolder(t *testing.T) {
	const started = "Connection holder started in 12ms: the job's stages share one SSH connection\n"
	const fellBack = "libvirt-executor: the connection holder is gone; this stage connects directly\n"
	for _, tc := range []struct {
		name, log      string
		direct, holder bool
		started        bool
		directStages   int
		problem        string
	}{
		{"holder path, all through it", "x\n" + started + "y\n", false, true, true, 0, ""},
		{"holder path, two stages fell back", started + fellBack + fellBack, false, true, true, 2, "2 stage(s) connected directly"},
		{"holder path, no holder", "Note: the job's stages connect one by one (no connection holder: boom)\n", false, true, false, 0, "started no connection holder"},
		{"direct round, as it should", "nothing\n", true, true, false, 0, ""},
		{"direct round with a holder", started, true, true, true, 0, "connection_holder = false did not take"},
		{"configuration without holder", "nothing\n", false, false, false, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var j JobSample
			j.readHolder(tc.log)
			require.Equal(t, tc.started, j.HolderStarted)
			require.Equal(t, tc.directStages, j.DirectStages)
			p := j.holderProblem(tc.direct, tc.holder)
			if tc.problem == "" {
				require.Empty(t, p)
			} else {
				require.Contains(t, p, tc.problem)
			}
		})
	}
}

// pathJob is a succeeded job: config 20 ms, prepare, run stages of the
// given walls (RunStages in order), cleanup 100 ms, a job wall, no-op
// overheads of the no-op stages, and the VM gone after cleanup.
func pathJob(prepare, wall float64, runWalls []float64, overheads []float64, gone float64) JobSample {
	j := JobSample{OK: true, PrepareWallMs: prepare, WallMs: wall, CleanupMs: 100, HolderStarted: true,
		Stages: []StageSample{{Name: "config", Exec: "config", WallMs: 20}, {Name: "prepare", Exec: "prepare", WallMs: prepare}},
		Gone:   &GoneMs{VM: "lve-x", Gone: fp(gone)}}
	for i, w := range runWalls {
		j.Stages = append(j.Stages, StageSample{Name: RunStages[i], Exec: "run", WallMs: w})
	}
	j.Stages = append(j.Stages, StageSample{Name: "cleanup", Exec: "cleanup", WallMs: 100})
	if len(overheads) > 0 {
		j.StageOverheadMs = map[string]float64{}
		for i, o := range overheads {
			j.StageOverheadMs[NoopStages[i]] = o
		}
		j.BuildOverheadMs = fp(overheads[0])
	}
	return j
}

func TestSummarizePath(t *testing.T) {
	jobs := []JobSample{
		pathJob(8000, 9000, []float64{10, 20, 30, 40, 50, 60}, []float64{5, 6, 7, 8}, 1500),
		pathJob(9000, 10000, []float64{12, 22, 32, 42, 52, 62}, []float64{9, 10, 11, 12}, 1700),
		{OK: false, PrepareWallMs: 1, WallMs: 1, HolderStarted: true, DirectStages: 3}, // failed: left out
	}
	jobs[1].DirectStages = 1
	// A job of before the several no-op stages: build_script's overhead alone.
	old := pathJob(7000, 8000, []float64{14, 24, 34}, nil, 1600)
	old.HolderStarted = false
	old.BuildOverheadMs = fp(100)
	old.Gone = nil
	jobs = append(jobs, old)

	p := SummarizePath(jobs)
	require.Equal(t, 4, p.Jobs)
	require.Equal(t, 1, p.Failures)
	require.Equal(t, 2, p.HolderStarted, "of the succeeded jobs")
	require.Equal(t, 1, p.DirectStages, "of the succeeded jobs")
	require.Equal(t, Summary{N: 3, Median: 20, Min: 20, Max: 20}, p.ConfigWall)
	require.Equal(t, Summary{N: 3, Median: 8000, Min: 7000, Max: 9000}, p.PrepareWall)
	require.Equal(t, Summary{N: 3, Median: 32, Min: 30, Max: 34}, p.StageWall["build_script"])
	require.Equal(t, Summary{N: 2, Median: 51, Min: 50, Max: 52}, p.StageWall["archive_cache"], "a stage the old job did not run")
	// Per job, the median of its run stages: 35, 37 and 24.
	require.Equal(t, Summary{N: 3, Median: 35, Min: 24, Max: 37}, p.RunStageWall)
	require.Equal(t, Summary{N: 3, Median: 210, Min: 72, Max: 222}, p.RunStagesTotal)
	require.Equal(t, Summary{N: 3, Median: 9, Min: 5, Max: 100}, p.Overhead)
	// Every no-op stage pooled: 4 + 4 samples, and the old job's one.
	require.Equal(t, Summary{N: 9, Median: 9, Min: 5, Max: 100}, p.OverheadAll)
	require.Equal(t, Summary{N: 2, Median: 1600, Min: 1500, Max: 1700}, p.VMGone, "a job without the figure is left out")
	require.Equal(t, Summary{N: 3, Median: 9000, Min: 8000, Max: 10000}, p.JobWall)
	// Job wall - config - prepare: 980, 980, 980.
	require.Equal(t, Summary{N: 3, Median: 980, Min: 980, Max: 980}, p.AfterPrepare)

	require.Equal(t, 0, SummarizePath(nil).Jobs)
	require.False(t, SummarizePath(nil).JobWall.Known())
}

func TestImageSummaryHasBothPaths(t *testing.T) {
	img := ImageReport{
		Jobs:   []JobSample{pathJob(8000, 9000, []float64{10, 20, 30, 40, 50, 60}, []float64{5, 6, 7, 8}, 1500)},
		Direct: &DirectRound{Jobs: []JobSample{pathJob(8000, 12000, []float64{700, 710, 720, 730, 740, 750}, []float64{700, 701, 702, 703}, 1400)}},
	}
	s := img.Summarize()
	require.NotNil(t, s.DirectPath)
	require.Equal(t, 12000.0, s.DirectPath.JobWall.Median)
	require.Equal(t, 9000.0, s.HolderPath.JobWall.Median)
	require.Equal(t, 9000.0, s.JobWall.Median, "the direct round stays out of the main figures")
	require.Equal(t, 4, s.OverheadAll.N)
	require.Equal(t, 1500.0, s.VMGone.Median)
	img.Direct = nil
	require.Nil(t, img.Summarize().DirectPath, "no direct round, no direct summary")
}

func TestWaitGone(t *testing.T) {
	ctx := context.Background()
	// The domain disappears at the 3rd look, the state directory at the 5th.
	n := 0
	check := func(context.Context) (bool, bool, error) {
		n++
		var err error
		if n == 1 {
			err = errors.New("libvirt hiccup")
		}
		return n >= 3, n >= 5, err
	}
	from := time.Now()
	g := waitGone(ctx, "lve-x", from, time.Millisecond, time.Minute, check)
	require.Empty(t, g.Error)
	require.Equal(t, "lve-x", g.VM)
	require.Equal(t, 5, g.Polls)
	require.NotNil(t, g.Domain)
	require.NotNil(t, g.StateDir)
	require.NotNil(t, g.Gone)
	require.Less(t, *g.Domain, *g.StateDir)
	require.Equal(t, *g.StateDir, *g.Gone, "gone when the last of both is")
	require.GreaterOrEqual(t, *g.Gone, 3.0, "at least 4 intervals of 1 ms")

	// Already gone at the first look, which comes 2 s after cleanup.
	g = waitGone(ctx, "lve-x", time.Now().Add(-2*time.Second), time.Millisecond, time.Minute, func(context.Context) (bool, bool, error) { return true, true, nil })
	require.Equal(t, 1, g.Polls)
	require.GreaterOrEqual(t, *g.Gone, 2000.0, "from cleanup's end, not from the first look")
	require.Less(t, *g.Gone, 5000.0)
	// cleanup's end a little ahead of the first look: never negative.
	g = waitGone(ctx, "lve-x", time.Now().Add(time.Second), time.Millisecond, time.Minute, func(context.Context) (bool, bool, error) { return true, true, nil })
	require.Equal(t, 0.0, *g.Gone)

	// Never gone: the error names what is left and the last failed look.
	t0 := time.Now()
	g = waitGone(ctx, "lve-y", t0, 5*time.Millisecond, 60*time.Millisecond, func(context.Context) (bool, bool, error) {
		return true, false, errors.New("permission denied")
	})
	require.GreaterOrEqual(t, time.Since(t0), 60*time.Millisecond, "it polls until within")
	require.Less(t, time.Since(t0), 2*time.Second)
	require.Nil(t, g.Gone)
	require.Nil(t, g.StateDir)
	require.NotNil(t, g.Domain)
	require.Greater(t, g.Polls, 3)
	require.Contains(t, g.Error, "VM lve-y not gone 60ms after cleanup: its state directory is still there")
	require.NotContains(t, g.Error, "domain")
	require.Contains(t, g.Error, "permission denied")

	// Stopped: it does not wait out within.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	t0 = time.Now()
	g = waitGone(cctx, "lve-z", t0, time.Millisecond, time.Minute, func(context.Context) (bool, bool, error) { return false, false, nil })
	require.Less(t, time.Since(t0), 5*time.Second, "within is a minute")
	require.Contains(t, g.Error, "its domain is still defined, its state directory is still there")
	require.Contains(t, g.Error, "stopped")
}

func TestWithoutHolder(t *testing.T) {
	const base = "[images.a]\nbase = \"/a.qcow2\"\n"
	for _, tc := range []struct{ name, text string }{
		{"no [ssh] table", base},
		{"[ssh] with other keys, then another table", "[ssh]\nkeepalive_interval = \"2s\"\n\n" + base},
		{"[ssh] with the holder on", "[ssh]\nconnection_holder = true\nkeepalive_count = 3\n" + base},
		{"[ssh] with the holder on after another table", base + "[ssh] # the guest connection\n  connection_holder=true # default\n"},
		{"quoted table name", "[ \"ssh\" ]\nconnect_timeout = \"5s\"\n" + base},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := WithoutHolder(tc.text)
			c, err := config.Parse([]byte(out))
			require.NoError(t, err, "%s", out)
			require.False(t, c.SSH.HolderEnabled(), "%s", out)
			require.Len(t, regexp.MustCompile(`(?m)^connection_holder = false$`).FindAllString(out, -1), 1, "%s", out)
			orig, err := config.Parse([]byte(tc.text))
			require.NoError(t, err)
			orig.SSH.ConnectionHolder, c.SSH.ConnectionHolder = nil, nil
			orig.Text, c.Text = nil, nil // the text differs by the edit itself
			require.Equal(t, orig, c, "nothing else changes")
		})
	}
	// Only [ssh]'s key is replaced: a table of another name, or [ssh.x],
	// is not [ssh].
	for _, other := range []string{"[other]\nconnection_holder = true\n", "[ssh.x]\nconnection_holder = true\n", "[[ssh]]\nconnection_holder = true\n"} {
		require.Equal(t, other+"\n[ssh]\nconnection_holder = false\n", WithoutHolder(other))
	}
	require.Equal(t, "[ssh]\nconnection_holder = false\nkeepalive_count = 3\n[other]\nconnection_holder = true\n",
		WithoutHolder("[ssh]\nkeepalive_count = 3\n[other]\nconnection_holder = true\n"))
	// The project's example configuration.
	text, err := os.ReadFile(filepath.Join("..", "..", "..", "deploy", "config.example.toml"))
	require.NoError(t, err)
	c, err := config.Parse([]byte(WithoutHolder(string(text))))
	require.NoError(t, err)
	require.False(t, c.SSH.HolderEnabled())
	require.Equal(t, 1, strings.Count(WithoutHolder(string(text)), "[ssh]"), "the table is not repeated")
}

func TestSetupDirect(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte("[ssh]\nkeepalive_count = 3\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	b := &bench{opts: Options{ConfigPath: cfgPath}}
	b.exec.Run, b.exec.RunArgs = "/bin/run", []string{"--config", cfgPath}
	d := b.setupDirect(t.TempDir())
	require.NoError(t, d.err)
	require.True(t, d.mode.direct)
	require.False(t, d.mode.warm)
	require.Equal(t, "/bin/run", d.mode.exec.Run)
	for _, args := range [][]string{d.mode.exec.ConfigArgs, d.mode.exec.PrepareArgs, d.mode.exec.RunArgs, d.mode.exec.CleanupArgs} {
		require.Equal(t, []string{"--config", d.config}, args)
	}
	require.Equal(t, []string{"--config", cfgPath}, b.exec.RunArgs, "the main jobs keep their configuration")
	c, err := config.Load(d.config)
	require.NoError(t, err)
	require.False(t, c.SSH.HolderEnabled())

	// A configuration the copy cannot fix: reported, no jobs.
	require.NoError(t, os.WriteFile(cfgPath, []byte("ssh = { connection_holder = true }\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	d = b.setupDirect(t.TempDir())
	require.Error(t, d.err)
	require.Contains(t, d.err.Error(), "connection_holder = false")
	require.False(t, d.mode.direct)
}

func TestEvaluateStartup(t *testing.T) {
	ts := EvaluateStartup(map[string]Summary{
		"config":  s(5, 4, 30), // at the limit; a slow start does not matter
		"run":     s(5.1, 4, 6),
		"prepare": s(100, 100, 100), // no target
	})
	require.Equal(t, map[string]string{
		"executable start libvirt-executor-config (--version)": "PASS",
		"executable start libvirt-executor-run (--version)":    "MISS",
	}, verdicts(ts))
	for _, tg := range ts {
		require.Equal(t, statMedian, tg.Stat)
		require.Equal(t, unitMs, tg.Unit)
		require.Equal(t, TargetStartupMs, tg.Limit)
	}
	require.Equal(t, "N/A", EvaluateStartup(nil)[1].Verdict(), "not measured")
}

func TestWriteTablePaths(t *testing.T) {
	holder := pathJob(8000, 9000, []float64{10, 20, 30, 40, 50, 60}, []float64{5, 6, 7, 8}, 1500)
	holder.Run = 1
	direct := pathJob(8000, 12000, []float64{700, 710, 720, 730, 740, 750}, []float64{700, 701, 702, 703}, 1400)
	direct.Run, direct.HolderStarted = 1, false
	img := ImageReport{Image: "tiny", DomainType: "qemu", VCPUs: 1, MemoryMiB: 512, FloorSpec: "same",
		Jobs: []JobSample{holder},
		Direct: &DirectRound{Jobs: []JobSample{direct, {Run: 2, Error: "job failed: boom\nlog"}},
			Errors: []string{"the direct round's configuration: broken\nmore"}},
	}
	img.Summary = img.Summarize()
	img.Targets = append(Evaluate(img.Summary), EvaluateStartup(map[string]Summary{"config": s(4, 3, 5), "run": s(6, 5, 7)})...)
	rep := &Report{Started: time.Unix(0, 0).UTC(), Runs: 1, ConnectionHolder: true, DirectRuns: 2, Images: []ImageReport{img}}
	var out bytes.Buffer
	require.NoError(t, rep.WriteTable(&out))
	text := out.String()
	line := func(re string) {
		t.Helper()
		require.Regexp(t, regexp.MustCompile(`(?m)^`+re+`$`), text)
	}
	line(`stages: through the connection holder; plus 2 direct job\(s\) per image \(\[ssh\] connection_holder = false\), interleaved`)
	line(`direct vs connection holder \(same run\)\s+direct \(old\)\s+holder \(new\)\s+holder - direct`)
	line(`  prepare wall\s+8\.00 s\s+8\.00 s\s+0\.0 ms`)
	line(`  jobs: succeeded \(failed\)\s+1 \(1\)\s+1 \(0\)\s*`)
	line(`  holder started / stages connected directly\s+0 / 0\s+1 / 0\s*`)
	line(`  build_script\s+720 ms\s+30 ms\s+-690 ms`)
	line(`  upload_artifacts_on_success\s+750 ms\s+60 ms\s+-690 ms`)
	line(`  run stage wall \(median of a job's stages\)\s+725 ms\s+35 ms\s+-690 ms`)
	line(`  overhead per stage \(all 4 no-op stages\)\s+702 ms \[700 ms - 703 ms\]\s+6\.5 ms \[5\.0 ms - 8\.0 ms\]\s+-695 ms`)
	line(`  cleanup -> VM gone\s+1\.40 s\s+1\.50 s\s+\+100 ms`)
	line(`  job wall \(config\.\.cleanup\)\s+12\.00 s\s+9\.00 s\s+-3\.00 s`)
	line(`  job wall without config, prepare\s+3\.98 s\s+980 ms\s+-3\.00 s`)
	// The main table's new rows.
	line(`  overhead per stage \(all 4 no-op stages\)\s+6\.5 ms\s+5\.0 ms - 8\.0 ms\s+4`)
	line(`  run stage wall \(median of a job's stages\)\s+35 ms\s+35 ms - 35 ms\s+1`)
	line(`  cleanup -> VM gone \(domain, state dir\)\s+1\.50 s\s+1\.50 s - 1\.50 s\s+1`)
	line(`  after_script\s+40 ms\s+40 ms - 40 ms\s+1`)
	// Targets.
	line(`cleanup\s+<= 300 ms\s+100 ms \(median\)\s+PASS`)
	line(`executable start libvirt-executor-config \(--version\)\s+<= 5\.0 ms\s+4\.0 ms \(median\)\s+PASS`)
	line(`executable start libvirt-executor-run \(--version\)\s+<= 5\.0 ms\s+6\.0 ms \(median\)\s+MISS`)
	// Notes.
	line(`DIRECT ROUND ERROR: the direct round's configuration: broken`)
	line(`direct run 2 FAILED: job failed: boom`)

	// Without a direct round: no comparison.
	img.Direct = nil
	img.Summary = img.Summarize()
	rep = &Report{Started: time.Unix(0, 0).UTC(), Runs: 1, ConnectionHolder: true, Images: []ImageReport{img}}
	out.Reset()
	require.NoError(t, rep.WriteTable(&out))
	require.NotContains(t, out.String(), "direct vs connection holder")
	require.Contains(t, out.String(), "stages: through the connection holder; no direct round")
	rep.ConnectionHolder = false
	out.Reset()
	require.NoError(t, rep.WriteTable(&out))
	require.Contains(t, out.String(), "stages: a connection per stage")
}

func TestOptionsDirectRuns(t *testing.T) {
	o := Options{ConfigPath: "/c", BinDir: "/b", Runs: 3}
	o.defaults()
	require.Equal(t, 3, o.DirectRuns, "default: as many as the cold jobs")
	o = Options{ConfigPath: "/c", BinDir: "/b", Runs: 3, DirectRuns: -1}
	o.defaults()
	require.Negative(t, o.DirectRuns, "negative: none")
	require.NoError(t, Options{ConfigPath: "/c", BinDir: "/b", DirectRuns: 7}.Validate())
	require.Error(t, Options{ConfigPath: "/c", BinDir: "/b", DirectRuns: 51}.Validate())
}
