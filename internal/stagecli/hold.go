package stagecli

import (
	"flag"
	"io"
	"strconv"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// Hold is the run executable as a job's connection holder
// (jobvm.HolderCommand): `hold-connection --config PATH [--config-stdin]
// --until UNIX NAME`, started by prepare with the listening socket as fd 3
// and the configuration's text on stdin. It logs to stderr (the holder's
// log file) and returns the process's exit code.
func Hold(args []string, stdin io.Reader, stderr io.Writer) int {
	var until string
	h, code := startHelper(jobvm.HolderCommand, "--config PATH [--config-stdin] --until UNIX NAME", false, args, stdin, stderr,
		func(fs *flag.FlagSet) {
			fs.StringVar(&until, "until", "", "end at this time (Unix seconds) at the latest")
		})
	if h == nil {
		return code
	}
	defer h.stop()
	var end time.Time
	if until != "" {
		secs, err := strconv.ParseInt(until, 10, 64)
		if err != nil {
			h.log.Error("--until is not a Unix time", "until", until)
			return 2
		}
		end = time.Unix(secs, 0)
	}
	name := h.names[0]
	log := h.log.With("vm", name)
	log.Info("holder starts", "until", end.UTC().Format(time.RFC3339))
	if err := h.m.Hold(h.ctx, name, end, log); err != nil {
		log.Error("holder failed", "err", err)
		return 1
	}
	return 0
}
