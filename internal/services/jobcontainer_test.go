package services

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

func TestContainerHost(t *testing.T) {
	cj := config.ContainerJobs{
		AllowedImages: []string{"alpine:*", "registry.example:5000/ci/**", "docker.io/library/debian:*"},
		VMImage:       "podman",
		VMImages:      map[string]string{"registry.example:5000/ci/**": "big"},
	}
	for name, want := range map[string]string{
		"alpine:3.19":                         "podman",
		"registry.example:5000/ci/tools/go:1": "big",
		"debian:12":                           "podman", // by its fully qualified form
		"alpine":                              "",       // neither "alpine" nor docker.io/library/alpine:latest matches "alpine:*"
		"ubuntu:24.04":                        "",
		"registry.example:5000/other/x":       "",
		"not a ref":                           "",
		"":                                    "",
	} {
		got, ok := ContainerHost(cj, name)
		require.Equal(t, want != "", ok, name)
		require.Equal(t, want, got, name)
	}
	_, ok := ContainerHost(config.ContainerJobs{VMImage: "podman"}, "alpine:3")
	require.False(t, ok, "no allowed_images: no container jobs")
}

func allowAlpine(t *testing.T) *Allowlist {
	a, err := NewAllowlist([]string{"alpine:*", "registry.example:5000/**"})
	require.NoError(t, err)
	return a
}

func TestNewJobContainer(t *testing.T) {
	mounts := []string{"/builds", "/cache", "/builds"}
	c, err := NewJobContainer(&Payload{Image: Image{Name: "alpine:3.$MINOR"}, Variables: []Variable{{Key: "MINOR", Value: "19", Public: true}}},
		7, mounts, allowAlpine(t), Options{})
	require.NoError(t, err)
	require.Equal(t, "docker.io/library/alpine:3.19", c.Ref.String())
	require.Equal(t, "lve-job-7-build", c.Name)
	require.Equal(t, []string{"/builds", "/cache"}, c.Mounts)
	require.Empty(t, c.Entrypoint)
	require.Equal(t, []string{PullIfNotPresent}, c.PullPolicies)
	require.Equal(t, []string{"podman", "run", "--detach", "--pull", "never", "--name", "lve-job-7-build", "--label", Label,
		"--network", "lve-job-7",
		"--mount", "type=bind,source=/builds,destination=/builds", "--mount", "type=bind,source=/cache,destination=/cache",
		`--entrypoint=["sh","-c","trap 'exit 0' TERM INT; while :; do sleep 3600 \u0026 wait $!; done"]`,
		"docker.io/library/alpine:3.19"}, JobRunArgv("lve-job-7", *c))

	// the job's entrypoint runs with the waiting process as its command;
	// [""] clears it (the waiting process is the entrypoint)
	c, err = NewJobContainer(&Payload{Image: Image{Name: "alpine:3", Entrypoint: []string{"/init", "--flag"}, PullPolicy: []string{"always"}}},
		7, nil, allowAlpine(t), Options{})
	require.NoError(t, err)
	argv := JobRunArgv("n", *c)
	require.Equal(t, []string{`--entrypoint=["/init","--flag"]`, "docker.io/library/alpine:3", "sh", "-c"},
		argv[len(argv)-5:len(argv)-1])
	require.Equal(t, []string{PullAlways}, c.PullPolicies)
	c, err = NewJobContainer(&Payload{Image: Image{Name: "alpine:3", Entrypoint: []string{""}}}, 7, nil, allowAlpine(t), Options{})
	require.NoError(t, err)
	require.Empty(t, c.Entrypoint)

	// a secret in the name: never shown
	c, err = NewJobContainer(&Payload{Image: Image{Name: "registry.example:5000/$TOKEN"}, Variables: []Variable{{Key: "TOKEN", Value: "sekrit-img", Masked: true}}},
		7, nil, allowAlpine(t), Options{})
	require.NoError(t, err)
	require.True(t, c.Hidden)
	require.NotContains(t, c.Shown+c.image()+c.guestText("x sekrit-img"), "sekrit-img")
}

func TestNewJobContainerRefusals(t *testing.T) {
	for name, tc := range map[string]struct {
		p      Payload
		mounts []string
		o      Options
		want   string
		class  exitcodes.Class
	}{
		"not allowed": {p: Payload{Image: Image{Name: "ubuntu:24.04"}},
			want: `the job's image "ubuntu:24.04" is not among the container images this runner allows (services.container_jobs.allowed_images: "alpine:*", "registry.example:5000/**")`, class: exitcodes.BuildClass},
		"no reference": {p: Payload{Image: Image{Name: "Alpine:3"}}, want: `the job's image "Alpine:3": `, class: exitcodes.BuildClass},
		"NUL":          {p: Payload{Image: Image{Name: "alpine:3", Entrypoint: []string{"a\x00b"}}}, want: "holds a NUL byte", class: exitcodes.BuildClass},
		"too many args": {p: Payload{Image: Image{Name: "alpine:3", Entrypoint: make([]string, MaxArgs+1)}},
			want: "an entrypoint of 257 arguments (at most 256)", class: exitcodes.BuildClass},
		"policy": {p: Payload{Image: Image{Name: "alpine:3", PullPolicy: []string{"always"}}}, o: Options{AllowedPullPolicies: []string{"never"}},
			want: `the job's image "alpine:3": pull_policy "always" is not allowed by this runner (services.allowed_pull_policies: "never")`, class: exitcodes.BuildClass},
		"mount": {p: Payload{Image: Image{Name: "alpine:3"}}, mounts: []string{"/a,b"}, want: `mount "/a,b"`, class: exitcodes.SystemClass},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := NewJobContainer(&tc.p, 1, tc.mounts, allowAlpine(t), tc.o)
			require.ErrorContains(t, err, tc.want)
			require.Equal(t, tc.class, exitcodes.Classify(err))
		})
	}
}

