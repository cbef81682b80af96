// Package packaging is the one description of the libvirt-executor package, and
// writes it as a .deb and an .rpm with nfpm's packagers (cmd/lve-package,
// deploy/package/build.sh, make release).
//
// Both formats ship the same files with the same modes; what differs is said
// here per format: dependencies (Debian's names, RHEL/Fedora's names), the
// maintainer scripts (deploy/package/debian/ and deploy/package/rpm/), the
// systemd unit directory, and what only Debian has (the changelog.gz and
// lintian's overrides).
package packaging

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/goreleaser/nfpm/v2"
	_ "github.com/goreleaser/nfpm/v2/deb" // registers the deb packager
	"github.com/goreleaser/nfpm/v2/files"
	_ "github.com/goreleaser/nfpm/v2/rpm" // registers the rpm packager
)

// Name is the package's name in both formats.
const Name = "libvirt-executor"

// Executables are the seven a host runs, installed into /usr/bin.
var Executables = []string{"libvirt-executor", "libvirt-executor-config", "libvirt-executor-prepare",
	"libvirt-executor-run", "libvirt-executor-cleanup", "libvirt-executor-garm", "libvirt-executor-hooks"}

// newerExecutables are executables that an earlier commit's build (a
// Prebuilt one: the e2e upgrade test's) may not have yet: such a package is
// made without them, as that version was.
var newerExecutables = map[string]bool{"libvirt-executor-hooks": true}

// Units are the systemd units, from deploy/systemd/.
var Units = []string{"libvirt-executor.service", "libvirt-executor-gc.service", "libvirt-executor-gc.timer"}

// Formats are the packagers Build knows.
var Formats = []string{"deb", "rpm"}

// GuardHook is libvirt's network hook. It is code, not configuration (its
// configuration, GuardConf, is what admins edit), so it is no conffile: an
// upgrade replaces it. It stays in /etc because libvirt runs hooks only from
// /etc/libvirt/hooks (and AppArmor's profile for libvirtd lets it execute only
// there). From a version where it was a conffile, dpkg replaces it and drops
// its conffile record (no dpkg-maintscript-helper needed).
//
// ConntrackHook is libvirt's QEMU hook that forgets a released VM's tracked
// connections (deploy/network/libvirt-executor-conntrack): code too, and
// in /etc for the same reason.
const (
	GuardHook = "/etc/libvirt/hooks/network.d/50-libvirt-executor-guard"
	// GitHubHook is what ACTIONS_RUNNER_CONTAINER_HOOKS names: the runner
	// runs only a .js, .sh or .ps1 file, so this script hands its input to
	// libvirt-executor-hooks (deploy/github-hooks/container-hook.sh).
	GitHubHook    = "/usr/lib/libvirt-executor/github-container-hook.sh"
	ConntrackHook = "/etc/libvirt/hooks/qemu.d/50-libvirt-executor-conntrack"
	GuardConf     = "/etc/libvirt/hooks/libvirt-executor-guard.conf"
	Config        = "/etc/libvirt-executor/config.toml"
)

var versionRE = regexp.MustCompile(`^[0-9][A-Za-z0-9.+~]*$`)

// Build is one build of the package.
type Build struct {
	// Top is the repository's root.
	Top string
	// Binaries holds the executables (make build's bin/, or --binaries DIR).
	Binaries string
	// Prebuilt: the executables were given (--binaries DIR: an earlier
	// commit's build); without lve-agent, or an executable added since
	// (newerExecutables), among them the package has none.
	Prebuilt bool
	// Version, Commit and Date: deploy/package/version.sh's identity. Date is
	// every file's time (reproducible: the same commit gives the same package).
	Version, Commit string
	Date            time.Time
	// Fast: gzip instead of xz (the e2e test).
	Fast bool
	// Strip: the tool that strips the executables ("" or "none": copied as they are).
	Strip string
}

// description is the package: nfpm's configuration with per-format overrides.
type description struct {
	cfg   nfpm.Config
	stage string
}

