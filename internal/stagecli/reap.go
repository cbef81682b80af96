package stagecli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Reap is the cleanup executable as the reaper of machines whose job
// ended (lifecycle.ReaperCommand): `reap-machines --config PATH
// [--config-stdin] -- NAME...`, started detached by the cleanup stage with
// the configuration's text on stdin. It removes them (lifecycle.Reap),
// then runs the opportunistic sweep, logs to stderr (the reaper's log
// file) and returns the process's exit code.
func Reap(args []string, stdin io.Reader, stderr io.Writer) int {
	log := slog.New(slog.NewTextHandler(stderr, nil)).With("exe", "reaper")
	fs := flag.NewFlagSet(lifecycle.ReaperCommand, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "driver configuration file")
	cfgStdin := fs.Bool("config-stdin", false, "read the configuration's text from stdin (--config names it)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	names := fs.Args()
	if len(names) == 0 || *cfgPath == "" {
		fmt.Fprintf(stderr, "usage: %s --config PATH -- NAME...\n", lifecycle.ReaperCommand)
		return 2
	}
	for _, n := range names {
		if err := vm.CheckName(n); err != nil {
			log.Error("bad machine name", "err", err)
			return 2
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	cfg, err := helperConfig(*cfgPath, *cfgStdin, stdin)
	if err != nil {
		log.Error("configuration", "err", err)
		return 1
	}
	m, err := lifecycle.Open(cfg, lifecycle.Options{Log: log})
	if err != nil {
		log.Error("open", "err", err)
		return 1
	}
	defer m.Close()
	ctx, cancel := context.WithTimeout(ctx, 2*cfg.Timeouts.Cleanup.D())
	defer cancel()
	t0 := time.Now()
	err = m.Reap(ctx, names)
	if err != nil {
		// The machines keep their ended mark: the next sweep removes them.
		log.Error("reaping incomplete; the next sweep removes what is left", "vms", strings.Join(names, ","), "err", err, "took", time.Since(t0))
		return 1
	}
	log.Info("reaped", "vms", strings.Join(names, ","), "took", time.Since(t0))
	m.OpportunisticSweep(ctx, log)
	return 0
}
