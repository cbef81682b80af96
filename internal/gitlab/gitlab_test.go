package gitlab

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/libvirtvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestReadJobFromPayload(t *testing.T) {
	env := map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json", "CUSTOM_ENV_CI_JOB_ID": "999", "CUSTOM_ENV_CI_JOB_IMAGE": "forged"}
	var warned []string
	j, err := ReadJob(envOf(env), false, func(s string) { warned = append(warned, s) })
	require.NoError(t, err)
	require.Equal(t, int64(1000), j.ID, "a forged CUSTOM_ENV_CI_JOB_ID is ignored")
	require.Equal(t, 30*time.Minute, j.Timeout)
	require.Equal(t, ImageRequest{Name: "tiny", Written: "tiny"}, j.Image)
	require.Equal(t, InstanceOf("", ""), j.Instance, "the payload has neither CI_SERVER_URL nor CI_RUNNER_ID")
	require.True(t, j.FromPayload)
	require.Empty(t, warned)
}

func TestReadJobFallbackAndErrors(t *testing.T) {
	// No payload file: a system failure that names the way out...
	var warned []string
	env := map[string]string{"CUSTOM_ENV_CI_JOB_ID": "77", "CUSTOM_ENV_CI_JOB_IMAGE": "debian-12",
		"CUSTOM_ENV_CI_SERVER_URL": "https://gitlab.example.com", "CUSTOM_ENV_CI_RUNNER_ID": "7"}
	_, err := ReadJob(envOf(env), false, func(s string) { warned = append(warned, s) })
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, "JOB_RESPONSE_FILE is not set")
	require.ErrorContains(t, err, "insecure_job_id_from_env = true")
	require.Empty(t, warned)

	// ...unless the administrator accepts the job-controlled id.
	j, err := ReadJob(envOf(env), true, func(s string) { warned = append(warned, s) })
	require.NoError(t, err)
	require.Equal(t, int64(77), j.ID)
	require.Equal(t, ImageRequest{Name: "debian-12", Written: "debian-12"}, j.Image)
	require.Equal(t, InstanceOf("https://gitlab.example.com", "7"), j.Instance)
	require.False(t, j.FromPayload)
	require.Len(t, warned, 1)
	require.Contains(t, warned[0], "insecure_job_id_from_env")

	for _, bad := range []string{"", "-1", "0", "1e3", "77; rm -rf /", "../1"} {
		_, err := ReadJob(envOf(map[string]string{"CUSTOM_ENV_CI_JOB_ID": bad}), true, func(string) {})
		require.Error(t, err, "%q", bad)
	}

	dir := t.TempDir()
	_, err = ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": filepath.Join(dir, "missing.json")}), false, func(string) {})
	require.ErrorContains(t, err, "JOB_RESPONSE_FILE")

	corrupt := filepath.Join(dir, "corrupt.json")
	require.NoError(t, os.WriteFile(corrupt, []byte(`{"id":5,"token":"secret-token-xyz",`), 0o600))
	_, err = ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": corrupt}), false, func(string) {})
	require.Error(t, err)
	require.NotContains(t, err.Error(), "secret-token-xyz")

	noID := filepath.Join(dir, "noid.json")
	require.NoError(t, os.WriteFile(noID, []byte(`{"token":"t"}`), 0o600))
	_, err = ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": noID}), false, func(string) {})
	require.ErrorContains(t, err, "no positive job id")

	wrongType := filepath.Join(dir, "wrongtype.json")
	require.NoError(t, os.WriteFile(wrongType, []byte(`{"id":"1000"}`), 0o600))
	_, err = ReadJob(envOf(map[string]string{"JOB_RESPONSE_FILE": wrongType}), false, func(string) {})
	require.Error(t, err)
}

func testConfig(t *testing.T) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(`
state_dir = "` + t.TempDir() + `"
default_image = "tiny"
[images.tiny]
base = "/img/tiny.qcow2"
builds_dir = "/builds"
[images.debian-12]
base = "/img/debian.qcow2"
builds_dir = "/srv/builds"
cache_dir = "/srv/cache"
`))
	require.NoError(t, err)
	return cfg
}

