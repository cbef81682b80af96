// Command lve-bench measures where a CI job's time, disk and memory go with
// this driver, against the guest's own boot (the floor): it runs no-op jobs
// through the runner-faithful harness on real VMs and prints medians and
// ranges per image, the prepare / floor ratio and PASS/MISS per target, and
// writes the same as JSON. After each image's cold jobs a warm round runs
// the same jobs on standby VMs that libvirt-executor serve keeps, for warm
// vs cold prepare (--warm=false skips it). Between the cold jobs it runs
// --direct-runs jobs (default: --runs; 0 skips them) with a copy of the
// configuration with [ssh] connection_holder = false, for the stages
// before and after the connection holder side by side, and --wrapper-runs
// jobs (the same default) with [guest_tools] agent = "none", for the
// stages before and after the guest agent. Run it inside the rig's network
// namespace (make bench). See docs/performance.md.
//
//	lve-bench --config FILE --bin DIR [--image NAME ...] [--runs 5] [--direct-runs N] [--wrapper-runs N] [--concurrency 2] [--warm=false] [--json FILE]
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/bench"
	_ "gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm" // lifecycle.Open's libvirt (bench imports it too)
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := app().RunContext(ctx, os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "lve-bench:", err)
		os.Exit(1)
	}
}

func app() *cli.App {
	return &cli.App{
		Name:            "lve-bench",
		Usage:           "benchmark the driver on real VMs: prepare breakdown vs the guest's own boot, run overhead, cleanup, disk, memory",
		Flags:           flags(),
		HideHelpCommand: true,
		Commands:        []*cli.Command{cacheCommand(), stepsCommand()},
		Action: func(c *cli.Context) error {
			o, err := options(c)
			if err != nil {
				return err
			}
			rep, runErr := bench.Run(c.Context, o)
			if rep == nil {
				return runErr
			}
			if err := rep.WriteTable(c.App.Writer); err != nil {
				return err
			}
			if path := c.String("json"); path != "" {
				data, err := json.MarshalIndent(rep, "", "  ")
				if err != nil {
					return err
				}
				if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
					return err
				}
				fmt.Fprintf(c.App.ErrWriter, "[lve-bench] report written to %s\n", path)
			}
			return runErr
		},
	}
}

func flags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "config", Usage: "driver configuration the executables get", EnvVars: []string{config.EnvPath}, Value: config.DefaultPath},
		&cli.StringFlag{Name: "bin", Usage: "directory with libvirt-executor-{config,prepare,run,cleanup} (default: this program's directory)"},
		&cli.StringSliceFlag{Name: "image", Usage: "image to measure (repeatable; default: the configuration's default image)"},
		&cli.IntFlag{Name: "runs", Value: 5, Usage: "sequential jobs and floor boots per image"},
		&cli.IntFlag{Name: "wrapper-runs", Usage: "jobs per image with [guest_tools] agent = \"none\" (through the holder, each stage a session and the stage wrapper: the path before the guest agent), interleaved with the cold jobs (default: --runs; 0: skip)"},
		&cli.IntFlag{Name: "direct-runs", Usage: "jobs per image with [ssh] connection_holder = false (a connection per stage, the path before the holder), interleaved with the cold jobs (default: --runs; 0: skip)"},
		&cli.IntFlag{Name: "concurrency", Value: 2, Usage: "jobs at once in the concurrent round (0: skip it)"},
		&cli.BoolFlag{Name: "warm", Value: true, Usage: "after each image's cold jobs, run --runs jobs on standby VMs that a libvirt-executor serve started by the benchmark keeps (--warm=false: skip)"},
		&cli.DurationFlag{Name: "poll", Value: 50 * time.Millisecond, Usage: "the floor's SSH polling interval"},
		&cli.StringFlag{Name: "json", Value: "lve-bench.json", Usage: "write the full report (every sample) here; empty: do not"},
		&cli.BoolFlag{Name: "job-logs", Usage: "print every job log on stderr"},
	}
}

