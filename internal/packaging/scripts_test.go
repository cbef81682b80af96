package packaging

import (
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// rpmScriptlets reads the scriptlets of an .rpm with rpm's own query
// (--scripts), by name (postinstall, preuninstall, ...).
func rpmScriptlets(t *testing.T, rpm string) map[string]string {
	t.Helper()
	out := output(t, "rpm", "-qp", "--nosignature", "--scripts", rpm)
	head := regexp.MustCompile(`(?m)^([a-z]+) scriptlet \(using /bin/sh\):\n`)
	idx := head.FindAllStringSubmatchIndex(out, -1)
	require.NotEmpty(t, idx, "rpm --scripts: no scriptlet in\n%s", out)
	s := map[string]string{}
	for i, m := range idx {
		end := len(out)
		if i+1 < len(idx) {
			end = idx[i+1][0]
		}
		s[out[m[2]:m[3]]] = out[m[1]:end]
	}
	return s
}

// The scriptlets as the .rpm carries them pass shellcheck (make lint checks
// their sources in deploy/package/rpm; this checks what rpm would run).
func TestRPMScriptletsShellcheck(t *testing.T) {
	needTool(t, "rpm")
	needTool(t, "shellcheck")
	b := testBuild(t)
	paths, err := b.Write(t.TempDir(), "rpm")
	require.NoError(t, err)
	scripts := rpmScriptlets(t, paths[0])
	require.ElementsMatch(t, []string{"postinstall", "preuninstall", "postuninstall"}, slices.Collect(maps.Keys(scripts)))
	dir := t.TempDir()
	for name, text := range scripts {
		require.True(t, strings.HasPrefix(text, "#!/bin/sh\n"), "%s: a POSIX sh script", name)
		f := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(f, []byte(text), 0o600))
		out, err := exec.Command("shellcheck", "-s", "sh", f).CombinedOutput()
		require.NoError(t, err, "shellcheck of the .rpm's %s scriptlet:\n%s", name, out)
	}
	// shellcheck finds what it should: the check can fail.
	bad := filepath.Join(dir, "bad")
	require.NoError(t, os.WriteFile(bad, []byte("#!/bin/sh\nrm -rf $1/x\n"), 0o600))
	require.Error(t, exec.Command("shellcheck", "-s", "sh", bad).Run())
}

// stubs are the commands the maintainer scripts run that change the system
// (users, groups, ownership, systemd) or ask it about them: each logs its
// argv and answers as a host with the runner's user and libvirt's group.
var stubs = map[string]string{
	"getent":             `exit 0`,
	"id":                 `case "$1" in -gn) echo gitlab-runner ;; -nG) echo gitlab-runner ;; esac`,
	"stat":               `case "$2" in *%a*) echo root:root:640 ;; *) echo root:root ;; esac`,
	"dpkg-statoverride":  `exit 1`,
	"usermod":            ``,
	"adduser":            ``,
	"install":            ``,
	"chown":              ``,
	"chgrp":              ``,
	"chmod":              ``,
	"systemctl":          ``,
	"deb-systemd-invoke": ``,
	"deb-systemd-helper": ``,
}

// runScript runs a maintainer script with args on a made-up host: its paths
// moved under root (the state directory, the cache, the configuration,
// /run/systemd/system: systemd runs), the commands of stubs logged, and returns
// what it did, in the words of intent (see intents).
func runScript(t *testing.T, root, text string, args ...string) []string {
	t.Helper()
	bin := filepath.Join(root, "stub-bin")
	logf := filepath.Join(root, "log")
	if _, err := os.Stat(bin); err != nil {
		require.NoError(t, os.MkdirAll(bin, 0o755))
		for name, body := range stubs {
			sh := "#!/bin/sh\nprintf '%s' \"$(basename \"$0\")\" >>\"$STUB_LOG\"\nfor a; do printf ' %s' \"$a\" >>\"$STUB_LOG\"; done\necho >>\"$STUB_LOG\"\n" + body + "\n"
			require.NoError(t, os.WriteFile(filepath.Join(bin, name), []byte(sh), 0o755)) //nolint:gosec // a test's stub
		}
		require.NoError(t, os.MkdirAll(filepath.Join(root, "run/systemd/system"), 0o755))
		require.NoError(t, os.MkdirAll(filepath.Join(root, "etc/libvirt-executor"), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, "etc/libvirt-executor/config.toml"), nil, 0o640)) //nolint:gosec // a test's file
	}
	moved := strings.NewReplacer("/var/lib/libvirt-executor", root+"/var/lib/libvirt-executor",
		"/var/cache/libvirt-executor", root+"/var/cache/libvirt-executor",
		"/etc/libvirt-executor", root+"/etc/libvirt-executor",
		"/run/systemd/system", root+"/run/systemd/system").Replace(text)
	script := filepath.Join(root, "script")
	require.NoError(t, os.WriteFile(script, []byte(moved), 0o700)) //nolint:gosec // a test's script
	require.NoError(t, os.WriteFile(logf, nil, 0o600))
	cmd := exec.Command("/bin/sh", append([]string{script}, args...)...)
	cmd.Env = []string{"PATH=" + bin + ":/usr/bin:/bin", "STUB_LOG=" + logf}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%v:\n%s", args, out)
	raw, err := os.ReadFile(logf)
	require.NoError(t, err)
	return intents(strings.ReplaceAll(string(raw), root, ""))
}

