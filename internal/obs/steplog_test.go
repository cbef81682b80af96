package obs

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// stepRecord is a failed prepare step with every field set.
func stepRecord() StepRecord {
	return StepRecord{
		Time:     time.Date(2026, 3, 4, 5, 6, 7, 891234567, time.UTC),
		Stage:    "prepare",
		Step:     "create",
		Job:      "123",
		Instance: "https://gitlab.example.com",
		VM:       "lve-123-abc",
		Image:    "debian-12",
		Path:     PathCold,
		Duration: 1234567 * time.Microsecond,
		Outcome:  StepFailed,
		Class:    ResultSystem,
		Reason:   "create_failed",
		Error:    "define domain: exit status 1",
	}
}

// openFile opens a file step log at path, closed with the test.
func openFile(t *testing.T, path string, maxBytes int64) StepLog {
	t.Helper()
	sl, err := OpenStepLog(StepLogFile, path, maxBytes)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sl.Close() })
	return sl
}

// fileLines reads the lines of a step log file; it fails on a last line
// without its newline (a record cut short).
func fileLines(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	if len(data) == 0 {
		return nil
	}
	require.Equal(t, byte('\n'), data[len(data)-1], "%s ends with a whole line", path)
	return strings.Split(string(data[:len(data)-1]), "\n")
}

// decodeLine decodes one line as a JSON object, failing on anything else.
func decodeLine(t *testing.T, line string) map[string]any {
	t.Helper()
	var m map[string]any
	dec := json.NewDecoder(strings.NewReader(line))
	require.NoError(t, dec.Decode(&m), "line %q", line)
	_, err := dec.Token()
	require.ErrorIs(t, err, io.EOF, "one object per line: %q", line)
	return m
}

// lineKeys is the object's keys in the order of the line.
func lineKeys(t *testing.T, line string) []string {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(line))
	tok, err := dec.Token()
	require.NoError(t, err)
	require.Equal(t, json.Delim('{'), tok)
	var keys []string
	for dec.More() {
		tok, err := dec.Token()
		require.NoError(t, err)
		keys = append(keys, tok.(string))
		var v any
		require.NoError(t, dec.Decode(&v))
	}
	return keys
}

// The file sink writes each field under its key with its JSON type: the
// time as RFC 3339 with nanoseconds, the duration as a float of
// milliseconds, everything else as strings, in the documented order.
func TestStepLogFileFields(t *testing.T) {
	path := filepath.Join(t.TempDir(), "steps.log")
	sl := openFile(t, path, 0)
	rec := stepRecord()
	require.NoError(t, sl.Log(rec))

	lines := fileLines(t, path)
	require.Len(t, lines, 1)
	require.Equal(t, []string{
		"time", "level", "msg", "host", "stage", "step", "job_id", "instance", "vm", "image", "path",
		"duration_ms", "outcome", "class", "reason", "error",
	}, lineKeys(t, lines[0]))

	m := decodeLine(t, lines[0])
	ts, ok := m["time"].(string)
	require.True(t, ok, "time is a string")
	got, err := time.Parse(time.RFC3339Nano, ts)
	require.NoError(t, err)
	require.True(t, rec.Time.Equal(got), "time %s, want %s", got, rec.Time)
	delete(m, "time")
	host, _ := os.Hostname()
	require.NotEmpty(t, host)
	require.Equal(t, map[string]any{
		"level":       "ERROR",
		"msg":         "step",
		"host":        host,
		"stage":       "prepare",
		"step":        "create",
		"job_id":      "123",
		"instance":    "https://gitlab.example.com",
		"vm":          "lve-123-abc",
		"image":       "debian-12",
		"path":        "cold",
		"duration_ms": 1234.567, // a float64: the type is checked too
		"outcome":     "failed",
		"class":       "system_failure",
		"reason":      "create_failed",
		"error":       "define domain: exit status 1",
	}, m)
}

