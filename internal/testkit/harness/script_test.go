package harness

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var nasty = []string{
	"", "simple", "with space", "it's", `back\slash`, "new\nline", "tab\there", "cr\r",
	"\x1b[31mred\x1b[0m", "ünïcödé ✓", "$HOME `id` $(id) ${x}", `'\''`, "\x01\x7f\xff\xfe",
	`"double"`, "*?[a]", "!bang", "trailing\\", "a=b;c&d|e>f<g", "\\x41",
}

// bashPrintf runs printf %s <word> in bash and returns what bash printed.
func bashPrintf(t *testing.T, word string) string {
	t.Helper()
	out, err := exec.Command("bash", "-c", "printf %s "+word).Output()
	require.NoError(t, err, word)
	return string(out)
}

func TestQuotingRoundTrips(t *testing.T) {
	t.Parallel()
	for _, s := range nasty {
		assert.Equal(t, s, bashPrintf(t, ansiQuote(s)), "ansiQuote(%q) = %s", s, ansiQuote(s))
		if s != "" {
			assert.Equal(t, s, bashPrintf(t, argQuote(s)), "argQuote(%q) = %s", s, argQuote(s))
			assert.Equal(t, s, bashPrintf(t, exportValue(s)), "exportValue(%q)", s)
			assert.Equal(t, s, bashPrintf(t, dquote(s)), "dquote(%q)", s)
		}
		assert.NotContains(t, ansiQuote(s), "\n")
	}
	assert.Equal(t, "1000", exportValue("1000"))
	assert.Equal(t, "127.0.0.1", exportValue("127.0.0.1"))
	assert.Equal(t, `$'main'`, exportValue("main"))
	assert.Equal(t, `$'false'`, exportValue("false"))
}

// TestRenderedScriptRunsThroughEval checks the double quoting of the
// runner's `: | eval $'...'` wrapper end to end with bash.
func TestRenderedScriptRunsThroughEval(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	vars := []kv{{key: "NASTY", value: strings.Join(nasty, "|")}, {key: "NUM", value: "42"}, {key: "HIDDEN", value: "x", envOnly: true}}
	body := userBody(vars, dir, "banner", []string{
		`printf '%s' "$NASTY" > nasty.out`,
		`echo "num=$NUM hidden=${HIDDEN:-unset} pwd=$PWD"`,
		"if true; then\n  echo multi-line\nfi",
		"echo 'single quotes' \"double $NUM\"",
	})
	script := filepath.Join(dir, "script.")
	require.NoError(t, os.WriteFile(script, []byte(renderScript(body)), 0o700))
	out, err := exec.Command("bash", script).CombinedOutput()
	require.NoError(t, err, string(out))
	got, err := os.ReadFile(filepath.Join(dir, "nasty.out"))
	require.NoError(t, err)
	assert.Equal(t, strings.Join(nasty, "|"), string(got))
	assert.Contains(t, string(out), "num=42 hidden=unset pwd="+dir)
	assert.Contains(t, string(out), "multi-line")
	assert.Contains(t, string(out), "$ if true; then # collapsed multi-line command")
	assert.Contains(t, string(out), "single quotes double 42")
	assert.Contains(t, string(out), "banner")
}

func TestRenderedScriptFailsFast(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	script := filepath.Join(dir, "script.")
	body := userBody(nil, dir, "", []string{"echo one", "exit 3", "echo never"})
	require.NoError(t, os.WriteFile(script, []byte(renderScript(body)), 0o700))
	out, err := exec.Command("bash", script).CombinedOutput()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, 3, ee.ExitCode())
	assert.Contains(t, string(out), "one")
	assert.NotContains(t, string(out), "never")

	// A failing command in the middle stops the script too (errexit, pipefail).
	body = userBody(nil, dir, "", []string{"false | cat", "echo never"})
	require.NoError(t, os.WriteFile(script, []byte(renderScript(body)), 0o700))
	out, err = exec.Command("bash", script).CombinedOutput()
	require.Error(t, err)
	assert.NotContains(t, string(out), "never")
}

func TestScriptShapeMatchesTrace(t *testing.T) {
	t.Parallel()
	// A script recorded from GitLab Runner 16.11.4 (see testdata/README.md).
	trace, err := os.ReadFile("testdata/gitlab-runner-16.11-trace/004-run-build_script.script")
	require.NoError(t, err)
	ours := renderScript(userBody(nil, "/builds/project-1", "", []string{"exit 3"}))
	// Same header and footer lines as the recorded runner script.
	tl := strings.Split(string(trace), "\n")
	ol := strings.Split(ours, "\n")
	require.GreaterOrEqual(t, len(tl), 7)
	assert.Equal(t, tl[:6], ol[:6])
	assert.True(t, strings.HasPrefix(ol[6], ": | eval $'"))
	assert.Equal(t, tl[len(tl)-2:], ol[len(ol)-2:])
}
