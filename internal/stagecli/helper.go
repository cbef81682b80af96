package stagecli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os/signal"
	"syscall"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// helper is what a helper process of the driver (connection holder,
// reaper) starts with: its flags parsed, its machine names checked, its
// configuration read and this installation's manager opened.
type helper struct {
	ctx   context.Context
	stop  func()
	log   *slog.Logger
	cfg   *config.Config
	m     *jobvm.Host
	names []string
}

// startHelper parses `--config PATH [--config-stdin] <flags> NAME...` for
// the helper command (flags adds its own), checks the names (at least one;
// at most one unless many), reads the configuration and opens the manager.
// code is the exit code when h is nil. The caller calls h.stop when done.
func startHelper(command, usage string, many bool, args []string, stdin io.Reader, stderr io.Writer, flags func(*flag.FlagSet)) (h *helper, code int) {
	log := obs.NewTextLogger(stderr, nil).With("exe", command)
	fs := flag.NewFlagSet(command, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfgPath := fs.String("config", "", "driver configuration file")
	cfgStdin := fs.Bool("config-stdin", false, "read the configuration's text from stdin (--config names it)")
	if flags != nil {
		flags(fs)
	}
	if err := fs.Parse(args); err != nil {
		return nil, 2
	}
	names := fs.Args()
	if len(names) == 0 || (!many && len(names) > 1) || *cfgPath == "" {
		fmt.Fprintf(stderr, "usage: %s %s\n", command, usage)
		return nil, 2
	}
	for _, n := range names {
		if err := vm.CheckName(n); err != nil {
			log.Error("bad machine name", "err", err)
			return nil, 2
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	cfg, err := helperConfig(*cfgPath, *cfgStdin, stdin)
	if err != nil {
		stop()
		log.Error("configuration", "err", err)
		return nil, 1
	}
	m, err := jobvm.Open(cfg, lifecycle.Options{Log: log})
	if err != nil {
		stop()
		log.Error("open", "err", err)
		return nil, 1
	}
	return &helper{ctx: ctx, log: log, cfg: cfg, m: m, names: names, stop: func() { _ = m.Close(); stop() }}, 0
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