// Path, reason and error are left out when empty, the other fields never;
// the level follows the outcome; a zero time is the time of the Log.
func TestStepLogFileOmitsEmptyAndLevels(t *testing.T) {
	path := filepath.Join(t.TempDir(), "steps.log")
	sl := openFile(t, path, 0)
	for _, outcome := range []string{StepOK, StepCancelled, StepFailed} {
		require.NoError(t, sl.Log(StepRecord{Stage: "cleanup", Step: "stage", Outcome: outcome, Class: ResultSuccess}))
	}
	before := time.Now()
	lines := fileLines(t, path)
	require.Len(t, lines, 3)
	for i, level := range []string{"INFO", "WARN", "ERROR"} {
		require.Equal(t, []string{
			"time", "level", "msg", "host", "stage", "step", "job_id", "instance", "vm", "image",
			"duration_ms", "outcome", "class",
		}, lineKeys(t, lines[i]))
		m := decodeLine(t, lines[i])
		require.Equal(t, level, m["level"])
		require.Equal(t, "", m["job_id"])
		require.Equal(t, float64(0), m["duration_ms"])
		ts, err := time.Parse(time.RFC3339Nano, m["time"].(string))
		require.NoError(t, err)
		require.WithinDuration(t, before, ts, time.Minute)
	}
}

// hostile is a record whose every user-influenced string tries to break
// the format: newlines (a forged second record), quotes, </script>,
// invalid UTF-8, terminal escapes, NUL, DEL, a C1 control, and an error
// far beyond the bound with a multi-byte rune across it.
func hostile() StepRecord {
	rec := stepRecord()
	rec.Job = "1\n{\"level\":\"INFO\",\"msg\":\"forged\"}\nPRIORITY=0"
	rec.Image = "img\"</script><script>alert(1)</script>"
	rec.Instance = "https://x\xff\xfe.example/\x1b[31mred\r\n"
	rec.VM = "vm\x00\x7f\u0085\u2028end\ttab"
	rec.Error = "line 1\r\nline 2\n" + strings.Repeat("é", 600) // 2 bytes each
	return rec
}

// What cleaned makes of hostile's strings.
var (
	hostileJob      = "1\n{\"level\":\"INFO\",\"msg\":\"forged\"}\nPRIORITY=0"
	hostileImage    = "img\"</script><script>alert(1)</script>"
	hostileInstance = "https://x\uFFFD.example/\uFFFD[31mred\n"
	hostileVM       = "vm\uFFFD\uFFFD\uFFFD\u2028end\ttab"
)

// The error, cleaned: its CR LF a newline, cut to 1024 bytes before the é
// that would be split (1024 - len("line 1\r\nline 2\n") is odd).
func hostileError(t *testing.T) string {
	t.Helper()
	cut := "line 1\r\nline 2\n" + strings.Repeat("é", 600)
	cut = cut[:1024-1]
	require.True(t, utf8.ValidString(cut))
	return strings.Replace(cut, "\r\n", "\n", 1)
}

// Hostile values do not break the file: each record is one line, no raw
// control character (but the newline ending it) or invalid UTF-8 reaches
// the file, and the values come back through encoding/json as cleaned.
func TestStepLogFileHostileValues(t *testing.T) {
	path := filepath.Join(t.TempDir(), "steps.log")
	sl := openFile(t, path, 0)
	require.NoError(t, sl.Log(hostile()))
	require.NoError(t, sl.Log(stepRecord()))

	data, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, 2, bytes.Count(data, []byte("\n")), "one line per record")
	require.True(t, utf8.Valid(data))
	for _, r := range string(data) {
		require.True(t, r == '\n' || !unicode.IsControl(r), "raw control character %U in the file", r)
	}

	lines := fileLines(t, path)
	m := decodeLine(t, lines[0])
	require.Equal(t, hostileJob, m["job_id"])
	require.Equal(t, hostileImage, m["image"])
	require.Equal(t, hostileInstance, m["instance"])
	require.Equal(t, hostileVM, m["vm"])
	require.Equal(t, hostileError(t), m["error"])
	require.LessOrEqual(t, len(m["error"].(string)), 1024)
	require.Equal(t, "ERROR", m["level"], "a forged level in a value is only text")
	require.Equal(t, "step", decodeLine(t, lines[1])["msg"])
}

