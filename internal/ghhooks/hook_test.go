package ghhooks

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/services"
)

// options is what an admin would configure for a runner at work/externals.
func options(t *testing.T, work, externals string) Options {
	allow, err := services.NewAllowlist([]string{"node:*", "redis", "redis:*", "alpine:*"})
	require.NoError(t, err)
	return Options{WorkDir: work, Externals: externals, Images: allow}
}

// example is the prepare_job example input (the shape of the runner's
// hook examples) with WORK and EXTERNALS made this test's directories.
func example(t *testing.T) (string, string, string) {
	dir := t.TempDir()
	work, ext := filepath.Join(dir, "_work"), filepath.Join(dir, "externals")
	b, err := os.ReadFile("testdata/prepare-job.json")
	require.NoError(t, err)
	s := strings.ReplaceAll(string(b), "EXTERNALS", ext)
	return strings.ReplaceAll(s, "WORK", work), work, ext
}

func TestDecodePrepareExample(t *testing.T) {
	in, work, ext := example(t)
	h, err := Decode(strings.NewReader(in))
	require.NoError(t, err)
	require.Equal(t, PrepareJob, h.Command)
	require.Equal(t, filepath.Join(work, "resp.json"), *h.ResponseFile)
	a, err := h.Prepare(options(t, work, ext))
	require.NoError(t, err)
	require.Equal(t, "node:22", a.Container.Image)
	require.Equal(t, "/__w/repo/repo", a.Container.WorkingDir)
	require.Len(t, a.Services, 1)
	require.Equal(t, "redis", a.Services[0].ContextName)
	require.Nil(t, a.Services[0].EntryPoint, "the example's lower-case entrypoint: null")
	args, err := options(t, work, ext).CreateArgs("container", a.Container.CreateOptions)
	require.NoError(t, err)
	require.Equal(t, []string{"--cpus=1", "--health-cmd=pg_isready -U postgres", "--init"}, args)
	for _, m := range a.Container.SystemMounts {
		require.NotEqual(t, "/var/run/docker.sock", m.Source, "the docker socket is dropped")
	}
	require.Len(t, a.Container.SystemMounts, 4)
	require.Equal(t, "docker.io", RegistryHost(a.Container.Registry.ServerURL))
	require.Equal(t, "registry.example:5000", RegistryHost("registry.example:5000"))
	args, err = options(t, work, ext).CreateArgs("c", "-e A=b --env=B= --label x=y")
	require.NoError(t, err)
	require.Equal(t, []string{"-e=A=b", "--env=B=", "--label=x=y"}, args)
}

func TestDecodeRefusesBadInput(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"not JSON", `{"command": "prepare_job"`, "not a JSON object"},
		{"two values", `{"command":"cleanup_job"} {"command":"cleanup_job"}`, "more than one JSON value"},
		{"trailing brace", `{"command":"cleanup_job"}}`, "more than one JSON value, or text after it"},
		{"control character", "{\"command\":\"prepare_job\",\"responseFile\":\"/w/a\\u001b[2Jb\",\"args\":{}}", "holds a control character"},
		{"unknown command", `{"command":"rm_rf","args":{}}`, `command "rm_rf" is not one of prepare_job, run_script_step, run_container_step, cleanup_job`},
		{"no response file", `{"command":"prepare_job","args":{}}`, "prepare_job has no responseFile"},
		{"null response file", `{"command":"prepare_job","responseFile":null,"args":{}}`, "prepare_job has no responseFile"},
		{"relative response file", `{"command":"prepare_job","responseFile":"resp.json","args":{}}`, `responseFile "resp.json": not an absolute path`},
		{"dotdot response file", `{"command":"prepare_job","responseFile":"/a/../etc/x","args":{}}`, "not a clean path"},
		{"too big", `{"command":"cleanup_job","state":"` + strings.Repeat("x", MaxInput) + `"}`, "more than 4194304 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(strings.NewReader(tc.in))
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
		})
	}
	// cleanup_job and the steps need no response file (the runner sends null).
	_, err := Decode(strings.NewReader(`{"command":"cleanup_job","responseFile":null,"state":{"machine":"m","job":"j"}}`))
	require.NoError(t, err)
}

