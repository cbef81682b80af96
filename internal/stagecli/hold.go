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
// (lifecycle.HolderCommand): `hold-connection --config PATH [--config-stdin]
// --until UNIX NAME`, started by prepare with the listening socket as fd 3
// and the configuration's text on stdin. It logs to
// stderr (the holder's log file) and returns the process's exit code.
func Hold(args []string, stdin io.Reader, stderr io.Writer) int {
	log := slog.New(slog.NewTextHandler(stderr, nil)).With("exe", "connection-holder")
	fs := flag.NewFlagSet(lifecycle.HolderCommand, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "driver configuration file")
	cfgStdin := fs.Bool("config-stdin", false, "read the configuration's text from stdin (--config names it)")
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
	log = log.With("vm", name)
	log.Info("holder starts", "until", end.UTC().Format(time.RFC3339))
	if err := m.Hold(ctx, name, end, log); err != nil {
		log.Error("holder failed", "err", err)
		return 1
	}
	return 0
}

// maxConfigText bounds a configuration read from stdin.
const maxConfigText = 4 << 20

// helperConfig is the configuration of a helper process (holder, reaper):
// the text its starter gave it on stdin (the very configuration that stage
// used, even if the file changed or went since), else the file at path.
func helperConfig(path string, fromStdin bool, stdin io.Reader) (*config.Config, error) {
	if !fromStdin {
		return config.Load(path)
	}
	text, err := io.ReadAll(io.LimitReader(stdin, maxConfigText+1))
	if err != nil {
		return nil, fmt.Errorf("read the configuration from stdin: %w", err)
	}
	if len(text) > maxConfigText {
		return nil, fmt.Errorf("configuration on stdin exceeds %d bytes", maxConfigText)
	}
	cfg, err := config.Parse(text)
	if err != nil {
		return nil, fmt.Errorf("config %s (from stdin): %w", path, err)
	}
	cfg.Path = path
	return cfg, nil
}
