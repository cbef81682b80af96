package ghjob

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghhooks"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

// fakeGuest records each command and answers from a table by argv prefix.
type fakeGuest struct {
	mu      sync.Mutex
	calls   [][]string
	envs    [][]string
	stdins  []string
	answers map[string]string // argv joined by " " prefix -> stdout
	fail    string            // argv prefix that exits 125
}

func (f *fakeGuest) Exec(_ context.Context, argv, env []string, stdin io.Reader, stdout, _ io.Writer) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	in := ""
	if stdin != nil {
		b, _ := io.ReadAll(stdin)
		in = string(b)
	}
	f.calls, f.envs, f.stdins = append(f.calls, argv), append(f.envs, env), append(f.stdins, in)
	line := strings.Join(argv, " ")
	if f.fail != "" && strings.HasPrefix(line, f.fail) {
		return 125, nil
	}
	for p, out := range f.answers {
		if strings.HasPrefix(line, p) {
			_, _ = io.WriteString(stdout, out)
		}
	}
	return 0, nil
}

func TestStartContainer(t *testing.T) {
	work := "/home/runner/_work"
	h := &hook{g: config.GitHubHooks{WorkDir: work}, say: func(string, ...any) {}}
	fg := &fakeGuest{answers: map[string]string{
		podman + " run ":                        "0123abcd\n",
		podman + " exec lve-gh-1-job sh -c":     "/usr/local/bin:/usr/bin",
		podman + " exec lve-gh-1-job cat /etc/": "NAME=\"Alpine Linux\"\nID=alpine\n",
	}}
	g := &guest{c: fg}
	ep := "tail"
	c := &ghhooks.Container{
		Image: "alpine:3.19", WorkingDir: "/__w/r/r", EntryPoint: &ep, EntryPointArgs: []string{"-f", "/dev/null"},
		Env: map[string]string{"TOKEN": "s3cret", "PATH": "/x:/bin"},
		SystemMounts: []ghhooks.Mount{
			{Source: work, Target: "/__w"},
			{Source: "/home/runner/externals", Target: "/__e", ReadOnly: true},
			{Source: "/" + work + "/_temp/_github_home", Target: "/github/home"},
		},
		UserMounts: []ghhooks.Mount{{Source: "cache", Target: "/cache", ReadOnly: true}},
		Registry:   &ghhooks.Registry{Username: "u", Password: "registry-s3cret", ServerURL: "https://index.docker.io/v1"},
	}
	st := ghhooks.State{Network: "lve-gh-1", Container: "lve-gh-1-job"}
	id, path, alpine, err := h.startContainer(context.Background(), g, c, []string{"--init"}, st, services.Options{})
	require.NoError(t, err)
	require.Equal(t, "0123abcd", id)
	require.Equal(t, "/usr/local/bin:/usr/bin", path)
	require.True(t, alpine)

	var run []string
	var runEnv []string
	for i, a := range fg.calls {
		if len(a) > 1 && a[1] == "run" {
			run, runEnv = a, fg.envs[i]
		}
		require.NotContains(t, strings.Join(a, " "), "s3cret", "no secret on a command line")
	}
	require.Equal(t, []string{podman, "run", "--detach", "--pull=never", "--name", "lve-gh-1-job", "--label", services.Label, "--network", "lve-gh-1",
		"--workdir", "/__w/r/r", "--env", "PATH=/x:/bin", "--env", "TOKEN",
		"--mount", "type=bind,source=" + work + ",destination=/__w",
		"--mount", "type=bind,source=" + work + "/_temp/_github_home,destination=/github/home",
		"--mount", "type=volume,source=cache,destination=/cache,readonly=true",
		"--init", `--entrypoint=["tail"]`, "docker.io/library/alpine:3.19", "-f", "/dev/null"}, run)
	require.Equal(t, []string{"TOKEN=s3cret"}, runEnv, "values in podman's environment")

	// the registry login: written through stdin for the pull, removed after
	var wrote, pulled, removed bool
	for i, a := range fg.calls {
		line := strings.Join(a, " ")
		switch {
		case strings.Contains(line, services.AuthPath) && a[0] == "sh":
			wrote = true
			require.Contains(t, fg.stdins[i], `"docker.io":{"auth":"dTpyZWdpc3RyeS1zM2NyZXQ="}`)
		case strings.HasPrefix(line, podman+" pull --quiet --authfile "+services.AuthPath):
			pulled = wrote
		case strings.HasPrefix(line, "rm -f -- "+services.AuthPath):
			removed = pulled
		}
	}
	require.True(t, wrote && pulled && removed, "login written, used by the pull, then removed: %v", fg.calls)

	// a failed start: its message names it
	fg2 := &fakeGuest{fail: podman + " run "}
	_, _, _, err = h.startContainer(context.Background(), &guest{c: fg2}, &ghhooks.Container{Image: "alpine:3.19"}, nil, st, services.Options{})
	require.ErrorContains(t, err, "start the job container failed (exit status 125)")
}