// prepareWith decodes the example with edit applied to its args.
func prepareWith(t *testing.T, edit func(a map[string]any)) error {
	in, work, ext := example(t)
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(in), &m))
	edit(m["args"].(map[string]any))
	b, err := json.Marshal(m)
	require.NoError(t, err)
	h, err := Decode(strings.NewReader(string(b)))
	require.NoError(t, err)
	_, err = h.Prepare(options(t, work, ext))
	return err
}

func TestPrepareRefuses(t *testing.T) {
	container := func(a map[string]any) map[string]any { return a["container"].(map[string]any) }
	for _, tc := range []struct {
		name string
		edit func(a map[string]any)
		want string
	}{
		{"no container", func(a map[string]any) { delete(a, "container") }, "ACTIONS_RUNNER_REQUIRE_JOB_CONTAINER=true"},
		{"image not allowed", func(a map[string]any) { container(a)["image"] = "ubuntu:24.04" }, `container.image "ubuntu:24.04" is not among the images this runner allows (allowed_images: node:*, redis, redis:*, alpine:*)`},
		{"privileged", func(a map[string]any) { container(a)["createOptions"] = "--cpus 1 --privileged" }, "container.createOptions: --privileged is not allowed (allowed: --cpus"},
		{"volume option", func(a map[string]any) { container(a)["createOptions"] = "-v /:/host" }, "container.createOptions: -v is not allowed"},
		{"network option", func(a map[string]any) { container(a)["createOptions"] = "--network=host" }, "container.createOptions: --network is not allowed"},
		{"shell operator", func(a map[string]any) { container(a)["createOptions"] = "--cpus 1; reboot" }, "a shell operator"},
		{"unbalanced quote", func(a map[string]any) { container(a)["createOptions"] = "--label 'x" }, "container.createOptions: invalid command line string"},
		{"bare word", func(a map[string]any) { container(a)["createOptions"] = "privileged" }, `"privileged" is not an option`},
		{"missing value", func(a map[string]any) { container(a)["createOptions"] = "--cpus" }, "--cpus needs a value"},
		{"host path mount", func(a map[string]any) {
			container(a)["systemMountVolumes"] = []any{map[string]any{"sourceVolumePath": "/etc", "targetVolumePath": "/x"}}
		}, `container.systemMountVolumes[0]: "/etc" is not under the runner's directories shared with the job's VM`},
		{"user host path", func(a map[string]any) {
			container(a)["userMountVolumes"] = []any{map[string]any{"sourceVolumePath": "/root/.ssh", "targetVolumePath": "/x"}}
		}, `container.userMountVolumes[0]: "/root/.ssh" is not under`},
		{"comma in a mount", func(a map[string]any) {
			container(a)["userMountVolumes"] = []any{map[string]any{"sourceVolumePath": "vol", "targetVolumePath": "/x,source=/etc"}}
		}, "container.userMountVolumes[0]: a path holds ','"},
		{"escape by dotdot", func(a map[string]any) {
			container(a)["userMountVolumes"] = []any{map[string]any{"sourceVolumePath": "/tmp/../etc", "targetVolumePath": "/x"}}
		}, "not a clean path"},
		{"bad env name", func(a map[string]any) { container(a)["environmentVariables"] = map[string]any{"A=B": "v"} }, `container.environmentVariables: "A=B" is not a variable name`},
		{"bad port", func(a map[string]any) { container(a)["portMappings"] = []any{"0.0.0.0:80:8080"} }, `container.portMappings[0]: "0.0.0.0:80:8080" is not a port mapping`},
		{"port range", func(a map[string]any) { container(a)["portMappings"] = []any{"70000"} }, "port 70000 is not 1 to 65535"},
		{"relative workdir", func(a map[string]any) { container(a)["workingDirectory"] = "repo" }, `container.workingDirectory "repo": not an absolute path`},
		{"service name", func(a map[string]any) {
			a["services"].([]any)[0].(map[string]any)["contextName"] = "a b"
		}, `services[0]: contextName "a b" is not a name`},
		{"service twice", func(a map[string]any) {
			a["services"] = append(a["services"].([]any), a["services"].([]any)[0])
		}, `services[1]: contextName "redis" is used twice`},
		{"env without value", func(a map[string]any) { container(a)["createOptions"] = "-e AWS_SECRET_ACCESS_KEY" }, "-e wants NAME=VALUE"},
		{"env pattern", func(a map[string]any) { container(a)["createOptions"] = "--env 'AWS*'" }, "--env wants NAME=VALUE"},
		{"driver's label", func(a map[string]any) { container(a)["createOptions"] = "--label io.libvirt-executor.services=1" }, "--label io.libvirt-executor.services is the driver's own"},
		{"docker socket as user mount", func(a map[string]any) {
			container(a)["userMountVolumes"] = []any{map[string]any{"sourceVolumePath": "/var/run/docker.sock", "targetVolumePath": "/var/run/docker.sock"}}
		}, "the docker socket is not shared with a job"},
		{"registry flag", func(a map[string]any) {
			container(a)["registry"] = map[string]any{"username": "u", "password": "s3cret-registry-password", "serverUrl": "--tls-verify=false"}
		}, `container.registry.serverUrl "--tls-verify=false": not a registry`},
		{"registry user flag", func(a map[string]any) {
			container(a)["registry"] = map[string]any{"username": "--password-stdin", "password": "s3cret-registry-password", "serverUrl": "ghcr.io"}
		}, "the user name starts with '-'"},
		{"registry newline", func(a map[string]any) {
			container(a)["registry"] = map[string]any{"username": "u", "password": "s3cret-registry-password\nx", "serverUrl": "ghcr.io"}
		}, "holds a control character"},
		{"service image", func(a map[string]any) {
			a["services"].([]any)[0].(map[string]any)["image"] = "mysql:8"
		}, `services[0].image "mysql:8" is not among the images`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := prepareWith(t, tc.edit)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "s3cret-registry-password", "no secret in a message")
		})
	}
}

