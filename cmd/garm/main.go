// Command libvirt-executor-garm is the garm external provider: garm runs it
// once per operation (GARM_COMMAND), with this provider's TOML configuration
// in GARM_PROVIDER_CONFIG_FILE (the executor's own format). See docs/garm.md.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/garm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	_ "gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm" // lifecycle.Open's libvirt
)

func main() {
	if len(os.Args) == 2 && (os.Args[1] == "--version" || os.Args[1] == "-v") {
		// garm asks with GARM_COMMAND=GetVersion; an admin asks this way.
		fmt.Println("libvirt-executor-garm version " + buildinfo.String())
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Getenv, os.Stdin, os.Stdout, os.Stderr, nil)
	stop()
	os.Exit(code)
}

// run is main without os.Exit; connect (nil: libvirt) is for tests.
func run(ctx context.Context, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer, connect lifecycle.Connector) int {
	log := obs.NewTextLogger(stderr, nil).With("exe", "libvirt-executor-garm")
	fail := func(err error) int {
		fmt.Fprintf(stderr, "libvirt-executor-garm: %v\n", err)
		return garm.ExitCode(err)
	}
	env, err := garm.ReadEnv(getenv)
	if err != nil {
		return fail(err)
	}
	p := &garm.Provider{Env: env, Out: stdout}
	switch env.Command {
	case garm.CmdVersion, garm.CmdVersions, garm.CmdConfigSchema, garm.CmdExtraSpecSchema:
		if err := p.Run(ctx, stdin); err != nil {
			return fail(err)
		}
		return garm.ExitOK
	}
	cfg, err := config.Load(env.ConfigFile)
	if err != nil {
		return fail(err)
	}
	// The engine with the hooks of job machines (jobvm.Open), as GitLab's
	// stages open it: a create on a host full of idle standby machines
	// retires one (lifecycle.Hooks.MakeRoom) instead of failing.
	h, err := jobvm.Open(cfg, lifecycle.Options{Connect: connect, Log: log})
	if err != nil {
		return fail(err)
	}
	defer h.Close()
	m := h.Manager()
	p.M, p.Cfg, p.Log = m, cfg, log
	if err := p.Run(ctx, stdin); err != nil {
		log.Error("command failed", "command", env.Command, "instance", env.InstanceID, "err", err)
		return fail(err)
	}
	return garm.ExitOK
}
