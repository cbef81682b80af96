package vm_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// Without a registered Connector (an executable that does not import
// internal/vm/libvirtvm), Connect says why it cannot; with one, it uses it.
func TestConnectThroughTheRegisteredConnector(t *testing.T) {
	ctx := context.Background()
	_, err := Connect(ctx, "qemu:///system")
	require.ErrorIs(t, err, ErrNoConnector)
	require.ErrorContains(t, err, "this executable was built without libvirt")

	hv := vmtest.New()
	var uris []string
	RegisterConnector(func(_ context.Context, uri string) (Hypervisor, error) {
		uris = append(uris, uri)
		return hv, nil
	})
	t.Cleanup(func() { RegisterConnector(nil) })
	got, err := Connect(ctx, "test:///default")
	require.NoError(t, err)
	require.Same(t, hv, got)
	require.Equal(t, []string{"test:///default"}, uris)
}

// LocalURI tells this host's libvirt from another's; HostKey tells one
// libvirt from another whatever the transport or its parameters.
func TestLocalURIAndHostKey(t *testing.T) {
	for uri, local := range map[string]bool{
		"qemu:///system": true, "qemu+unix:///system?socket=/run/x/libvirt-sock": true, "qemu://localhost/system": true,
		"qemu+ssh://kvm2.example/system": false, "qemu+tls://10.0.0.2/system": false, "qemu+ssh://root@kvm2:2222/system?keyfile=/k": false,
		"qemu+ssh://LOCALHOST/system": true, "qemu+ssh://localhost:2222/system": false, "qemu+ssh://%zz/system": false,
	} {
		require.Equal(t, local, LocalURI(uri), uri)
	}
	same := [][2]string{
		{"qemu+ssh://kvm2.example/system", "qemu+tls://KVM2.example/system"},
		{"qemu+ssh://kvm2.example/system?keyfile=/a", "qemu+ssh://kvm2.example/system?keyfile=/b&no_tty=1"},
		{"qemu:///system", "qemu+unix:///system"},
		{"qemu:///system", "qemu://localhost/system"},
		{"qemu:///system", "qemu+ssh://LocalHost/system"},
		{"qemu+ssh://kvm2:2222/system", "qemu+tls://kvm2/system"},
		{"qemu+tls://kvm2:16514/system", "qemu+tls://kvm2/system"},
		{"qemu+tcp://kvm2:16509/system", "qemu+ssh://root@kvm2/system"},
	}
	for _, p := range same {
		require.Equal(t, HostKey(p[0]), HostKey(p[1]), p)
	}
	differ := [][2]string{
		{"qemu+ssh://kvm2.example/system", "qemu+ssh://kvm3.example/system"},
		{"qemu:///system", "qemu:///session"},
		{"qemu:///system", "qemu+unix:///system?socket=/run/other/libvirt-sock"},
		{"qemu:///system", "qemu+tls://kvm2/system"},
		{"qemu+tls://kvm2:16514/system", "qemu+tls://kvm2:16515/system"},
		{"qemu+ssh://localhost:2222/system", "qemu:///system"},
	}
	for _, p := range differ {
		require.NotEqual(t, HostKey(p[0]), HostKey(p[1]), p)
	}
}
