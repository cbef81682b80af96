package config_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ociimage/transfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

func TestRegistryConfigRefuses(t *testing.T) {
	src := "[images.a]\nsource = \"oci://r.example:5000/vm/a:v1\"\n"
	for _, tc := range []struct{ name, toml, want string }{
		{"not oci", "[images.a]\nsource = \"https://r.example/a.qcow2\"\n", `images.a.source: image source "https://r.example/a.qcow2": must start with oci://`},
		{"no tag", "[images.a]\nsource = \"oci://r.example/a\"\n", `names no tag or digest`},
		{"base and source", src + "base = \"/a.qcow2\"\n", "images.a.base: set base (a file on this host) or source (an image in a registry), not both"},
		{"kernel of its own", src + "boot = \"kernel\"\nkernel = \"/k\"\n", "images.a.kernel: an image with a source gets its kernel and initrd from the registry's artifact"},
		{"raw", src + "format = \"raw\"\n", `images.a.format: an image with a source is a qcow2 disk, got "raw"`},
		{"store dir", "[registry]\ndir = \"oci\"\n" + src, `registry.dir: "oci" must be a clean absolute path`},
		{"credentials", "[registry]\ncredentials = \"auth.json\"\n" + src, `registry.credentials: "auth.json" must be an absolute path`},
		{"plain http", "[registry]\nplain_http = [\"r.example\"]\n" + src, `registry.plain_http[0]: "r.example": want HOST:PORT`},
		{"interval", "[registry]\npull_interval = \"1s\"\n" + src, "registry.pull_interval: 1s is too short: at least 10s"},
		{"size", "[registry]\nmax_image_gib = 5000\n" + src, "registry.max_image_gib: 5000 is out of range 1-4096"},
		{"neither", "[images.a]\nuser = \"root\"\n", `images.a.base: "" must be an absolute path to the base disk image (or set source = "oci://...")`},
		{"remote libvirt", "libvirt_uri = \"qemu+ssh://kvm2.example/system\"\n" + src, `images.a.source: needs a libvirt on this host (libvirt_uri "qemu+ssh://kvm2.example/system" is another host's)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := config.Parse([]byte(tc.toml))
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestLocalLibvirt(t *testing.T) {
	for uri, local := range map[string]bool{
		"qemu:///system": true, "qemu:///session": true, "test:///default": true,
		"qemu+unix:///system?socket=/run/lve/libvirt-sock": true, "qemu+ssh://localhost/system": true,
		"qemu+ssh://kvm2.example/system": false, "qemu+tls://10.0.0.2/system": false, "qemu+ssh://localhost:2222/system": false,
	} {
		cfg, err := config.Parse([]byte("libvirt_uri = \"" + uri + "\"\nstate_dir = \"/var/lib/lve-h\"\n[images.a]\nbase = \"/a.qcow2\"\n"))
		require.NoError(t, err, uri)
		require.Equal(t, local, cfg.LocalLibvirt(), uri)
	}
}

// Another host's libvirt: only transports that authenticate the host and
// keep the traffic private, no no_verify, and a state_dir of its own.
func TestRemoteLibvirtRefusals(t *testing.T) {
	own := "state_dir = \"/var/lib/lve-kvm2\"\n[images.a]\nbase = \"/a.qcow2\"\n"
	for uri, want := range map[string]string{
		"qemu+tcp://kvm3:16509/system":            `libvirt_uri: transport "tcp" to another host is not allowed: use qemu+ssh:// or qemu+tls://`,
		"qemu+ssh://kvm2/system?no_verify=1":      "libvirt_uri: no_verify=1 accepts any host as kvm2: pin its key (ssh) or certificate (tls) instead",
		"qemu+tls://kvm2/system?no_verify=1":      "libvirt_uri: no_verify=1 accepts any host as kvm2",
		"qemu+ext://kvm2/system?command=/bin/foo": `transport "ext" to another host is not allowed`,
	} {
		_, err := config.Parse([]byte("libvirt_uri = \"" + uri + "\"\n" + own))
		require.ErrorContains(t, err, want, uri)
	}
	_, err := config.Parse([]byte("libvirt_uri = \"qemu+ssh://kvm2.example/system\"\n[images.a]\nbase = \"/a.qcow2\"\n"))
	require.ErrorContains(t, err, "state_dir: libvirt_uri names another host's libvirt: give this configuration a state_dir of its own")
	for _, uri := range []string{"qemu+ssh://garm@kvm2/system?keyfile=/etc/garm/k", "qemu+tls://kvm2/system?pkipath=/etc/garm/pki", "qemu+libssh2://kvm2/system?known_hosts=/k"} {
		_, err := config.Parse([]byte("libvirt_uri = \"" + uri + "\"\n" + own))
		require.NoError(t, err, uri)
	}
}

// TestSourceResolves: an image with a source has no base until the host's
// store has it; once pulled, loading the configuration points it at the
// stored files, kernel and initrd included, and at the digest.
func TestSourceResolves(t *testing.T) {
	reg := registrytest.Start(t)
	dir := t.TempDir()
	var files []transfer.PushFile
	for _, n := range ociimage.FileNames {
		p := filepath.Join(dir, n)
		b := []byte(strings.Repeat(n, 100))
		if n == ociimage.DiskFile {
			b = registrytest.Qcow2(1<<30, b)
		}
		require.NoError(t, os.WriteFile(p, b, 0o644))
		files = append(files, transfer.PushFile{Name: n, Path: p})
	}
	store := filepath.Join(t.TempDir(), "oci")
	text := []byte("[registry]\ndir = \"" + store + "\"\nplain_http = [\"" + reg.Host + "\"]\n" +
		"[images.tiny]\nsource = \"oci://" + reg.Host + "/vm/tiny:v1\"\nboot = \"kernel\"\ncmdline = \"console=ttyS0\"\n")
	cfg, err := config.Parse(text)
	require.NoError(t, err)
	img, _ := cfg.Image("tiny")
	require.False(t, img.Pulled(), "nothing stored yet")
	require.Empty(t, img.Base)

	src, err := ociimage.ParseSource(img.Source)
	require.NoError(t, err)
	pushed, err := transfer.Push(context.Background(), transfer.RemoteOf(cfg.Registry, "test"), src, files, t.TempDir(), "")
	require.NoError(t, err)
	res, err := transfer.Pull(context.Background(), cfg.Registry.Store(), transfer.RemoteOf(cfg.Registry, "test"), src)
	require.NoError(t, err)

	cfg, err = config.Parse(text)
	require.NoError(t, err)
	img, _ = cfg.Image("tiny")
	require.True(t, img.Pulled())
	require.Equal(t, res.Image.Path(ociimage.DiskFile), img.Base)
	require.Equal(t, res.Image.Path(ociimage.KernelFile), img.Kernel)
	require.Equal(t, res.Image.Path(ociimage.InitrdFile), img.Initrd)
	require.Equal(t, pushed.Descriptor.Digest.String(), img.Digest)
	require.True(t, strings.HasPrefix(img.Base, store+"/images/sha256-"), img.Base)

	// A damaged record counts as not pulled (prepare pulls again), never
	// as a configuration error for every job.
	recs, _ := filepath.Glob(filepath.Join(store, "refs", "*.json"))
	require.Len(t, recs, 1)
	require.NoError(t, os.WriteFile(recs[0], []byte("{"), 0o644))
	cfg, err = config.Parse(text)
	require.NoError(t, err)
	img, _ = cfg.Image("tiny")
	require.False(t, img.Pulled())
}

// TestStoredImageCheckedAgain: an image stored before the disk check (no
// record of it) is checked on its next use: a standalone disk is used and
// its check recorded; one whose header names a host file is not used, and
// the reason names the field and the file.
func TestStoredImageCheckedAgain(t *testing.T) {
	reg := registrytest.Start(t)
	store := filepath.Join(t.TempDir(), "oci")
	text := []byte("[registry]\ndir = \"" + store + "\"\nplain_http = [\"" + reg.Host + "\"]\n" +
		"[images.tiny]\nsource = \"oci://" + reg.Host + "/vm/tiny:v1\"\n")
	cfg, err := config.Parse(text)
	require.NoError(t, err)
	img, _ := cfg.Image("tiny")
	src, err := ociimage.ParseSource(img.Source)
	require.NoError(t, err)
	disk := filepath.Join(t.TempDir(), ociimage.DiskFile)
	require.NoError(t, os.WriteFile(disk, registrytest.Qcow2(1<<30, []byte("disk")), 0o644))
	_, err = transfer.Push(context.Background(), transfer.RemoteOf(cfg.Registry, "test"), src, []transfer.PushFile{{Name: ociimage.DiskFile, Path: disk}}, t.TempDir(), "")
	require.NoError(t, err)
	res, err := transfer.Pull(context.Background(), cfg.Registry.Store(), transfer.RemoteOf(cfg.Registry, "test"), src)
	require.NoError(t, err)
	checked := filepath.Join(res.Image.Dir, ociimage.CheckedFile)
	require.FileExists(t, checked, "the pull records its check")

	require.NoError(t, os.Remove(checked)) // as an older version stored it
	cfg, err = config.Parse(text)
	require.NoError(t, err)
	img, _ = cfg.Image("tiny")
	require.True(t, img.Pulled())
	require.FileExists(t, checked, "checked again, and recorded")

	// The stored disk replaced by one naming a host file (as an older
	// version would have stored it: it did not look inside).
	require.NoError(t, os.Remove(checked))
	evil := filepath.Join(t.TempDir(), "evil.qcow2")
	out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/shadow", "-F", "raw", evil, "1M").CombinedOutput()
	require.NoError(t, err, "%s", out)
	b, err := os.ReadFile(evil)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(res.Image.Path(ociimage.DiskFile), b, 0o644))
	cfg, err = config.Parse(text)
	require.NoError(t, err)
	img, _ = cfg.Image("tiny")
	require.False(t, img.Pulled(), "a refused image is not used")
	err = cfg.ResolveSource(img)
	require.ErrorIs(t, err, ociimage.ErrRefused)
	require.Contains(t, err.Error(), `backing file "/etc/shadow"`)
	require.NoFileExists(t, checked)
}

