package admin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
)

// recorder is a progress.Reporter that keeps the steps' names.
type recorder struct{ steps []string }

func (r *recorder) Step(name string, _ int64) { r.steps = append(r.steps, name) }
func (r *recorder) Add(int64)                 {}
func (r *recorder) Done()                     {}

// fakeBuild is a build.sh with build.sh's interface (NAME; LVE_IMAGE_CACHE;
// the image's directory last on stdout; progress on stderr as
// "[images] ...") and lib.sh's lve_image_hash; body runs where the image is
// made.
const fakeBuild = `#!/bin/bash
set -eu
name=$1
final=$LVE_IMAGE_CACHE/$name-0123456789abcdef
if [ -f "$final/image.toml" ]; then echo "[images] $name: cached" >&2; echo "$final"; exit 0; fi
echo "[images] $name: first step" >&2
echo "apt-get said this" >&2
echo "[images] $name: second step" >&2
%s
mkdir -p "$final"
for f in disk.qcow2 vmlinuz initrd.img; do echo x >"$final/$f"; done
cat >"$final/image.toml" <<T
[images.$name]
base = "$final/disk.qcow2"
format = "qcow2"
user = "root"
shell = "bash"
builds_dir = "/builds"
cache_dir = "/cache"
key_injection = "smbios"
boot = "kernel"
kernel = "$final/vmlinuz"
initrd = "$final/initrd.img"
cmdline = "console=ttyS0 root=/dev/vda rw quiet"
T
echo "[images] $name: built" >&2
echo "$final"
`

// fakeRecipes is a recipes directory with the recipes names and a build.sh
// that runs body before it makes the image.
func fakeRecipes(t *testing.T, body string, names ...string) string {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "build.sh"), fmt.Appendf(nil, fakeBuild, body), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "lib.sh"), []byte("lve_image_hash() { echo 0123456789abcdef; }\n"), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "common"), 0o755))
	for _, n := range names {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, n), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, n, "recipe.sh"), []byte("#!/bin/bash\n"), 0o755))
	}
	return dir
}

