package packaging

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/goreleaser/nfpm/v2/files"
	"github.com/stretchr/testify/require"
)

// needTool skips without the tool, or fails where make deps installed it: make
// test sets LVE_REQUIRE_PACKAGE_TOOLS=1 (and LVE_REQUIRE_PROMETHEUS=1, which
// counts too).
func needTool(t *testing.T, tool string) {
	t.Helper()
	if _, err := exec.LookPath(tool); err != nil {
		if os.Getenv("LVE_REQUIRE_PACKAGE_TOOLS") == "1" || os.Getenv("LVE_REQUIRE_PROMETHEUS") == "1" {
			t.Fatalf("%s is missing (make deps installs it): %v", tool, err)
		}
		t.Skipf("%s is missing (make deps installs it)", tool)
	}
}

func testBuild(t *testing.T) Build {
	t.Helper()
	top, err := filepath.Abs("../..")
	require.NoError(t, err)
	bins := t.TempDir()
	for _, e := range append(append([]string{}, Executables...), "lve-agent") {
		require.NoError(t, os.WriteFile(filepath.Join(bins, e), []byte("#!/bin/sh\necho "+e+"\n"), 0o755))
	}
	return Build{Top: top, Binaries: bins, Version: "1.2.3+4.gabc1234", Commit: "abc1234",
		Date: time.Date(2026, 11, 27, 21, 0, 0, 0, time.UTC), Fast: true, Strip: "none"}
}

// entry is what the description says of one path, in a format.
type entry struct {
	mode   string // ls -l's, as dpkg-deb -c and rpm's FILEMODES:perms print it
	config bool
}

func perms(dir bool, m os.FileMode) string {
	s := (m & 0o777).String()
	if dir {
		return "d" + s[1:]
	}
	return s
}

// described lists the description's files, directories and conffiles in format.
func described(t *testing.T, b Build, format string) map[string]entry {
	t.Helper()
	d, err := b.describe(t.TempDir())
	require.NoError(t, err)
	info, err := d.info(format)
	require.NoError(t, err)
	want := map[string]entry{}
	for _, c := range info.Contents {
		want[c.Destination] = entry{mode: perms(c.Type == files.TypeDir, c.FileInfo.Mode),
			config: c.Type == files.TypeConfig || c.Type == files.TypeConfigNoReplace}
	}
	return want
}

func output(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).Output()
	var stderr []byte
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = ee.Stderr
	}
	require.NoError(t, err, "%s %s: %s", name, strings.Join(args, " "), stderr)
	return string(out)
}

func configs(want map[string]entry) []string {
	var c []string
	for p, e := range want {
		if e.config {
			c = append(c, p)
		}
	}
	sort.Strings(c)
	return c
}

// The configuration files are the same in both formats, and the guard hook is
// none of them (it is code; its configuration is what admins edit).
func TestDescriptionConffiles(t *testing.T) {
	b := testBuild(t)
	for _, f := range Formats {
		want := described(t, b, f)
		require.Equal(t, []string{Config, GuardConf}, configs(want), f)
		require.Contains(t, want, GuardHook, f)
		require.Equal(t, "-rwxr-xr-x", want[GuardHook].mode, f)
		require.Contains(t, want, ConntrackHook, f)
		require.Equal(t, "-rwxr-xr-x", want[ConntrackHook].mode, f)
		require.Contains(t, want, GitHubHook, f)
		require.Equal(t, "-rwxr-xr-x", want[GitHubHook].mode, f)
		script, err := os.ReadFile(filepath.Join(b.Top, "deploy/github-hooks/container-hook.sh"))
		require.NoError(t, err)
		require.Contains(t, string(script), "exec /usr/bin/libvirt-executor-hooks \"$@\"")
		require.Contains(t, want, "/usr/bin/libvirt-executor-hooks", "%s: the hook script's executable is packaged", f)
		require.Equal(t, "-rw-r-----", want[Config].mode, "%s: the configuration is the runner's group's only (postinst)", f)
	}
}