func TestScriptStep(t *testing.T) {
	h, err := Decode(strings.NewReader(`{"command":"run_script_step","responseFile":null,"state":{"machine":"m","job":"j"},
		"args":{"entryPoint":"bash","entryPointArgs":["-e","/__w/_temp/x.sh"],"environmentVariables":{"CI":"true"},"prependPath":["/opt/bin"],"workingDirectory":"/__w/repo/repo"}}`))
	require.NoError(t, err)
	a, err := h.Script()
	require.NoError(t, err)
	require.Equal(t, "bash", a.EntryPoint)
	require.Equal(t, []string{"-e", "/__w/_temp/x.sh"}, a.EntryPointArgs)
	st, err := h.DecodeState()
	require.NoError(t, err)
	require.Equal(t, "m", st.Machine)

	for _, tc := range []struct{ args, want string }{
		{`{"entryPoint":""}`, "args.entryPoint: empty"},
		{`{"entryPoint":"sh","prependPath":["/a:/b"]}`, "args.prependPath[0]: not a directory for PATH"},
		{`{"entryPoint":"sh","workingDirectory":"x"}`, `args.workingDirectory "x": not an absolute path`},
		{`null`, "args: missing"},
	} {
		h, err := Decode(strings.NewReader(`{"command":"run_script_step","args":` + tc.args + `}`))
		require.NoError(t, err)
		_, err = h.Script()
		require.Error(t, err, tc.args)
		require.Contains(t, err.Error(), tc.want)
	}
	for _, st := range []string{`{}`, `null`, `{"network":"x"}`} {
		h, err := Decode(strings.NewReader(`{"command":"cleanup_job","state":` + st + `}`))
		require.NoError(t, err)
		_, err = h.DecodeState()
		require.Error(t, err, st)
	}
}

