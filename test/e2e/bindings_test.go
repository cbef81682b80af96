//go:build e2e

package e2e

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirtxml"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// TestStaleFilterBindings: libvirt 9.0 under its polkit access driver (the
// rig's default) leaves a stopped domain's network filter binding behind
// when the client whose call stopped it has exited before libvirt's
// teardown asked polkit (libvirtd: "Unable to release network device
// 'vnetN'"; a prepare or cleanup killed in the middle of a start or a
// destroy), and then refuses to start the next domain it gives that tap
// name ("binding 'vnetN' already exists"): a job failed on it. Such a
// binding is made here by hand for the tap name libvirt gives next: the
// next prepare removes it, says so and starts; gc removes another; a
// binding of a machine that runs is kept.
func TestStaleFilterBindings(t *testing.T) {
	r := setup(t)
	first := newStageRunner(t, r)
	require.Equal(t, 0, first.run(t, "config").code)
	res := first.run(t, "prepare")
	require.Equal(t, 0, res.code, "%s\n%s", res.stdout, res.stderr)
	t.Cleanup(func() { first.run(t, "cleanup") })
	name := first.name(t)
	dev := r.tapOf(t, name)
	n, err := strconv.Atoi(strings.TrimPrefix(dev, "vnet"))
	require.NoError(t, err, "libvirt names the tap vnetN: %s", dev)
	// The machine prefix of this installation: the name without its last
	// two parts (instance tag and job id).
	parts := strings.Split(name, "-")
	prefix := strings.Join(parts[:len(parts)-2], "-") + "-"

	next := fmt.Sprintf("vnet%d", n+1)
	r.staleBinding(t, next, prefix+"gone-1")
	second := newStageRunner(t, r)
	require.Equal(t, 0, second.run(t, "config").code)
	res = second.run(t, "prepare")
	t.Cleanup(func() { second.run(t, "cleanup") })
	require.Equal(t, 0, res.code, "%s\n%s", res.stdout, res.stderr)
	require.Contains(t, res.stdout, "removed 1 stale network filter binding(s) left by machines libvirt could not release ("+next+" ("+vm.FilterName+" of "+prefix+"gone-1)); starting again")
	require.NotContains(t, r.staleBindings(t), "binding "+dev+" "+name, "a running machine's binding is not stale")

	r.staleBinding(t, "vnet9999", prefix+"gone-2")
	out, err := r.admin("gc").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "removed stale network filter binding vnet9999 ("+vm.FilterName+" of "+prefix+"gone-2) (its machine did not run)")
	require.Empty(t, r.staleBindings(t))
	require.Equal(t, 0, first.run(t, "cleanup").code)
	require.Equal(t, 0, second.run(t, "cleanup").code)
	r.requireNoLeftovers(t, "after both jobs")
}

// tapOf is the host-side device of the running domain's interface.
func (r *rig) tapOf(t *testing.T, name string) string {
	t.Helper()
	d, err := r.conn.LookupDomainByName(name)
	require.NoError(t, err)
	defer d.Free()
	x, err := d.GetXMLDesc(0)
	require.NoError(t, err)
	var dx libvirtxml.Domain
	require.NoError(t, dx.Unmarshal(x))
	require.NotNil(t, dx.Devices)
	require.NotEmpty(t, dx.Devices.Interfaces)
	require.NotNil(t, dx.Devices.Interfaces[0].Target)
	return dx.Devices.Interfaces[0].Target.Dev
}

// staleBinding makes the binding libvirt would have left for owner on tap
// dev (removed again at the end of the test if it is still there).
func (r *rig) staleBinding(t *testing.T, dev, owner string) {
	t.Helper()
	b := libvirtxml.NWFilterBinding{
		Owner:   &libvirtxml.NWFilterBindingOwner{Name: owner, UUID: "27923c66-193d-4813-b24b-72b530aae599"},
		PortDev: &libvirtxml.NWFilterBindingPortDev{Name: dev},
		MAC:     &libvirtxml.NWFilterBindingMAC{Address: "52:54:00:d6:94:ae"},
		FilterRef: &libvirtxml.NWFilterBindingFilterRef{Filter: vm.FilterName, Parameters: []libvirtxml.NWFilterBindingFilterParam{
			{Name: "DENY_HOST", Value: "0.0.0.0"}, {Name: "DENY_PORT", Value: "1"}, {Name: "DHCPSERVER", Value: r.gateway(t)},
			{Name: "IP", Value: "10.213.7.250"}, {Name: "MAC", Value: "52:54:00:d6:94:ae"},
		}},
	}
	x, err := b.Marshal()
	require.NoError(t, err)
	nb, err := r.conn.NWFilterBindingCreateXML(x, 0)
	require.NoError(t, err)
	_ = nb.Free()
	t.Cleanup(func() {
		if nb, err := r.conn.LookupNWFilterBindingByPortDev(dev); err == nil {
			_ = nb.Delete()
			_ = nb.Free()
		}
	})
}
