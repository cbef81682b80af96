package jobvm

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

const controller = lifecycletest.Controller

func newGuest(t *testing.T, hv *vmtest.Fake) *lifecycletest.Guest {
	return lifecycletest.NewGuest(t, hv)
}

// newHost is a Host of cfg on the fake hypervisor whose guests answer SSH
// on 127.0.0.1:sshPort.
func newHost(cfg *config.Config, hv *vmtest.Fake, sshPort int, s *lifecycletest.Sayings) *Host {
	m := lifecycle.New(cfg, hv, controller, lifecycle.Options{Say: s.Say})
	m.SSHPort, m.SSHPollInterval, m.AddressPollInterval = sshPort, 20*time.Millisecond, 10*time.Millisecond
	return New(m)
}

// manager is a Host with one image, tiny, on the fake hypervisor and
// guest.
func manager(t *testing.T, hv *vmtest.Fake, g *lifecycletest.Guest) (*Host, *config.Image) {
	cfg, img := lifecycletest.TinyConfig(t)
	return newHost(cfg, hv, g.Port(), lifecycletest.NewSayings(t)), img
}

func testRequest(img *config.Image) lifecycle.Request {
	return lifecycle.Request{Name: "lve-0123abcd-7", Image: img, VCPUs: 1, MemoryMiB: 256, Frontend: "test", Job: "7", Lifetime: time.Hour}
}

func requireNothingLeft(t *testing.T, hv *vmtest.Fake, m *Host) {
	t.Helper()
	lifecycletest.RequireNothingLeft(t, hv, m.Manager().Store)
}

// owned is an ownership record of this installation with that deadline.
func owned(t *testing.T, deadline time.Time) string {
	x, err := vm.MarshalOwner(vm.Owner{Controller: controller, Job: "1", Deadline: deadline})
	require.NoError(t, err)
	return x
}
