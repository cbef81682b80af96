package harness

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeDriver is a bash stand-in for the driver: four scripts that record
// every invocation (argv, pid/pgid, cwd, the environment, the stage script)
// into rec/ and behave like a driver that runs stage scripts locally.
type fakeDriver struct {
	dir, rec, builds string
	exec             Executables
}

// newFake writes the fake driver. snippets are bash inserted after the
// recording and before the default behaviour, keyed "config", "prepare",
// "cleanup" or "run:<stage>"; a snippet that exits replaces the default.
func newFake(t *testing.T, snippets map[string]string) *fakeDriver {
	t.Helper()
	dir := t.TempDir()
	f := &fakeDriver{dir: dir, rec: filepath.Join(dir, "rec"), builds: filepath.Join(dir, "builds")}
	require.NoError(t, os.MkdirAll(f.rec, 0o755))

	record := fmt.Sprintf(`rec=%q
role=$(basename "$0" .sh)
stage=$role
[ "$role" = run ] && stage="run-$2"
n=$(ls "$rec" | grep -c '\.env$')
seq=$(printf %%03d "$n")
pgid=$(cut -d' ' -f5 /proc/$$/stat)
{ printf '%%s pid=%%s pgid=%%s cwd=%%s' "$stage" "$$" "$pgid" "$PWD"; for a in "$0" "$@"; do printf ' [%%s]' "$a"; done; echo; } >> "$rec/sequence.log"
env > "$rec/$seq-$stage.env"
[ -f "$rec/response.json" ] || cp "$JOB_RESPONSE_FILE" "$rec/response.json" 2>/dev/null
`, f.rec)

	defaults := map[string]string{
		"config": fmt.Sprintf(`echo "config: stderr goes to the job log" >&2
cat <<'EOF'
{"builds_dir": %q, "hostname": "fake-host", "driver": {"name": "fake", "version": "0.1"},
 "job_env": {"FAKE_FROM_CONFIG": "hello-from-config"}, "unknown_key": 1}
EOF
`, f.builds),
		"prepare": "echo 'prepare: stdout'; echo 'prepare: stderr' >&2\n",
		"run": `script=$1; stage=$2
cp "$script" "$rec/$seq-$stage.script"
bash "$script"; rc=$?
if [ "$rc" -ne 0 ]; then
  [ -n "${BUILD_EXIT_CODE_FILE:-}" ] && echo "$rc" > "$BUILD_EXIT_CODE_FILE"
  exit "$BUILD_FAILURE_EXIT_CODE"
fi
exit 0
`,
		"cleanup": `echo "cleanup: status=$CUSTOM_ENV_CI_JOB_STATUS"` + "\n",
	}

	paths := map[string]string{}
	for _, role := range []string{"config", "prepare", "run", "cleanup"} {
		var b strings.Builder
		b.WriteString("#!/usr/bin/env bash\n")
		b.WriteString(record)
		if role == "run" {
			b.WriteString("case \"$2\" in\n")
			for k, s := range snippets {
				if name, ok := strings.CutPrefix(k, "run:"); ok {
					fmt.Fprintf(&b, "%s)\n%s\n;;\n", name, s)
				}
			}
			b.WriteString("esac\n")
		} else if s, ok := snippets[role]; ok {
			b.WriteString(s + "\n")
		}
		b.WriteString(defaults[role])
		p := filepath.Join(dir, role+".sh")
		require.NoError(t, os.WriteFile(p, []byte(b.String()), 0o755))
		paths[role] = p
	}
	f.exec = Executables{Config: paths["config"], Prepare: paths["prepare"], Run: paths["run"], Cleanup: paths["cleanup"]}
	return f
}

// opts are fast test options for f.
func (f *fakeDriver) opts(t *testing.T) Options {
	return Options{
		Exec:         f.exec,
		Env:          os.Environ(),
		WorkDir:      t.TempDir(),
		RetryPause:   200 * time.Millisecond,
		GracefulKill: 5 * time.Second,
		ForceKill:    2 * time.Second,
		Log:          testWriter{t},
	}
}

// sequence returns the recorded invocations, one line each.
func (f *fakeDriver) sequence(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(f.rec, "sequence.log"))
	require.NoError(t, err)
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

// stages returns the recorded stage names in order ("config", "run-get_sources", ...).
func (f *fakeDriver) stages(t *testing.T) []string {
	var out []string
	for _, l := range f.sequence(t) {
		out = append(out, strings.Fields(l)[0])
	}
	return out
}

// env returns the environment recorded for the idx-th invocation of stage.
func (f *fakeDriver) env(t *testing.T, stage string, idx int) map[string]string {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join(f.rec, "*-"+stage+".env"))
	require.NoError(t, err)
	require.Greater(t, len(matches), idx, "no env recorded for %s #%d", stage, idx)
	data, err := os.ReadFile(matches[idx])
	require.NoError(t, err)
	env := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			env[k] = v
		}
	}
	return env
}

func (f *fakeDriver) file(t *testing.T, name string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(f.rec, name))
	require.NoError(t, err)
	return string(data)
}

func (f *fakeDriver) exists(name string) bool {
	_, err := os.Stat(filepath.Join(f.rec, name))
	return err == nil
}

// testWriter sends the job log to t.Log, for -v runs.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func run(t *testing.T, opts Options, job Job) *Result {
	t.Helper()
	res, err := RunJob(context.Background(), opts, job)
	require.NoError(t, err)
	return res
}