const summary = "run every CI job in a fresh, disposable libvirt/KVM virtual machine"

const longDescription = summary + `
A driver for GitLab Runner's Custom executor (libvirt-executor-config,
-prepare, -run and -cleanup) and an external provider for garm
(libvirt-executor-garm): each job gets a linked clone of a base image with
fresh per-VM keys, pinned host keys and a network filter, and is removed
when the job ends. libvirt-executor administers the VMs (list, gc, doctor,
selftest) and keeps standby pools booted for warm starts (serve).

Installing starts nothing. Next: edit /etc/libvirt-executor/config.toml,
then run "libvirt-executor doctor" and "libvirt-executor selftest".`

// describe stages what is generated (stripped executables, units pointed at
// /usr/bin, the commented guard configuration, Debian's changelog) into
// stage and returns the description.
func (b Build) describe(stage string) (*description, error) {
	if !versionRE.MatchString(b.Version) {
		return nil, fmt.Errorf("version %q: must start with a digit and hold only letters, digits and . + ~", b.Version)
	}
	if b.Date.IsZero() {
		return nil, fmt.Errorf("no build date")
	}
	top := b.Top
	var c files.Contents
	add := func(typ, packager, src, dst string, mode os.FileMode) {
		c = append(c, &files.Content{Type: typ, Packager: packager, Source: src, Destination: dst,
			FileInfo: &files.ContentFileInfo{Owner: "root", Group: "root", Mode: mode, MTime: b.Date}})
	}
	file := func(src, dst string, mode os.FileMode) { add("", "", src, dst, mode) }
	dir := func(dst string) { add(files.TypeDir, "", "", dst, 0o755) }

	// The executables, stripped (what dh_strip does: the package ships no symbols).
	packaged := map[string]bool{}
	for _, e := range Executables {
		if _, err := os.Stat(filepath.Join(b.Binaries, e)); err != nil && b.Prebuilt && newerExecutables[e] {
			continue
		}
		out, err := b.strip(filepath.Join(b.Binaries, e), filepath.Join(stage, "bin", e))
		if err != nil {
			return nil, err
		}
		file(out, "/usr/bin/"+e, 0o755)
		packaged[e] = true
	}
	// The guest agent (static; it goes onto the guests' tools disk, never runs on
	// the host): where guest_tools.agent = "auto" finds it, ../lib/libvirt-executor
	// from /usr/bin.
	dir("/usr/lib/libvirt-executor")
	if _, err := os.Stat(filepath.Join(b.Binaries, "lve-agent")); err == nil || !b.Prebuilt {
		out, err := b.strip(filepath.Join(b.Binaries, "lve-agent"), filepath.Join(stage, "bin", "lve-agent"))
		if err != nil {
			return nil, err
		}
		file(out, "/usr/lib/libvirt-executor/lve-agent", 0o755)
	}

	// systemd units, pointed at /usr/bin: Debian 12's directory, and RHEL's.
	units := strings.NewReplacer("/usr/local/bin/", "/usr/bin/",
		"make install (or cp it to /etc/systemd/system/)", "the libvirt-executor package")
	for _, u := range Units {
		src, err := os.ReadFile(filepath.Join(top, "deploy/systemd", u))
		if err != nil {
			return nil, err
		}
		out := filepath.Join(stage, "units", u)
		if err := writeFile(out, []byte(units.Replace(string(src)))); err != nil {
			return nil, err
		}
		add("", "deb", out, "/lib/systemd/system/"+u, 0o644)
		add("", "rpm", out, "/usr/lib/systemd/system/"+u, 0o644)
	}

	// Configuration: conffiles (%config(noreplace)), kept over upgrades when
	// changed. The guard hook guards no network until one is listed in its
	// configuration (commented out here), so installing changes no network.
	dir("/etc/libvirt-executor")
	add(files.TypeConfigNoReplace, "", filepath.Join(top, "deploy/config.example.toml"), Config, 0o640)
	guardConf, err := os.ReadFile(filepath.Join(top, "deploy/network/libvirt-executor-guard.conf"))
	if err != nil {
		return nil, err
	}
	out := filepath.Join(stage, "libvirt-executor-guard.conf")
	if err := writeFile(out, regexp.MustCompile(`(?m)^([a-z])`).ReplaceAll(guardConf, []byte("# $1"))); err != nil {
		return nil, err
	}
	add(files.TypeConfigNoReplace, "", out, GuardConf, 0o644)
	file(filepath.Join(top, "deploy/network/libvirt-executor-guard"), GuardHook, 0o755)
	file(filepath.Join(top, "deploy/network/libvirt-executor-conntrack"), ConntrackHook, 0o755)
	if packaged["libvirt-executor-hooks"] { // the script runs it
		file(filepath.Join(top, "deploy/github-hooks/container-hook.sh"), GitHubHook, 0o755)
	}
	// polkit rules for libvirt's access driver, for the example configuration (they
	// do nothing until access_drivers = [ "polkit" ]; /etc/polkit-1/rules.d/ of the
	// same name wins).
	file(filepath.Join(top, "deploy/polkit/50-libvirt-executor.rules"), "/usr/share/polkit-1/rules.d/50-libvirt-executor.rules", 0o644)

	// The guest image recipes (libvirt-executor image build NAME finds them
	// at ../share/libvirt-executor/images from /usr/bin), with their modes:
	// the same files give the same cache key (lib.sh's lve_image_hash) as
	// in the source tree.
	if err := b.recipes(dir, file); err != nil {
		return nil, err
	}
	// The example configuration's network (docs/install.md: virsh net-define).
	file(filepath.Join(top, "deploy/network/ci-network.xml"), "/usr/share/"+Name+"/ci-network.xml", 0o644)

	// Documentation and examples: %doc in the .rpm (dnf --nodocs leaves them out).
	docFile := func(src, dst string) {
		add("", "deb", src, dst, 0o644)
		add(files.TypeRPMDoc, "rpm", src, dst, 0o644)
	}
	doc := "/usr/share/doc/" + Name
	dir(doc)
	dir(doc + "/examples")
	mds, err := filepath.Glob(filepath.Join(top, "docs/*.md"))
	if err != nil {
		return nil, err
	}
	sort.Strings(mds)
	for _, m := range mds {
		docFile(m, doc+"/"+filepath.Base(m))
	}
	docFile(filepath.Join(top, "README.md"), doc+"/README.md")
	for _, ex := range []string{"deploy/config.example.toml", "deploy/garm.example.toml", "deploy/prometheus/alerts.yml", "deploy/grafana/libvirt-executor.json"} {
		docFile(filepath.Join(top, ex), doc+"/examples/"+filepath.Base(ex))
	}
	docFile(filepath.Join(top, "deploy/package/debian/copyright"), doc+"/copyright")
	add(files.TypeRPMLicence, "rpm", filepath.Join(top, "LICENSE"), doc+"/LICENSE", 0o644)
	// Debian's changelog (a native package's) and lintian's overrides.
	cl, err := b.debianChangelog()
	if err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(stage, "changelog.gz"), cl); err != nil {
		return nil, err
	}
	add("", "deb", filepath.Join(stage, "changelog.gz"), doc+"/changelog.gz", 0o644)
	add("", "deb", filepath.Join(top, "deploy/package/debian/lintian-overrides"), "/usr/share/lintian/overrides/"+Name, 0o644)

	debComp, rpmComp := "xz", "xz"
	if b.Fast {
		debComp, rpmComp = "gzip", "gzip"
	}
	cfg := nfpm.Config{
		Info: nfpm.Info{
			Name:          Name,
			Arch:          "amd64",
			Platform:      "linux",
			Version:       b.Version,
			VersionSchema: "none",
			Section:       "admin",
			Priority:      "optional",
			Maintainer:    "libvirt-executor developers <libvirt-executor@localhost>",
			Description:   longDescription,
			Vendor:        "libvirt-executor developers",
			Homepage:      "https://gitlab.com/libvirt-executor/libvirt-executor",
			License:       "MIT",
			MTime:         b.Date,
			Overridables: nfpm.Overridables{
				Contents: c,
				Umask:    0o022,
			},
		},
		Overrides: map[string]*nfpm.Overridables{
			"deb": {
				Depends:    []string{"libc6 (>= 2.34)", "libvirt0 (>= 9.0.0)", "adduser", "init-system-helpers (>= 1.60)"},
				Recommends: []string{"libvirt-daemon-system", "libvirt-clients", "libvirt-daemon-config-nwfilter", "qemu-system-x86", "qemu-utils", "dnsmasq-base", "ebtables", "conntrack"},
				// uidmap: libvirt-executor-hooks runs virtiofsd in a user
				// namespace of the share user's subordinate ids (newuidmap).
				Suggests: []string{"gitlab-runner", "prometheus", "uidmap"},
				Scripts: nfpm.Scripts{
					PostInstall: filepath.Join(top, "deploy/package/debian/postinst"),
					PreRemove:   filepath.Join(top, "deploy/package/debian/prerm"),
					PostRemove:  filepath.Join(top, "deploy/package/debian/postrm"),
				},
				Deb: nfpm.Deb{Compression: debComp},
			},
			"rpm": {
				// RHEL 9 / Fedora names. libvirt-libs holds libvirt.so.0 (the
				// executables' one shared library besides glibc's); shadow-utils
				// usermod (%post adds the runner's user to libvirt's group).
				Depends:    []string{"glibc >= 2.34", "libvirt-libs >= 9.0.0", "shadow-utils", "systemd"},
				Recommends: []string{"libvirt-daemon-kvm", "libvirt-daemon-config-network", "libvirt-daemon-config-nwfilter", "libvirt-client", "qemu-kvm", "qemu-img", "dnsmasq", "conntrack-tools"},
				Suggests:   []string{"gitlab-runner"},
				Scripts: nfpm.Scripts{
					PostInstall: filepath.Join(top, "deploy/package/rpm/post"),
					PreRemove:   filepath.Join(top, "deploy/package/rpm/preun"),
					PostRemove:  filepath.Join(top, "deploy/package/rpm/postun"),
				},
				RPM: nfpm.RPM{
					// rpm's Summary starts with a capital (rpmlint); Debian's
					// synopsis does not.
					Summary:     strings.ToUpper(summary[:1]) + summary[1:],
					Group:       "Applications/System",
					Compression: rpmComp,
					// Reproducible: no build machine's name.
					BuildHost: "localhost",
					Packager:  "libvirt-executor developers <libvirt-executor@localhost>",
				},
			},
		},
	}
	return &description{cfg: cfg, stage: stage}, nil
}

