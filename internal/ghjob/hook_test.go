package ghjob

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/ghhooks"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

func TestStepArgv(t *testing.T) {
	st := &ghhooks.State{Container: "lve-gh-1-job", Path: "/usr/bin:/bin"}
	argv, env := stepArgv(st, &ghhooks.ScriptArgs{
		EntryPoint: "bash", EntryPointArgs: []string{"-e", "/__w/_temp/x.sh"},
		Env:         map[string]string{"B": "2", "A": "secret value", "PATH": "/custom"},
		PrependPath: []string{"/opt/tool/bin", "/opt/b"}, WorkingDir: "/__w/repo/repo",
	})
	require.Equal(t, []string{podman, "exec", "--workdir", "/__w/repo/repo", "--env", "PATH=/opt/tool/bin:/opt/b:/custom",
		"--env", "A", "--env", "B", "lve-gh-1-job", "bash", "-e", "/__w/_temp/x.sh"}, argv)
	require.Equal(t, []string{"A=secret value", "B=2"}, env, "values travel in the environment, never on the command line")
	require.NotContains(t, strings.Join(argv, " "), "secret value")

	argv, env = stepArgv(st, &ghhooks.ScriptArgs{EntryPoint: "sh", PrependPath: []string{"/x"}})
	require.Equal(t, []string{podman, "exec", "--env", "PATH=/x:/usr/bin:/bin", "lve-gh-1-job", "sh"}, argv, "the container's own PATH after prependPath")
	require.Empty(t, env)
	argv, _ = stepArgv(&ghhooks.State{Container: "c"}, &ghhooks.ScriptArgs{EntryPoint: "sh", PrependPath: []string{"/x"}})
	require.Contains(t, argv, "PATH=/x:"+defaultPath)
}

// run is Run on input under a configuration with the hook on, work dir
// work.
func run(t *testing.T, input, work string, mutate func(*config.Config)) (string, error) {
	cfg, err := config.Parse([]byte("state_dir = \"" + t.TempDir() + "\"\n[images.podman]\nbase = \"/p.qcow2\"\n[github_hooks]\nvm_image = \"podman\"\nallowed_images = [\"alpine:*\"]\nwork_dir = \"" + work + "\"\n"))
	require.NoError(t, err)
	if mutate != nil {
		mutate(cfg)
	}
	var stderr bytes.Buffer
	err = Run(context.Background(), Env{Stdin: strings.NewReader(input), Stdout: &stderr, Stderr: &stderr, Log: obs.NewTextLogger(&stderr, nil), Euid: 0}, cfg)
	return stderr.String(), err
}

