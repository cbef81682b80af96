package lifecycle

import (
	"bytes"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

// fixedKeys are keys that stay the same from run to run (NewKeys makes fresh
// ones), so that the golden files can hold what is derived from them.
func fixedKeys(t *testing.T) *guestinit.Keys {
	client, err := ssh.NewSignerFromKey(ed25519.NewKeyFromSeed(bytes.Repeat([]byte{1}, ed25519.SeedSize)))
	require.NoError(t, err)
	host, err := ssh.NewPublicKey(ed25519.NewKeyFromSeed(bytes.Repeat([]byte{2}, ed25519.SeedSize)).Public())
	require.NoError(t, err)
	return &guestinit.Keys{
		Client: client, ClientPEM: []byte("client key: not in the spec"),
		Host: host, HostPEM: []byte("-----BEGIN OPENSSH PRIVATE KEY-----\nfixed host key\n-----END OPENSSH PRIVATE KEY-----\n"),
	}
}

func specConfig(t *testing.T, isolate bool) *config.Config {
	iso := "true"
	if !isolate {
		iso = "false"
	}
	cfg, err := config.Parse([]byte(`
domain_type = "qemu"
storage_pool = "jobs"
network = "ci"
isolate_guests = ` + iso + `
default_image = "tiny"
[timeouts]
job_slack = "30m"
[images.tiny]
base = "/img/tiny.qcow2"
boot = "kernel"
kernel = "/img/vmlinuz"
initrd = "/img/initrd.img"
cmdline = "console=ttyS0 root=/dev/vda rw"
[images.debian]
base = "/img/debian.raw"
format = "raw"
key_injection = "cloud-init"
user = "debian"
machine = "q35"
[images.bridged]
base = "/img/bridged.qcow2"
address_source = "agent"
`))
	require.NoError(t, err)
	return cfg
}

// TestMachineSpecGolden pins the machine Provision (and the benchmark's
// floor) creates for each kind of image: the spec, and the domain XML
// vm.DomainXML makes of it (vm.Engine.Create adds the volumes to the
// ownership record).
func TestMachineSpecGolden(t *testing.T) {
	created := time.Date(2026, 11, 21, 15, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name, image, domainType string
		isolate                 bool
		diskGiB                 int
		tools                   bool
	}{
		{"kernel-smbios-isolated", "tiny", "qemu", true, 0, false},
		{"kernel-smbios-not-isolated", "tiny", "qemu", false, 0, false},
		{"cloud-init-seed-kvm", "debian", "kvm", true, 20, false},
		{"guest-agent-address", "bridged", "qemu", true, 0, false},
		{"tools-disk", "tiny", "qemu", true, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := specConfig(t, tc.isolate)
			img, ok := cfg.Image(tc.image)
			require.True(t, ok)
			in := SpecInput{
				Request: Request{Name: "lve-0123abcd-7", Image: img, VCPUs: 2, MemoryMiB: 1024, DiskGiB: tc.diskGiB,
					Frontend: "gitlab", Job: "7", Lifetime: time.Hour},
				Controller: controller, DomainType: tc.domainType, Keys: fixedKeys(t),
				CloudInitSeed: []byte("a NoCloud seed image"), MAC: "52:54:00:aa:bb:cc",
				Created: created, ConsoleLog: "/state/lve-0123abcd-7/console.log",
			}
			if tc.tools {
				in.Shared = []vm.SharedDisk{{Path: "/pool/lve-0123abcd-tools-0011223344556677.iso", Serial: guestinit.ToolsDiskSerial}}
			}
			got := goldenView(t, MachineSpec(cfg, in))
			path := filepath.Join("testdata", tc.name+".golden")
			if *update {
				require.NoError(t, os.WriteFile(path, []byte(got), 0o644))
			}
			want, err := os.ReadFile(path)
			require.NoError(t, err, "run with -update to create it")
			require.Equal(t, string(want), got)
		})
	}
}

