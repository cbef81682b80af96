package gitlab

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// warmJob is a job whose image has a standby pool with one idle machine,
// the pool service running: the machine's guest is an in-process SSH
// server with the machine's own keys, its domain a fake's.
type warmJob struct {
	cfg     *config.Config
	hv      *vmtest.Fake
	m       *jobvm.Host
	e       Env
	stdout  *sshtest.Buffer
	standby string
}

func newWarmJob(t *testing.T) *warmJob {
	t.Helper()
	dir := t.TempDir()
	base := filepath.Join(dir, "tiny.qcow2")
	require.NoError(t, os.WriteFile(base, registrytest.Qcow2(1<<30, []byte("")), 0o644))
	cfg, err := config.Parse([]byte(`
state_dir = "` + filepath.Join(dir, "state") + `"
storage_pool = "jobs"
default_image = "tiny"
[ssh]
keepalive_interval = "1s"
keepalive_count = 10
[images.tiny]
base = "` + base + `"
[images.tiny.pool]
idle_count = 1
`))
	require.NoError(t, err)
	img, _ := cfg.Image("tiny")
	w := &warmJob{cfg: cfg, hv: vmtest.New(), stdout: &sshtest.Buffer{}}
	w.e = Env{
		Getenv: envOf(map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json"}),
		Stdout: w.stdout, Stderr: &bytes.Buffer{}, Log: slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)),
		Connect: fake(w.hv),
	}
	w.m, err = jobvm.Open(cfg, lifecycle.Options{Connect: fake(w.hv)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.m.Close() })

	// What BootStandby leaves: keys, record, a running domain of kind
	// standby; its guest serves with the machine's keys.
	w.standby, err = lifecycle.StandbyName(cfg.NamePrefix, w.m.Manager().Controller)
	require.NoError(t, err)
	keys, err := guestinit.NewKeys(w.standby)
	require.NoError(t, err)
	hostKey, err := ssh.ParsePrivateKey(keys.HostPEM)
	require.NoError(t, err)
	guest := sshtest.Start(t)
	guest.SetHostKey(hostKey)
	guest.SetAuthorizedKey(keys.Client.PublicKey())
	size := cfg.ImageSize(img)
	_, err = w.m.Manager().Store.Reserve(w.standby, state.Reservation{VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB})
	require.NoError(t, err)
	require.NoError(t, w.m.Manager().Store.SaveKey(w.standby, keys.ClientPEM))
	bv, err := state.VersionOf(base)
	require.NoError(t, err)
	require.NoError(t, w.m.Manager().Store.Save(state.Machine{
		Name: w.standby, Image: img.Name, Address: guest.Host(), Port: guest.Port(), User: img.User, Shell: img.Shell,
		HostKey: keys.HostPublicLine(), Created: time.Now().Add(-time.Minute).UTC(), BuildsDir: img.BuildsDir, CacheDir: img.CacheDir,
		Standby: &state.Standby{Image: img.Name, VCPUs: size.VCPUs, MemoryMiB: size.MemoryMiB, DiskGiB: size.DiskGiB, Base: bv,
			Spec: lifecycle.SpecFingerprint(cfg, img)},
	}))
	owner, err := vm.MarshalOwner(vm.Owner{Controller: w.m.Manager().Controller, Frontend: jobvm.FrontendStandby, Job: img.Name,
		Created: time.Now(), Deadline: time.Now().Add(time.Hour), Volumes: []string{vm.DiskVolume(w.standby)}})
	require.NoError(t, err)
	w.hv.Domains[w.standby] = &vmtest.Domain{OwnerXML: owner, Active: true}
	w.hv.Volumes["jobs/"+vm.DiskVolume(w.standby)] = nil

	// The pool service runs.
	unlock, err := w.m.LockService(context.Background())
	require.NoError(t, err)
	t.Cleanup(unlock)
	require.NoError(t, w.m.Heartbeat())
	return w
}

// A warm job end to end through the stages: prepare claims the idle
// machine (job log says so), run executes in it, cleanup removes it with
// its mapping; it never serves another job.
func TestWarmJobThroughTheStages(t *testing.T) {
	w := newWarmJob(t)
	ctx := context.Background()
	require.NoError(t, Prepare(ctx, w.e, w.cfg))
	log := w.stdout.String()
	require.Contains(t, log, "Warm start: VM "+w.standby)
	require.Contains(t, log, "(warm)")
	require.NotContains(t, log, "Created ", "no boot")

	j, err := w.e.load(w.cfg)
	require.NoError(t, err)
	defer j.jobs.Close()
	jm, err := w.m.MachineOf(j.name)
	require.NoError(t, err)
	require.Equal(t, jobvm.JobMachine{Name: w.standby, Warm: true}, jm)
	o, err := vm.ParseOwner(w.hv.Domains[w.standby].OwnerXML)
	require.NoError(t, err)
	require.Equal(t, "gitlab", o.Frontend, "the ownership record names the job now")
	require.Equal(t, "1000", o.Job)

	script := filepath.Join(t.TempDir(), "script.")
	require.NoError(t, os.WriteFile(script, []byte("echo ran-in-the-warm-vm\n"), 0o600))
	require.NoError(t, Run(ctx, w.e, w.cfg, script, "build_script"))
	require.Contains(t, w.stdout.String(), "ran-in-the-warm-vm")

	require.NoError(t, Cleanup(ctx, w.e, w.cfg))
	require.NotContains(t, w.hv.Domains, w.standby, "the warm VM is destroyed with its job")
	has, err := w.m.Manager().Store.Has(w.standby)
	require.NoError(t, err)
	require.False(t, has)
	mapped, err := w.m.Manager().Store.MachineOfJob(j.name)
	require.NoError(t, err)
	require.Nil(t, mapped)
}

// A prepare stopped right after its claim removes the machine: it never goes
// back to the pool, and the stage is a system failure.
func TestWarmPrepareStoppedAfterClaim(t *testing.T) {
	w := newWarmJob(t)
	ctx, cancel := context.WithCancel(context.Background())
	// The claim's last libvirt call is the ownership update: stop the
	// stage right then.
	w.hv.BeforeCall = func(method string) {
		if method == "SetOwner" {
			cancel()
		}
	}
	err := Prepare(ctx, w.e, w.cfg)
	require.Error(t, err)
	require.Equal(t, exitcodes.SystemClass, exitcodes.Classify(err))
	w.hv.Lock()
	_, there := w.hv.Domains[w.standby]
	w.hv.Unlock()
	require.False(t, there, "the claimed VM is removed, not returned")
	all, err := w.m.Standbys()
	require.NoError(t, err)
	require.Empty(t, all)
}
