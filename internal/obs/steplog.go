package obs

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// StepRecord is one step of a stage, as the host's structured log gets it.
type StepRecord struct {
	Time     time.Time // when the step ended
	Stage    string    // config, prepare, cleanup, or the run stage's name (step_script, ...)
	Step     string    // the step: "claim", "create", "ssh", ... or "stage" for the whole stage
	Job      string    // the front end's job id
	Instance string    // the GitLab instance URL
	VM       string    // the machine's name
	Image    string
	Path     string // warm or cold (prepare), else ""
	Duration time.Duration
	Outcome  string // ok, failed, cancelled (Step*)
	Class    string // success, build_failure, system_failure (Result*)
	Reason   string // why it failed (bounded word), "" when ok
	Error    string // the error message, "" when ok
}

// Outcomes of a step.
const (
	StepOK        = "ok"
	StepFailed    = "failed"
	StepCancelled = "cancelled"
)

// StepLog receives step records: the structured log of the stage
// executables on the host, for the admin. It never writes to stdout or
// stderr (stdout is the job log). Log never fails the stage: it returns an
// error the caller logs at debug level. Log and Close are safe for
// concurrent use.
type StepLog interface {
	Log(StepRecord) error
	Close() error
}

// Step log kinds, the values of OpenStepLog's kind.
const (
	StepLogNone     = "none"
	StepLogFile     = "file"
	StepLogJournald = "journald"
	StepLogAuto     = "auto"
)

// DefaultJournalSocket is the systemd journal's native protocol socket.
const DefaultJournalSocket = "/run/systemd/journal/socket"

// DefaultStepLogMaxBytes is the size at which the file step log rotates
// when OpenStepLog gets 0.
const DefaultStepLogMaxBytes = 64 << 20

// Bounds of a record's strings, in bytes: the error message (cut further,
// to maxJournalRetryError, when a journal datagram is too large), and
// every other string (ids, names, the instance URL, words).
const (
	maxStepError         = 1024
	maxStepField         = 1024
	maxJournalRetryError = 256
	maxMessageError      = 256
)

// Permissions of what the file step log creates: readable by the admin's
// group, never by everyone.
const (
	stepLogFileMode = 0o640
	stepLogDirMode  = 0o750
)

// journalTimeout bounds one send to the journal: a journal that does not
// read does not hold the stage up.
const journalTimeout = time.Second

// stepLockTimeout bounds the wait for another process's rotation; past it
// the record is written to the file as it is.
const stepLockTimeout = time.Second

var errStepLogClosed = errors.New("step log is closed")

// OpenStepLog opens the step log of the given kind:
//   - "none" discards the records;
//   - "file" appends them as JSON lines to the file at path (its directory
//     created if missing), rotated to path+".1" at maxBytes (0:
//     DefaultStepLogMaxBytes);
//   - "journald" sends them to the systemd journal's native socket at path
//     ("": DefaultJournalSocket);
//   - "auto" is journald when its socket (path, or the default) exists,
//     else none.
func OpenStepLog(kind, path string, maxBytes int64) (StepLog, error) {
	switch kind {
	case StepLogNone:
		return noneStepLog{}, nil
	case StepLogFile:
		return openFileStepLog(path, maxBytes)
	case StepLogJournald:
		return openJournalStepLog(journalSocket(path))
	case StepLogAuto:
		socket := journalSocket(path)
		if fi, err := os.Stat(socket); err != nil || fi.Mode()&os.ModeSocket == 0 { //nolint:gosec // G703: the admin's configuration names the socket; nothing of a job does
			return noneStepLog{}, nil
		}
		return openJournalStepLog(socket)
	}
	return nil, fmt.Errorf("step log kind %q: want one of %s, %s, %s, %s",
		kind, StepLogNone, StepLogFile, StepLogJournald, StepLogAuto)
}

func journalSocket(path string) string {
	if path == "" {
		return DefaultJournalSocket
	}
	return path
}

// noneStepLog discards the records.
type noneStepLog struct{}

func (noneStepLog) Log(StepRecord) error { return nil }
func (noneStepLog) Close() error         { return nil }

// cleaned returns r with every string made safe to log: valid UTF-8,
// no control characters but newlines and tabs (a CR LF becomes a newline,
// any other control character U+FFFD: nothing a terminal acts on), and
// bounded in bytes on a UTF-8 boundary. A zero Time becomes now.
func (r StepRecord) cleaned() StepRecord {
	if r.Time.IsZero() {
		r.Time = time.Now()
	}
	for _, p := range []*string{&r.Stage, &r.Step, &r.Job, &r.Instance, &r.VM, &r.Image, &r.Path, &r.Outcome, &r.Class, &r.Reason} {
		*p = cleanStepString(*p, maxStepField)
	}
	r.Error = cleanStepString(r.Error, maxStepError)
	return r
}