// asked is an image request written without variables.
func asked(name string) ImageRequest { return ImageRequest{Name: name, Written: name} }

func TestChooseImage(t *testing.T) {
	cfg := testConfig(t)
	img, err := ChooseImage(cfg, asked(""))
	require.NoError(t, err)
	require.Equal(t, "tiny", img.Name)
	img, err = ChooseImage(cfg, asked("debian-12"))
	require.NoError(t, err)
	require.Equal(t, "debian-12", img.Name)
	for _, hostile := range []string{
		"../../etc/passwd", "/img/tiny.qcow2", "tiny\x00", "tiny\n", "<tiny/>", "tiny'; reboot", "TINY",
		"docker.io/library/alpine:latest", strings.Repeat("x", 5000),
	} {
		_, err := ChooseImage(cfg, asked(hostile))
		require.Error(t, err, "%q", hostile)
		require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err), "a user mistake, not retried")
		require.ErrorContains(t, err, `allowed images: ["debian-12","tiny"]`)
		require.Less(t, len(err.Error()), 400, "message stays readable")
	}
}

type recorder struct{ connected int }

// testDriver connects to libvirt's in-process test driver.
func testDriver(ctx context.Context) (vm.Hypervisor, error) {
	c, err := libvirtvm.Connect(ctx, "test:///default")
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return c, nil
}

// fake is a Connector that hands out hv.
func fake(hv vm.Hypervisor) lifecycle.Connector {
	return func(context.Context, string) (vm.Hypervisor, error) { return hv, nil }
}

func (r *recorder) env(vars map[string]string, stdout *bytes.Buffer) Env {
	return Env{
		Getenv: envOf(vars), Stdout: stdout, Stderr: &bytes.Buffer{},
		Log: slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)),
		Connect: func(ctx context.Context, uri string) (vm.Hypervisor, error) {
			r.connected++
			return testDriver(ctx)
		},
	}
}

func TestConfigStageOutput(t *testing.T) {
	cfg := testConfig(t)
	var out bytes.Buffer
	r := &recorder{}
	payload := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(payload, []byte(`{"id":42,"image":{"name":"debian-12"}}`), 0o600))
	require.NoError(t, Config(context.Background(), r.env(map[string]string{"JOB_RESPONSE_FILE": payload}, &out), cfg))
	var got map[string]any
	require.NoError(t, json.Unmarshal(out.Bytes(), &got))
	require.Equal(t, "/srv/builds", got["builds_dir"])
	require.Equal(t, "/srv/cache", got["cache_dir"])
	require.Equal(t, false, got["builds_dir_is_shared"])
	require.Equal(t, "bash", got["shell"])
	require.Regexp(t, `^lve-[0-9a-f]{8}-[0-9a-f]{8}-42$`, got["hostname"])
	require.Equal(t, DriverName, got["driver"].(map[string]any)["name"])
	require.Zero(t, r.connected, "config needs no libvirt")
}

// Another host's libvirt is garm's: every GitLab stage refuses it, naming
// what to do, before it connects or writes anything.
func TestStagesRefuseAnotherHostsLibvirt(t *testing.T) {
	cfg := testConfig(t)
	cfg.LibvirtURI = "qemu+ssh://kvm2.example/system"
	payload := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(payload, []byte(`{"id":42}`), 0o600))
	r := &recorder{}
	var out bytes.Buffer
	env := r.env(map[string]string{"JOB_RESPONSE_FILE": payload}, &out)
	for name, stage := range map[string]func() error{
		"config":  func() error { return Config(context.Background(), env, cfg) },
		"prepare": func() error { return Prepare(context.Background(), env, cfg) },
		"cleanup": func() error { return Cleanup(context.Background(), env, cfg) },
	} {
		err := stage()
		require.ErrorContains(t, err, `libvirt_uri "qemu+ssh://kvm2.example/system" is another host's libvirt: GitLab's stages run on the host of their VMs`, name)
		require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err), name)
	}
	require.Zero(t, r.connected)
	require.Empty(t, out.String())
	entries, err := os.ReadDir(cfg.StateDir)
	require.NoError(t, err)
	require.Empty(t, entries, "nothing written to the state dir")
}