// The error is cut to 1024 bytes on a UTF-8 boundary; a huge one costs no
// more than that.
func TestStepLogCleanBounds(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{strings.Repeat("a", 2000), strings.Repeat("a", 1024)},
		{strings.Repeat("a", 1023) + "é", strings.Repeat("a", 1023)},
		{strings.Repeat("a", 1022) + "€x", strings.Repeat("a", 1022)},
		{strings.Repeat("a", 1021) + "€x", strings.Repeat("a", 1021) + "€"},
		{strings.Repeat("\x00", 2000), strings.Repeat("\uFFFD", 341)},
		{strings.Repeat("\xff", 2000), "\uFFFD"}, // a run of invalid bytes is one U+FFFD
	} {
		got := cleanStepString(tc.in, maxStepError)
		require.Equal(t, tc.want, got)
		require.True(t, utf8.ValidString(got))
	}
}

// A helper process (the test binary run again) for the tests below, by
// LVE_STEPLOG_HELPER:
//   - "append": LVE_STEPLOG_N records by writer LVE_STEPLOG_WRITER to the
//     file LVE_STEPLOG_PATH (maxBytes LVE_STEPLOG_MAX);
//   - "umask": under umask 077, one record to LVE_STEPLOG_PATH, then
//     enough to rotate it at LVE_STEPLOG_MAX.
func TestStepLogHelperProcess(t *testing.T) {
	mode := os.Getenv("LVE_STEPLOG_HELPER")
	if mode == "" {
		t.Skip("helper process of the step log tests")
	}
	path := os.Getenv("LVE_STEPLOG_PATH")
	maxBytes, err := strconv.ParseInt(os.Getenv("LVE_STEPLOG_MAX"), 10, 64)
	require.NoError(t, err)
	switch mode {
	case "append":
		n, err := strconv.Atoi(os.Getenv("LVE_STEPLOG_N"))
		require.NoError(t, err)
		sl := openFile(t, path, maxBytes)
		appendRecords(t, sl, os.Getenv("LVE_STEPLOG_WRITER"), n)
	case "umask":
		unix.Umask(0o077)
		sl := openFile(t, path, maxBytes)
		for range 3 {
			require.NoError(t, sl.Log(stepRecord()))
		}
	default:
		t.Fatalf("unknown helper mode %q", mode)
	}
}

// runHelper runs the helper process in mode with env, failing with its
// output.
func runHelper(t *testing.T, mode string, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestStepLogHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), append([]string{"LVE_STEPLOG_HELPER=" + mode}, env...)...)
	return cmd
}

// appendRecords logs n records of writer, each with Job "writer/seq" and a
// long error, so that mixed writes would show as broken lines.
func appendRecords(t *testing.T, sl StepLog, writer string, n int) {
	for i := range n {
		rec := stepRecord()
		rec.Job = fmt.Sprintf("%s/%d", writer, i)
		rec.Error = strings.Repeat(writer+" ", 900/(len(writer)+1))
		if err := sl.Log(rec); err != nil {
			t.Errorf("writer %s record %d: %v", writer, i, err)
			return
		}
	}
}

// Several goroutines on one StepLog, several StepLogs on the same file,
// and other processes append at once: every line is one whole record,
// and every record is there once.
func TestStepLogFileConcurrentAppends(t *testing.T) {
	path := filepath.Join(t.TempDir(), "steps.log")
	const n = 200
	var writers []string

	procs := make([]*exec.Cmd, 3)
	for i := range procs {
		w := fmt.Sprintf("proc%d", i)
		writers = append(writers, w)
		procs[i] = runHelper(t, "append", "LVE_STEPLOG_PATH="+path, "LVE_STEPLOG_MAX=0",
			"LVE_STEPLOG_WRITER="+w, "LVE_STEPLOG_N="+strconv.Itoa(n))
		var out bytes.Buffer
		procs[i].Stdout, procs[i].Stderr = &out, &out
		require.NoError(t, procs[i].Start())
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("helper %s: %s", w, out.String())
			}
		})
	}

	shared := openFile(t, path, 0)
	var wg sync.WaitGroup
	for i := range 4 {
		w := fmt.Sprintf("shared%d", i)
		writers = append(writers, w)
		wg.Go(func() { appendRecords(t, shared, w, n) })
	}
	for i := range 4 {
		w := fmt.Sprintf("own%d", i)
		writers = append(writers, w)
		own := openFile(t, path, 0)
		wg.Go(func() { appendRecords(t, own, w, n) })
	}
	wg.Wait()
	for _, p := range procs {
		require.NoError(t, p.Wait())
	}

	seen := map[string]bool{}
	for _, line := range fileLines(t, path) {
		m := decodeLine(t, line)
		job := m["job_id"].(string)
		require.False(t, seen[job], "record %s twice", job)
		seen[job] = true
		w, _, _ := strings.Cut(job, "/")
		require.Equal(t, strings.Repeat(w+" ", 900/(len(w)+1)), m["error"], "record %s whole", job)
	}
	require.Len(t, seen, n*len(writers))
}

