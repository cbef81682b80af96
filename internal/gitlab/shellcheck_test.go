package gitlab

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// shellGuest is a fake outputter that runs the check's command in a real
// POSIX shell whose PATH holds only the given tools: the command's quoting
// and `command -v` behave as in a guest.
type shellGuest struct {
	bin   string
	calls int
	cmds  []string
}

func newShellGuest(t *testing.T, tools ...string) *shellGuest {
	g := &shellGuest{bin: t.TempDir()}
	for _, tool := range tools {
		require.NoError(t, os.WriteFile(filepath.Join(g.bin, tool), []byte("#!/bin/sh\n"), 0o755))
	}
	return g
}

func (g *shellGuest) Output(ctx context.Context, cmd string) ([]byte, error) {
	g.calls++
	g.cmds = append(g.cmds, cmd)
	c := exec.CommandContext(ctx, "/bin/sh", "-c", cmd)
	c.Env = []string{"PATH=" + g.bin}
	return c.Output()
}

// An image whose configured shell is missing would exit 127 in every stage,
// reported as the script's failure. Prepare finds it and fails as a system
// failure naming the image, the shell and the fix; the remembered answer
// fails every later job of the same image version too.
func TestGuestToolCheckFailsOnMissingShell(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, []byte("v1"), 0o644))
	store := state.Store{Dir: filepath.Join(dir, "state")}
	var said []string
	say := func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }

	for _, shell := range []string{"bash", "sh", "/opt/ci tools/bin/zsh"} {
		img := &config.Image{Name: "img-" + filepath.Base(shell), Base: base, User: "root", Shell: shell}
		g := newShellGuest(t, "git", "git-lfs", "gitlab-runner", "setsid", "mkfifo") // no bash, no sh, no zsh
		for job := 1; job <= 2; job++ {
			err := checkGuestTools(context.Background(), g, say, store, img, imageVersion(img), nil, false)
			require.Error(t, err, "shell %q, job %d", shell, job)
			require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
			require.ErrorContains(t, err, img.Name)
			require.ErrorContains(t, err, fmt.Sprintf("%q", shell))
			require.ErrorContains(t, err, "images."+img.Name+".shell")
		}
		require.Equal(t, 1, g.calls, "the second job is failed from the remembered answer")
	}

	// Present: bare name on PATH, or an executable absolute path.
	abs := filepath.Join(t.TempDir(), "my shell")
	require.NoError(t, os.WriteFile(abs, []byte("#!/bin/sh\n"), 0o755))
	for _, shell := range []string{"bash", abs} {
		img := &config.Image{Name: "ok", Base: base, User: "root", Shell: shell}
		g := newShellGuest(t, "bash", "git", "git-lfs", "gitlab-runner", "setsid", "mkfifo")
		require.NoError(t, checkGuestTools(context.Background(), g, say, store, img, imageVersion(img), nil, false), shell)
		require.NoError(t, checkGuestTools(context.Background(), g, say, store, img, imageVersion(img), nil, false), shell)
	}
}

// The stage wrapper needs mkfifo (a system failure in prepare, not a
// misleading "copy script into guest failed" in every stage) and wants
// setsid (a warning: leftovers would not be stopped).
func TestGuestToolCheckNeedsTheWrappersTools(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, []byte("v1"), 0o644))
	store := state.Store{Dir: filepath.Join(dir, "state")}
	var said []string
	say := func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }
	img := &config.Image{Name: "nofifo", Base: base, User: "root", Shell: "bash"}
	err := checkGuestTools(context.Background(), newShellGuest(t, "bash", "git", "setsid"), say, store, img, imageVersion(img), nil, false)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), "%v", err)
	require.ErrorContains(t, err, "mkfifo is not installed")

	img = &config.Image{Name: "nosetsid", Base: base, User: "root", Shell: "bash"}
	said = nil
	require.NoError(t, checkGuestTools(context.Background(), newShellGuest(t, "bash", "git", "mkfifo"), say, store, img, imageVersion(img), nil, false))
	require.Contains(t, strings.Join(said, "\n"), "setsid is not installed")
}