func TestContainerStep(t *testing.T) {
	_, work, ext := example(t)
	o := options(t, work, ext)
	step := func(args string) error {
		h, err := Decode(strings.NewReader(`{"command":"run_container_step","args":` + args + `}`))
		require.NoError(t, err)
		_, err = h.ContainerStep(o)
		return err
	}
	require.NoError(t, step(`{"image":"alpine:3.19","entryPoint":"sh","entryPointArgs":["-c","true"],"workingDirectory":"/__w/repo/repo"}`))
	dockerfile := `{"dockerfile":"` + work + `/repo/repo/Dockerfile","workingDirectory":"/__w/repo/repo"}`
	require.ErrorContains(t, step(dockerfile), "does not build container steps from a Dockerfile", "a Dockerfile would bypass the allowed images")
	o.AllowBuild = true
	require.NoError(t, step(dockerfile))
	err := step(`{"dockerfile":"/etc/Dockerfile"}`)
	require.ErrorContains(t, err, `args.dockerfile "/etc/Dockerfile": not under the runner's directories shared with the job's VM`)
	require.ErrorContains(t, step(`{}`), "neither image nor dockerfile")
	require.ErrorContains(t, step(`{"image":"evil.example/x:1"}`), "is not among the images this runner allows")
	none, err := services.NewAllowlist(nil)
	require.NoError(t, err)
	o.Images = none
	require.ErrorContains(t, step(`{"image":"alpine:3.19"}`), "allowed_images: none configured", "an empty list allows nothing here")
}

func TestParsePort(t *testing.T) {
	p, err := ParsePort("8080:80/udp")
	require.NoError(t, err)
	require.Equal(t, Port{VM: 8080, Container: 80, Proto: "udp"}, p)
	p, err = ParsePort("6379")
	require.NoError(t, err)
	require.Equal(t, Port{Container: 6379, Proto: "tcp"}, p)
	for _, bad := range []string{"", "a", "1:2:3", "80/sctp", "0", "65536:1"} {
		_, err := ParsePort(bad)
		require.Error(t, err, bad)
	}
}

func TestWriteResponse(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "resp.json")
	r := &Response{State: State{Machine: "lve-x", Job: "k", Network: "n", Container: "c", Services: map[string]string{"redis": "s"}}, IsAlpine: true}
	r.Context.Container = ContainerContext{ID: "c", Network: "n", Ports: map[string]string{"8080": "80"}}
	r.Context.Services = []ServiceContext{{ContextName: "redis", Image: "redis", ID: "s"}}
	require.NoError(t, WriteResponse(dir, path, r))
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	var back map[string]any
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, true, back["isAlpine"])
	require.Equal(t, "lve-x", back["state"].(map[string]any)["machine"])
	require.Equal(t, "redis", back["context"].(map[string]any)["services"].([]any)[0].(map[string]any)["contextName"])
	left, _ := filepath.Glob(filepath.Join(dir, ".lve-hook-response-*"))
	require.Empty(t, left, "no temporary file left")

	require.NoError(t, WriteResponse(dir, path, r), "an answer already there is replaced")

	err = WriteResponse(dir, filepath.Join(dir, "nope", "resp.json"), r)
	require.ErrorContains(t, err, "does not exist")
	err = WriteResponse(dir, "/etc/resp.json", r)
	require.ErrorContains(t, err, "not in the runner's work directory")

	// A link a job left in the work directory is not followed: not on
	// the way to the file, and not at its name (replaced, not written
	// through).
	outside := t.TempDir()
	require.NoError(t, os.Symlink(outside, filepath.Join(dir, "_temp")))
	err = WriteResponse(dir, filepath.Join(dir, "_temp", "resp.json"), r)
	require.ErrorContains(t, err, "a symbolic link on the way")
	left, _ = filepath.Glob(filepath.Join(outside, "*"))
	require.Empty(t, left, "nothing written through the link")
	target := filepath.Join(outside, "victim")
	require.NoError(t, os.WriteFile(target, []byte("keep"), 0o644))
	require.NoError(t, os.Symlink(target, filepath.Join(dir, "linked.json")))
	require.NoError(t, WriteResponse(dir, filepath.Join(dir, "linked.json"), r))
	b, err = os.ReadFile(target)
	require.NoError(t, err)
	require.Equal(t, "keep", string(b), "the link's target is untouched")
	fi, err := os.Lstat(filepath.Join(dir, "linked.json"))
	require.NoError(t, err)
	require.True(t, fi.Mode().IsRegular(), "the link itself was replaced by the answer")
}