// At maxBytes the file is renamed to .1 (replacing an older one) before
// the next write: both files parse, the current one has the newest
// records, .1 those just before them, and the file stays under maxBytes
// and one line.
func TestStepLogFileRotation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "steps.log")
	require.NoError(t, os.WriteFile(path+".1", []byte("older\n"), 0o600))
	const maxBytes = 4096
	sl := openFile(t, path, maxBytes)
	const n = 40
	lineLen := 0
	for i := range n {
		rec := stepRecord()
		rec.Job = fmt.Sprintf("%03d", i)
		require.NoError(t, sl.Log(rec))
		if lineLen == 0 {
			fi, err := os.Stat(path)
			require.NoError(t, err)
			lineLen = int(fi.Size())
		}
	}

	seq := func(file string) []int {
		var s []int
		for _, line := range fileLines(t, file) {
			i, err := strconv.Atoi(decodeLine(t, line)["job_id"].(string))
			require.NoError(t, err)
			s = append(s, i)
		}
		return s
	}
	cur, old := seq(path), seq(path+".1")
	require.NotEmpty(t, cur)
	require.NotEmpty(t, old)
	require.Equal(t, n-1, cur[len(cur)-1], "the newest record is in the current file")
	all := append(old, cur...)
	for i := 1; i < len(all); i++ {
		require.Equal(t, all[i-1]+1, all[i], "the records run on from .1 into the current file")
	}
	perFile := (maxBytes + lineLen - 1) / lineLen // lines until the size reaches maxBytes
	require.Len(t, old, perFile, ".1 was rotated when it reached maxBytes")
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Less(t, fi.Size(), int64(maxBytes+lineLen))
}