// cleanStepString is s cleaned as cleaned says, at most limit bytes. It
// cuts before it cleans, so a huge string costs no more than a short one.
func cleanStepString(s string, limit int) string {
	s = cutUTF8(s, limit)
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\r\n", "\n")
	s = strings.Map(func(r rune) rune {
		if r == '\n' || r == '\t' || !unicode.IsControl(r) {
			return r
		}
		return utf8.RuneError
	}, s)
	// A replaced control character is longer than the byte it was.
	return cutUTF8(s, limit)
}

// cutUTF8 cuts s to at most n bytes, before the rune that would be split.
func cutUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n
	// s[i] is the first byte left out: back up to the start of its rune
	// (at most UTFMax-1 bytes, so that bytes that are not UTF-8 do not
	// take the whole string with them).
	for i > 0 && i > n-utf8.UTFMax+1 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i]
}

// stepLevel is the record's level: INFO for ok, WARN for cancelled, ERROR
// for failed (and anything unexpected).
func stepLevel(outcome string) slog.Level {
	switch outcome {
	case StepOK:
		return slog.LevelInfo
	case StepCancelled:
		return slog.LevelWarn
	}
	return slog.LevelError
}

func durationMs(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// fileStepLog appends the records as JSON lines to a file that several
// stage processes share. It keeps no descriptor open: each record opens
// the file (a stage logs a handful of records), so a rotation by another
// process never leaves it writing to the old file for long.
type fileStepLog struct {
	path     string
	maxBytes int64
	closed   atomic.Bool
}

func openFileStepLog(path string, maxBytes int64) (*fileStepLog, error) {
	if path == "" {
		return nil, errors.New("step log kind file needs a path")
	}
	if maxBytes < 0 {
		return nil, fmt.Errorf("step log max bytes %d: want 0 (the default, %d) or more", maxBytes, DefaultStepLogMaxBytes)
	}
	if maxBytes == 0 {
		maxBytes = DefaultStepLogMaxBytes
	}
	dir := filepath.Dir(path)
	// The admin's configuration names the file; nothing of a job does.
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) { //nolint:gosec // G703: the admin's path
		if err := os.MkdirAll(dir, stepLogDirMode); err != nil { //nolint:gosec // G703: the admin's path
			return nil, fmt.Errorf("step log directory: %w", err)
		}
		// The exact mode, whatever the umask.
		if err := os.Chmod(dir, stepLogDirMode); err != nil { //nolint:gosec // G703: the admin's path
			return nil, fmt.Errorf("step log directory: %w", err)
		}
	}
	return &fileStepLog{path: path, maxBytes: maxBytes}, nil
}

// Log appends r as one JSON line, in one write(2) to the file opened with
// O_APPEND: lines of processes that append at the same time never mix.
// Before the write, a file at or above maxBytes is rotated.
func (f *fileStepLog) Log(r StepRecord) error {
	if f.closed.Load() {
		return errStepLogClosed
	}
	line, err := stepJSONLine(r.cleaned())
	if err != nil {
		return fmt.Errorf("step log: %w", err)
	}
	fd, err := openCreate(f.path, unix.O_WRONLY|unix.O_APPEND)
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		_ = unix.Close(fd)
		return &os.PathError{Op: "fstat", Path: f.path, Err: err}
	}
	var rotateErr error
	if st.Size >= f.maxBytes {
		_ = unix.Close(fd)
		// A failed rotation still writes the record, to the file as it is.
		rotateErr = f.rotate()
		if fd, err = openCreate(f.path, unix.O_WRONLY|unix.O_APPEND); err != nil {
			return err
		}
	}
	n, err := unix.Write(fd, line)
	if cerr := unix.Close(fd); err == nil && cerr != nil {
		err = cerr
	}
	if err == nil && n != len(line) {
		err = io.ErrShortWrite
	}
	if err != nil {
		return &os.PathError{Op: "write", Path: f.path, Err: err}
	}
	return rotateErr
}