func TestRunRefusesBeforeAnythingIsMade(t *testing.T) {
	work := t.TempDir()
	resp := filepath.Join(work, "resp.json")
	prep := func(args string) string {
		return `{"command":"prepare_job","responseFile":"` + resp + `","state":{},"args":` + args + `}`
	}
	_, err := run(t, prep(`{"container":null}`), work, nil)
	require.ErrorIs(t, err, ghhooks.ErrNoJobContainer)
	require.ErrorContains(t, err, "ACTIONS_RUNNER_REQUIRE_JOB_CONTAINER=true")
	_, err = run(t, prep(`{"container":{"image":"evil:1","workingDirectory":"/__w/r/r"}}`), work, nil)
	require.ErrorContains(t, err, `container.image "evil:1" is not among the images this runner allows (allowed_images: alpine:*)`)
	_, err = run(t, prep(`{"container":{"image":"alpine:3","workingDirectory":"/__w/r/r"},"services":[{"contextName":"redis","image":"redis:7"}]}`), work, nil)
	require.ErrorContains(t, err, `services[0].image "redis:7" is not among the images this runner allows (allowed_images: alpine:*)`)
	_, err = run(t, prep(`{"container":{"image":"alpine:3","workingDirectory":"/__w/r/r"},"services":[{"contextName":"db","image":"alpine:3","createOptions":"--cpus 1 --privileged"}]}`), work, nil)
	require.ErrorContains(t, err, "services[0].createOptions: --privileged is not allowed (allowed: --cpus")
	_, err = run(t, prep(`{"container":{"image":"alpine:3","workingDirectory":"/__w/r/r"},"services":[{"contextName":"-db","image":"alpine:3"}]}`), work, nil)
	require.ErrorContains(t, err, `services[0]: contextName "-db" is not a name`)
	_, err = run(t, prep(`{"container":{"image":"alpine:3","workingDirectory":"/__w/r/r","portMappings":["127.0.0.1:80:80"]}}`), work, nil)
	require.ErrorContains(t, err, `container.portMappings[0]: "127.0.0.1:80:80" is not a port mapping (PORT, VMPORT:PORT, with /tcp or /udp)`)
	_, err = run(t, prep(`["not","an","object"]`), work, nil)
	require.ErrorContains(t, err, "args: json: cannot unmarshal array")
	_, err = run(t, prep(`{"container":{"image":"alpine:3","workingDirectory":"/__w/r/r"}}`), work, nil)
	require.ErrorContains(t, err, "share_user is not set and the hook runs as root", "the share user is settled before any VM")
	_, err = run(t, prep(`{"container":{"image":"alpine:3","workingDirectory":"/__w/r/r"}}`), work, func(c *config.Config) { c.GitHubHooks.VMImage = "" })
	require.ErrorContains(t, err, "[github_hooks] vm_image is not set")
	// container steps: refused before the hook reaches for the job's VM
	step := func(args string) string {
		return `{"command":"run_container_step","state":{"machine":"lve-x-1","job":"1"},"args":` + args + `}`
	}
	_, err = run(t, step(`{"image":"evil:1"}`), work, nil)
	require.ErrorContains(t, err, `args.image "evil:1" is not among the images this runner allows (allowed_images: alpine:*)`)
	_, err = run(t, step(`{"image":"alpine:3","createOptions":"--network host"}`), work, nil)
	require.ErrorContains(t, err, "args.createOptions: --network is not allowed (allowed: --cpus")
	_, err = run(t, step(`{"image":"alpine:3","createOptions":"--cpus 1; reboot"}`), work, nil)
	require.ErrorContains(t, err, "args.createOptions: a shell operator")
	_, err = run(t, step(`{"image":"alpine:3","userMountVolumes":[{"sourceVolumePath":"/etc","targetVolumePath":"/x"}]}`), work, nil)
	require.ErrorContains(t, err, `args.userMountVolumes[0]: "/etc" is not under the runner's directories shared with the job's VM`)
	_, err = run(t, step(`{"dockerfile":"`+work+`/repo/Dockerfile"}`), work, nil)
	require.ErrorContains(t, err, "args.dockerfile: this runner does not build container steps from a Dockerfile")
	allowBuild := func(c *config.Config) { c.GitHubHooks.AllowBuild = true }
	_, err = run(t, step(`{"dockerfile":"`+filepath.Dir(work)+`/externals/Dockerfile"}`), work, allowBuild)
	require.ErrorContains(t, err, "not under the runner's work directory "+work)
	_, err = run(t, step(`{"entryPoint":"sh"}`), work, nil)
	require.ErrorContains(t, err, "args: neither image nor dockerfile")
	_, err = run(t, step(`"x"`), work, nil)
	require.ErrorContains(t, err, "args: json: cannot unmarshal string")
	_, err = run(t, `{"command":"run_container_step","state":{},"args":{"image":"alpine:3"}}`, work, nil)
	require.ErrorContains(t, err, "state: empty")
	_, err = run(t, `{"command":"nope"}`, work, nil)
	require.ErrorContains(t, err, `command "nope" is not one of prepare_job, run_script_step, run_container_step, cleanup_job`)
	out, err := run(t, `{"command":"cleanup_job","state":{}}`, work, nil)
	require.NoError(t, err, "a cleanup without a prepared job has nothing to do")
	require.Contains(t, out, "Nothing to clean up")
	_, err = run(t, `{"command":"run_script_step","state":{"machine":"lve-x-1","job":"x"},"args":{"entryPoint":"sh"}}`, work, nil)
	require.ErrorContains(t, err, `state: job "x" is not a job of this hook`)
	require.NoFileExists(t, resp)
	left, err := filepath.Glob(filepath.Join(work, "*"))
	require.NoError(t, err)
	require.Empty(t, left, "nothing written in the work directory")
}
