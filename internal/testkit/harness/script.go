package harness

import (
	"fmt"
	"path"
	"regexp"
	"strings"
)

// ansiQuote quotes s as a bash ANSI-C string ($'...'): backslash and single
// quote are escaped, control characters and bytes >= 0x7f become escapes, so
// the result is one line of printable ASCII whatever s holds.
func ansiQuote(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 3)
	b.WriteString("$'")
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '\\' || c == '\'':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c == '\n':
			b.WriteString(`\n`)
		case c == '\t':
			b.WriteString(`\t`)
		case c == '\r':
			b.WriteString(`\r`)
		case c < 0x20 || c >= 0x7f:
			fmt.Fprintf(&b, `\x%02x`, c)
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('\'')
	return b.String()
}

var (
	safeArg    = regexp.MustCompile(`^[A-Za-z0-9_./:@%+,=-]+$`)
	plainValue = regexp.MustCompile(`^[0-9.]+$`)
)

// argQuote leaves words made only of safe characters as they are and quotes
// anything else with ansiQuote.
func argQuote(s string) string {
	if safeArg.MatchString(s) {
		return s
	}
	return ansiQuote(s)
}

// exportValue quotes a value the way runner 16.11's exports look: numbers and
// dotted numbers bare, everything else $'...'.
func exportValue(s string) string {
	if plainValue.MatchString(s) {
		return s
	}
	return ansiQuote(s)
}

// dquote quotes s for use inside double quotes.
func dquote(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, `$`, `\$`, "`", "\\`")
	return `"` + r.Replace(s) + `"`
}

const (
	ansiGreen = "\x1b[32;1m"
	ansiCyan  = "\x1b[36;1m"
	ansiRed   = "\x1b[31;1m"
	ansiWarn  = "\x1b[0;33m"
	ansiReset = "\x1b[0;m"
)

// renderScript wraps a stage body like the runner's bash shell writer: the
// file passed to run_exec as .../script.
func renderScript(body string) string {
	return "#!/usr/bin/env bash\n\n" +
		"trap exit 1 TERM\n\n" +
		"if set -o | grep pipefail > /dev/null; then set -o pipefail; fi; set -o errexit\n" +
		"set +o noclobber\n" +
		": | eval " + ansiQuote(body) + "\n" +
		"exit 0\n"
}

// scriptWriter builds a stage body.
type scriptWriter struct{ b strings.Builder }

func (w *scriptWriter) line(format string, args ...any) {
	fmt.Fprintf(&w.b, format, args...)
	w.b.WriteByte('\n')
}

func (w *scriptWriter) notice(msg string) {
	w.line("echo %s", ansiQuote(ansiGreen+msg+ansiReset))
}

// prelude exports the variables and sets up GITLAB_ENV as the runner does at
// the start of every stage but prepare_script.
func (w *scriptWriter) prelude(vars []kv, projectDir string) {
	tmp := projectDir + ".tmp"
	envFile := tmp + "/gitlab_runner_env"
	for _, v := range vars {
		if !v.envOnly {
			w.line("export %s=%s", v.key, exportValue(v.value))
		}
	}
	w.line("export GITLAB_ENV=%s", exportValue(envFile))
	w.line("mkdir -p %s", argQuote(tmp))
	w.line("touch %s", argQuote(envFile))
	w.line("set -o allexport")
	w.line("source %s", argQuote(envFile))
	w.line("set +o allexport")
}

// commands echoes each command in green, then runs it.
func (w *scriptWriter) commands(cmds []string) {
	for _, c := range cmds {
		shown := c
		if i := strings.IndexByte(c, '\n'); i >= 0 {
			shown = c[:i] + " # collapsed multi-line command"
		}
		w.notice("$ " + shown)
		w.line("%s", c)
	}
}

func prepareScriptBody(hostname string) string {
	var w scriptWriter
	w.line(`echo "Running on $(hostname) via "%s`, dquote(hostname+"..."))
	return w.b.String()
}

// getSourcesBody is a fetch-based get_sources like runner 16.11's: init the
// project dir with a template, add or update origin, fetch the refspecs,
// check out the commit detached, clean.
func getSourcesBody(j *Job, vars []kv, projectDir string) string {
	var w scriptWriter
	w.prelude(vars, projectDir)
	if j.RepoURL == "" {
		w.notice("Skipping Git repository setup")
		w.line("mkdir -p %s", argQuote(projectDir))
		return w.b.String()
	}
	tmpl := projectDir + ".tmp/git-template"
	url := j.repoURL()
	q := argQuote
	w.line("export GIT_LFS_SKIP_SMUDGE=1")
	if j.GitDepth > 0 {
		w.notice(fmt.Sprintf("Fetching changes with git depth set to %d...", j.GitDepth))
	} else {
		w.notice("Fetching changes...")
	}
	w.line("mkdir -p %s", q(tmpl))
	w.line("git config -f %s init.defaultBranch none", q(tmpl+"/config"))
	w.line("git config -f %s fetch.recurseSubmodules false", q(tmpl+"/config"))
	for _, lock := range []string{"index.lock", "shallow.lock", "HEAD.lock", "hooks/post-checkout", "config.lock"} {
		w.line("rm -f %s", q(path.Join(projectDir, ".git", lock)))
	}
	w.line("git init %s --template %s", q(projectDir), q(tmpl))
	w.line("cd %s", q(projectDir))
	w.line("if git remote add origin %s >/dev/null 2>&1; then", q(url))
	w.notice("Created fresh repository.")
	w.line("else")
	w.line("  git remote set-url origin %s", q(url))
	w.line("fi")
	fetch := fmt.Sprintf("git -c %s fetch origin --no-recurse-submodules", q("http.userAgent=gitlab-runner "+RunnerVersion+" "+runnerArch+" (lve-harness)"))
	for _, r := range gitRefspecs {
		fetch += " " + q(r)
	}
	fetch += " --prune --quiet"
	if j.GitDepth > 0 {
		w.line("%s --depth %d", fetch, j.GitDepth)
	} else {
		w.line(`if [ -e ".git/shallow" ]; then`)
		w.line("  %s --unshallow", fetch)
		w.line("else")
		w.line("  %s", fetch)
		w.line("fi")
	}
	target := j.SHA
	shown := target
	if target == "" {
		target = "refs/remotes/origin/" + j.Ref
		shown = "origin/" + j.Ref
	} else if len(shown) > 8 {
		shown = shown[:8]
	}
	w.notice(fmt.Sprintf("Checking out %s as detached HEAD (ref is %s)...", shown, j.Ref))
	w.line("git -c submodule.recurse=false checkout -f -q %s", q(target))
	w.line("git clean -ffdx")
	w.line("if git lfs version >/dev/null 2>&1; then")
	w.line("  git lfs pull")
	w.line("  echo")
	w.line("fi")
	w.notice("Skipping Git submodules setup")
	return w.b.String()
}

// userBody is build_script, after_script or an extra stage: prelude, cd into
// the project, then the commands.
func userBody(vars []kv, projectDir, banner string, cmds []string) string {
	var w scriptWriter
	w.prelude(vars, projectDir)
	w.line("cd %s", argQuote(projectDir))
	if banner != "" {
		w.notice(banner)
	}
	w.commands(cmds)
	return w.b.String()
}