func TestInContainer(t *testing.T) {
	for _, s := range []string{"build_script", "step_script", "step_release", "after_script"} {
		require.True(t, InContainer(s), s)
	}
	for _, s := range []string{"prepare_script", "get_sources", "clear_worktree", "restore_cache", "download_artifacts",
		"archive_cache", "archive_cache_on_failure", "upload_artifacts_on_success", "upload_artifacts_on_failure",
		"cleanup_file_variables", "some_future_stage"} {
		require.False(t, InContainer(s), s)
	}
}

func TestExecArgvIsFixed(t *testing.T) {
	require.Equal(t, []string{"podman", "exec", "--interactive", "lve-job-1-build", "sh", "-c", detectShell}, ExecArgv("lve-job-1-build"))
	require.Equal(t, []string{"podman", "exec", "lve-job-1-build", "sh", "-c", stopScripts}, StopScriptsArgv("lve-job-1-build"))
}

// A container job without services: the network, the job's image pulled,
// its directories made, its container started on the network; a pull that
// fails is a system failure naming the image.
func TestStartJobContainer(t *testing.T) {
	pl, err := NewPlan(&Payload{}, Options{JobID: 9})
	require.NoError(t, err)
	pl.Job, err = NewJobContainer(&Payload{Image: Image{Name: "alpine:3"}}, 9, []string{"/builds", "/cache"}, allowAlpine(t), Options{})
	require.NoError(t, err)
	g := &fakeGuest{rules: []rule{{prefix: "podman image exists", code: 1}}}
	var log bytes.Buffer
	_, err = Start(context.Background(), g, pl, Options{}, &log)
	require.NoError(t, err, log.String())
	lines := g.lines()
	require.Equal(t, []string{
		"podman --version",
		"podman network create --label " + Label + " lve-job-9",
		"podman image exists docker.io/library/alpine:3",
		"podman pull --quiet docker.io/library/alpine:3",
		"cat -- /etc/hosts",
	}, lines[:5])
	require.Equal(t, "mkdir -p -- /builds /cache", lines[6])
	require.True(t, strings.HasPrefix(lines[7], "podman run --detach --pull never --name lve-job-9-build"), lines[7])
	require.Contains(t, log.String(), "Started the job's container lve-job-9-build of image docker.io/library/alpine:3")
	require.NotContains(t, log.String(), "Services ready")

	g = &fakeGuest{rules: []rule{{prefix: "podman image exists", code: 1}, {prefix: "podman pull", code: 125, out: "manifest unknown"}}}
	_, err = Start(context.Background(), g, pl, Options{}, io.Discard)
	require.ErrorContains(t, err, `cannot get image docker.io/library/alpine:3 of the job's image "alpine:3" (pull policies if-not-present): if-not-present: podman pull: exit status 125: "manifest unknown"`)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))

	g = &fakeGuest{rules: []rule{{prefix: "podman image exists"}, {prefix: "podman run", code: 125, out: "no sh"}}}
	_, err = Start(context.Background(), g, pl, Options{}, io.Discard)
	require.ErrorContains(t, err, `the job's container lve-job-9-build (the job's image "alpine:3") did not start (podman run: exit status 125): "no sh"`)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
}

func TestRunStage(t *testing.T) {
	script := "#!/usr/bin/env bash\necho $'hi'\n"
	g := &fakeGuest{rules: []rule{{prefix: "podman exec --interactive c1", code: 3}}}
	err := RunStage(context.Background(), g, "c1", false, []byte(script), io.Discard, io.Discard)
	code, ok := exitcodes.ScriptCode(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, 3, code, "the script's status is the build failure's")
	require.Equal(t, script, g.calls[0].stdin, "the script goes on stdin")
	require.Equal(t, ExecArgv("c1"), g.calls[0].argv, "never on argv")
	require.Empty(t, g.calls[0].env)

	g = &fakeGuest{}
	require.NoError(t, RunStage(context.Background(), g, "c1", true, []byte(script), io.Discard, io.Discard))
	require.Equal(t, append([]string{"sudo", "-n", "--"}, ExecArgv("c1")...), g.calls[0].argv)

	// 125: the container is gone (a system failure), or it was the script's
	g = &fakeGuest{rules: []rule{{prefix: "podman exec", code: 125}, {prefix: "podman container inspect", out: "false\n"}}}
	err = RunStage(context.Background(), g, "c1", false, []byte(script), io.Discard, io.Discard)
	require.ErrorContains(t, err, "the job's container c1 is not running")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	g = &fakeGuest{rules: []rule{{prefix: "podman exec", code: 125}, {prefix: "podman container inspect", out: "true\n"}}}
	code, ok = exitcodes.ScriptCode(RunStage(context.Background(), g, "c1", false, []byte(script), io.Discard, io.Discard))
	require.True(t, ok)
	require.Equal(t, 125, code)

	// the stage cancelled: the script's processes in the container stopped
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	g = &fakeGuest{}
	err = RunStage(ctx, g, "c1", false, []byte(script), io.Discard, io.Discard)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.Equal(t, StopScriptsArgv("c1"), g.calls[len(g.calls)-1].argv)
}