// Processes that find the file full at the same time rotate it once: the
// full file is .1, every record is in the new file. Without the lock and
// the second look at the size, a late one renames the new file over .1.
func TestStepLogFileRotatesOnce(t *testing.T) {
	path := filepath.Join(t.TempDir(), "steps.log")
	seed := bytes.Repeat([]byte("{\"seed\":true}\n"), 1000)
	const maxBytes = 10000
	require.Greater(t, len(seed), maxBytes)
	for round := range 5 {
		require.NoError(t, os.WriteFile(path, seed, 0o640))
		var wg sync.WaitGroup
		const n = 16
		for i := range n {
			sl := openFile(t, path, maxBytes)
			wg.Go(func() {
				rec := stepRecord()
				rec.Job = strconv.Itoa(i)
				if err := sl.Log(rec); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		old, err := os.ReadFile(path + ".1")
		require.NoError(t, err)
		require.Equal(t, seed, old, "round %d: .1 is the full file", round)
		require.Len(t, fileLines(t, path), n, "round %d: every record in the new file", round)
	}
}

// What the file sink creates has exact modes, whatever the umask: the
// directory 0750, the file, its rotated file and the lock file 0640.
func TestStepLogFileModes(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "log")
	path := filepath.Join(dir, "steps.log")
	// One record is over 200 bytes: the third Log rotates.
	cmd := runHelper(t, "umask", "LVE_STEPLOG_PATH="+path, "LVE_STEPLOG_MAX=200")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	mode := func(p string) os.FileMode {
		fi, err := os.Stat(p)
		require.NoError(t, err)
		return fi.Mode()
	}
	require.Equal(t, os.ModeDir|0o750, mode(dir))
	require.Equal(t, os.FileMode(0o640), mode(path))
	require.Equal(t, os.FileMode(0o640), mode(path+".1"))
	require.Equal(t, os.FileMode(0o640), mode(path+".lock"))
	require.Len(t, fileLines(t, path), 1)
	require.Len(t, fileLines(t, path+".1"), 1, "the second record rotated the first away, the third the second")
}

// journalField is one field of a native protocol datagram.
type journalField struct {
	name, value string
	binary      bool // sent in the binary-safe form
}

// parseJournal parses a native protocol datagram: NAME=value lines, and
// NAME, newline, 64-bit little-endian length, value, newline.
func parseJournal(t *testing.T, b []byte) []journalField {
	t.Helper()
	var fields []journalField
	for len(b) > 0 {
		nl := bytes.IndexByte(b, '\n')
		require.GreaterOrEqual(t, nl, 0, "field without its newline: %q", b)
		line := b[:nl]
		var f journalField
		if name, value, ok := bytes.Cut(line, []byte("=")); ok {
			f = journalField{name: string(name), value: string(value)}
			b = b[nl+1:]
		} else {
			f = journalField{name: string(line), binary: true}
			b = b[nl+1:]
			require.GreaterOrEqual(t, len(b), 8, "length of %s", f.name)
			n := binary.LittleEndian.Uint64(b)
			b = b[8:]
			require.Less(t, n, uint64(len(b)), "value of %s", f.name)
			f.value = string(b[:n])
			require.Equal(t, byte('\n'), b[n], "newline after %s", f.name)
			b = b[n+1:]
		}
		require.Regexp(t, `^[A-Z][A-Z0-9_]*$`, f.name)
		fields = append(fields, f)
	}
	return fields
}

// fieldMap is the fields by name, each once.
func fieldMap(t *testing.T, fields []journalField) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, f := range fields {
		_, dup := m[f.name]
		require.False(t, dup, "%s twice", f.name)
		m[f.name] = f.value
	}
	return m
}

// journalListener is a unix datagram socket standing in for the journal's,
// and its path.
func journalListener(t *testing.T) (*net.UnixConn, string) {
	t.Helper()
	dir := t.TempDir()
	if len(dir) > 80 { // a socket path has at most 107 bytes
		var err error
		dir, err = os.MkdirTemp("", "lve")
		require.NoError(t, err)
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
	}
	path := filepath.Join(dir, "journal.sock")
	l, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l, path
}

// receive reads one datagram, waiting at most 5 s.
func receive(t *testing.T, l *net.UnixConn) []byte {
	t.Helper()
	require.NoError(t, l.SetReadDeadline(time.Now().Add(5*time.Second)))
	buf := make([]byte, 1<<16)
	n, err := l.Read(buf)
	require.NoError(t, err)
	return buf[:n]
}

func openJournal(t *testing.T, path string) StepLog {
	t.Helper()
	sl, err := OpenStepLog(StepLogJournald, path, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sl.Close() })
	return sl
}

// The journald sink sends one datagram with every field; a multi-line
// value (the error, a hostile job id) goes in the binary-safe form and
// cannot forge another field; MESSAGE is one line.
func TestStepLogJournaldFields(t *testing.T) {
	l, path := journalListener(t)
	sl := openJournal(t, path)

	rec := stepRecord()
	rec.Error = "define domain:\nexit status 1"
	require.NoError(t, sl.Log(rec))
	fields := parseJournal(t, receive(t, l))
	require.Equal(t, map[string]string{
		"PRIORITY":          "3",
		"SYSLOG_IDENTIFIER": "libvirt-executor",
		"MESSAGE":           "prepare/create failed in 1.235s vm=lve-123-abc job=123 reason=create_failed: define domain:",
		"LVE_STAGE":         "prepare",
		"LVE_STEP":          "create",
		"LVE_JOB_ID":        "123",
		"LVE_INSTANCE":      "https://gitlab.example.com",
		"LVE_VM":            "lve-123-abc",
		"LVE_IMAGE":         "debian-12",
		"LVE_PATH":          "cold",
		"LVE_DURATION_MS":   "1234.567",
		"LVE_OUTCOME":       "failed",
		"LVE_CLASS":         "system_failure",
		"LVE_REASON":        "create_failed",
		"LVE_ERROR":         "define domain:\nexit status 1",
	}, fieldMap(t, fields))
	for _, f := range fields {
		require.Equal(t, f.name == "LVE_ERROR", f.binary, "%s in the binary-safe form only when multi-line", f.name)
	}

	require.NoError(t, sl.Log(hostile()))
	fields = parseJournal(t, receive(t, l))
	m := fieldMap(t, fields)
	require.Equal(t, "3", m["PRIORITY"], "a forged PRIORITY in a value is only text")
	require.Equal(t, hostileJob, m["LVE_JOB_ID"])
	require.Equal(t, hostileImage, m["LVE_IMAGE"])
	require.Equal(t, hostileInstance, m["LVE_INSTANCE"])
	require.Equal(t, hostileVM, m["LVE_VM"])
	require.Equal(t, hostileError(t), m["LVE_ERROR"])
	require.NotContains(t, m["MESSAGE"], "\n")
	for _, f := range fields {
		require.Equal(t, strings.Contains(f.value, "\n"), f.binary, "%s", f.name)
		for _, r := range f.value {
			require.True(t, r == '\n' || r == '\t' || !unicode.IsControl(r), "%s: control character %U", f.name, r)
		}
	}
}

