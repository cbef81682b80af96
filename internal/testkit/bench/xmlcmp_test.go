package bench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

func spec(name, mac string) vm.Spec {
	return vm.Spec{
		Name: name, DomainType: "qemu", VCPUs: 1, MemoryMiB: 512, Machine: "pc",
		Kernel: "/img/vmlinuz", Initrd: "/img/initrd.img", Cmdline: "console=ttyS0 root=/dev/vda rw quiet",
		Pool: "p", Network: "n", MAC: mac, Seed: []byte("x"), SeedSerial: "lve-credentials",
		OEMStrings: []string{"io.systemd.credential:ssh.authorized_keys.root=ssh-ed25519 AAAA" + name},
		ConsoleLog: "/state/" + name + "/console.log",
		Owner:      vm.Owner{Controller: "c", Frontend: "f", Job: name, Created: time.Unix(1, 0), Deadline: time.Unix(2, 0)},
	}
}

func domXML(t *testing.T, s vm.Spec) string {
	t.Helper()
	x, err := vm.DomainXML(s, "/pool/"+s.Name+".qcow2", "/pool/"+s.Name+"-seed.img")
	require.NoError(t, err)
	return x
}

func TestDomainDiffIgnoresPerMachineValues(t *testing.T) {
	a := domXML(t, spec("lvb-1234abcd-100001", "52:54:00:00:00:01"))
	b := domXML(t, spec("lvb-1234abcd-floor-0a0b0c0d", "52:54:00:aa:bb:cc"))
	diff, err := domainDiff(a, b, 10)
	require.NoError(t, err)
	require.Empty(t, diff)
}

func TestDomainDiffShowsRealDifferences(t *testing.T) {
	a := domXML(t, spec("lvb-1234abcd-100001", "52:54:00:00:00:01"))
	other := spec("lvb-1234abcd-floor-0a0b0c0d", "52:54:00:aa:bb:cc")
	other.MemoryMiB = 768
	other.Isolated = true
	diff, err := domainDiff(a, domXML(t, other), 10)
	require.NoError(t, err)
	require.Contains(t, diff, `- <memory unit="MiB">512</memory>`)
	require.Contains(t, diff, `+ <memory unit="MiB">768</memory>`)
	require.Contains(t, diff, `+ <port isolated="yes"></port>`)

	limited, err := domainDiff(a, domXML(t, other), 1)
	require.NoError(t, err)
	require.Len(t, limited, 1)

	_, err = domainDiff("<domain", a, 10)
	require.Error(t, err)
}
