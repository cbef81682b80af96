package admin

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/progress"
)

// DefaultImageDir is where image build puts the images it builds (the
// recipes' cache, docs/images.md): one directory per build,
// NAME-HASH/, and NAME, a link to the newest.
const DefaultImageDir = "/var/cache/libvirt-executor/images"

// RecipesSubdir is where the package installs the recipes, relative to the
// admin tool's directory (/usr/bin -> /usr/share/libvirt-executor/images).
const RecipesSubdir = "../share/libvirt-executor/images"

// stepMark starts a line of the recipes' progress (lib.sh's lve_log): each
// such line is a step of image build.
const stepMark = "[images] "

// Bounds of what image build keeps of a recipe's output (its step log,
// shown when the build fails).
const (
	buildLogLines   = 200
	buildLogLineLen = 2048
	buildLogShown   = 40
)

var recipeNameRE = regexp.MustCompile(`^[a-z][a-z0-9-]{0,31}$`)

// BuildOptions are image build's arguments.
type BuildOptions struct {
	// Name is the recipe's name (a directory of Recipes with recipe.sh).
	Name string
	// Recipes is the recipes' directory (build.sh, lib.sh, common/, NAME/).
	Recipes string
	// Output is where the image goes (DefaultImageDir).
	Output string
	// Force builds the image again even when the recipe's build is there.
	Force bool
}

// RecipesDir is the recipes' directory: dir when given, else the one the
// package installs beside the admin tool exe (RecipesSubdir).
func RecipesDir(dir, exe string) (string, error) {
	if dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "build.sh")); err != nil {
			return "", fmt.Errorf("--recipes %s: no build.sh there (name the directory of the image recipes, deploy/images in a source checkout)", dir)
		}
		return dir, nil
	}
	if real, err := filepath.EvalSymlinks(exe); err == nil {
		exe = real
	}
	d := filepath.Clean(filepath.Join(filepath.Dir(exe), RecipesSubdir))
	if _, err := os.Stat(filepath.Join(d, "build.sh")); err != nil {
		return "", fmt.Errorf("no image recipes at %s (the package installs them there): pass --recipes DIR (deploy/images in a source checkout)", d)
	}
	return d, nil
}

