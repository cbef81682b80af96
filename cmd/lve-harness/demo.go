package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

// demoCommand runs one sample job through the installed driver: the demo
// repository is served to the guest over HTTP and checked out by get_sources.
func demoCommand() *cli.Command {
	return &cli.Command{
		Name:  "demo",
		Usage: "run a sample job end to end through bin/libvirt-executor-{config,prepare,run,cleanup}",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "bin", Required: true, Usage: "directory holding libvirt-executor-{config,prepare,run,cleanup}"},
			&cli.StringFlag{Name: "config", Usage: "driver config file, passed to every stage as --config FILE"},
			&cli.StringFlag{Name: "git-host", Usage: "host address the guest reaches the demo git server on (default: the first non-loopback IPv4 address here)"},
			&cli.IntFlag{Name: "git-port", Usage: "port of the demo git server (default: any free port)"},
			&cli.StringFlag{Name: "image", Usage: "the job's image: name (default: the driver's default image)"},
			&cli.DurationFlag{Name: "timeout", Value: 20 * time.Minute, Usage: "job timeout"},
			&cli.BoolFlag{Name: "debug", Usage: "show cleanup's output and harness details on stderr"},
			&cli.BoolFlag{Name: "warm", Usage: "then run the job again warm: start libvirt-executor serve (from --bin) with a pool of one idle VM of the job's image, and compare the two prepares (needs --config)"},
		},
		Action: demoAction,
	}
}

func demoAction(c *cli.Context) error {
	bin := c.String("bin")
	var args []string
	if cfg := c.String("config"); cfg != "" {
		args = []string{"--config", cfg}
	}
	exe := func(stage string) string { return filepath.Join(bin, "libvirt-executor-"+stage) }
	for _, s := range []string{"config", "prepare", "run", "cleanup"} {
		if _, err := os.Stat(exe(s)); err != nil {
			return fmt.Errorf("demo: %w (build with `make build`)", err)
		}
	}

	tmp, err := os.MkdirTemp("", "lve-demo")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	bare, sha, err := harness.MakeDemoRepo(tmp)
	if err != nil {
		return err
	}
	host := c.String("git-host")
	if host == "" {
		if host, err = firstHostAddress(); err != nil {
			return fmt.Errorf("demo: %w; pass --git-host", err)
		}
	}
	url, stop, err := harness.ServeGit(c.Context, bare, net.JoinHostPort(host, fmt.Sprint(c.Int("git-port"))))
	if err != nil {
		return fmt.Errorf("demo: serving the demo repository: %w", err)
	}
	defer stop()
	fmt.Printf("demo: serving %s at %s (commit %s)\n\n", bare, url, sha[:8])

	opts := harness.Options{
		Exec: harness.Executables{
			Config: exe("config"), Prepare: exe("prepare"), Run: exe("run"), Cleanup: exe("cleanup"),
			ConfigArgs: args, PrepareArgs: args, RunArgs: args, CleanupArgs: args,
		},
		BuildExitCodeFile: true,
		GracefulKill:      30 * time.Second,
		StageTimeouts:     harness.StageTimeouts{Prepare: 10 * time.Minute, Cleanup: 5 * time.Minute},
		Log:               os.Stdout,
		DebugLog:          debugLog(c),
	}
	job := harness.Job{
		Name: "demo", RepoURL: url, SHA: sha, Image: c.String("image"),
		Script: []string{
			"cat README.md",
			"./build.sh",
			`echo "job $CI_JOB_ID, image '${CI_JOB_IMAGE:-default}', secret: $DEMO_SECRET"`,
		},
		AfterScript: []string{`echo "after_script: CI_JOB_STATUS=$CI_JOB_STATUS"`},
		Masked:      map[string]string{"DEMO_SECRET": "demo-secret-value-1234"},
		Timeout:     c.Duration("timeout"),
	}
	if !c.Bool("warm") {
		return runAndReport(c.Context, opts, job)
	}
	return demoColdThenWarm(c, opts, job, bin)
}

// firstHostAddress is the first IPv4 address of an up, non-loopback
// interface: inside the rig's network namespace, the libvirt network's
// gateway, which guests reach.
func firstHostAddress() (string, error) {
	ifaces, err := net.Interfaces()
	if err != nil {
		return "", err
	}
	for _, i := range ifaces {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := i.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil {
				return n.IP.String(), nil
			}
		}
	}
	return "", errors.New("no non-loopback IPv4 address found for the demo git server")
}
