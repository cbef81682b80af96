package stepsvc

import (
	"fmt"
	"regexp"
	"strings"
	"time"
)

// The guest side of native mode, as fixed shell commands: the service's
// directory is the driver's own (never job input), and so is every other
// value formatted into them (a job id of digits, a line count).

// DefaultDir is the service's private directory in the guest: its socket
// (step-runner.sock: serve and proxy take no flags and use $TMPDIR), its
// process record, its log, and each run's output directory with the run's
// log and file variables (step-runner-output-ID, removed by Close).
const DefaultDir = "/tmp/lve-steps"

// safeDir is what a service directory may look like (it is formatted into
// shell commands unquoted).
var safeDir = regexp.MustCompile(`^/[A-Za-z0-9._/-]+$`)

func checkDir(dir string) error {
	if !safeDir.MatchString(dir) || strings.Contains(dir, "..") {
		return fmt.Errorf("step-runner directory %q: only an absolute path of letters, digits, '.', '_', '-' and '/' is allowed", dir)
	}
	return nil
}

// Answers of startCommand (its last line).
const (
	answerReady      = "ready"
	answerNoRunner   = "no-step-runner"
	answerNoSetsid   = "no-setsid"
	answerNoAwk      = "no-awk"
	answerNotOwned   = "not-owned"
	answerServeEnded = "serve-ended"
	answerServeSlow  = "serve-slow"
	answerGone       = "gone"
)

// aliveCommand answers "gone" when the service recorded in dir no longer
// runs or has no socket.
func aliveCommand(dir string) string {
	return strings.ReplaceAll(`p=$(cat {d}/serve.pid 2>/dev/null); if [ -n "$p" ] && kill -0 "$p" 2>/dev/null && [ -S {d}/step-runner.sock ]; then echo alive; else echo `+answerGone+`; fi`, "{d}", dir)
}

// startCommand starts `step-runner serve` in the guest unless it runs
// already (a second stage process of the same job, or a re-attach), and
// answers on its last line when its socket is there. The service runs in a
// session of its own (setsid): it outlives the SSH session and connection
// that started it (a dropped connection must not end the steps), and
// stopCommand ends it with everything the steps left in its session. A
// socket left by a service that was killed is removed first (serve cannot
// bind over it).
func startCommand(dir string, wait time.Duration) string {
	ticks := int(wait / (100 * time.Millisecond))
	return strings.NewReplacer("{d}", dir, "{ticks}", fmt.Sprint(ticks)).Replace(strings.Join([]string{
		`command -v step-runner >/dev/null 2>&1 || { echo ` + answerNoRunner + `; exit 0; }`,
		`command -v setsid >/dev/null 2>&1 || { echo ` + answerNoSetsid + `; exit 0; }`,
		`command -v awk >/dev/null 2>&1 || { echo ` + answerNoAwk + `; exit 0; }`,
		`if [ -e {d} ] || [ -L {d} ]; then`,
		`  { [ -d {d} ] && [ ! -L {d} ] && [ -O {d} ]; } || { echo ` + answerNotOwned + `; exit 0; }`,
		`else`,
		`  (umask 077 && mkdir {d}) || exit 1`,
		`fi`,
		`p=$(cat {d}/serve.pid 2>/dev/null)`,
		`if [ -n "$p" ] && kill -0 "$p" 2>/dev/null && [ -S {d}/step-runner.sock ]; then echo ` + answerReady + `; exit 0; fi`,
		`rm -f {d}/step-runner.sock`,
		`cd {d} || exit 1`,
		`TMPDIR={d} setsid step-runner serve < /dev/null >> {d}/serve.log 2>&1 & p=$!`,
		`echo $p > {d}/serve.pid`,
		`i=0; while [ ! -S {d}/step-runner.sock ] && [ $i -lt {ticks} ]; do`,
		`  kill -0 $p 2>/dev/null || { echo ` + answerServeEnded + `; tail -c 2000 {d}/serve.log; exit 0; }`,
		`  sleep 0.1; i=$((i+1))`,
		`done`,
		`if [ -S {d}/step-runner.sock ]; then echo ` + answerReady + `; else echo ` + answerServeSlow + `; fi`,
	}, "\n"))
}