func TestDeb(t *testing.T) {
	needTool(t, "dpkg-deb")
	b := testBuild(t)
	out := t.TempDir()
	paths, err := b.Write(out, "deb")
	require.NoError(t, err)
	deb := paths[0]
	require.Equal(t, filepath.Join(out, "libvirt-executor_1.2.3+4.gabc1234_amd64.deb"), deb)
	want := described(t, b, "deb")

	// Files and directories, with modes, owners and the build date as time.
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(output(t, "dpkg-deb", "-c", deb)), "\n") {
		f := strings.Fields(l)
		require.Len(t, f, 6, l)
		require.Equal(t, "root/root", f[1], l)
		require.Equal(t, "2026-11-27 21:00", f[3]+" "+f[4], "%s: the build date is every file's time", l)
		p := strings.TrimSuffix(strings.TrimPrefix(f[5], "."), "/")
		got[p] = f[0]
	}
	for p, e := range want {
		require.Equal(t, e.mode, got[p], p)
	}
	for p, m := range got {
		if _, ok := want[p]; !ok {
			require.True(t, strings.HasPrefix(m, "d"), "%s is in the .deb but not in the description", p)
		}
	}
	require.Contains(t, want, "/lib/systemd/system/libvirt-executor.service")
	require.Contains(t, want, "/usr/share/doc/libvirt-executor/changelog.gz")

	// conffiles, scripts, fields.
	require.Equal(t, strings.Join(configs(want), "\n")+"\n", output(t, "dpkg-deb", "-I", deb, "conffiles"))
	for _, s := range []string{"postinst", "prerm", "postrm"} {
		src, err := os.ReadFile(filepath.Join(b.Top, "deploy/package/debian", s))
		require.NoError(t, err)
		require.Equal(t, string(src), output(t, "dpkg-deb", "-I", deb, s), s)
	}
	fields := output(t, "dpkg-deb", "-f", deb, "Package", "Version", "Architecture", "Depends", "Maintainer")
	require.Contains(t, fields, "Version: 1.2.3+4.gabc1234\n")
	require.Contains(t, fields, "Depends: libc6 (>= 2.34), libvirt0 (>= 9.0.0), adduser, init-system-helpers (>= 1.60)\n")
	// The units name /usr/bin.
	x := t.TempDir()
	output(t, "dpkg-deb", "-x", deb, x)
	unit, err := os.ReadFile(filepath.Join(x, "lib/systemd/system/libvirt-executor.service"))
	require.NoError(t, err)
	require.Contains(t, string(unit), "ExecStart=/usr/bin/libvirt-executor serve")
	require.NotContains(t, string(unit), "/usr/local/bin/")
	// The image recipes (image build): the tree's, so of the same cache key.
	require.Equal(t, "-rwxr-xr-x", want[Recipes+"/build.sh"].mode)
	require.Equal(t, "-rw-r--r--", want[Recipes+"/lib.sh"].mode)
	require.Contains(t, want, Recipes+"/debian/recipe.sh")
	for _, n := range []string{"tiny", "debian", "cloud"} {
		hash := func(dir string) string {
			return output(t, "bash", "-c", `. "$1/lib.sh" && lve_image_hash "$1" "$2"`, "hash", dir, n)
		}
		require.Equal(t, hash(filepath.Join(b.Top, "deploy/images")), hash(filepath.Join(x, Recipes)), "recipe %s installed as in the tree", n)
	}

	// Reproducible: the same build gives the same bytes.
	again, err := b.Write(t.TempDir(), "deb")
	require.NoError(t, err)
	requireSameFile(t, deb, again[0])
}

