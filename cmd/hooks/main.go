// Command libvirt-executor-hooks is the GitHub Actions runner's container
// hook (ACTIONS_RUNNER_CONTAINER_HOOKS): the runner runs it once per
// command with one JSON object on stdin; each container job runs in a VM of
// its own (internal/ghjob, docs/github-hooks.md). Its configuration is the
// executor's (LIBVIRT_EXECUTOR_CONFIG, else /etc/libvirt-executor/config.toml),
// section [github_hooks]. A step's output is its stdout and stderr, and its
// exit status the hook's; the hook's own messages go to stderr.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghjob"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	_ "gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm" // lifecycle.Open's libvirt
)

func main() {
	if len(os.Args) == 2 && (os.Args[1] == "--version" || os.Args[1] == "-v") {
		fmt.Println("libvirt-executor-hooks version " + buildinfo.String())
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Getenv, os.Stdin, os.Stdout, os.Stderr, nil)
	stop()
	os.Exit(code)
}

// run is main without os.Exit; connect (nil: libvirt) is for tests.
func run(ctx context.Context, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer, connect lifecycle.Connector) int {
	log := obs.NewTextLogger(stderr, nil).With("exe", "libvirt-executor-hooks")
	cfg, err := config.Load(config.Resolve("", getenv))
	if err == nil {
		err = ghjob.Run(ctx, ghjob.Env{Stdin: stdin, Stdout: stdout, Stderr: stderr, Log: log, Connect: connect,
			Euid: os.Geteuid(), PPID: os.Getppid()}, cfg)
	}
	code := exitCode(err)
	if err != nil && code == 1 {
		fmt.Fprintf(stderr, "libvirt-executor-hooks: %v\n", err)
	}
	return code
}

// exitCode is the hook's exit status for err: 0 for none, a step's own
// status (*ghjob.ExitError, also wrapped), else 1 (the hook's own failure,
// which it has said on stderr).
func exitCode(err error) int {
	var exit *ghjob.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit) && exit.Code > 0 && exit.Code < 256:
		return exit.Code
	}
	return 1
}
