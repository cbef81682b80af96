package stagecli

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/gitlab"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// fakeAdminTool is a stand-in for the admin tool: it records its argv (one
// NUL-terminated argument each) and environment in its directory, then
// does what FAKE_MODE says: answer with two lines, fail, or hang (in a
// child of its own, as a tool that started something would).
const fakeAdminTool = `#!/bin/sh
dir=$(dirname "$0")
printf '%s\0' "$@" > "$dir/argv"
env > "$dir/env"
cat > "$dir/stdin"
case "$FAKE_MODE" in
hang) sleep 30; echo late ;;
fail) echo "libvirt said no" >&2; exit 3 ;;
attach) echo '{"attached":{"files":3,"bytes":1234}}' ;;
done) echo '{}' ;;
keep) echo '{"kept":{"result":{"Files":2,"Bytes":10,"Unchanged":1},"error":"too big","over_limit":true,"drop_error":"volume busy"}}' ;;
kept) echo '{"kept":{"result":{"Files":1,"Bytes":3},"dropped":true,"from_file":true},"newer":"left aside"}' ;;
kept-old) echo '{"kept":{"result":{"Files":1,"Bytes":3}}}' ;;
garbage) echo "3 1234" ;;
two) echo '{"attached":{"files":1,"bytes":1}}{"attached":{"files":2,"bytes":2}}' ;;
negative) echo '{"attached":{"files":-1,"bytes":5}}' ;;
wrong) echo '{"kept":{"result":{}}}' ;;
huge) printf '{"attached":{"files":1,"bytes":1},"pad":"'; head -c 70000 /dev/zero | tr '\0' x; echo '"}' ;;
*) echo "VM $4 is shut off (destroyed)"; echo "a second line is not read" ;;
esac
`

// installFake writes the fake admin tool into a new directory and returns
// the directory.
func installFake(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, jobvm.AdminExecutable), []byte(fakeAdminTool), 0o700)) //nolint:gosec // G306: an executable test script in a private directory
	return dir
}

func testExplainer(t *testing.T, exeDir, configPath string, environ ...string) (*adminTool, *bytes.Buffer) {
	t.Helper()
	var log bytes.Buffer
	return &adminTool{
		exeDir:     exeDir,
		lookPath:   func(string) (string, error) { return "", exec.ErrNotFound },
		configPath: configPath,
		environ:    append([]string{"PATH=" + os.Getenv("PATH")}, environ...),
		timeout:    explainWait,
		log:        slog.New(slog.NewTextHandler(&log, nil)),
	}, &log
}

// The admin tool runs from its argv, never through a shell: a configuration
// path full of shell syntax arrives as one argument and runs nothing. Its
// first line is the explanation; the job's variables are not passed on.
func TestExplainRunsTheAdminToolFromItsArgv(t *testing.T) {
	dir := installFake(t)
	cfgPath := filepath.Join(t.TempDir(), `my conf; touch PWNED $(touch PWNED2) 'x" | true.toml`)
	environ := withoutJobVariables([]string{"FAKE_MODE=answer", "LIBVIRT_EXECUTOR_CONFIG=/elsewhere.toml", "CUSTOM_ENV_CI_JOB_TOKEN=secret"})
	a, _ := testExplainer(t, dir, cfgPath, environ...)
	name := "lve-0123abcd-89abcdef-42"

	require.Equal(t, "VM "+name+" is shut off (destroyed)", a.Explain(context.Background(), name))

	argv, err := os.ReadFile(filepath.Join(dir, "argv"))
	require.NoError(t, err)
	require.Equal(t, []string{"--config=" + cfgPath, jobvm.ExplainCommand, "--", name},
		strings.Split(strings.TrimSuffix(string(argv), "\x00"), "\x00"))
	for _, d := range []string{dir, filepath.Dir(cfgPath), "."} {
		for _, f := range []string{"PWNED", "PWNED2"} {
			require.NoFileExists(t, filepath.Join(d, f), "no shell ran the configuration path")
		}
	}
	env, err := os.ReadFile(filepath.Join(dir, "env"))
	require.NoError(t, err)
	require.Contains(t, string(env), "FAKE_MODE=answer")
	require.NotContains(t, string(env), "CUSTOM_ENV_", "the job's variables stay with the stage")
	require.NotContains(t, string(env), "secret")
}