func TestPrepareRefusesUnknownImageBeforeLibvirt(t *testing.T) {
	cfg := testConfig(t)
	payload := filepath.Join(t.TempDir(), "response.json")
	require.NoError(t, os.WriteFile(payload, []byte(`{"id":42,"image":{"name":"../../etc/shadow"}}`), 0o600))
	r := &recorder{}
	var out bytes.Buffer
	err := Prepare(context.Background(), r.env(map[string]string{"JOB_RESPONSE_FILE": payload}, &out), cfg)
	require.Equal(t, exitcodes.BuildClass, exitcodes.Classify(err))
	require.Zero(t, r.connected, "nothing touched")
	names, err := os.ReadDir(filepath.Join(cfg.StateDir, "machines"))
	require.True(t, err != nil || len(names) == 0, "no state created")
}

func TestRunWithoutPreparedMachineIsSystemFailure(t *testing.T) {
	cfg := testConfig(t)
	script := filepath.Join(t.TempDir(), "script.")
	require.NoError(t, os.WriteFile(script, []byte("exit 0\n"), 0o600))
	r := &recorder{}
	var out bytes.Buffer
	err := Run(context.Background(), r.env(map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json"}, &out), cfg, script, "build_script")
	require.Error(t, err)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.True(t, errors.Is(err, state.ErrNoMachine), "%v", err)
}

func TestCleanupWithNothingLeftSucceeds(t *testing.T) {
	cfg := testConfig(t)
	cfg.StoragePool = "default-pool"
	r := &recorder{}
	var out bytes.Buffer
	env := r.env(map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json"}, &out)
	require.NoError(t, Cleanup(context.Background(), env, cfg))
	require.NoError(t, Cleanup(context.Background(), env, cfg), "idempotent")
	require.Equal(t, 2, r.connected)
}

func TestKeepOnFailure(t *testing.T) {
	cfg := testConfig(t)
	cfg.StoragePool = "jobs"
	hv := vmtest.New()
	env := map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json", "CUSTOM_ENV_CI_JOB_STATUS": "failed",
		"CUSTOM_ENV_LIBVIRT_EXECUTOR_KEEP_ON_FAILURE": "true"}
	e := Env{Getenv: envOf(env), Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{},
		Log:     slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)),
		Connect: fake(hv)}
	j, err := e.load(cfg)
	require.NoError(t, err)
	x, err := vm.MarshalOwner(vm.Owner{Controller: j.jobs.Controller(), Job: "1000", Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	hv.Domains[j.name] = &vmtest.Domain{OwnerXML: x, Active: true}

	// Not allowed: removed as usual.
	require.NoError(t, Cleanup(context.Background(), e, cfg))
	require.NotContains(t, hv.Domains, j.name)

	// Allowed: kept, deadline moved to now + keep_max_age.
	hv.Domains[j.name] = &vmtest.Domain{OwnerXML: x, Active: true}
	_, err = state.Store{Dir: j.cfg.StateDir}.Create(j.name)
	require.NoError(t, err)
	cfg.Debug.AllowKeepOnFailure = true
	require.NoError(t, Cleanup(context.Background(), e, cfg))
	require.Contains(t, hv.Domains, j.name)
	o, err := vm.ParseOwner(hv.Domains[j.name].OwnerXML)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(2*time.Hour), o.Deadline, time.Minute)

	// A successful job is never kept.
	env["CUSTOM_ENV_CI_JOB_STATUS"] = "success"
	require.NoError(t, Cleanup(context.Background(), e, cfg))
	require.NotContains(t, hv.Domains, j.name)
}

// Kept VMs are capped: a project keeps at most keep_max_per_project (its
// oldest goes for the newest), the host at most keep_max (then a failed
// job's VM is not kept, and no other project's VM goes for it).
func TestKeepOnFailureCapped(t *testing.T) {
	cfg := testConfig(t)
	cfg.StoragePool = "jobs"
	cfg.Debug.AllowKeepOnFailure = true
	hv := vmtest.New()
	env := map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json", "CUSTOM_ENV_CI_JOB_STATUS": "failed",
		"CUSTOM_ENV_LIBVIRT_EXECUTOR_KEEP_ON_FAILURE": "true"}
	logs := &bytes.Buffer{}
	e := Env{Getenv: envOf(env), Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{},
		Log: slog.New(slog.NewTextHandler(logs, nil)), Connect: fake(hv)}
	j, err := e.load(cfg)
	require.NoError(t, err)
	project := keepProject(j.job)
	now := time.Now()
	machine := func(id int64, keptBy string, at time.Time) string {
		name := lifecycle.MachineName(cfg.NamePrefix, j.jobs.Controller(), j.job.Instance, id)
		x, err := vm.MarshalOwner(vm.Owner{Controller: j.jobs.Controller(), Job: strconv.FormatInt(id, 10), Deadline: now.Add(time.Hour)})
		require.NoError(t, err)
		hv.Domains[name] = &vmtest.Domain{OwnerXML: x, Active: true}
		_, err = state.Store{Dir: j.cfg.StateDir}.Create(name)
		require.NoError(t, err)
		if keptBy != "" {
			require.NoError(t, state.Store{Dir: j.cfg.StateDir}.MarkKept(name, state.Kept{Project: keptBy, At: at, Until: at.Add(2 * time.Hour)}))
		}
		return name
	}

	// The project keeps one already: it goes, this job's VM stays.
	older := machine(900, project, now.Add(-time.Hour))
	machine(1000, "", time.Time{})
	require.NoError(t, Cleanup(context.Background(), e, cfg))
	require.Contains(t, hv.Domains, j.name)
	require.NotContains(t, hv.Domains, older, "the project's oldest kept VM gave way")
	require.Contains(t, logs.String(), "removed a kept VM")
	kept, err := state.Store{Dir: j.cfg.StateDir}.KeptMachines()
	require.NoError(t, err)
	require.Len(t, kept, 1)
	require.Equal(t, j.name, kept[0].Name)
	require.Equal(t, project, kept[0].Project)
	h, err := jobvm.Open(cfg, lifecycle.Options{Connect: fake(hv)})
	require.NoError(t, err)
	require.NoError(t, h.Manager().Machine(j.name).Teardown(context.Background()))
	require.NoError(t, h.Close())

	// The host keeps two (keep_max) of other projects: not kept, theirs untouched.
	a := machine(901, "https://gitlab.example#7", now.Add(-time.Hour))
	b := machine(902, "https://gitlab.example#8", now.Add(-time.Minute))
	machine(1000, "", time.Time{})
	var stderr bytes.Buffer
	e.Stderr = &stderr
	require.True(t, sayKeepPlan(e, j, cfg, j.name))
	require.Contains(t, stderr.String(), "will not be kept if the job fails: the host already keeps 2 VM(s) of failed jobs, its most (debug.keep_max = 2)")
	require.NoError(t, Cleanup(context.Background(), e, cfg))
	require.NotContains(t, hv.Domains, j.name, "not kept")
	require.Contains(t, hv.Domains, a)
	require.Contains(t, hv.Domains, b)
	require.Contains(t, logs.String(), "not keeping the failed job's VM")

	// One of them past its deadline counts for nothing (the sweep's).
	require.NoError(t, state.Store{Dir: j.cfg.StateDir}.MarkKept(a, state.Kept{Project: "https://gitlab.example#7", At: now.Add(-3 * time.Hour), Until: now.Add(-time.Hour)}))
	machine(1000, "", time.Time{})
	require.NoError(t, Cleanup(context.Background(), e, cfg))
	require.Contains(t, hv.Domains, j.name)
}