// TestCheckBase: a configured base file is checked before a machine is
// made on it; a missing one is left to libvirt to report.
func TestCheckBase(t *testing.T) {
	dir := t.TempDir()
	good, evil, huge := filepath.Join(dir, "good.qcow2"), filepath.Join(dir, "evil.qcow2"), filepath.Join(dir, "huge.qcow2")
	for _, args := range [][]string{{good, "1G"}, {evil, "-b", "/etc/shadow", "-F", "raw", "1G"}, {huge, "1P"}} {
		cmd := append([]string{"create", "-q", "-f", "qcow2"}, args[1:len(args)-1]...)
		out, err := exec.Command("qemu-img", append(cmd, args[0], args[len(args)-1])...).CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
	cfg, err := config.Parse([]byte("default_image = \"good\"\n[limits]\nmax_disk_gib = 20\n[images.good]\nbase = \"" + good + "\"\n[images.evil]\nbase = \"" + evil +
		"\"\n[images.huge]\nbase = \"" + huge + "\"\n[images.gone]\nbase = \"" + filepath.Join(dir, "gone.qcow2") + "\"\n"))
	require.NoError(t, err)
	check := func(name string) error {
		img, ok := cfg.Image(name)
		require.True(t, ok)
		return cfg.CheckBase(img)
	}
	require.NoError(t, check("good"))
	require.NoError(t, check("gone"))
	err = check("evil")
	require.ErrorContains(t, err, "image evil refused: "+evil+`: backing file "/etc/shadow"`)
	err = check("huge")
	require.ErrorContains(t, err, "image huge refused: "+huge+": virtual size 1125899906842624 bytes")
	require.ErrorContains(t, err, "limits.max_disk_gib")
}

// A base named through a link is made a machine with the file the link
// names at that moment: moving the link (a rebuild) later changes nothing
// for it, and kernel and initrd beside it come from the same build.
func TestResolveFilesThroughTheBuildLink(t *testing.T) {
	dir := t.TempDir()
	for _, b := range []string{"debian-aaa", "debian-bbb"} {
		require.NoError(t, os.Mkdir(filepath.Join(dir, b), 0o755))
		for _, f := range []string{"disk.qcow2", "vmlinuz", "initrd.img"} {
			require.NoError(t, os.WriteFile(filepath.Join(dir, b, f), []byte(b), 0o644))
		}
	}
	link := filepath.Join(dir, "debian")
	require.NoError(t, os.Symlink("debian-aaa", link))
	cfg := &config.Config{LibvirtURI: "qemu:///system"}
	img := &config.Image{Name: "debian-12", Base: filepath.Join(link, "disk.qcow2"),
		Kernel: filepath.Join(link, "vmlinuz"), Initrd: filepath.Join(link, "initrd.img")}

	got := cfg.ResolveFiles(img)
	require.Equal(t, filepath.Join(dir, "debian-aaa", "disk.qcow2"), got.Base)
	require.Equal(t, filepath.Join(dir, "debian-aaa", "vmlinuz"), got.Kernel)
	require.Equal(t, filepath.Join(dir, "debian-aaa", "initrd.img"), got.Initrd)
	require.Equal(t, filepath.Join(link, "disk.qcow2"), img.Base, "the configuration's image is not changed")

	// A rebuild moves the link: the next machine gets the new build.
	require.NoError(t, os.Remove(link))
	require.NoError(t, os.Symlink("debian-bbb", link))
	require.Equal(t, filepath.Join(dir, "debian-bbb", "disk.qcow2"), cfg.ResolveFiles(img).Base)

	// Remote libvirt: paths are the remote host's, kept as they are.
	remote := &config.Config{LibvirtURI: "qemu+ssh://kvm1/system"}
	require.Equal(t, img.Base, remote.ResolveFiles(img).Base)
	// A file that is not there keeps its name.
	gone := &config.Image{Name: "x", Base: filepath.Join(dir, "nope", "disk.qcow2")}
	require.Equal(t, gone.Base, cfg.ResolveFiles(gone).Base)
}
