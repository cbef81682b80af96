package sshexec

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// wrapper is the command the guest's login shell runs for one stage. One
// session does it all (each session costs the guest a shell start):
//
//   - The session's shell is a session and process group leader (the SSH
//     server calls setsid), so $$ is the group to signal; it is recorded
//     first, so a cancel can stop the stage even during the upload.
//   - The script arrives on stdin and is written with a private umask and
//     noclobber in a subshell (the job keeps its own umask). Only a file of
//     exactly the script's length runs: a connection lost mid-upload ends
//     the guest's stdin early and must not run half a script. If the upload
//     fails the session shell ends itself with SIGUSR1, which tells an
//     infrastructure failure from anything the script can exit with; from
//     then on the shell ignores USR1 for itself (trap), so a job that sends
//     USR1 to its process group is still judged by its exit code.
//   - The script runs with stdin closed in a session of its own (setsid, if
//     the guest has it), so everything it leaves in its process group can be
//     stopped as a group, and {pid}.g now names that group for a cancel.
//     Its stdout and stderr both go into one FIFO, in order, and a relay
//     (cat) copies the FIFO to the SSH channel: nothing the script starts
//     holds the channel itself.
//   - When the script's shell ends, what it left in its group gets SIGTERM,
//     then SIGKILL after the grace. The relay then gets a moment to copy
//     what is left; a writer that detached (setsid) cannot keep it, and so
//     the stage, open: the relay is stopped. A sink takes over the FIFO's
//     read end first (opened by the wrapper itself, read-write and then
//     read-only, so neither open blocks nor races the relay's end), so the
//     detached writer does not die of SIGPIPE; the sink ends with it.
//   - The script, pidfile and FIFO are removed as soon as the script ends:
//     the script holds the job's variables.
type wrapper struct {
	base          string
	size          int
	shell         string
	leftoverGrace time.Duration
}

func (w wrapper) script() string  { return w.base + ".sh" }
func (w wrapper) pidfile() string { return w.base + ".pid" }
func (w wrapper) fifo() string    { return w.base + ".out" }

func (w wrapper) command() string {
	// Group signals are sent as "kill -SIG -PGID": dash rejects
	// "kill -SIG -- -PGID" and busybox ash fails it, and any of them may be
	// the guest's login shell. The script's group goes into a file of its
	// own, never rewritten (no mv: one process less per stage), and a
	// cancel reads it again while it is still empty (groupOf).
	ticks := int(w.leftoverGrace / (100 * time.Millisecond))
	lines := []string{
		`echo $$ > {pid}`,
		`{ (umask 077 && set -C && exec cat > {sh}) && [ $(wc -c < {sh}) -eq {size} ] && (umask 077 && mkfifo {out}); } || { rm -f {sh} {pid} {out}; kill -s USR1 $$; exit 1; }`,
		`trap : USR1`,
		`cat {out} & r=$!`,
		`if command -v setsid >/dev/null 2>&1; then`,
		`  : > {pid}.g`,
		`  setsid {shell} {sh} < /dev/null > {out} 2>&1 & s=$! g=$s`,
		`  echo $s > {pid}.g`,
		`else`,
		`  {shell} {sh} < /dev/null > {out} 2>&1 & s=$! g=`,
		`fi`,
		`wait $s; rc=$?`,
		`rm -f {sh}`,
		`if [ -n "$g" ] && kill -TERM -$g 2>/dev/null; then`,
		`  echo "libvirt-executor: the script has ended; stopping the processes it left running" >&2`,
		`  i=0; while kill -0 -$g 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done`,
		`  kill -KILL -$g 2>/dev/null && echo "libvirt-executor: they ignored SIGTERM for {grace}: killed" >&2`,
		`fi`,
		`i=0; while kill -0 $r 2>/dev/null && [ $i -lt 100 ]; do sleep 0.01; i=$((i+1)); done`,
		`if kill -0 $r 2>/dev/null; then`,
		`  exec 3<> {out} 4< {out} 3>&-`,
		`  cat <&4 > /dev/null 2>&1 &`,
		`  exec 4<&-`,
		`  kill $r 2>/dev/null`,
		`  echo "libvirt-executor: a detached process still writes to the stage's output; the stage ends without it" >&2`,
		`fi`,
		`wait $r 2>/dev/null`,
		`rm -f {pid} {pid}.g {out}`,
		`exit $rc`,
	}
	return strings.NewReplacer(
		"{pid}", w.pidfile(), "{sh}", w.script(), "{out}", w.fifo(), "{size}", strconv.Itoa(w.size),
		"{shell}", ShellQuote(w.shell), "{ticks}", strconv.Itoa(ticks), "{grace}", w.leftoverGrace.String(),
	).Replace(strings.Join(lines, "\n"))
}

