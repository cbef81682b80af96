package gitlab

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

func writeJobPayload(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
	return p
}

// A run: job (its payload has run) is a steps job; the image the runner
// gives one without image: asks for the default VM image unless an image
// of that name is configured; any other job asking for it is refused.
func TestStepsJobAndItsImage(t *testing.T) {
	cfg := testConfig(t)
	read := func(body string) *Job {
		t.Helper()
		j, err := ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": writeJobPayload(t, body)}), false, func(string) {})
		require.NoError(t, err)
		return j
	}
	steps := read(`{"id":5,"run":"[{\"name\":\"a\",\"script\":\"echo\"}]","image":{"name":"` + StepRunnerImage + `"}}`)
	require.True(t, steps.Steps)
	require.True(t, steps.Image.StepsDefault)
	img, err := ChooseImage(cfg, steps.Image)
	require.NoError(t, err)
	require.Equal(t, cfg.DefaultImage, img.Name)

	named := read(`{"id":5,"run":"[]","image":{"name":"debian-12"}}`)
	require.True(t, named.Steps)
	require.False(t, named.Image.StepsDefault)
	img, err = ChooseImage(cfg, named.Image)
	require.NoError(t, err)
	require.Equal(t, "debian-12", img.Name, "a run: job with image: gets that image")

	for _, notSteps := range []string{`{"id":5,"image":{"name":"%s"}}`, `{"id":5,"run":"","image":{"name":"%s"}}`, `{"id":5,"run":null,"image":{"name":"%s"}}`} {
		j := read(fmt.Sprintf(notSteps, StepRunnerImage))
		require.False(t, j.Steps, notSteps)
		_, err = ChooseImage(cfg, j.Image)
		require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "only a run: job gets the default for the step-runner image: %s", notSteps)
	}
	require.True(t, read(`{"id":5,"run":[{"name":"a"}]}`).Steps, "a run that is not a string is still a run: the runner says what is wrong with it")

	// Without the payload (insecure_job_id_from_env): the shim's STEPS.
	j, err := ReadJob(envOf(map[string]string{"CUSTOM_ENV_CI_JOB_ID": "7", "CUSTOM_ENV_STEPS": "[]", "CUSTOM_ENV_CI_JOB_IMAGE": StepRunnerImage}), true, func(string) {})
	require.NoError(t, err)
	require.True(t, j.Steps)
	require.True(t, j.Image.StepsDefault)

	// An image of that name configured by the admin is taken.
	cfg.Images[StepRunnerImage] = &config.Image{Name: StepRunnerImage, Base: "/img/steps.qcow2"}
	img, err = ChooseImage(cfg, steps.Image)
	require.NoError(t, err)
	require.Equal(t, StepRunnerImage, img.Name)
}

// A steps job whose guest has no step-runner fails at prepare as a
// system failure naming the fix; another job is not bothered.
func TestGuestToolCheckStepsJob(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, []byte("v1"), 0o644))
	img := &config.Image{Name: "deb", Base: base}
	store := state.Store{Dir: filepath.Join(dir, "state")}
	var said []string
	say := func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }
	g := &fakeGuest{out: "step-runner\n"}

	require.NoError(t, checkGuestTools(context.Background(), g, say, store, img, imageVersion(img), nil, false))
	require.Empty(t, said, "a job without run: is not told about step-runner")
	for range 2 { // asked, then remembered: the same answer
		err := checkGuestTools(context.Background(), g, say, store, img, imageVersion(img), nil, true)
		require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
		require.ErrorContains(t, err, `image "deb" has none on PATH`)
		require.ErrorContains(t, err, "[guest_tools] step_runner")
	}
	require.Equal(t, 1, g.calls)

	tools := &state.Tools{Volume: "lve-0123abcd-tools-0011223344556677.iso", StepRunner: &state.ToolOrigin{Source: "/usr/bin/step-runner", SHA256: "ab"}}
	err := checkGuestTools(context.Background(), g, say, store, img, imageVersion(img).withTools(tools), tools, true)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, "does not put it on PATH")
	require.ErrorContains(t, err, "/opt/libvirt-executor/bin/step-runner")

	said = nil
	has := &fakeGuest{out: ""}
	other := *tools
	other.Volume = "lve-0123abcd-tools-7766554433221100.iso"
	require.NoError(t, checkGuestTools(context.Background(), has, say, store, img, imageVersion(img).withTools(&other), &other, true))
	require.Empty(t, said, "the tools disk's step-runner: the line that describes the disk said it")

	// No step-runner on the disk, but the image has its own: the job log
	// says which one the job gets.
	without := &state.Tools{Volume: "lve-0123abcd-tools-0000000000000001.iso", Source: "/usr/bin/gitlab-runner"}
	require.NoError(t, checkGuestTools(context.Background(), has, say, store, img, imageVersion(img).withTools(without), without, true))
	require.Equal(t, []string{"step-runner for this run: job: the image's own (the VM's guest tools disk has none: [guest_tools] step_runner)"}, said)
}