func TestImageBuildArguments(t *testing.T) {
	recipes := fakeRecipes(t, "", "tiny", "debian", "cloud")
	// common/ has no recipe.sh: not a recipe; nor a name with odd characters.
	require.NoError(t, os.MkdirAll(filepath.Join(recipes, "Odd.Name"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(recipes, "Odd.Name", "recipe.sh"), nil, 0o755))
	out := t.TempDir()
	for _, tc := range []struct {
		name, output, want string
	}{
		{"bogus", out, `image build "bogus": no such recipe in ` + recipes + ` (allowed: cloud, debian, tiny)`},
		{"../tiny", out, `image build "../tiny": no such recipe in ` + recipes + ` (allowed: cloud, debian, tiny)`},
		{"common", out, `(allowed: cloud, debian, tiny)`},
		{"Odd.Name", out, `(allowed: cloud, debian, tiny)`},
		{"", out, "image build needs the name of a recipe (allowed: cloud, debian, tiny)"},
		{"tiny", "images", `image build --output "images": must be an absolute directory`},
	} {
		o := BuildOptions{Name: tc.name, Recipes: recipes, Output: tc.output}
		err := o.Check()
		require.Error(t, err, tc.name)
		require.Contains(t, err.Error(), tc.want)
		_, err = ImageBuild(context.Background(), &recorder{}, o)
		require.ErrorContains(t, err, tc.want, "ImageBuild checks its arguments first")
	}
	require.NoError(t, BuildOptions{Name: "debian", Recipes: recipes, Output: out}.Check())
	entries, err := os.ReadDir(out)
	require.NoError(t, err)
	require.Empty(t, entries, "nothing was built for bad arguments")
}

func TestRecipesDir(t *testing.T) {
	// The package's layout: /usr/bin/libvirt-executor and
	// /usr/share/libvirt-executor/images.
	root := t.TempDir()
	exe := filepath.Join(root, "usr/bin/libvirt-executor")
	require.NoError(t, os.MkdirAll(filepath.Dir(exe), 0o755))
	require.NoError(t, os.WriteFile(exe, nil, 0o755))
	_, err := RecipesDir("", exe)
	require.ErrorContains(t, err, "no image recipes at "+filepath.Join(root, "usr/share/libvirt-executor/images")+" (the package installs them there): pass --recipes DIR")
	installed := filepath.Join(root, "usr/share/libvirt-executor/images")
	require.NoError(t, os.MkdirAll(installed, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(installed, "build.sh"), nil, 0o755))
	dir, err := RecipesDir("", exe)
	require.NoError(t, err)
	require.Equal(t, installed, dir)
	// A link to the executable (alternatives, /usr/local/bin): its target's.
	link := filepath.Join(t.TempDir(), "libvirt-executor")
	require.NoError(t, os.Symlink(exe, link))
	dir, err = RecipesDir("", link)
	require.NoError(t, err)
	require.Equal(t, installed, dir)
	// --recipes wins, and must hold build.sh.
	other := fakeRecipes(t, "", "tiny")
	dir, err = RecipesDir(other, exe)
	require.NoError(t, err)
	require.Equal(t, other, dir)
	_, err = RecipesDir(t.TempDir(), exe)
	require.ErrorContains(t, err, "no build.sh there")
}

func TestImageBuild(t *testing.T) {
	recipes := fakeRecipes(t, "", "tiny")
	out := t.TempDir()
	rec := &recorder{}
	res, err := ImageBuild(context.Background(), rec, BuildOptions{Name: "tiny", Recipes: recipes, Output: out})
	require.NoError(t, err)
	dir := filepath.Join(out, "tiny-0123456789abcdef")
	link := filepath.Join(out, "tiny")
	require.Equal(t, dir, res.Dir)
	require.Equal(t, link, res.Link)
	require.False(t, res.Cached)
	// One step per line the recipe logged, after the start.
	require.Len(t, rec.steps, 4, "%q", rec.steps)
	require.Contains(t, rec.steps[0], "tiny: starting the recipe")
	require.Equal(t, []string{"tiny: first step", "tiny: second step", "tiny: built"}, rec.steps[1:])
	target, err := os.Readlink(link)
	require.NoError(t, err)
	require.Equal(t, "tiny-0123456789abcdef", target, "a relative link to the build")

	// The table names the files through the link and is a valid image.
	require.Contains(t, res.Table, "[images.tiny]\n")
	require.Contains(t, res.Table, `base = "`+link+`/disk.qcow2"`)
	require.Contains(t, res.Table, `kernel = "`+link+`/vmlinuz"`)
	require.Contains(t, res.Table, `initrd = "`+link+`/initrd.img"`)
	require.Contains(t, res.Table, `boot = "kernel"`)
	require.NotContains(t, res.Table, dir)
	cfg, err := config.Parse([]byte("default_image = \"tiny\"\n" + res.Table))
	require.NoError(t, err, "the printed table is a valid [images.NAME] table")
	img, ok := cfg.Image("tiny")
	require.True(t, ok)
	require.Equal(t, link+"/disk.qcow2", img.Base)
	require.Equal(t, "kernel", img.Boot)
	require.Equal(t, "smbios", img.KeyInjection)
	require.Equal(t, "/builds", img.BuildsDir)

	var b strings.Builder
	require.NoError(t, PrintBuild(&b, "tiny", res))
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	require.Regexp(t, `^image tiny: `+link+` -> tiny-0123456789abcdef, built in \d`, lines[len(lines)-1], "the last line names the image's path")
	require.Contains(t, b.String(), res.Table)

	// Again: the recipe's build is there.
	rec = &recorder{}
	res, err = ImageBuild(context.Background(), rec, BuildOptions{Name: "tiny", Recipes: recipes, Output: out})
	require.NoError(t, err)
	require.True(t, res.Cached)
	require.Equal(t, "tiny: cached", rec.steps[len(rec.steps)-1])
	b.Reset()
	require.NoError(t, PrintBuild(&b, "tiny", res))
	require.Contains(t, b.String(), "already built (the recipe is unchanged; --force builds it again)")

	// --force builds it again.
	stamp := filepath.Join(dir, "stamp")
	require.NoError(t, os.WriteFile(stamp, nil, 0o644))
	res, err = ImageBuild(context.Background(), &recorder{}, BuildOptions{Name: "tiny", Recipes: recipes, Output: out, Force: true})
	require.NoError(t, err)
	require.False(t, res.Cached)
	require.NoFileExists(t, stamp, "a new build")
	left, err := filepath.Glob(filepath.Join(out, ".old-*"))
	require.NoError(t, err)
	require.Empty(t, left, "the earlier build is removed")

	// A directory where the link goes is not replaced.
	require.NoError(t, os.Remove(link))
	require.NoError(t, os.Mkdir(link, 0o755))
	_, err = ImageBuild(context.Background(), &recorder{}, BuildOptions{Name: "tiny", Recipes: recipes, Output: out})
	require.ErrorContains(t, err, link+" is not a link")
}

func TestImageBuildFailure(t *testing.T) {
	// 500 lines, then the recipe fails: the error shows the last 40.
	recipes := fakeRecipes(t, `for i in $(seq 1 500); do echo "apt line $i" >&2; done; echo "[images] tiny: doomed" >&2; head -c 10000 /dev/zero | tr '\0' y >&2; echo >&2; exit 7`, "tiny")
	out := t.TempDir()
	rec := &recorder{}
	_, err := ImageBuild(context.Background(), rec, BuildOptions{Name: "tiny", Recipes: recipes, Output: out})
	require.Error(t, err)
	msg := err.Error()
	require.Contains(t, msg, "image build tiny failed: exit status 7; the recipe's last 40 lines:")
	require.Contains(t, msg, "  apt line 500\n")
	require.Contains(t, msg, "  [images] tiny: doomed\n")
	require.NotContains(t, msg, "apt line 462\n")
	require.Contains(t, msg, "apt line 463\n")
	require.Contains(t, msg, strings.Repeat("y", buildLogLineLen), "a long line is cut")
	require.NotContains(t, msg, strings.Repeat("y", buildLogLineLen+1))
	require.Contains(t, msg, "docs/troubleshooting.md")
	require.Equal(t, "tiny: doomed", rec.steps[len(rec.steps)-1])
	_, err = os.Lstat(filepath.Join(out, "tiny"))
	require.ErrorIs(t, err, os.ErrNotExist, "no link to a failed build")

	// --force over a good build that then fails keeps the good one.
	good := fakeRecipes(t, "", "tiny")
	_, err = ImageBuild(context.Background(), &recorder{}, BuildOptions{Name: "tiny", Recipes: good, Output: out})
	require.NoError(t, err)
	_, err = ImageBuild(context.Background(), &recorder{}, BuildOptions{Name: "tiny", Recipes: recipes, Output: out, Force: true})
	require.ErrorContains(t, err, "exit status 7")
	require.FileExists(t, filepath.Join(out, "tiny-0123456789abcdef", "image.toml"), "the earlier build is put back")
	require.FileExists(t, filepath.Join(out, "tiny", "disk.qcow2"))
}

// The example configuration's default image is what `image build debian`
// makes, through the link it points at the newest build, booted as
// build.sh's image.toml says (docs/install.md: the admin changes none of it).
func TestExampleConfigNamesTheBuiltImage(t *testing.T) {
	cfg, err := config.Load("../../deploy/config.example.toml")
	require.NoError(t, err)
	img, ok := cfg.Image(cfg.DefaultImage)
	require.True(t, ok)
	link := DefaultImageDir + "/debian"
	require.Equal(t, link+"/disk.qcow2", img.Base)
	require.Equal(t, link+"/vmlinuz", img.Kernel)
	require.Equal(t, link+"/initrd.img", img.Initrd)
	build, err := os.ReadFile("../../deploy/images/build.sh")
	require.NoError(t, err)
	require.Contains(t, string(build), `cmdline="`+img.Cmdline+`"`)
	require.Contains(t, string(build), "\nboot = \"kernel\"\n")
	require.Equal(t, "kernel", img.Boot)
	require.NoFileExists(t, "../../deploy/images/debian/image.env", "the debian recipe's image: root, smbios (build.sh's defaults)")
	require.Equal(t, "root", img.User)
	require.Equal(t, "smbios", img.KeyInjection)
	require.Equal(t, "/builds", img.BuildsDir)
	require.Equal(t, "/cache", img.CacheDir)
	require.Equal(t, "ci", cfg.StoragePool, "docs/install.md makes the pool ci")
	require.Equal(t, "ci", cfg.Network, "docs/install.md's network is ci")
}

func TestBuiltBy(t *testing.T) {
	for base, want := range map[string]string{
		DefaultImageDir + "/debian/disk.qcow2":                 "debian",
		DefaultImageDir + "/tiny-0123456789abcdef/disk.qcow2":  "tiny",
		DefaultImageDir + "/my-image/disk.qcow2":               "my-image",
		DefaultImageDir + "/disk.qcow2":                        "",
		DefaultImageDir + "/a/b/disk.qcow2":                    "",
		"/var/lib/libvirt/images/debian-12-ci.qcow2":           "",
		DefaultImageDir + "/../images-other/debian/disk.qcow2": "",
	} {
		require.Equal(t, want, BuiltBy(base), base)
	}
}