func TestPlanKeep(t *testing.T) {
	now := time.Now()
	d := config.Debug{KeepMaxPerProject: 2, KeepMax: 3}
	k := func(name, project string, ago time.Duration) state.Kept {
		return state.Kept{Name: name, Project: project, At: now.Add(-ago), Until: now.Add(time.Hour - ago)}
	}
	// Oldest first, as KeptMachines lists them.
	kept := []state.Kept{k("a1", "A", 50*time.Minute), k("a2", "A", 40*time.Minute), k("b1", "B", 30*time.Minute)}

	p := planKeep(kept, "new", "A", now, d)
	require.True(t, p.Keep)
	require.Equal(t, []state.Kept{kept[0]}, p.Release, "A gives up its oldest")
	require.Contains(t, p.Why, "a1")
	require.Contains(t, p.Why, "debug.keep_max_per_project")

	p = planKeep(kept, "new", "C", now, d)
	require.False(t, p.Keep, "the host is full and C has none to give up")
	require.Empty(t, p.Release)
	require.Contains(t, p.Why, "debug.keep_max = 3")

	p = planKeep(kept, "new", "B", now, config.Debug{KeepMaxPerProject: 2, KeepMax: 4})
	require.True(t, p.Keep)
	require.Empty(t, p.Release)
	require.Empty(t, p.Why)

	// Itself (a second cleanup) and expired marks count for nothing.
	kept = append(kept, state.Kept{Name: "new", Project: "C", At: now, Until: now.Add(time.Hour)})
	kept[0].Until = now.Add(-time.Minute)
	p = planKeep(kept, "new", "C", now, d)
	require.True(t, p.Keep)
	require.Empty(t, p.Release)
}