// stageBase is where a stage's files are in the guest.
func stageBase(tag string) string { return "/tmp/lve-run-" + tag }

// StopStage stops the stage with tag that another connection started
// (whose connection ended mid-stage): its process group gets SIGTERM, and
// SIGKILL after grace if it is still there; its files are removed. Nothing
// happens if that stage has already ended.
func (c *Client) StopStage(ctx context.Context, tag string, grace time.Duration) error {
	if !validTag(tag) {
		return fmt.Errorf("invalid stage tag %q (16 lowercase hex digits)", tag)
	}
	w := wrapper{base: stageBase(tag)}
	pid, sh, out := w.pidfile(), w.script(), w.fifo()
	ticks := int(orDefault(grace, 5*time.Second) / (100 * time.Millisecond))
	cmd := strings.NewReplacer("{pid}", pid, "{sh}", sh, "{out}", out, "{ticks}", strconv.Itoa(ticks)).Replace(
		groupOf + `; if [ -n "$g" ]; then kill -TERM -$g 2>/dev/null; ` +
			`i=0; while kill -0 -$g 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; ` +
			`kill -KILL -$g 2>/dev/null; fi; rm -f {pid} {pid}.g {sh} {out}; exit 0`)
	_, err := c.Output(ctx, cmd)
	return err
}

// groupOf sets g to the process group of the stage whose pidfile is {pid}:
// the script's own group ({pid}.g, written once the script runs in a session
// of its own), else the session shell's ({pid}, written first). A {pid}.g
// that exists but is still empty is being written: it is read again.
const groupOf = `g=; i=0; while [ $i -lt 20 ]; do ` +
	`if [ -s {pid}.g ]; then g=$(cat {pid}.g); elif [ ! -e {pid}.g ] && [ -s {pid} ]; then g=$(cat {pid}); fi; ` +
	`[ -n "$g" ] && break; [ -e {pid}.g ] || [ -e {pid} ] || break; i=$((i+1)); sleep 0.01; done; true`

// killGroup sends SIGTERM to the script's process group through a new
// session, waits up to grace for the script to end, then sends SIGKILL.
func (c *Client) killGroup(pidfile string, grace time.Duration, exited <-chan exitResult) error {
	if grace <= 0 {
		grace = 5 * time.Second
	}
	kill := func(sig string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Output(ctx, strings.ReplaceAll(groupOf, "{pid}", pidfile)+` && [ -n "$g" ] && kill -`+sig+` -$g`)
		return err
	}
	if err := kill("TERM"); err != nil {
		return err
	}
	select {
	case <-exited:
	case <-time.After(grace):
		if err := kill("KILL"); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	base := strings.TrimSuffix(pidfile, ".pid")
	_, _ = c.Output(ctx, "rm -f "+pidfile+" "+pidfile+".g "+base+".sh "+base+".out")
	return nil
}

// ShellQuote quotes s as one word for a POSIX shell (for fixed commands
// built from configured values, never from job input).
func ShellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