// rotate renames the file to path+".1" (replacing the older one) under an
// exclusive lock on path+".lock", if the file is still at or above
// maxBytes once the lock is held: of processes that found it full at the
// same time, only the first rotates it.
func (f *fileStepLog) rotate() error {
	lockPath := f.path + ".lock"
	// Made here, if missing, with the log's exact mode (flock would make
	// it under the umask); nothing removes it.
	fd, err := openCreate(lockPath, unix.O_RDWR)
	if err != nil {
		return err
	}
	_ = unix.Close(fd)
	lock, err := lockWithin(lockPath, os.O_RDWR, false, stepLockTimeout, 10*time.Millisecond)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return fmt.Errorf("step log rotation: %s held for more than %s", lockPath, stepLockTimeout)
	}
	if err != nil {
		return err
	}
	defer func() { _ = lock.Close() }()
	fi, err := os.Stat(f.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil // rotated by another process, nothing written since
	}
	if err != nil {
		return err
	}
	if fi.Size() < f.maxBytes {
		return nil // rotated by another process
	}
	return os.Rename(f.path, f.path+".1")
}

// Close makes later Logs fail; the file stays as it is.
func (f *fileStepLog) Close() error {
	f.closed.Store(true)
	return nil
}

// openCreate opens path with flags, creating it if it does not exist with
// mode stepLogFileMode exactly (the umask does not narrow it: the admin's
// group reads the log whatever the stage's umask). It returns the
// descriptor.
func openCreate(path string, flags int) (int, error) {
	var err error
	// Three tries: another process may create the file between our two
	// opens, or rotate it away again.
	for range 3 {
		var fd int
		if fd, err = unix.Open(path, flags|unix.O_CLOEXEC, 0); err == nil {
			return fd, nil
		}
		if !errors.Is(err, unix.ENOENT) {
			break
		}
		fd, err = unix.Open(path, flags|unix.O_CLOEXEC|unix.O_CREAT|unix.O_EXCL, stepLogFileMode)
		if err == nil {
			if err = unix.Fchmod(fd, stepLogFileMode); err != nil {
				_ = unix.Close(fd)
				break
			}
			return fd, nil
		}
		if !errors.Is(err, unix.EEXIST) {
			break
		}
	}
	return -1, &os.PathError{Op: "open", Path: path, Err: err}
}

// hostName is this host's name (os.Hostname), "" when it has none.
var hostName, _ = os.Hostname()

// stepJSONLine is r (cleaned) as one JSON line by log/slog's JSONHandler:
// time, level, msg "step", host (this host's name: one file gathered
// from a fleet tells the hosts apart; journald records carry _HOSTNAME),
// stage, step, job_id, instance, vm, image,
// path (omitted when empty), duration_ms, outcome, class, reason and error
// (omitted when empty). The encoder escapes every control character, and
// writes invalid UTF-8 (of which a cleaned record has none) as U+FFFD.
func stepJSONLine(r StepRecord) ([]byte, error) {
	rec := slog.NewRecord(r.Time, stepLevel(r.Outcome), "step", 0)
	rec.AddAttrs(
		slog.String("host", hostName),
		slog.String("stage", r.Stage),
		slog.String("step", r.Step),
		slog.String("job_id", r.Job),
		slog.String("instance", r.Instance),
		slog.String("vm", r.VM),
		slog.String("image", r.Image),
	)
	if r.Path != "" {
		rec.AddAttrs(slog.String("path", r.Path))
	}
	rec.AddAttrs(
		slog.Float64("duration_ms", durationMs(r.Duration)),
		slog.String("outcome", r.Outcome),
		slog.String("class", r.Class),
	)
	if r.Reason != "" {
		rec.AddAttrs(slog.String("reason", r.Reason))
	}
	if r.Error != "" {
		rec.AddAttrs(slog.String("error", r.Error))
	}
	// A handler of its own per record: the buffer holds exactly this line.
	var buf bytes.Buffer
	if err := slog.NewJSONHandler(&buf, nil).Handle(context.Background(), rec); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// journalStepLog sends the records to the systemd journal over its native
// protocol (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/): one datagram per
// record to the journal's socket. It is written here rather than taken
// from github.com/coreos/go-systemd/v22/journal (checked at v22.7.0)
// because that package:
//   - sends to a fixed socket path (/run/systemd/journal/socket, settable
//     only with -ldflags -X), through one process-wide socket: it cannot
//     be pointed at a test's socket, nor at OpenStepLog's path;
//   - sets no write deadline on that socket and offers no way to: a
//     journal that does not read would hold the stage up (journalTimeout
//     here);
//   - sends a record too large for a datagram through a file in /dev/shm,
//     where this one sends it again with the error cut (the records are
//     bounded; the journal's fields stay as documented).
//
// Its lower-level parts (the field encoding) are unexported.
type journalStepLog struct {
	conn *net.UnixConn
	addr *net.UnixAddr
}

func openJournalStepLog(socket string) (*journalStepLog, error) {
	if _, err := os.Stat(socket); err != nil { //nolint:gosec // G703: the admin's configuration names the socket
		return nil, fmt.Errorf("journald step log: %w", err)
	}
	// An unconnected socket, bound to an automatic (abstract) address like
	// go-systemd's: each record is sent to the journal's path, so a
	// restarted journal still gets them.
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Net: "unixgram"})
	if err != nil {
		return nil, fmt.Errorf("journald step log: %w", err)
	}
	return &journalStepLog{conn: conn, addr: &net.UnixAddr{Name: socket, Net: "unixgram"}}, nil
}

