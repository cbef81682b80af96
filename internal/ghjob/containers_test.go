package ghjob

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghhooks"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

func TestParsePorts(t *testing.T) {
	p, err := parsePorts([]byte("5432/tcp -> 0.0.0.0:40123\n53/udp -> 0.0.0.0:40124\n80/tcp -> [::]:8080\n"))
	require.NoError(t, err)
	require.Equal(t, map[string]string{"5432": "40123", "53": "40124", "80": "8080"}, p)
	p, err = parsePorts(nil)
	require.NoError(t, err)
	require.Empty(t, p)
	_, err = parsePorts([]byte("Error: no such container\n"))
	require.ErrorContains(t, err, `podman port: "Error: no such container" is not a port mapping`)
}

func TestStartServices(t *testing.T) {
	work := "/home/runner/_work"
	h := &hook{g: config.GitHubHooks{WorkDir: work}, say: func(string, ...any) {}}
	fg := &fakeGuest{answers: map[string]string{
		podman + " run ":                        "feed01\n",
		podman + " port lve-gh-1-job-svc-db":    "5432/tcp -> 0.0.0.0:40001\n",
		podman + " port lve-gh-1-job-svc-cache": "",
	}}
	ep := "/bin/svcserver"
	svcs := []ghhooks.Container{
		{ContextName: "db", Image: "alpine:3.19", EntryPoint: &ep, EntryPointArgs: []string{"-v"},
			Env:          map[string]string{"MARKER": "m", "DB_PASSWORD": "svc-s3cret"},
			PortMappings: []string{"5432"}, UserMounts: []ghhooks.Mount{{Source: work + "/data", Target: "/data"}}},
		{ContextName: "cache", Image: "alpine:3.19"},
	}
	st := ghhooks.State{Network: "lve-gh-1", Container: "lve-gh-1-job"}
	got, err := h.startServices(context.Background(), &guest{c: fg}, svcs, [][]string{{"--cpus=1"}, nil}, &st)
	require.NoError(t, err)
	require.Equal(t, []ghhooks.ServiceContext{
		{ContextName: "db", Image: "alpine:3.19", ID: "feed01", Network: "lve-gh-1", Ports: map[string]string{"5432": "40001"}},
		{ContextName: "cache", Image: "alpine:3.19", ID: "feed01", Network: "lve-gh-1"},
	}, got)
	require.Equal(t, map[string]string{"db": "lve-gh-1-job-svc-db", "cache": "lve-gh-1-job-svc-cache"}, st.Services)

	var runs [][]string
	var envs [][]string
	for i, a := range fg.calls {
		require.NotContains(t, strings.Join(a, " "), "svc-s3cret", "no value on a command line")
		if len(a) > 1 && a[1] == "run" {
			runs, envs = append(runs, a), append(envs, fg.envs[i])
		}
	}
	require.Len(t, runs, 2)
	require.Equal(t, []string{podman, "run", "--detach", "--pull=never", "--name", "lve-gh-1-job-svc-db", "--label", services.Label,
		"--network", "lve-gh-1", "--network-alias", "db", "--env", "DB_PASSWORD", "--env", "MARKER",
		"--mount", "type=bind,source=" + work + "/data,destination=/data", "--publish", "5432/tcp", "--cpus=1",
		`--entrypoint=["/bin/svcserver"]`, "docker.io/library/alpine:3.19", "-v"}, runs[0])
	require.Equal(t, []string{"DB_PASSWORD=svc-s3cret", "MARKER=m"}, envs[0])
	require.Equal(t, []string{podman, "run", "--detach", "--pull=never", "--name", "lve-gh-1-job-svc-cache", "--label", services.Label,
		"--network", "lve-gh-1", "--network-alias", "cache", "docker.io/library/alpine:3.19"}, runs[1],
		"no entry point: the image's own; no ports asked: none read")
	pulls := 0
	for _, a := range fg.calls {
		require.NotEqual(t, []string{podman, "port", "lve-gh-1-job-svc-cache"}, a)
		if len(a) > 1 && a[1] == "pull" {
			pulls++
		}
	}
	require.Equal(t, 1, pulls, "two services of one image: one pull")

	// a service that fails to start fails the prepare, naming it
	_, err = h.startServices(context.Background(), &guest{c: &fakeGuest{fail: podman + " run "}}, svcs[:1], [][]string{nil}, &st)
	require.ErrorContains(t, err, "start the service db failed (exit status 125)")
}

// stepGuest answers podman run with a status and what a step prints.
type stepGuest struct {
	fakeGuest
	code int
	err  error
}