// A remembered check that found no step-runner fails the next run: job
// before a VM is booted (the runner retries prepare twice more), for that
// image version and tools disk only.
func TestKnownStepRunnerMissing(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, []byte("v1"), 0o644))
	img := &config.Image{Name: "deb", Base: base}
	store := state.Store{Dir: filepath.Join(dir, "state")}
	say := func(string, ...any) {}
	tools := &state.Tools{Volume: "lve-0123abcd-tools-0011223344556677.iso", Source: "/usr/bin/gitlab-runner"}

	require.NoError(t, knownStepRunnerMissing(store, img, imageVersion(img), tools), "nothing remembered: boot and ask")
	require.Error(t, checkGuestTools(context.Background(), &fakeGuest{out: "step-runner\n"}, say, store, img, imageVersion(img).withTools(tools), tools, true))
	err := knownStepRunnerMissing(store, img, imageVersion(img), tools)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, "needs step-runner in the guest")

	withSteps := &state.Tools{Volume: "lve-0123abcd-tools-7766554433221100.iso", StepRunner: &state.ToolOrigin{Source: "/usr/bin/step-runner"}}
	require.NoError(t, knownStepRunnerMissing(store, img, imageVersion(img), withSteps), "another tools disk: boot and ask")
	require.NoError(t, os.WriteFile(base, []byte("v2 of the image"), 0o644))
	require.NoError(t, knownStepRunnerMissing(store, img, imageVersion(img), tools), "another image version: boot and ask")
	require.NoError(t, checkGuestTools(context.Background(), &fakeGuest{out: ""}, say, store, img, imageVersion(img).withTools(tools), tools, true))
	require.NoError(t, knownStepRunnerMissing(store, img, imageVersion(img), tools), "this version has one")
}

// A disk with only step-runner whose guest lacks it (a late mount) is not
// remembered: the next job asks again.
func TestGuestToolCheckStepRunnerOnlyDiskUnmounted(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, []byte("v1"), 0o644))
	img := &config.Image{Name: "deb", Base: base}
	store := state.Store{Dir: filepath.Join(dir, "state")}
	var said []string
	say := func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }
	tools := &state.Tools{Volume: "lve-0123abcd-tools-0011223344556677.iso", StepRunner: &state.ToolOrigin{Source: "/usr/bin/step-runner"}}
	g := &fakeGuest{out: "gitlab-runner\nstep-runner\n"}
	for range 2 {
		require.Error(t, checkGuestTools(context.Background(), g, say, store, img, imageVersion(img).withTools(tools), tools, true))
	}
	require.Equal(t, 2, g.calls, "a disk's program missing in the guest is asked again, not remembered")
	require.NoError(t, knownStepRunnerMissing(store, img, imageVersion(img), tools), "nothing remembered to fail on before booting")
	require.Contains(t, said[0], "Note: gitlab-runner is not on the guest's PATH: caches and artifacts", "the disk has no gitlab-runner: not a mount problem for it")
}