// Write builds the package in each of formats into outdir and returns their
// paths, in the order asked.
func (b Build) Write(outdir string, formats ...string) ([]string, error) {
	stage, err := os.MkdirTemp("", "lve-package-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(stage) }()
	d, err := b.describe(stage)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(outdir, 0o750); err != nil {
		return nil, err
	}
	var paths []string
	for _, f := range formats {
		p, err := d.write(outdir, f)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		paths = append(paths, p)
	}
	return paths, nil
}

// FileName is the package's file name in format: Debian's name_version_arch.deb,
// rpm's name-version-release.arch.rpm.
func FileName(format, version string) string {
	if format == "rpm" {
		return fmt.Sprintf("%s-%s-1.x86_64.rpm", Name, version)
	}
	return fmt.Sprintf("%s_%s_amd64.deb", Name, version)
}

func (d *description) info(format string) (*nfpm.Info, error) {
	info, err := d.cfg.Get(format)
	if err != nil {
		return nil, err
	}
	if format == "rpm" {
		// rpm's Summary is the first line already.
		_, info.Description, _ = strings.Cut(info.Description, "\n")
	}
	return nfpm.WithDefaults(info), nil
}

func (d *description) write(outdir, format string) (string, error) {
	pkgr, err := nfpm.Get(format)
	if err != nil {
		return "", err
	}
	info, err := d.info(format)
	if err != nil {
		return "", err
	}
	info.Target = filepath.Join(outdir, FileName(format, info.Version))
	if got := pkgr.ConventionalFileName(info); got != filepath.Base(info.Target) {
		return "", fmt.Errorf("file name %s, nfpm's is %s", filepath.Base(info.Target), got)
	}
	tmp, err := os.CreateTemp(outdir, ".lve-package-*")
	if err != nil {
		return "", err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if err := pkgr.Package(info, tmp); err != nil {
		_ = tmp.Close()
		return "", err
	}
	if err := tmp.Chmod(0o644); err != nil {
		_ = tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	return info.Target, os.Rename(tmp.Name(), info.Target)
}

// strip writes src stripped (or copied) to out.
func (b Build) strip(src, out string) (string, error) {
	st, err := os.Stat(src)
	if err != nil || !st.Mode().IsRegular() || st.Mode()&0o111 == 0 {
		return "", fmt.Errorf("no executable %s in %s (make build first, or --binaries DIR)", filepath.Base(src), filepath.Dir(src))
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o700); err != nil {
		return "", err
	}
	if b.Strip == "" || b.Strip == "none" {
		data, err := os.ReadFile(src)
		if err != nil {
			return "", err
		}
		return out, writeFile(out, data)
	}
	if o, err := exec.Command(b.Strip, "--remove-section=.comment", "--remove-section=.note", "--strip-unneeded", "-o", out, src).CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s %s: %w: %s", b.Strip, src, err, o)
	}
	return out, nil
}

// debianChangelog is a native package's changelog.gz: one entry for this build.
func (b Build) debianChangelog() ([]byte, error) {
	var text bytes.Buffer
	fmt.Fprintf(&text, "%s (%s) unstable; urgency=medium\n\n", Name, b.Version)
	if b.Prebuilt {
		text.WriteString("  * Packaged from the prebuilt executables given (--binaries).\n\n")
	} else {
		fmt.Fprintf(&text, "  * Built from commit %s.\n\n", b.Commit)
	}
	fmt.Fprintf(&text, " -- libvirt-executor developers <libvirt-executor@localhost>  %s\n", b.Date.UTC().Format("Mon, 02 Jan 2006 15:04:05 -0700"))
	var gz bytes.Buffer
	// As gzip -9n: no name, no time.
	w, err := gzip.NewWriterLevel(&gz, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	if _, err := w.Write(text.Bytes()); err != nil {
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return gz.Bytes(), nil
}

func writeFile(path string, data []byte) error {
	// Staged for the packagers: the packages' modes are the description's.
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o600) //nolint:gosec // G703: paths under our own staging directory
}

// Recipes is where the package installs deploy/images.
const Recipes = "/usr/share/" + Name + "/images"

// recipes adds deploy/images under Recipes: its directories, and its files
// 0755 when executable in the tree, else 0644.
func (b Build) recipes(dir func(string), file func(src, dst string, mode os.FileMode)) error {
	src := filepath.Join(b.Top, "deploy/images")
	dir("/usr/share/" + Name)
	return filepath.WalkDir(src, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		dst := Recipes
		if rel != "." {
			dst += "/" + filepath.ToSlash(rel)
		}
		if d.IsDir() {
			dir(dst)
			return nil
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s: not a regular file (the package ships the recipes' files only)", p)
		}
		st, err := d.Info()
		if err != nil {
			return err
		}
		mode := os.FileMode(0o644)
		if st.Mode()&0o100 != 0 {
			mode = 0o755
		}
		file(p, dst, mode)
		return nil
	})
}