func TestRPM(t *testing.T) {
	needTool(t, "rpm")
	b := testBuild(t)
	out := t.TempDir()
	paths, err := b.Write(out, "rpm")
	require.NoError(t, err)
	rpm := paths[0]
	require.Equal(t, filepath.Join(out, "libvirt-executor-1.2.3+4.gabc1234-1.x86_64.rpm"), rpm)
	want := described(t, b, "rpm")
	q := func(args ...string) string {
		return output(t, "rpm", append([]string{"-qp", "--nosignature"}, append(args, rpm)...)...)
	}

	// Files with modes, owners, times and config flags (c: %config, n: noreplace).
	got := map[string][]string{}
	for _, l := range strings.Split(strings.TrimSpace(q("--qf", "[%{FILEMODES:perms} %{FILEUSERNAME}:%{FILEGROUPNAME} %{FILEMTIMES} f=%{FILEFLAGS:fflags} %{FILENAMES}\n]")), "\n") {
		f := strings.Fields(l)
		require.Len(t, f, 5, l)
		got[f[4]] = f[:4]
	}
	require.Len(t, got, len(want), "the .rpm holds what the description lists")
	date := fmt.Sprint(b.Date.Unix())
	for p, e := range want {
		require.Contains(t, got, p)
		require.Equal(t, e.mode, got[p][0], p)
		require.Equal(t, "root:root", got[p][1], p)
		require.Equal(t, date, got[p][2], "%s: the build date is every file's time", p)
		switch {
		case e.config:
			require.Equal(t, "f=cn", got[p][3], "%s: %%config(noreplace)", p)
		case p == "/usr/share/doc/libvirt-executor/LICENSE":
			require.Equal(t, "f=l", got[p][3], "%s: %%license", p)
		case strings.HasPrefix(p, "/usr/share/doc/") && !strings.HasPrefix(e.mode, "d"):
			require.Equal(t, "f=d", got[p][3], "%s: %%doc", p)
		default:
			require.Equal(t, "f=", got[p][3], p)
		}
	}
	require.Contains(t, want, "/usr/lib/systemd/system/libvirt-executor.service")
	require.NotContains(t, want, "/usr/share/doc/libvirt-executor/changelog.gz", "Debian's only")
	require.NotContains(t, want, "/usr/share/lintian/overrides/libvirt-executor", "Debian's only")
	require.Equal(t, strings.Join(configs(want), "\n")+"\n", q("--configfiles"))

	// Scripts: ours, each under its scriptlet.
	scripts := q("--scripts")
	for name, file := range map[string]string{"postinstall": "post", "preuninstall": "preun", "postuninstall": "postun"} {
		src, err := os.ReadFile(filepath.Join(b.Top, "deploy/package/rpm", file))
		require.NoError(t, err)
		require.Contains(t, scripts, name+" scriptlet (using /bin/sh):\n"+string(src), file)
	}
	require.NotContains(t, scripts, "preinstall scriptlet")
	require.NotContains(t, scripts, "deb-systemd", "no Debian tool in the .rpm's scripts")

	// Dependencies: the RHEL family's package names (RHEL 9, Rocky, Alma,
	// Fedora): libvirt's library required; the daemon with its KVM driver,
	// QEMU, qemu-img, the network and nwfilter configuration, dnsmasq and
	// conntrack-tools (the QEMU hook's conntrack) recommended. No Debian
	// name in either.
	requires := q("--requires")
	for _, r := range []string{"libvirt-libs >= 9.0.0", "glibc >= 2.34", "shadow-utils", "systemd"} {
		require.Contains(t, requires, r+"\n")
	}
	recommends := q("--recommends")
	require.Equal(t, "conntrack-tools\ndnsmasq\nlibvirt-client\nlibvirt-daemon-config-network\nlibvirt-daemon-config-nwfilter\nlibvirt-daemon-kvm\nqemu-img\nqemu-kvm\n",
		sortedLines(recommends))
	for _, debian := range []string{"libvirt0", "libc6", "adduser", "init-system-helpers", "libvirt-daemon-system", "libvirt-clients", "qemu-system-x86", "qemu-utils", "dnsmasq-base", "ebtables", "conntrack"} {
		for _, l := range strings.Split(requires+recommends, "\n") {
			name, _, _ := strings.Cut(l, " ")
			require.NotEqual(t, debian, name, "Debian's %s in the .rpm's dependencies", debian)
		}
	}
	require.Equal(t, "libvirt-executor 1.2.3+4.gabc1234 1 x86_64 MIT", q("--qf", "%{NAME} %{VERSION} %{RELEASE} %{ARCH} %{LICENSE}"))
	require.Equal(t, "Run every CI job in a fresh, disposable libvirt/KVM virtual machine", q("--qf", "%{SUMMARY}"))

	again, err := b.Write(t.TempDir(), "rpm")
	require.NoError(t, err)
	requireSameFile(t, rpm, again[0])
}

// sortedLines is text's lines sorted, each ending in a newline.
func sortedLines(text string) string {
	l := strings.Split(strings.TrimSpace(text), "\n")
	sort.Strings(l)
	return strings.Join(l, "\n") + "\n"
}

func requireSameFile(t *testing.T, a, b string) {
	t.Helper()
	da, err := os.ReadFile(a)
	require.NoError(t, err)
	db, err := os.ReadFile(b)
	require.NoError(t, err)
	require.True(t, bytes.Equal(da, db), "%s and %s differ: the build is not reproducible", a, b)
}

func TestPrebuiltWithoutAgent(t *testing.T) {
	b := testBuild(t)
	require.NoError(t, os.Remove(filepath.Join(b.Binaries, "lve-agent")))
	_, err := b.describe(t.TempDir())
	require.ErrorContains(t, err, "no executable lve-agent")
	b.Prebuilt = true
	want := described(t, b, "deb")
	require.NotContains(t, want, "/usr/lib/libvirt-executor/lve-agent")
	require.Contains(t, want, "/usr/bin/libvirt-executor")
}

// An earlier build without an executable added since is packaged without
// it (the upgrade test's old version); this tree's build must have it.
func TestPrebuiltWithoutNewerExecutable(t *testing.T) {
	b := testBuild(t)
	require.NoError(t, os.Remove(filepath.Join(b.Binaries, "libvirt-executor-hooks")))
	_, err := b.describe(t.TempDir())
	require.ErrorContains(t, err, "no executable libvirt-executor-hooks")
	b.Prebuilt = true
	want := described(t, b, "deb")
	require.NotContains(t, want, "/usr/bin/libvirt-executor-hooks")
	require.NotContains(t, want, GitHubHook, "no hook script without the executable it runs")
	require.Contains(t, want, "/usr/bin/libvirt-executor-prepare")
	require.NoError(t, os.Remove(filepath.Join(b.Binaries, "libvirt-executor-prepare")))
	_, err = b.describe(t.TempDir())
	require.ErrorContains(t, err, "no executable libvirt-executor-prepare", "only the newer ones may be missing")
}

func TestVersionChecked(t *testing.T) {
	b := testBuild(t)
	b.Version = "v1.0-rc1"
	_, err := b.describe(t.TempDir())
	require.ErrorContains(t, err, "must start with a digit")
}
