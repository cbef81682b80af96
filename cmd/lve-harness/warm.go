package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	_ "gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm" // lifecycle.Open's libvirt
)

// demoColdThenWarm runs the demo job twice: first cold (the pool service is
// not running, so prepare boots a VM), then warm (on the idle VM that
// libvirt-executor serve booted meanwhile), and prints both prepares. The
// service is stopped and its idle VMs removed at the end.
func demoColdThenWarm(c *cli.Context, opts harness.Options, job harness.Job, bin string) error {
	ctx := c.Context
	cfgPath := c.String("config")
	if cfgPath == "" {
		return errors.New("demo --warm needs --config")
	}
	cfg, err := config.Load(cfgPath)
	if err != nil {
		return err
	}
	image := job.Image
	if image == "" {
		image = cfg.DefaultImage
	}
	// The same configuration with a pool of one idle VM for the image.
	text, err := os.ReadFile(cfgPath)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "lve-demo-warm")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	poolCfg := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(poolCfg, []byte(poolsvc.WithPool(string(text), image, 1)), 0o600); err != nil {
		return err
	}
	if cfg, err = config.Load(poolCfg); err != nil {
		return err
	}
	args := []string{"--config", poolCfg}
	opts.Exec.ConfigArgs, opts.Exec.PrepareArgs, opts.Exec.RunArgs, opts.Exec.CleanupArgs = args, args, args, args

	fmt.Printf("demo: job 1 of 2, cold: the pool service is not running yet\n\n")
	cold, err := harness.RunJob(ctx, opts, job)
	if err != nil {
		return err
	}
	if cold.State != harness.StateSuccess {
		_ = cold.WriteSummary(os.Stdout)
		return errJobFailed
	}

	m, err := jobvm.Open(cfg, lifecycle.Options{})
	if err != nil {
		return err
	}
	defer m.Close()
	fmt.Printf("\ndemo: starting libvirt-executor serve with a pool of one idle %s VM\n", image)
	svc, err := poolsvc.Start(filepath.Join(bin, "libvirt-executor"), poolCfg)
	if err != nil {
		return err
	}
	defer func() {
		if _, err := svc.Stop(poolsvc.StopWait); err != nil {
			fmt.Fprintln(os.Stderr, "demo:", err)
		}
		rctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		_, errs := poolsvc.RemoveStandbys(rctx, m, time.Minute, "demo over")
		for _, err := range errs {
			fmt.Fprintln(os.Stderr, "demo:", err)
		}
		if c.Bool("debug") {
			fmt.Fprintf(os.Stderr, "[debug] pool service log:\n%s", svc.Log())
		}
	}()
	t0 := time.Now()
	if _, err := svc.WaitIdle(ctx, m, 1, 10*time.Minute); err != nil {
		return err
	}
	fmt.Printf("demo: idle VM ready after %s\n\n", time.Since(t0).Round(100*time.Millisecond))
	fmt.Printf("demo: job 2 of 2, warm\n\n")
	warm, err := harness.RunJob(ctx, opts, job)
	if err != nil {
		return err
	}
	fmt.Println("\n=== lve-harness summary (job 2, warm)")
	if err := warm.WriteSummary(os.Stdout); err != nil {
		return err
	}
	prep := func(r *harness.Result) time.Duration {
		st := r.Stage("prepare")
		if len(st) == 0 {
			return 0
		}
		return st[len(st)-1].Duration
	}
	fmt.Printf("\ndemo: prepare cold %s, warm %s\n", prep(cold).Round(time.Millisecond), prep(warm).Round(time.Millisecond))
	if warm.State != harness.StateSuccess {
		return errJobFailed
	}
	return nil
}