// Log sends r as one datagram, waiting at most journalTimeout. A datagram
// too large for the socket (EMSGSIZE) is sent again with the error cut to
// maxJournalRetryError bytes (the protocol's other way, a memfd passed
// along, is not worth it for a log of bounded records).
func (j *journalStepLog) Log(r StepRecord) error {
	r = r.cleaned()
	err := j.send(journalDatagram(r))
	if errors.Is(err, unix.EMSGSIZE) {
		r.Error = cutUTF8(r.Error, maxJournalRetryError)
		err = j.send(journalDatagram(r))
	}
	if err != nil {
		return fmt.Errorf("journald step log (%s): %w", j.addr.Name, err)
	}
	return nil
}

func (j *journalStepLog) send(datagram []byte) error {
	if err := j.conn.SetWriteDeadline(time.Now().Add(journalTimeout)); err != nil {
		return err
	}
	_, _, err := j.conn.WriteMsgUnix(datagram, nil, j.addr)
	return err
}

func (j *journalStepLog) Close() error { return j.conn.Close() }

// journalPriority is the syslog priority of the outcome: 6 (info) for ok,
// 4 (warning) for cancelled, 3 (err) for failed (and anything unexpected).
func journalPriority(outcome string) string {
	switch outcome {
	case StepOK:
		return "6"
	case StepCancelled:
		return "4"
	}
	return "3"
}

// journalDatagram is r (cleaned) in the native protocol. Field names are
// constants; a value with a newline goes in the binary-safe form (name,
// newline, 64-bit little-endian length, value, newline), any other as
// NAME=value and a newline, so no value can end its field early or make
// up another. Empty values are left out.
func journalDatagram(r StepRecord) []byte {
	var b bytes.Buffer
	field := func(name, value string) {
		if value == "" {
			return
		}
		if strings.Contains(value, "\n") {
			b.WriteString(name)
			b.WriteByte('\n')
			b.Write(binary.LittleEndian.AppendUint64(nil, uint64(len(value))))
			b.WriteString(value)
			b.WriteByte('\n')
			return
		}
		b.WriteString(name)
		b.WriteByte('=')
		b.WriteString(value)
		b.WriteByte('\n')
	}
	field("PRIORITY", journalPriority(r.Outcome))
	field("SYSLOG_IDENTIFIER", "libvirt-executor")
	field("MESSAGE", journalMessage(r))
	field("LVE_STAGE", r.Stage)
	field("LVE_STEP", r.Step)
	field("LVE_JOB_ID", r.Job)
	field("LVE_INSTANCE", r.Instance)
	field("LVE_VM", r.VM)
	field("LVE_IMAGE", r.Image)
	field("LVE_PATH", r.Path)
	field("LVE_DURATION_MS", strconv.FormatFloat(durationMs(r.Duration), 'f', 3, 64))
	field("LVE_OUTCOME", r.Outcome)
	field("LVE_CLASS", r.Class)
	field("LVE_REASON", r.Reason)
	field("LVE_ERROR", r.Error)
	return b.Bytes()
}

// journalMessage is the record as one human line, e.g.
//
//	prepare/create ok in 1.234s vm=lve-... job=123
//	prepare/ssh failed in 30.000s vm=lve-... job=123 reason=ssh_timeout: first line of the error
func journalMessage(r StepRecord) string {
	oneLine := strings.NewReplacer("\n", " ", "\t", " ").Replace
	var b strings.Builder
	fmt.Fprintf(&b, "%s/%s %s in %.3fs", oneLine(r.Stage), oneLine(r.Step), oneLine(r.Outcome), r.Duration.Seconds())
	if r.VM != "" {
		b.WriteString(" vm=" + oneLine(r.VM))
	}
	if r.Job != "" {
		b.WriteString(" job=" + oneLine(r.Job))
	}
	if r.Reason != "" {
		b.WriteString(" reason=" + oneLine(r.Reason))
	}
	if r.Error != "" {
		first, _, _ := strings.Cut(r.Error, "\n")
		b.WriteString(": " + oneLine(cutUTF8(first, maxMessageError)))
	}
	return b.String()
}