// PRIORITY follows the outcome (6 ok, 4 cancelled, 3 failed); empty fields
// are left out.
func TestStepLogJournaldPriorityAndOmission(t *testing.T) {
	l, path := journalListener(t)
	sl := openJournal(t, path)
	for outcome, prio := range map[string]string{StepOK: "6", StepCancelled: "4", StepFailed: "3"} {
		require.NoError(t, sl.Log(StepRecord{Stage: "step_script", Step: "stage", VM: "lve-1",
			Duration: 2 * time.Second, Outcome: outcome, Class: ResultSuccess}))
		m := fieldMap(t, parseJournal(t, receive(t, l)))
		require.Equal(t, map[string]string{
			"PRIORITY":          prio,
			"SYSLOG_IDENTIFIER": "libvirt-executor",
			"MESSAGE":           "step_script/stage " + outcome + " in 2.000s vm=lve-1",
			"LVE_STAGE":         "step_script",
			"LVE_STEP":          "stage",
			"LVE_VM":            "lve-1",
			"LVE_DURATION_MS":   "2000.000",
			"LVE_OUTCOME":       outcome,
			"LVE_CLASS":         "success",
		}, m)
	}
}

// A datagram too large for the socket (EMSGSIZE) is sent again with the
// error cut to 256 bytes. The test makes the sink's send buffer as small
// as the kernel allows and pads the record so that it fits only cut.
func TestStepLogJournaldTooLarge(t *testing.T) {
	l, path := journalListener(t)
	sl := openJournal(t, path)
	js := sl.(*journalStepLog)
	require.NoError(t, js.conn.SetWriteBuffer(1))
	raw, err := js.conn.SyscallConn()
	require.NoError(t, err)
	var sndbuf int
	var serr error
	require.NoError(t, raw.Control(func(fd uintptr) {
		sndbuf, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF)
	}))
	require.NoError(t, serr)
	limit := sndbuf - 32 // unix_dgram_sendmsg: EMSGSIZE above sk_sndbuf - 32

	rec := stepRecord()
	rec.Error = "first line\n" + strings.Repeat("x", 2000)
	rec.Job, rec.Instance, rec.Image = "", "", ""
	size := func(r StepRecord) int { return len(journalDatagram(r.cleaned())) }
	cutOf := func(r StepRecord) StepRecord {
		c := r.cleaned()
		c.Error = cutUTF8(c.Error, maxJournalRetryError)
		return c
	}
	// Pad the image, the instance, the machine, the job id until the cut
	// record just fits.
pad:
	for _, p := range []*string{&rec.Image, &rec.Instance, &rec.VM, &rec.Job} {
		for len(*p) < maxStepField {
			*p += "p"
			if size(cutOf(rec)) > limit {
				*p = (*p)[:len(*p)-1]
				break pad
			}
		}
	}
	cut := cutOf(rec)
	require.LessOrEqual(t, size(cut), limit, "send buffer %d", sndbuf)
	require.Greater(t, size(rec), limit, "send buffer %d", sndbuf)

	require.NoError(t, sl.Log(rec))
	m := fieldMap(t, parseJournal(t, receive(t, l)))
	require.Equal(t, cut.Error, m["LVE_ERROR"])
	require.Len(t, m["LVE_ERROR"], 256)
	require.Equal(t, rec.Image, m["LVE_IMAGE"], "only the error is cut")
}