func (s *stepGuest) Exec(ctx context.Context, argv, env []string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	code, _ := s.fakeGuest.Exec(ctx, argv, env, stdin, stdout, stderr)
	if len(argv) > 2 && argv[1] == "run" {
		_, _ = stdout.Write([]byte("step output\n"))
		return s.code, s.err
	}
	return code, nil
}

func TestRunStep(t *testing.T) {
	work := "/home/runner/_work"
	var stdout, stderr bytes.Buffer
	h := &hook{g: config.GitHubHooks{WorkDir: work}, e: Env{Stdout: &stdout, Stderr: &stderr}, say: func(string, ...any) {}}
	st := &ghhooks.State{Network: "lve-gh-1", Container: "lve-gh-1-job"}
	ep := "sh"
	c := &ghhooks.Container{Image: "alpine:3.19", EntryPoint: &ep, EntryPointArgs: []string{"-c", "echo hi > out"},
		Env: map[string]string{"TOKEN": "step-s3cret"}, WorkingDir: "/github/workspace",
		SystemMounts: []ghhooks.Mount{{Source: work + "/repo/repo", Target: "/github/workspace"}, {Source: "/home/runner/externals", Target: "/__e"}}}
	sg := &stepGuest{code: 7}
	err := h.runStep(context.Background(), &guest{c: sg}, st, c, []string{"--memory=1g"})
	var ee *ExitError
	require.ErrorAs(t, err, &ee, "the container's status is the hook's")
	require.Equal(t, 7, ee.Code)
	require.Equal(t, "step output\n", stdout.String(), "the step's output streams to the hook's")

	var run []string
	var name string
	for i, a := range sg.calls {
		require.NotContains(t, strings.Join(a, " "), "step-s3cret")
		if len(a) > 1 && a[1] == "run" {
			run = a
			name = a[5]
			require.Equal(t, []string{"TOKEN=step-s3cret"}, sg.envs[i])
		}
	}
	require.True(t, strings.HasPrefix(name, "lve-gh-1-job-step-"), name)
	require.Equal(t, []string{podman, "run", "--rm", "--pull=never", "--name", name, "--label", services.Label, "--network", "lve-gh-1",
		"--workdir", "/github/workspace", "--env", "TOKEN",
		"--mount", "type=bind,source=" + work + "/repo/repo,destination=/github/workspace", "--memory=1g",
		`--entrypoint=["sh"]`, "docker.io/library/alpine:3.19", "-c", "echo hi > out"}, run)
	require.Equal(t, []string{podman, "pull", "--quiet", "docker.io/library/alpine:3.19"}, sg.calls[0])
	require.Equal(t, rmArgv(name), sg.calls[len(sg.calls)-1], "the container goes after the step")

	// a Dockerfile: built in the VM from its directory, run, then both go
	df := work + "/repo/repo/.github/act/Dockerfile"
	sg = &stepGuest{}
	stdout.Reset()
	require.NoError(t, h.runStep(context.Background(), &guest{c: sg}, st, &ghhooks.Container{Dockerfile: &df}, nil))
	require.Len(t, sg.calls, 4)
	b := sg.calls[0]
	require.Equal(t, []string{podman, "build", "--label", services.Label, "--file", df, "--tag"}, b[:7])
	tag := b[7]
	require.Equal(t, work+"/repo/repo/.github/act", b[8], "the Dockerfile's directory is the context")
	require.True(t, strings.HasPrefix(tag, "localhost/lve-gh-1-job-step-") && strings.HasSuffix(tag, ":latest"), tag)
	require.Equal(t, tag, sg.calls[1][len(sg.calls[1])-1], "the step runs the built image")
	require.Equal(t, rmiArgv(tag), sg.calls[3], "the built image goes after the step")

	// a lost connection is the hook's failure, not a step status
	sg = &stepGuest{err: errors.New("connection lost")}
	err = h.runStep(context.Background(), &guest{c: sg}, st, &ghhooks.Container{Image: "alpine:3.19"}, nil)
	require.ErrorContains(t, err, "connection lost")
	require.False(t, errors.As(err, &ee))
}

// healthGuest answers podman healthcheck run NAME from a list of exit
// statuses per container (the last one repeats), every other command 0.
type healthGuest struct {
	fakeGuest
	codes map[string][]int
	runs  map[string]int
}

func (g *healthGuest) Exec(ctx context.Context, argv, env []string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	if len(argv) == 4 && argv[1] == "healthcheck" && argv[2] == "run" {
		g.mu.Lock()
		defer g.mu.Unlock()
		cs, ok := g.codes[argv[3]]
		if !ok {
			_, _ = io.WriteString(stderr, "Error: container "+argv[3]+" has no defined healthcheck")
			return 125, nil
		}
		i := min(g.runs[argv[3]], len(cs)-1)
		g.runs[argv[3]]++
		if cs[i] < 0 { // a check that hangs
			g.mu.Unlock()
			<-ctx.Done()
			g.mu.Lock()
			return -1, ctx.Err()
		}
		if cs[i] == 1 {
			_, _ = io.WriteString(stdout, "unhealthy\n")
		}
		return cs[i], nil
	}
	return g.fakeGuest.Exec(ctx, argv, env, stdin, stdout, stderr)
}