// When run cannot reach the job's machine, it asks libvirt what became of
// it and says so: a system failure that names the cause.
func TestRunExplainsAMachineThatIsGone(t *testing.T) {
	cfg := testConfig(t)
	hv := vmtest.New()
	e := Env{Getenv: envOf(map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json"}),
		Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{}, Log: slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)),
		Connect: fake(hv)}
	j, err := e.load(cfg)
	require.NoError(t, err)
	// The machine's record says it listens on a port where nothing does.
	recordUnreachableMachine(t, e, cfg)
	script := filepath.Join(t.TempDir(), "script.")
	require.NoError(t, os.WriteFile(script, []byte("exit 0\n"), 0o600))

	err = Run(context.Background(), e, cfg, script, "build_script")
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	require.ErrorContains(t, err, "VM "+j.name+" no longer exists")

	x, err := vm.MarshalOwner(vm.Owner{Controller: j.jobs.Controller(), Job: "1000"})
	require.NoError(t, err)
	hv.Domains[j.name] = &vmtest.Domain{OwnerXML: x, State: &vm.DomainState{Code: vm.StateShutOff, Summary: "shut off (destroyed)"}}
	err = Run(context.Background(), e, cfg, script, "build_script")
	require.ErrorContains(t, err, "VM "+j.name+" is shut off (destroyed)")
}

type fakeGuest struct {
	calls int
	out   string
}

func (f *fakeGuest) Output(context.Context, string) ([]byte, error) {
	f.calls++
	return []byte(f.out), nil
}