// options maps the flags to bench.Options and checks them.
func options(c *cli.Context) (bench.Options, error) {
	bin := c.String("bin")
	if bin == "" {
		exe, err := os.Executable()
		if err != nil {
			return bench.Options{}, err
		}
		bin = filepath.Dir(exe)
	}
	if c.Int("runs") < 1 {
		return bench.Options{}, fmt.Errorf("--runs %d: want at least 1", c.Int("runs"))
	}
	if c.Duration("poll") <= 0 {
		return bench.Options{}, fmt.Errorf("--poll %s: want a positive interval", c.Duration("poll"))
	}
	conc := c.Int("concurrency")
	if conc < 0 {
		return bench.Options{}, fmt.Errorf("--concurrency %d: want 0 (skip) or more", conc)
	}
	if conc == 0 {
		conc = -1 // bench.Options: 0 is the default, negative skips
	}
	// bench.Options: 0 is the default (as many as --runs), negative skips.
	rounds := map[string]int{}
	for _, flag := range []string{"direct-runs", "wrapper-runs"} {
		if !c.IsSet(flag) {
			continue
		}
		n := c.Int(flag)
		if n < 0 {
			return bench.Options{}, fmt.Errorf("--%s %d: want 0 (skip) or more", flag, n)
		}
		if n == 0 {
			n = -1
		}
		rounds[flag] = n
	}
	o := bench.Options{
		ConfigPath:  c.String("config"),
		BinDir:      bin,
		Images:      c.StringSlice("image"),
		Runs:        c.Int("runs"),
		Concurrency: conc,
		Poll:        c.Duration("poll"),
		SkipWarm:    !c.Bool("warm"),
		DirectRuns:  rounds["direct-runs"],
		WrapperRuns: rounds["wrapper-runs"],
		Progress:    c.App.ErrWriter,
	}
	if c.Bool("job-logs") {
		o.JobLog = c.App.ErrWriter
	}
	// The stages run in their own work directories: absolute paths only.
	for _, p := range []*string{&o.ConfigPath, &o.BinDir} {
		if abs, err := filepath.Abs(*p); err == nil {
			*p = abs
		}
	}
	return o, o.Validate()
}

// stepsCommand is `lve-bench steps`: a no-op run: job (GitLab Steps, shim
// mode) beside a no-op script: job, through a real gitlab-runner run
// (docs/performance.md).
func stepsCommand() *cli.Command {
	return &cli.Command{
		Name:  "steps",
		Usage: "a no-op run: job (GitLab Steps, shim mode) beside a no-op script: job, cold on the default image, jobs through gitlab-runner run",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "config", Usage: "driver configuration (the rig's, with guest_tools.step_runner)", EnvVars: []string{config.EnvPath}, Value: config.DefaultPath},
			&cli.StringFlag{Name: "bin", Usage: "directory with libvirt-executor-{config,prepare,run,cleanup}", Required: true},
			&cli.StringFlag{Name: "runner", Usage: "the gitlab-runner binary", Required: true},
			&cli.StringFlag{Name: "listen", Usage: "host:port for the fake job API", Value: "127.0.0.1:0"},
			&cli.IntFlag{Name: "runs", Value: 3, Usage: "rounds (each: one job of each kind)"},
			&cli.StringFlag{Name: "json", Usage: "also write the report as JSON to this file"},
		},
		Action: func(c *cli.Context) error {
			rep, err := bench.StepsRound(c.Context, bench.StepsOptions{
				Config: c.String("config"), Bin: c.String("bin"), Runner: c.String("runner"), Listen: c.String("listen"),
				Runs: c.Int("runs"), Log: c.App.ErrWriter,
			})
			if rep != nil {
				if werr := rep.WriteTable(c.App.Writer); werr != nil {
					return werr
				}
				if path := c.String("json"); path != "" {
					return writeJSON(path, rep)
				}
			}
			return err
		},
	}
}

// writeJSON writes v, indented, to path.
func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err == nil {
		err = os.WriteFile(path, append(data, '\n'), 0o644)
	}
	return err
}

// cacheCommand is `lve-bench cache`: the host cache against the runner's
// distributed cache, jobs through a real gitlab-runner (docs/performance.md).
func cacheCommand() *cli.Command {
	return &cli.Command{
		Name:  "cache",
		Usage: "a cache of --mib MiB kept by the runner's distributed cache (the fake job API's S3) and by the host cache, side by side, jobs through gitlab-runner run-single",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "config", Usage: "driver configuration (the rig's)", EnvVars: []string{config.EnvPath}, Value: config.DefaultPath},
			&cli.StringFlag{Name: "bin", Usage: "directory with libvirt-executor-{config,prepare,run,cleanup}", Required: true},
			&cli.StringFlag{Name: "runner", Usage: "the gitlab-runner binary", Required: true},
			&cli.StringFlag{Name: "listen", Usage: "host:port for the fake job API, where the guests reach it", Required: true},
			&cli.IntFlag{Name: "mib", Value: 100, Usage: "the cache's size"},
			&cli.IntFlag{Name: "runs", Value: 3, Usage: "rounds per mode (each: a saving job, a restoring job, a job without cache)"},
			&cli.StringFlag{Name: "json", Usage: "also write the report as JSON to this file"},
		},
		Action: func(c *cli.Context) error {
			rep, err := bench.CacheRound(c.Context, bench.CacheOptions{
				Config: c.String("config"), Bin: c.String("bin"), Runner: c.String("runner"), Listen: c.String("listen"),
				MiB: c.Int("mib"), Runs: c.Int("runs"), Log: c.App.ErrWriter,
			})
			if rep != nil {
				if werr := rep.WriteTable(c.App.Writer); werr != nil {
					return werr
				}
				if path := c.String("json"); path != "" {
					if jerr := writeJSON(path, rep); jerr != nil {
						return jerr
					}
				}
			}
			return err
		},
	}
}
