package lifecycle

import (
	"bytes"
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func openConfig(t *testing.T) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(`
state_dir = "` + t.TempDir() + `"
storage_pool = "jobs"
[images.tiny]
base = "/img/tiny.qcow2"
`))
	require.NoError(t, err)
	return cfg
}

// Open keeps the installation's identity, connects only when something
// needs libvirt, and reconnects (saying so in the log) when the connection
// breaks.
func TestOpenConnectsWhenNeededAndReconnects(t *testing.T) {
	cfg := openConfig(t)
	first, second := vmtest.New(), vmtest.New()
	first.FailOn["State"] = vmtest.LostConnection("Cannot recv data")
	var uris []string
	connect := func(_ context.Context, uri string) (vm.Hypervisor, error) {
		uris = append(uris, uri)
		if len(uris) == 1 {
			return first, nil
		}
		return second, nil
	}
	var log bytes.Buffer
	m, err := Open(cfg, Options{Connect: connect, Log: slog.New(slog.NewTextHandler(&log, nil))})
	require.NoError(t, err)
	require.Empty(t, uris, "not connected before it is needed")
	again, err := Open(cfg, Options{})
	require.NoError(t, err)
	require.Equal(t, m.Controller, again.Controller, "one controller id per state directory")
	require.NoError(t, again.Close(), "never connected")

	name := MachineName(cfg.NamePrefix, m.Controller, InstanceTag("x"), 7)
	require.Equal(t, "VM "+name+" no longer exists", m.Machine(name).Explain(context.Background()),
		"answered on the second connection")
	require.Equal(t, []string{cfg.LibvirtURI, cfg.LibvirtURI}, uris)
	require.Contains(t, log.String(), "libvirt connection lost; reconnected")
	require.NoError(t, m.Dial(context.Background()), "connected already: no new dial")
	require.Len(t, uris, 2)
	require.NoError(t, m.Close())
}

// Explain gives up with ctx on a hung libvirtd, and Dial gives up on a
// connection that does not come.
func TestExplainAndDialEndWithCtx(t *testing.T) {
	cfg := openConfig(t)
	hv := vmtest.New()
	hang := make(chan struct{})
	defer close(hang)
	hv.Hang = hang
	m, err := Open(cfg, Options{Connect: func(context.Context, string) (vm.Hypervisor, error) { return hv, nil }})
	require.NoError(t, err)
	defer m.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	require.Empty(t, m.Machine("lve-0123abcd-7").Explain(ctx), "libvirt cannot tell")
	require.Less(t, time.Since(start), 3*time.Second)
	require.Equal(t, 1, hv.Hung())

	m, err = Open(cfg, Options{Connect: func(ctx context.Context, _ string) (vm.Hypervisor, error) {
		<-ctx.Done() // libvirtd accepts the socket and never answers
		return nil, ctx.Err()
	}})
	require.NoError(t, err)
	ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, m.Dial(ctx), context.DeadlineExceeded)
}

// In an executable built without libvirt (config, run: nothing imports
// internal/vm/libvirtvm) the default connection fails, saying so; Open
// itself, and everything that needs no hypervisor, works.
func TestOpenWithoutLibvirt(t *testing.T) {
	m, err := Open(openConfig(t), Options{})
	require.NoError(t, err)
	defer m.Close()
	err = m.Dial(context.Background())
	require.ErrorIs(t, err, vm.ErrNoConnector)
	require.ErrorContains(t, err, "built without libvirt")
}

// A state directory keeps one libvirt's machines: a configuration naming
// another host's libvirt is refused before anything is made (garm's entries
// for two hosts sharing one would sweep each other's machine records);
// the same libvirt through another transport is the same.
func TestOpenRefusesAnotherHostsStateDir(t *testing.T) {
	cfg := openConfig(t)
	cfg.LibvirtURI = "qemu+ssh://kvm2.example/system"
	m, err := Open(cfg, Options{})
	require.NoError(t, err)
	require.NoError(t, m.Close())
	cfg.LibvirtURI = "qemu+tls://kvm2.example/system?pkipath=/etc/pki/kvm2"
	m, err = Open(cfg, Options{ReadOnly: true})
	require.NoError(t, err)
	require.NoError(t, m.Close())

	cfg.LibvirtURI = "qemu+ssh://kvm3.example/system"
	_, err = Open(cfg, Options{})
	var he *state.HostError
	require.ErrorAs(t, err, &he)
	require.ErrorContains(t, err, "keeps the machines of libvirt qemu://kvm2.example/system, and this configuration's libvirt_uri names qemu://kvm3.example/system, another one")
	_, err = Open(cfg, Options{ReadOnly: true})
	require.ErrorAs(t, err, &he)
}