// proxyCommand is the gRPC connection: `step-runner proxy` copies its stdin
// and stdout to the service's socket (no PTY: the bytes are HTTP/2).
func proxyCommand(dir string) string {
	return "TMPDIR=" + dir + " exec step-runner proxy 2>/dev/null"
}

// stopCommand ends the service and everything in its session (the steps
// and what they left running: Close stops only a step's direct child).
// The service goes first, with SIGKILL (it holds nothing once its run is
// closed, and its own SIGTERM handling waits for its connections); what is
// left of its session gets SIGTERM, up to grace, then SIGKILL, process by
// process. It answers "left" when there was something left, and "killed"
// when that ignored SIGTERM. Processes are read from /proc (a zombie does
// not count: an init that is slow to reap must not look like a step that
// ignores signals). A process that left the session (setsid) is not found,
// as with the stage wrapper. Then the directory goes (logs, and the file
// variables of a run that was not closed). The pid file is in the job's
// user's directory: 0, 1 or anything but digits is refused.
func stopCommand(dir string, grace time.Duration) string {
	ticks := int(grace / (100 * time.Millisecond))
	return strings.NewReplacer("{d}", dir, "{ticks}", fmt.Sprint(ticks)).Replace(strings.Join([]string{
		`[ -d {d} ] && [ ! -L {d} ] && [ -O {d} ] || exit 0`,
		`p=$(cat {d}/serve.pid 2>/dev/null)`,
		`case "$p" in ''|*[!0-9]*|0|1) p= ;; esac`,
		`live() { for f in /proc/[0-9]*/stat; do read -r l 2>/dev/null < $f || continue; q=${f#/proc/}; q=${q%/stat}; l=${l##*) }; set -- $l; [ "$4" = "$p" ] && [ "$1" != Z ] && echo $q; done; }`,
		`if [ -n "$p" ]; then`,
		`  kill -KILL $p 2>/dev/null`,
		`  i=0; while [ -r /proc/$p/stat ] && [ $i -lt 20 ]; do read -r l 2>/dev/null < /proc/$p/stat || break; l=${l##*) }; [ "${l%% *}" = Z ] && break; sleep 0.05; i=$((i+1)); done`,
		`  s=$(live)`,
		`  if [ -n "$s" ]; then`,
		`    echo left; kill -TERM $s 2>/dev/null`,
		`    i=0; while [ -n "$(live)" ] && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done`,
		`    s=$(live); [ -n "$s" ] && kill -KILL $s 2>/dev/null && echo killed`,
		`  fi`,
		`fi`,
		`rm -rf {d}`,
	}, "\n"))
}

// offsetCommand answers the byte offset in the run's log file just after
// its lines-th non-empty line, as FollowLogs counts them: the service
// sends each line without its newline (and without a CR before it), then
// "\n" apart, and skips the empty ones, so the bytes received say where to
// resume only for logs without empty lines or CRs. -1: the log has fewer.
func offsetCommand(dir, id string, lines int64) string {
	return fmt.Sprintf(`LC_ALL=C awk -v n=%d '{ p += length($0) + 1; t = $0; sub(/\r$/, "", t); if (t != "" && ++k == n) { print p; f = 1; exit } } END { if (!f) print -1 }' %s`,
		lines, logFile(dir, id))
}

// logFile is a run's log in the guest.
func logFile(dir, id string) string { return dir + "/step-runner-output-" + id + "/logs" }

// tailCommand copies a run's log from offset on (the fallback when the
// service's stream ends before the run does: a line over its 64 KiB limit).
func tailCommand(dir, id string, offset int64) string {
	return fmt.Sprintf("tail -c +%d %s", offset+1, logFile(dir, id))
}