// prepare_job waits for each service with a health check to be healthy
// (as the Docker hook does), not for one without; one that stays
// unhealthy fails it, saying so.
func TestStartServicesWaitsForHealth(t *testing.T) {
	var said []string
	h := &hook{g: config.GitHubHooks{WorkDir: "/home/runner/_work", HealthTimeout: config.Duration(30 * time.Second)},
		say: func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }}
	svcs := []ghhooks.Container{{ContextName: "db", Image: "alpine:3.19"}, {ContextName: "cache", Image: "alpine:3.19"}}
	st := ghhooks.State{Network: "lve-gh-1", Container: "lve-gh-1-job"}
	g := &healthGuest{codes: map[string][]int{"lve-gh-1-job-svc-db": {1, 1, 0}}, runs: map[string]int{}}
	_, err := h.startServices(context.Background(), &guest{c: g}, svcs, [][]string{nil, nil}, &st)
	require.NoError(t, err)
	require.Equal(t, 3, g.runs["lve-gh-1-job-svc-db"], "checked until healthy")
	require.Contains(t, strings.Join(said, "\n"), "The service db is healthy after")
	require.NotContains(t, strings.Join(said, "\n"), "The service cache is healthy", "no health check: not waited for")

	h.g.HealthTimeout = config.Duration(1500 * time.Millisecond)
	g = &healthGuest{codes: map[string][]int{"lve-gh-1-job-svc-db": {1}}, runs: map[string]int{}}
	_, err = h.startServices(context.Background(), &guest{c: g}, svcs[:1], [][]string{nil}, &st)
	require.ErrorContains(t, err, "the service db is not healthy after")
	// Two checks 1 s apart fit in 1.5 s; a loaded machine may leave room for one.
	require.Regexp(t, `github_hooks\.health_timeout = 1\.5s, allowed 1s to 30m; [12] checks, podman's last answer "unhealthy"`, err.Error())

	// A check that hangs ends with health_timeout (and a little grace).
	healthGrace = 100 * time.Millisecond
	t.Cleanup(func() { healthGrace = 5 * time.Second })
	h.g.HealthTimeout = config.Duration(time.Second)
	g = &healthGuest{codes: map[string][]int{"lve-gh-1-job-svc-db": {-1}}, runs: map[string]int{}}
	t0 := time.Now()
	_, err = h.startServices(context.Background(), &guest{c: g}, svcs[:1], [][]string{nil}, &st)
	require.ErrorContains(t, err, "its health check did not answer (github_hooks.health_timeout = 1s")
	require.Less(t, time.Since(t0), 5*time.Second)

	g = &healthGuest{codes: map[string][]int{"lve-gh-1-job-svc-db": {2}}, runs: map[string]int{}}
	_, err = h.startServices(context.Background(), &guest{c: g}, svcs[:1], [][]string{nil}, &st)
	require.ErrorContains(t, err, "the health check of the service db failed (exit status 2)")
}

// A mount under the externals is bound read-only when the externals are
// in the VM, whatever the runner asks; left out when they are not.
func TestRunArgvExternalsReadOnly(t *testing.T) {
	var said []string
	h := &hook{g: config.GitHubHooks{WorkDir: "/r/_work", ExternalsDir: "/r/externals"},
		say: func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }}
	c := &ghhooks.Container{SystemMounts: []ghhooks.Mount{
		{Source: "/r/externals", Target: "/__e"},
		{Source: "/r/_work", Target: "/__w"},
	}}
	argv, _ := h.runArgv([]string{podman, "run"}, c, "n", "net", nil, nil)
	require.NotContains(t, strings.Join(argv, " "), "/__e", "externals not shared: not mounted")
	require.Contains(t, argv, "type=bind,source=/r/_work,destination=/__w")
	require.Contains(t, strings.Join(said, "\n"), "Not mounted in n: /r/externals at /__e (not shared with the VM)")
	h.extShared = true
	argv, _ = h.runArgv([]string{podman, "run"}, c, "n", "net", nil, nil)
	require.Contains(t, argv, "type=bind,source=/r/externals,destination=/__e,readonly=true", "read-only although the runner asked for it writable")
	require.Contains(t, argv, "type=bind,source=/r/_work,destination=/__w")
}
