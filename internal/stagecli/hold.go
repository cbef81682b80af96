package stagecli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Hold is the run executable as a job's connection holder
// (lifecycle.HolderCommand): `hold-connection --config PATH --until UNIX
// NAME`, started by prepare with the listening socket as fd 3. It logs to
// stderr (the holder's log file) and returns the process's exit code.
func Hold(args []string, stderr io.Writer) int {
	log := slog.New(slog.NewTextHandler(stderr, nil)).With("exe", "connection-holder")
	fs := flag.NewFlagSet(lifecycle.HolderCommand, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "driver configuration file")
	until := fs.String("until", "", "end at this time (Unix seconds) at the latest")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() != 1 || *cfgPath == "" {
		fmt.Fprintf(stderr, "usage: %s --config PATH --until UNIX NAME\n", lifecycle.HolderCommand)
		return 2
	}
	name := fs.Arg(0)
	if err := vm.CheckName(name); err != nil {
		log.Error("bad machine name", "err", err)
		return 2
	}
	var end time.Time
	if *until != "" {
		secs, err := strconv.ParseInt(*until, 10, 64)
		if err != nil {
			log.Error("--until is not a Unix time", "until", *until)
			return 2
		}
		end = time.Unix(secs, 0)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	cfg, err := config.Load(*cfgPath)
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
	log = log.With("vm", name)
	log.Info("holder starts", "until", end.UTC().Format(time.RFC3339))
	if err := m.Hold(ctx, name, end, log); err != nil {
		log.Error("holder failed", "err", err)
		return 1
	}
	return 0
}
