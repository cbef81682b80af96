package gitlab

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// fakePodman puts a podman on PATH for the in-process guest (which runs
// its commands on this host): it logs its arguments, and runs what
// follows "exec --interactive NAME" (the fixed shell detection, reading
// the script from stdin), as the container would.
func fakePodman(t *testing.T) (logPath string) {
	dir := t.TempDir()
	logPath = filepath.Join(dir, "podman.log")
	require.NoError(t, os.WriteFile(filepath.Join(dir, "podman"), []byte(`#!/bin/sh
printf '%s\n' "$*" >>'`+logPath+`'
if [ "$1" = exec ] && [ "$2" = --interactive ]; then shift 3; exec "$@"; fi
exit 125
`), 0o755))
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	return logPath
}

// A container job's stages: the user's scripts (build_script,
// after_script) go to its container through podman exec with the script
// on stdin, its status kept as the build failure's; the runner's own
// stages (get_sources here) run on the VM's OS.
//
// The job's mapping names the container (prepare's Acquire); a job an
// earlier version prepared has it in its machine's record (an upgrade
// between its stages): both are found.
func TestRunContainerJobStageRouting(t *testing.T) {
	for _, where := range []string{"mapping", "machine record"} {
		t.Run(where, func(t *testing.T) { testContainerStageRouting(t, where) })
	}
}

func testContainerStageRouting(t *testing.T, where string) {
	j := preparedJob(t)
	log := fakePodman(t)
	store := state.Store{Dir: j.cfg.StateDir}
	if where == "mapping" {
		require.NoError(t, store.MapJob(j.name, state.JobMachine{Machine: j.name, At: time.Now(), Container: "lve-job-1000-build"}))
	} else {
		rec, err := store.Record(j.name)
		require.NoError(t, err)
		rec.Container = "lve-job-1000-build"
		require.NoError(t, store.Save(*rec))
	}

	stage := func(name string, cmds ...string) error {
		path := filepath.Join(t.TempDir(), "script.")
		require.NoError(t, os.WriteFile(path, []byte(runnerScript(j.dir, cmds...)), 0o700))
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return Run(ctx, j.e, j.cfg, path, name)
	}
	podmanCalls := func() string {
		b, _ := os.ReadFile(log)
		return string(b)
	}

	require.NoError(t, stage("get_sources", "echo fetching"))
	require.Empty(t, podmanCalls(), "the runner's stage runs on the VM's OS")

	require.NoError(t, stage("build_script", "echo in-the-container"))
	require.Contains(t, j.stdout.String(), "in-the-container")
	calls := podmanCalls()
	require.True(t, strings.HasPrefix(calls, "exec --interactive lve-job-1000-build sh -c "), calls)
	require.NotContains(t, calls, "in-the-container", "the script is never on argv")

	err := stage("after_script", "exit 7")
	code, ok := exitcodes.ScriptCode(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, 7, code)
	j.requireExitFile(t, 7)
	require.Equal(t, 2, strings.Count(podmanCalls(), "exec --interactive"))
}

// ChooseImage: a configured VM image wins; an allowed container image is
// hosted by its pattern's VM image; anything else is refused naming both
// lists. A container job's plan has its container with the image's
// builds and cache directories.
func TestChooseImageContainerJobs(t *testing.T) {
	cfg, err := config.Parse([]byte(`
default_image = "tiny"
[images.tiny]
base = "/img/tiny.qcow2"
[images.podman]
base = "/img/podman.qcow2"
builds_dir = "/b"
cache_dir = "/c"
[images.big]
base = "/img/big.qcow2"
[services]
enabled = true
[services.container_jobs]
allowed_images = ["alpine:*", "registry.example:5000/ci/**"]
vm_image = "podman"
[services.container_jobs.vm_images]
"registry.example:5000/ci/**" = "big"
`))
	require.NoError(t, err)
	for name, want := range map[string]string{"tiny": "tiny", "alpine:3.19": "podman", "registry.example:5000/ci/go:1": "big", "": "tiny"} {
		img, err := ChooseImage(cfg, ImageRequest{Name: name, Written: name})
		require.NoError(t, err, name)
		require.Equal(t, want, img.Name, name)
	}
	_, err = ChooseImage(cfg, ImageRequest{Name: "ubuntu:24.04", Written: "ubuntu:24.04"})
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, `image "ubuntu:24.04" is not offered by this runner; allowed images: ["big","podman","tiny"] (or leave image: empty for "tiny"); `+
		`or a container image this runner allows (services.container_jobs.allowed_images: ["alpine:*","registry.example:5000/ci/**"])`)

	dir := t.TempDir()
	payload := filepath.Join(dir, "job.json")
	require.NoError(t, os.WriteFile(payload, []byte(`{"id": 7, "image": {"name": "alpine:3.19", "entrypoint": ["/init"]}}`), 0o600))
	getenv := envOf(map[string]string{"JOB_RESPONSE_FILE": payload})
	img, _ := cfg.Image("podman")
	plan, _, err := servicesPlan(cfg, &job{job: &Job{ID: 7, Image: ImageRequest{Name: "alpine:3.19"}}}, img, getenv)
	require.NoError(t, err)
	require.NotNil(t, plan.Job)
	require.Equal(t, "lve-job-7-build", plan.Job.Name)
	require.Equal(t, []string{"/b", "/c"}, plan.Job.Mounts)
	require.Equal(t, []string{"/init"}, plan.Job.Entrypoint)

	_, _, err = servicesPlan(cfg, &job{job: &Job{ID: 7, Steps: true, Image: ImageRequest{Name: "alpine:3.19"}}}, img, getenv)
	require.ErrorContains(t, err, "a GitLab Steps job (run:) runs on a VM image, not in a container image")

	plan, _, err = servicesPlan(cfg, &job{job: &Job{ID: 7, Image: ImageRequest{Name: "podman"}}}, img, getenv)
	require.NoError(t, err)
	require.Nil(t, plan, "a VM image job without services: nothing to start")
}