// The guest tool check asks the guest once per version of an image file and
// tells every job the same.
func TestGuestToolCheckIsRememberedPerImageFile(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, []byte("v1"), 0o644))
	img := &config.Image{Name: "deb", Base: base}
	store := state.Store{Dir: filepath.Join(dir, "state")}
	g := &fakeGuest{out: "git-lfs\ngitlab-runner\n"}
	var said []string
	say := func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }

	check := func(ctx context.Context, g outputter) error {
		return checkGuestTools(ctx, g, say, store, img, imageVersion(img), nil, false)
	}
	require.NoError(t, check(context.Background(), g))
	require.NoError(t, check(context.Background(), g))
	require.Equal(t, 1, g.calls, "the second job of the same image file does not ask")
	require.Len(t, said, 4, "both jobs are told: %q", said)
	require.Equal(t, said[:2], said[2:])
	require.Contains(t, said[0], "git-lfs is not installed")

	// The image file changes: ask again.
	require.NoError(t, os.WriteFile(base, []byte("version 2"), 0o644))
	g.out = ""
	said = nil
	require.NoError(t, check(context.Background(), g))
	require.Equal(t, 2, g.calls)
	require.Empty(t, said, "nothing missing in the new image")

	// Another account (its PATH) is another answer.
	img.User = "ci"
	require.NoError(t, check(context.Background(), g))
	require.Equal(t, 3, g.calls)

	// An image that cannot be examined is always asked about.
	require.NoError(t, checkGuestTools(context.Background(), g, say, store, img, nil, nil, false))
	require.NoError(t, checkGuestTools(context.Background(), g, say, store, img, nil, nil, false))
	require.Equal(t, 5, g.calls)

	// A cancelled stage is an error, not a note.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, os.WriteFile(base, []byte("version three"), 0o644))
	require.Error(t, check(ctx, &cancelledGuest{}))
}

type cancelledGuest struct{}

func (cancelledGuest) Output(ctx context.Context, _ string) ([]byte, error) { return nil, ctx.Err() }

// A machine with the guest tools disk whose guest lacks gitlab-runner has an
// image that does not mount it: the job log says so (not the plain note),
// and the answer is remembered apart from that of machines without it.
func TestGuestToolCheckKnowsTheToolsDisk(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	require.NoError(t, os.WriteFile(base, []byte("v1"), 0o644))
	img := &config.Image{Name: "deb", Base: base}
	store := state.Store{Dir: filepath.Join(dir, "state")}
	var said []string
	say := func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }
	tools := &state.Tools{Volume: "lve-0123abcd-tools-0011223344556677.iso", Source: "/usr/bin/gitlab-runner", SHA256: "ab"}

	without := &fakeGuest{out: "gitlab-runner\n"}
	require.NoError(t, checkGuestTools(context.Background(), without, say, store, img, imageVersion(img).withTools(nil), nil, false))
	require.Len(t, said, 1)
	require.Contains(t, said[0], "Note: gitlab-runner is not on the guest's PATH")

	said = nil
	unmounted := &fakeGuest{out: "gitlab-runner\n"}
	require.NoError(t, checkGuestTools(context.Background(), unmounted, say, store, img, imageVersion(img).withTools(tools), tools, false))
	require.Equal(t, 1, unmounted.calls, "another tools disk is another answer")
	require.Len(t, said, 1)
	require.Contains(t, said[0], "the image does not mount it")
	require.Contains(t, said[0], "lve-tools")
	said = nil
	require.NoError(t, checkGuestTools(context.Background(), unmounted, say, store, img, imageVersion(img).withTools(tools), tools, false))
	require.Equal(t, 2, unmounted.calls, "a missing gitlab-runner despite the disk is asked again, not remembered")

	said = nil
	mounted := &fakeGuest{out: ""}
	other := *tools
	other.Volume = "lve-0123abcd-tools-7766554433221100.iso"
	require.NoError(t, checkGuestTools(context.Background(), mounted, say, store, img, imageVersion(img).withTools(&other), &other, false))
	require.Equal(t, 1, mounted.calls)
	require.Empty(t, said)

	// Machines of two tools disks in turn (two configurations sharing the
	// state directory, e.g. one without the guest agent): each answer is
	// kept, neither evicts the other.
	third := other
	third.Volume = "lve-0123abcd-tools-0123456789abcdef.iso"
	require.NoError(t, checkGuestTools(context.Background(), mounted, say, store, img, imageVersion(img).withTools(&third), &third, false))
	require.Equal(t, 2, mounted.calls)
	for range 2 {
		for _, v := range []*state.Tools{&other, &third} {
			require.NoError(t, checkGuestTools(context.Background(), mounted, say, store, img, imageVersion(img).withTools(v), v, false))
		}
	}
	require.Equal(t, 2, mounted.calls, "both answers remembered")
}