// intents turns the stubs' log into what was meant, the same words for
// either format's tools: "group gitlab-runner libvirt", "mkdir PATH MODE
// OWNER", "chgrp ...", "daemon-reload", "try-restart UNIT", "stop UNIT",
// "disable UNIT"; questions (getent, id, stat, dpkg-statoverride) and
// Debian's bookkeeping of enablement (deb-systemd-helper update-state) are
// left out. Sorted.
func intents(log string) []string {
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(log), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "getent", "id", "stat", "dpkg-statoverride", "deb-systemd-helper":
		case "adduser": // adduser --quiet USER GROUP
			out = append(out, "group "+f[len(f)-2]+" "+f[len(f)-1])
		case "usermod": // usermod -a -G GROUP USER
			out = append(out, "group "+f[len(f)-1]+" "+f[3])
		case "install": // install -d -m MODE -o USER -g GROUP PATH
			out = append(out, "mkdir "+f[len(f)-1]+" "+strings.Join(f[1:len(f)-1], " "))
		case "systemctl", "deb-systemd-invoke":
			var verb string
			var units []string
			for _, a := range f[1:] {
				switch {
				case a == "--now":
					verb = "disable-now"
				case strings.HasPrefix(a, "-"):
				case verb == "":
					verb = a
				default:
					units = append(units, a)
				}
			}
			if verb == "daemon-reload" {
				out = append(out, "daemon-reload")
				continue
			}
			for _, u := range units {
				if verb == "disable-now" {
					out = append(out, "disable "+u, "stop "+u)
				} else {
					out = append(out, verb+" "+u)
				}
			}
		default:
			out = append(out, l)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// The .rpm's scriptlets do what the .deb's maintainer scripts do, run on
// the same made-up host: an install adds the runner's user to libvirt's
// group, makes the state directory, image store and host cache, gives the
// configuration the user's group and starts nothing; an upgrade stops
// nothing and restarts a running pool service; a removal stops the service
// and the sweep. What differs is said: Debian records the units'
// enablement at install and undoes it at purge, rpm (no purge) disables
// them at removal.
func TestRPMScriptletsDoWhatTheDebDoes(t *testing.T) {
	needTool(t, "rpm")
	needTool(t, "dpkg-deb")
	b := testBuild(t)
	paths, err := b.Write(t.TempDir(), "deb", "rpm")
	require.NoError(t, err)
	deb := func(name string) string { return output(t, "dpkg-deb", "-I", paths[0], name) }
	rpm := rpmScriptlets(t, paths[1])

	// run runs scripts (text, args...) one after the other on a fresh host.
	type step struct {
		text string
		args []string
	}
	run := func(steps ...step) []string {
		root := t.TempDir()
		var all []string
		for _, s := range steps {
			all = append(all, runScript(t, root, s.text, s.args...)...)
		}
		slices.Sort(all)
		return slices.Compact(all)
	}

	install := []string{
		"chgrp gitlab-runner /etc/libvirt-executor/config.toml",
		"daemon-reload",
		"group gitlab-runner libvirt",
		"mkdir /var/cache/libvirt-executor -d -m 0755",
		"mkdir /var/cache/libvirt-executor/jobs -d -m 0700 -o gitlab-runner -g gitlab-runner",
		"mkdir /var/cache/libvirt-executor/oci -d -m 0755 -o gitlab-runner -g gitlab-runner",
		"mkdir /var/lib/libvirt-executor -d -m 0700 -o gitlab-runner -g gitlab-runner",
	}
	require.Equal(t, install, run(step{deb("postinst"), []string{"configure", ""}}), "deb: install")
	require.Equal(t, install, run(step{rpm["postinstall"], []string{"1"}}), "rpm: install")

	// An upgrade: the old version's prerm/preun, the new one's postinst/post,
	// and rpm's old %postun after it. Nothing stops; the service restarts if
	// it runs.
	upgrade := append(slices.Clone(install), "try-restart libvirt-executor.service")
	slices.Sort(upgrade)
	require.Equal(t, upgrade, run(step{deb("prerm"), []string{"upgrade", "1.2.4"}}, step{deb("postinst"), []string{"configure", "1.2.2"}}), "deb: upgrade")
	require.Equal(t, upgrade, run(step{rpm["preuninstall"], []string{"1"}}, step{rpm["postinstall"], []string{"2"}}, step{rpm["postuninstall"], []string{"1"}}), "rpm: upgrade")

	// A removal stops the service, the sweep's timer and a sweep in progress.
	stops := []string{"daemon-reload", "stop libvirt-executor-gc.service", "stop libvirt-executor-gc.timer", "stop libvirt-executor.service"}
	require.Equal(t, stops, run(step{deb("prerm"), []string{"remove"}}, step{deb("postrm"), []string{"remove"}}), "deb: remove")
	require.Equal(t, append([]string{"daemon-reload", "disable libvirt-executor-gc.timer", "disable libvirt-executor.service"}, stops[1:]...),
		run(step{rpm["preuninstall"], []string{"0"}}, step{rpm["postuninstall"], []string{"0"}}), "rpm: remove (and disable: rpm has no purge)")
}