// Recipes are the names of the recipes in dir: its directories holding a
// recipe.sh, sorted.
func Recipes(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range ents {
		if !e.IsDir() || !recipeNameRE.MatchString(e.Name()) {
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, e.Name(), "recipe.sh")); err == nil {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// Check checks image build's arguments: a recipe of o.Recipes and an
// absolute output directory.
func (o BuildOptions) Check() error {
	names, err := Recipes(o.Recipes)
	if err != nil {
		return fmt.Errorf("image build: the recipes' directory: %w", err)
	}
	if !slices.Contains(names, o.Name) {
		if o.Name == "" {
			return fmt.Errorf("image build needs the name of a recipe (allowed: %s)", strings.Join(names, ", "))
		}
		return fmt.Errorf("image build %q: no such recipe in %s (allowed: %s)", o.Name, o.Recipes, strings.Join(names, ", "))
	}
	if !filepath.IsAbs(o.Output) {
		return fmt.Errorf("image build --output %q: must be an absolute directory", o.Output)
	}
	return nil
}

// BuildResult is a built (or found) image.
type BuildResult struct {
	// Dir is the build's own directory (NAME-HASH), Link the stable name
	// (Output/NAME) that points at it.
	Dir, Link string
	// Cached: the recipe's build was there already.
	Cached bool
	// Took is how long it took.
	Took time.Duration
	// Table is the [images.NAME] table for the configuration, naming the
	// files through Link.
	Table string
}

// ImageBuild runs the recipe o.Name (build.sh NAME with the cache in
// o.Output), one progress step per line the recipe logs (p), points
// Output/NAME at the result and returns it with its configuration table.
// A failed build's error carries the last lines of the recipe's output.
func ImageBuild(ctx context.Context, p progress.Reporter, o BuildOptions) (*BuildResult, error) {
	if err := o.Check(); err != nil {
		return nil, err
	}
	t0 := time.Now()
	var old, oldAside string
	if o.Force {
		hash, err := recipeHash(ctx, o.Recipes, o.Name)
		if err != nil {
			return nil, err
		}
		old = filepath.Join(o.Output, o.Name+"-"+hash)
		if _, err := os.Stat(old); err == nil {
			oldAside = filepath.Join(o.Output, fmt.Sprintf(".old-%s-%s-%d", o.Name, hash, os.Getpid()))
			if err := os.Rename(old, oldAside); err != nil {
				return nil, fmt.Errorf("image build --force: %w", err)
			}
		}
	}
	dir, log, err := runBuild(ctx, p, o)
	if err != nil {
		if oldAside != "" {
			_ = os.Rename(oldAside, old)
		}
		return nil, buildError(o.Name, err, log)
	}
	if oldAside != "" {
		_ = os.RemoveAll(oldAside)
	}
	res := &BuildResult{Dir: dir, Link: filepath.Join(o.Output, o.Name), Took: time.Since(t0)}
	res.Cached = slices.ContainsFunc(log, func(l string) bool { return l == stepMark+o.Name+": cached" })
	if filepath.Dir(dir) != filepath.Clean(o.Output) || !strings.HasPrefix(filepath.Base(dir), o.Name+"-") {
		return nil, fmt.Errorf("image build %s: the recipe named %q, not a directory %s-HASH of %s", o.Name, dir, o.Name, o.Output)
	}
	toml, err := os.ReadFile(filepath.Join(dir, "image.toml"))
	if err != nil {
		return nil, fmt.Errorf("image build %s: %w", o.Name, err)
	}
	if err := pointLink(res.Link, filepath.Base(dir)); err != nil {
		return nil, fmt.Errorf("image build %s: %w", o.Name, err)
	}
	res.Table = ConfigTable(string(toml), dir, res.Link)
	return res, nil
}

// BuiltBy is the recipe whose image build output holds base (a file of
// DefaultImageDir/NAME/ or DefaultImageDir/NAME-HASH/), or "".
func BuiltBy(base string) string {
	rel, err := filepath.Rel(DefaultImageDir, filepath.Dir(base))
	if err != nil {
		return ""
	}
	if m := regexp.MustCompile(`^([a-z][a-z0-9-]{0,31}?)(-[0-9a-f]{16})?$`).FindStringSubmatch(rel); m != nil {
		return m[1]
	}
	return ""
}

// ConfigTable is the image's image.toml with the files named through link
// (Output/NAME) instead of the build's own directory dir: the table stays
// right when a changed recipe builds the image again.
func ConfigTable(imageTOML, dir, link string) string {
	t := strings.ReplaceAll(imageTOML, `"`+dir+`/`, `"`+link+`/`)
	return strings.TrimRight(t, "\n") + "\n"
}

// pointLink makes link a symbolic link to target (a name in link's
// directory), replacing an earlier link in one rename.
func pointLink(link, target string) error {
	if st, err := os.Lstat(link); err == nil && st.Mode()&os.ModeSymlink == 0 {
		return fmt.Errorf("%s is not a link (image build points it at the newest build): move it away", link)
	}
	tmp := fmt.Sprintf("%s.tmp-%d", link, os.Getpid())
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, link); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return nil
}

// recipeHash is the recipe's cache key (lib.sh's lve_image_hash), as
// build.sh computes it.
func recipeHash(ctx context.Context, recipes, name string) (string, error) {
	out, err := exec.CommandContext(ctx, "bash", "-c", `. "$1/lib.sh" && lve_image_hash "$1" "$2"`, "lve-image-hash", recipes, name).Output()
	hash := strings.TrimSpace(string(out))
	if err != nil || !regexp.MustCompile(`^[0-9a-f]{16}$`).MatchString(hash) {
		return "", fmt.Errorf("image build --force: the recipe's hash (lib.sh lve_image_hash): %q %v", hash, err)
	}
	return hash, nil
}

// runBuild runs build.sh NAME: each line the recipe logs is a step of p;
// every line of its output goes into the step log (the last
// buildLogLines, each cut at buildLogLineLen). It returns the directory
// build.sh printed last.
func runBuild(ctx context.Context, p progress.Reporter, o BuildOptions) (string, []string, error) {
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(o.Recipes, "build.sh"), o.Name)
	cmd.Env = append(os.Environ(), "LVE_IMAGE_CACHE="+filepath.Clean(o.Output))
	cmd.Stdin = nil
	// The recipe's own processes (debootstrap, apt-get in the chroot) go
	// with it when image build is interrupted.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	var stdout strings.Builder
	cmd.Stdout = &limitedWriter{w: &stdout, n: 64 << 10}
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	p.Step(o.Name+": starting the recipe ("+filepath.Join(o.Recipes, o.Name, "recipe.sh")+")", 0)
	if err := cmd.Start(); err != nil {
		p.Done()
		return "", nil, err
	}
	logc := make(chan []string, 1)
	go func() { logc <- stepLog(pr, p) }()
	err := cmd.Wait()
	_ = pw.Close()
	log := <-logc
	p.Done()
	if err != nil {
		return "", log, err
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	return strings.TrimSpace(lines[len(lines)-1]), log, nil
}

// stepLog reads the recipe's output: a line that starts with stepMark
// starts a step of p; it returns the last buildLogLines lines.
func stepLog(r io.Reader, p progress.Reporter) []string {
	br := bufio.NewReaderSize(r, buildLogLineLen)
	var log []string
	for {
		line, err := readLine(br)
		if line != "" || err == nil {
			if strings.HasPrefix(line, stepMark) {
				p.Step(strings.TrimPrefix(line, stepMark), 0)
			}
			if len(log) == buildLogLines {
				log = log[1:]
			}
			log = append(log, line)
		}
		if err != nil {
			_, _ = io.Copy(io.Discard, r)
			return log
		}
	}
}

// readLine is the next line of br without its newline, cut at
// buildLogLineLen (the rest of a longer line is skipped).
func readLine(br *bufio.Reader) (string, error) {
	line, more, err := br.ReadLine()
	s := string(line)
	for more && err == nil {
		_, more, err = br.ReadLine()
	}
	return strings.ToValidUTF8(s, "?"), err
}

// buildError is a failed build's error: the recipe's exit and the last
// lines of its output.
func buildError(name string, err error, log []string) error {
	if len(log) > buildLogShown {
		log = log[len(log)-buildLogShown:]
	}
	var b strings.Builder
	fmt.Fprintf(&b, "image build %s failed: %v", name, err)
	var ee *exec.ExitError
	if errors.As(err, &ee) && len(log) > 0 {
		fmt.Fprintf(&b, "; the recipe's last %d lines:\n", len(log))
		for _, l := range log {
			b.WriteString("  " + l + "\n")
		}
		b.WriteString("(docs/troubleshooting.md, \"image build\")")
	}
	return errors.New(strings.TrimRight(b.String(), "\n"))
}

// limitedWriter keeps the first n bytes written to it.
type limitedWriter struct {
	w io.Writer
	n int
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	k := min(len(p), l.n)
	if k > 0 {
		if _, err := l.w.Write(p[:k]); err != nil {
			return 0, err
		}
		l.n -= k
	}
	return len(p), nil
}

// PrintBuild prints a build's configuration table and, last, the line
// with the image's path.
func PrintBuild(w io.Writer, name string, res *BuildResult) error {
	what := "built"
	if res.Cached {
		what = "already built (the recipe is unchanged; --force builds it again)"
	}
	_, err := fmt.Fprintf(w, "# the image's table for /etc/libvirt-executor/config.toml (rename it to the name jobs give in image:)\n%s\nimage %s: %s -> %s, %s in %s\n",
		res.Table, name, res.Link, filepath.Base(res.Dir), what, res.Took.Round(time.Millisecond))
	return err
}