// goldenView is a spec as JSON (its seed as size and digest) followed by
// its domain XML.
func goldenView(t *testing.T, s vm.Spec) string {
	seedPath := ""
	if s.Seed != nil {
		seedPath = "/pool/" + vm.SeedVolume(s.Name)
	}
	x, err := vm.DomainXML(s, "/pool/"+vm.DiskVolume(s.Name), seedPath)
	require.NoError(t, err)
	sum := sha256.Sum256(s.Seed)
	view := struct {
		Spec       vm.Spec
		SeedBytes  int
		SeedSHA256 string
	}{s, len(s.Seed), hex.EncodeToString(sum[:])}
	view.Spec.Seed = nil
	j, err := json.MarshalIndent(view, "", "  ")
	require.NoError(t, err)
	return string(j) + "\n" + x + "\n"
}

// The inputs that differ from machine to machine end up where they belong,
// and nothing of the private host key is in the domain XML.
func TestMachineSpecUsesItsInputs(t *testing.T) {
	cfg := specConfig(t, true)
	img, _ := cfg.Image("tiny")
	keys := fixedKeys(t)
	created := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	s := MachineSpec(cfg, SpecInput{
		Request:    Request{Name: "lve-0123abcd-9", Image: img, VCPUs: 1, MemoryMiB: 256, DiskGiB: 3, Frontend: "f", Job: "9", Lifetime: 2 * time.Hour},
		Controller: controller, DomainType: "kvm", Keys: keys, MAC: "52:54:00:01:02:03", Created: created, ConsoleLog: "/c.log",
		CloudInitSeed: []byte("ignored: the image takes SMBIOS credentials"),
	})
	require.Equal(t, uint64(3)<<30, s.DiskBytes)
	require.Equal(t, created.Add(2*time.Hour+30*time.Minute), s.Owner.Deadline)
	require.Equal(t, keys.CredentialDisk(), s.Seed)
	require.Equal(t, keys.OEMStrings("lve-0123abcd-9"), s.OEMStrings)
	x, err := vm.DomainXML(s, "/d", "/s")
	require.NoError(t, err)
	require.NotContains(t, x, "fixed host key")
	require.Empty(t, s.Dirs)
	require.NotContains(t, x, "virtiofs")

	// A GitHub hook job's machine shares _work through the caller's
	// virtiofsd (Request.Dirs).
	dirs := []vm.SharedDir{{Socket: "/run/lve-hooks/lve-0123abcd-9/fs.sock", Tag: "lve-work"}}
	s = MachineSpec(cfg, SpecInput{
		Request:    Request{Name: "lve-0123abcd-9", Image: img, VCPUs: 1, MemoryMiB: 256, Dirs: dirs, Lifetime: time.Hour},
		Controller: controller, DomainType: "kvm", Keys: keys, MAC: "52:54:00:01:02:03", Created: created,
	})
	require.Equal(t, dirs, s.Dirs)
	x, err = vm.DomainXML(s, "/d", "/s")
	require.NoError(t, err)
	require.Contains(t, x, `socket="/run/lve-hooks/lve-0123abcd-9/fs.sock"`)
	require.Contains(t, x, `<access mode="shared"></access>`)
}

func TestCloudInitSeedOnlyForCloudInitImages(t *testing.T) {
	cfg := specConfig(t, true)
	tiny, _ := cfg.Image("tiny")
	seed, err := CloudInitSeed("lve-0123abcd-7", tiny, fixedKeys(t), t.TempDir())
	require.NoError(t, err)
	require.Nil(t, seed)

	debian, _ := cfg.Image("debian")
	keys, err := guestinit.NewKeys("lve-0123abcd-7")
	require.NoError(t, err)
	seed, err = CloudInitSeed("lve-0123abcd-7", debian, keys, t.TempDir())
	require.NoError(t, err)
	require.NotEmpty(t, seed)
}