// A tool that does not answer is given up on after the timeout, with what it
// started; a tool that fails gives no explanation. Both are logged.
func TestExplainIsBoundedAndSilentOnFailure(t *testing.T) {
	dir := installFake(t)
	a, log := testExplainer(t, dir, "/etc/lve.toml", "FAKE_MODE=hang")
	a.timeout = 300 * time.Millisecond
	start := time.Now()
	require.Empty(t, a.Explain(context.Background(), "lve-0123abcd-89abcdef-42"))
	require.Less(t, time.Since(start), 4*time.Second, "bounded by the timeout (and WaitDelay), not explainWait (6 s) or the tool's 30 s")
	require.Contains(t, log.String(), "the admin tool failed")
	require.Contains(t, log.String(), "deadline exceeded")

	a, log = testExplainer(t, dir, "/etc/lve.toml", "FAKE_MODE=fail")
	require.Empty(t, a.Explain(context.Background(), "lve-0123abcd-89abcdef-42"))
	require.Contains(t, log.String(), "libvirt said no", "the tool's stderr is logged")

	// The stage's own cancel ends it too.
	a, _ = testExplainer(t, dir, "/etc/lve.toml", "FAKE_MODE=hang")
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start = time.Now()
	require.Empty(t, a.Explain(ctx, "lve-0123abcd-89abcdef-42"))
	require.Less(t, time.Since(start), 4*time.Second, "bounded by the stage's ctx, not explainWait (6 s)")
}

// The tool is looked for next to the running executable, then on PATH; when
// it is in neither, the explanation is a note that says so.
func TestExplainFindsTheAdminTool(t *testing.T) {
	dir := installFake(t)
	empty := t.TempDir()
	a, _ := testExplainer(t, empty, "/etc/lve.toml")
	why := a.Explain(context.Background(), "lve-0123abcd-89abcdef-42")
	require.Equal(t, "what became of VM lve-0123abcd-89abcdef-42 is not known: the admin tool libvirt-executor, which asks libvirt, was not found in "+empty+" or on PATH", why)

	// Not executable: not the tool.
	require.NoError(t, os.WriteFile(filepath.Join(empty, jobvm.AdminExecutable), []byte(fakeAdminTool), 0o600))
	require.Contains(t, a.Explain(context.Background(), "lve-0123abcd-89abcdef-42"), "was not found")

	// On PATH.
	a.lookPath = func(file string) (string, error) {
		require.Equal(t, jobvm.AdminExecutable, file)
		return filepath.Join(dir, file), nil
	}
	require.Equal(t, "VM lve-0123abcd-89abcdef-42 is shut off (destroyed)", a.Explain(context.Background(), "lve-0123abcd-89abcdef-42"))

	// A name not of the engine's shape is not passed on.
	require.NoError(t, os.Remove(filepath.Join(dir, "argv")))
	require.Empty(t, a.Explain(context.Background(), "--config=/etc/shadow"))
	require.NoFileExists(t, filepath.Join(dir, "argv"), "the tool did not run")
}

// Only a stage marked ExplainViaAdminTool (run) explains through the admin
// tool; the others leave gitlab.Env.Explain nil (lifecycle.Manager.Explain).
func TestExplainViaAdminToolOption(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "c.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte("state_dir = \""+dir+"\"\n[images.a]\nbase = \"/a.qcow2\"\n"), 0o600))
	for _, via := range []bool{false, true} {
		var got gitlab.Env
		code := Run(Process{Args: []string{"x", "--config", cfgPath}, Getenv: func(string) string { return "" }, Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{}},
			Exe{Name: "x", ExplainViaAdminTool: via,
				Stage: func(_ context.Context, e gitlab.Env, _ *config.Config, _ []string) error { got = e; return nil }})
		require.Zero(t, code)
		require.Equal(t, via, got.Explain != nil)
	}
}

// refreshImage starts the admin tool's image pull detached, from its argv,
// with the host's proxy settings and none of the job's variables.
func TestRefreshImageStartsTheAdminToolDetached(t *testing.T) {
	dir := installFake(t)
	cfgPath := filepath.Join(t.TempDir(), "config; rm -rf $HOME.toml")
	a, _ := testExplainer(t, dir, cfgPath, "HTTPS_PROXY=http://proxy.example:3128", "CUSTOM_ENV_CI_JOB_TOKEN=secret", "LANG=C")
	stateDir := t.TempDir()
	require.NoError(t, a.refreshImage(stateDir)("tiny"))
	// Detached: it is not waited for; its argv file appears once it ran.
	var argv []byte
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(filepath.Join(dir, "argv"))
		argv = b
		return err == nil && bytes.Count(b, []byte{0}) == 6
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"--config", cfgPath, "image", "pull", "--", "tiny"}, strings.Split(strings.TrimSuffix(string(argv), "\x00"), "\x00"))
	var env []byte
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(filepath.Join(dir, "env"))
		env = b
		return err == nil && bytes.Contains(b, []byte("HTTPS_PROXY"))
	}, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, string(env), "HTTPS_PROXY=http://proxy.example:3128")
	require.NotContains(t, string(env), "secret")
	require.NotContains(t, string(env), "LANG=C", "PATH and the proxy settings only")
	require.FileExists(t, filepath.Join(stateDir, "log", "image-pull.log"))
}
