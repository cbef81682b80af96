package pool

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// reloadEnv is a running service of two images, tiny and small, whose
// configuration text cfgText makes from the pool tables given; load is its
// Service.Load.
type reloadEnv struct {
	*env
	dir   string
	mu    sync.Mutex
	text  string
	fail  error
	notes []string
	done  chan error
}

func (r *reloadEnv) cfgText(stateDir, tinyPool, smallPool string) string {
	text := `
domain_type = "qemu"
default_image = "tiny"
state_dir = "` + stateDir + `"
storage_pool = "jobs"
[serve]
boot_parallelism = 1
interval = "50ms"
[timeouts]
boot = "20s"
[defaults]
vcpus = 1
memory_mib = 256
[images.tiny]
base = "` + filepath.Join(r.dir, "tiny.qcow2") + `"
[images.small]
base = "` + filepath.Join(r.dir, "small.qcow2") + `"
`
	if tinyPool != "" {
		text += "[images.tiny.pool]\n" + tinyPool
	}
	if smallPool != "" {
		text += "[images.small.pool]\n" + smallPool
	}
	return text
}

func (r *reloadEnv) set(text string, fail error) {
	r.mu.Lock()
	r.text, r.fail = text, fail
	r.mu.Unlock()
}

func (r *reloadEnv) notified() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.notes...)
}

// idleOf lists the idle machines of image.
func (r *reloadEnv) idleOf(image string) []string {
	var out []string
	for _, n := range r.idle() {
		if sb := r.standbys()[n]; sb.Record != nil && sb.Record.Standby != nil && sb.Record.Standby.Image == image {
			out = append(out, n)
		}
	}
	return out
}

func newReloadEnv(t *testing.T, ctx context.Context) *reloadEnv {
	t.Helper()
	r := &reloadEnv{dir: t.TempDir(), done: make(chan error, 1)}
	for _, n := range []string{"tiny", "small"} {
		require.NoError(t, os.WriteFile(filepath.Join(r.dir, n+".qcow2"), registrytest.Qcow2(1<<30, []byte(n)), 0o644))
	}
	r.text = r.cfgText(filepath.Join(r.dir, "state"), "idle_count = 1\n", "idle_count = 1\n")
	cfg, err := config.Parse([]byte(r.text))
	require.NoError(t, err)
	hv := vmtest.New()
	g := newGuest(t, hv)
	log := &sshtest.Buffer{}
	s := newService(t, cfg, hv, g, log)
	s.Load = func() (*config.Config, error) {
		r.mu.Lock()
		text, fail := r.text, r.fail
		r.mu.Unlock()
		if fail != nil {
			return nil, fail
		}
		return config.Parse([]byte(text))
	}
	s.Notify = func(state string) {
		r.mu.Lock()
		r.notes = append(r.notes, state)
		r.mu.Unlock()
	}
	img, _ := cfg.Image("tiny")
	r.env = &env{t: t, hv: hv, g: g, m: s.M, s: s, img: img, log: log}
	go func() { r.done <- s.Run(ctx) }()
	t.Cleanup(func() {
		_ = s.M.Close()
		if t.Failed() {
			t.Logf("service log:\n%s", log.String())
		}
	})
	return r
}

// A reload with changed pool sizes keeps the idle machines of the images
// it did not change, boots and retires to the new sizes; a bad file, or
// one that changes what only a restart can, is refused and the old
// configuration kept, said in the log. The supervisor hears READY once the
// first look is done, RELOADING and READY around each reload, and
// STOPPING at the end.
func TestReloadKeepsUnchangedPoolsAndRefusesBadFile(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := newReloadEnv(t, ctx)
	require.Eventually(t, func() bool { return len(r.idleOf("tiny")) == 1 && len(r.idleOf("small")) == 1 }, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, "READY=1", r.notified()[0][:len("READY=1")])
	tiny, small := r.idleOf("tiny")[0], r.idleOf("small")[0]

	// tiny grows to 2, small's pool goes.
	stateDir := filepath.Join(r.dir, "state")
	r.set(r.cfgText(stateDir, "idle_count = 2\n", ""), nil)
	require.NoError(t, r.s.Reload(ctx))
	require.Contains(t, r.log.String(), "configuration reloaded")
	require.Contains(t, r.log.String(), "standby pool changed")
	require.Contains(t, r.log.String(), "standby pool removed")
	require.Eventually(t, func() bool { return len(r.idleOf("tiny")) == 2 && len(r.idleOf("small")) == 0 }, 30*time.Second, 20*time.Millisecond)
	require.Contains(t, r.idleOf("tiny"), tiny, "the idle VM of the unchanged image stays")
	require.Eventually(t, func() bool { return !slices.Contains(r.domains(), small) }, 30*time.Second, 20*time.Millisecond, "small's VM retired")

	// A bad file: refused, the old configuration kept, said in the log.
	r.set("", errors.New("config x.toml: line 3: broken"))
	err := r.s.Reload(ctx)
	require.ErrorContains(t, err, "broken")
	require.Contains(t, r.log.String(), "configuration refused: kept the one in use")
	require.Contains(t, r.log.String(), "line 3: broken")
	r.set(r.cfgText(filepath.Join(r.dir, "elsewhere"), "idle_count = 2\n", ""), nil)
	require.ErrorContains(t, r.s.Reload(ctx), "state_dir")
	time.Sleep(200 * time.Millisecond) // looks under the kept configuration
	require.Len(t, r.idleOf("tiny"), 2, "the old pool sizes still hold")
	pool := r.m.Manager().Cfg.Pooled()
	require.Len(t, pool, 1)
	require.Equal(t, 2, pool[0].Pool.IdleCount)

	cancel()
	select {
	case err := <-r.done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not stop")
	}
	notes := r.notified()
	require.Equal(t, "STOPPING=1", notes[len(notes)-1])
	require.Contains(t, notes, "RELOADING=1")
	require.Len(t, r.idleOf("tiny"), 2, "idle machines stay for the next start")
}

// With Load, a changed configuration file is reloaded, not a reason to
// stop; a broken one is refused once, said in the log, and the service
// runs on.
func TestRunReloadsWhenConfigFileChanges(t *testing.T) {
	e := newEnv(t, "idle_count = 0\nmax_idle = 1\n", "interval = \"50ms\"\n", "")
	path := filepath.Join(t.TempDir(), "config.toml")
	text := string(e.m.Manager().Cfg.Text)
	require.NoError(t, os.WriteFile(path, []byte(text), 0o600))
	e.m.Manager().Cfg.Path = path
	e.s.Load = func() (*config.Config, error) { return config.Load(path) }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- e.s.Run(ctx) }()
	require.Eventually(t, func() bool { return e.m.ServiceRunning() }, 5*time.Second, 10*time.Millisecond)

	require.NoError(t, os.WriteFile(path, []byte("state_dir = 7\n"), 0o600))
	require.Eventually(t, func() bool { return strings.Contains(e.log.String(), "configuration refused") }, 10*time.Second, 20*time.Millisecond)
	require.NoError(t, os.WriteFile(path, []byte(strings.Replace(text, "max_idle = 1", "max_idle = 2", 1)), 0o600))
	require.Eventually(t, func() bool { return strings.Contains(e.log.String(), "configuration reloaded") }, 10*time.Second, 20*time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("Run ended: %v", err)
	default:
	}
	cancel()
	require.NoError(t, <-done)
}
