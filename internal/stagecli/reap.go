package stagecli

import (
	"context"
	"io"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// Reap is the cleanup executable as the reaper of machines whose job
// ended (jobvm.ReaperCommand): `reap-machines --config PATH
// [--config-stdin] -- NAME...`, started detached by the cleanup stage with
// the configuration's text on stdin. It removes them (lifecycle.Reap),
// then runs the opportunistic sweep, logs to stderr (the reaper's log
// file) and returns the process's exit code.
func Reap(args []string, stdin io.Reader, stderr io.Writer) int {
	h, code := startHelper(jobvm.ReaperCommand, "--config PATH [--config-stdin] -- NAME...", true, args, stdin, stderr, nil)
	if h == nil {
		return code
	}
	defer h.stop()
	ctx, cancel := context.WithTimeout(h.ctx, 2*h.cfg.Timeouts.Cleanup.D())
	defer cancel()
	vms := strings.Join(h.names, ",")
	t0 := time.Now()
	if err := h.m.Reap(ctx, h.names); err != nil {
		// The machines keep their ended mark: the next sweep removes them.
		h.log.Error("reaping incomplete; the next sweep removes what is left", "vms", vms, "err", err, "took", time.Since(t0))
		return 1
	}
	h.log.Info("reaped", "vms", vms, "took", time.Since(t0))
	h.m.OpportunisticSweep(ctx, h.log)
	return 0
}