// A journal socket that is gone (closed, then removed) makes Log return
// the kernel's refusal, not a deadline; a journal that does not read makes
// it return an error once journalTimeout is out. Neither panics.
func TestStepLogJournaldGone(t *testing.T) {
	l, path := journalListener(t)
	sl := openJournal(t, path)
	require.NoError(t, sl.Log(stepRecord()))
	receive(t, l)

	// Gone: the send is refused by the kernel, not cut by the deadline.
	require.NoError(t, l.Close())
	start := time.Now()
	err := sl.Log(stepRecord())
	require.ErrorIs(t, err, unix.ECONNREFUSED, "closed socket")
	require.NoError(t, os.Remove(path))
	err = sl.Log(stepRecord())
	require.ErrorIs(t, err, unix.ENOENT, "removed socket")
	require.Less(t, time.Since(start), journalTimeout, "not retried until the deadline")

	// A journal that never reads: its queue fills, then each Log gives up
	// after journalTimeout. The bound is the timeout with room for a
	// loaded machine (a CI run under -race took 1.86 s for a 1 s
	// deadline): it catches a send that waits without a deadline, not one
	// that is late by a scheduler's tick.
	_, path2 := journalListener(t)
	sl2 := openJournal(t, path2)
	var failed error
	for i := 0; i < 10000 && failed == nil; i++ {
		start := time.Now()
		failed = sl2.Log(stepRecord())
		require.Less(t, time.Since(start), journalTimeout+5*time.Second, "Log %d", i)
	}
	require.Error(t, failed, "a full journal queue")
	require.True(t, errors.Is(failed, os.ErrDeadlineExceeded) || errors.Is(failed, unix.EAGAIN), "%v", failed)

	require.NoError(t, sl2.Close())
	require.Error(t, sl2.Log(stepRecord()), "after Close")
}

// The kinds: none discards; auto is none without a journal socket and
// journald with one; journald needs its socket; file needs a path and a
// maxBytes not below 0; anything else is an error naming the value and the
// allowed ones.
func TestOpenStepLogKinds(t *testing.T) {
	sl, err := OpenStepLog(StepLogNone, "", 0)
	require.NoError(t, err)
	require.NoError(t, sl.Log(stepRecord()))
	require.NoError(t, sl.Close())

	missing := filepath.Join(t.TempDir(), "no.sock")
	sl, err = OpenStepLog(StepLogAuto, missing, 0)
	require.NoError(t, err)
	require.IsType(t, noneStepLog{}, sl)
	notSocket := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(notSocket, nil, 0o600))
	sl, err = OpenStepLog(StepLogAuto, notSocket, 0)
	require.NoError(t, err)
	require.IsType(t, noneStepLog{}, sl)

	l, path := journalListener(t)
	sl, err = OpenStepLog(StepLogAuto, path, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sl.Close() })
	require.IsType(t, &journalStepLog{}, sl)
	require.NoError(t, sl.Log(stepRecord()))
	receive(t, l)

	_, err = OpenStepLog(StepLogJournald, missing, 0)
	require.ErrorContains(t, err, missing)

	_, err = OpenStepLog(StepLogFile, "", 0)
	require.Error(t, err)
	_, err = OpenStepLog(StepLogFile, filepath.Join(t.TempDir(), "x.log"), -1)
	require.Error(t, err)
	sl, err = OpenStepLog(StepLogFile, filepath.Join(t.TempDir(), "x.log"), 0)
	require.NoError(t, err)
	require.Equal(t, int64(DefaultStepLogMaxBytes), sl.(*fileStepLog).maxBytes)
	require.NoError(t, sl.Close())
	require.Error(t, sl.Log(stepRecord()), "after Close")

	_, err = OpenStepLog("syslog", "", 0)
	require.EqualError(t, err, `step log kind "syslog": want one of none, file, journald, auto`)
}
