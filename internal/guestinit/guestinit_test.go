package guestinit

import (
	"encoding/base64"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	diskfs "github.com/diskfs/go-diskfs"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
)

func TestKeysAreFreshAndConsistent(t *testing.T) {
	a, err := NewKeys("lve-x-1")
	require.NoError(t, err)
	b, err := NewKeys("lve-x-1")
	require.NoError(t, err)
	require.NotEqual(t, a.ClientPEM, b.ClientPEM, "fresh per job")
	require.NotEqual(t, a.HostPEM, b.HostPEM)
	require.NotEqual(t, a.ClientPEM, a.HostPEM, "client and host keys differ")

	// The PEMs parse back to the same keys.
	cs, err := ssh.ParsePrivateKey(a.ClientPEM)
	require.NoError(t, err)
	require.Equal(t, a.Client.PublicKey().Marshal(), cs.PublicKey().Marshal())
	hs, err := ssh.ParsePrivateKey(a.HostPEM)
	require.NoError(t, err)
	require.Equal(t, a.Host.Marshal(), hs.PublicKey().Marshal())
	require.Equal(t, ssh.KeyAlgoED25519, a.Host.Type())
}

func TestOEMStrings(t *testing.T) {
	k, err := NewKeys("c")
	require.NoError(t, err)
	s := k.OEMStrings("lve-x-1")
	require.Len(t, s, 1, "only the public key travels in SMBIOS")
	require.True(t, strings.HasPrefix(s[0], "io.systemd.credential:ssh.authorized_keys.root=ssh-ed25519 "))
	pub, _, _, _, err := ssh.ParseAuthorizedKey([]byte(strings.TrimPrefix(s[0], "io.systemd.credential:ssh.authorized_keys.root=")))
	require.NoError(t, err)
	require.Equal(t, k.Client.PublicKey().Marshal(), pub.Marshal())

	require.NotContains(t, s[0], "\n", "an SMBIOS string is one line")
	require.NotContains(t, s[0], base64.StdEncoding.EncodeToString(k.HostPEM)[:40])
}

func TestCredentialDisk(t *testing.T) {
	k, err := NewKeys("c")
	require.NoError(t, err)
	disk := k.CredentialDisk()
	require.Zero(t, len(disk)%512, "whole sectors")
	text := strings.TrimRight(string(disk), "\x00")
	require.True(t, strings.HasSuffix(text, "\n"))
	prefix := "io.systemd.credential.binary:" + HostKeyCredential + "="
	line := strings.TrimSuffix(text, "\n")
	require.True(t, strings.HasPrefix(line, prefix), line)
	pemBytes, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(line, prefix))
	require.NoError(t, err)
	hs, err := ssh.ParsePrivateKey(pemBytes)
	require.NoError(t, err)
	require.Equal(t, k.Host.Marshal(), hs.PublicKey().Marshal())
}

func TestUserDataIsStructured(t *testing.T) {
	k, err := NewKeys("c")
	require.NoError(t, err)
	ci := CloudInit{InstanceID: "lve-x-1", Hostname: "lve-x-1", User: "debian"}
	ud, err := ci.UserData(k, "lve-x-1")
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(ud), "#cloud-config\n"))
	var doc struct {
		Users []struct {
			Name string   `json:"name"`
			Sudo string   `json:"sudo"`
			Keys []string `json:"ssh_authorized_keys"`
		} `json:"users"`
		SSHKeys    map[string]string `json:"ssh_keys"`
		DeleteKeys bool              `json:"ssh_deletekeys"`
	}
	require.NoError(t, json.Unmarshal(ud[len("#cloud-config\n"):], &doc))
	require.Len(t, doc.Users, 1)
	require.Equal(t, "debian", doc.Users[0].Name)
	require.Equal(t, "ALL=(ALL) NOPASSWD:ALL", doc.Users[0].Sudo)
	require.Equal(t, []string{k.AuthorizedKey("lve-x-1")}, doc.Users[0].Keys)
	// With ssh_keys present cloud-init generates no host key of its own; the
	// image's keys are deleted first.
	require.Equal(t, string(k.HostPEM), doc.SSHKeys["ed25519_private"])
	require.Equal(t, k.HostPublicLine(), doc.SSHKeys["ed25519_public"])
	require.Len(t, doc.SSHKeys, 2)
	require.True(t, doc.DeleteKeys)
}

// TestUserDataPassesCloudInitSchema guards against keys that cloud-init's
// schema (cloud-init 22.4, Debian 12) rejects: a schema error makes cloud-init
// log the whole user-data as invalid on every boot. "ssh_genkeytypes: []" was
// one (minItems 1). It also keeps out keys whose modules act after sshd has
// started ("ssh_pwauth" restarts it).
func TestUserDataPassesCloudInitSchema(t *testing.T) {
	k, err := NewKeys("c")
	require.NoError(t, err)
	for _, user := range []string{"root", "debian"} {
		ud, err := CloudInit{InstanceID: "lve-x-1", Hostname: "lve-x-1", User: user}.UserData(k, "lve-x-1")
		require.NoError(t, err)
		var doc map[string]any
		require.NoError(t, json.Unmarshal(ud[len("#cloud-config\n"):], &doc))
		known := map[string]bool{"users": true, "disable_root": true, "ssh_deletekeys": true, "ssh_keys": true}
		for key, v := range doc {
			require.True(t, known[key], "top-level key %q: check it against cloud-init's schema, then list it here", key)
			if list, ok := v.([]any); ok {
				require.NotEmpty(t, list, "%s: cloud-init's schema rejects empty lists", key)
			}
		}
		require.NotContains(t, doc, "ssh_genkeytypes", "ignored beside ssh_keys; [] fails the schema")
		require.NotContains(t, doc, "ssh_pwauth", "set-passwords would restart sshd after the executor connected")
		users := doc["users"].([]any)
		u := users[0].(map[string]any)
		require.Equal(t, user, u["name"])
		require.Equal(t, "/bin/bash", u["shell"])
		require.Equal(t, true, u["lock_passwd"])
		if user == "root" {
			require.NotContains(t, u, "sudo")
			require.Equal(t, false, doc["disable_root"])
		} else {
			require.Equal(t, true, doc["disable_root"])
		}
	}
}

func TestSeedISO(t *testing.T) {
	k, err := NewKeys("c")
	require.NoError(t, err)
	dir := t.TempDir()
	ci := CloudInit{InstanceID: "lve-x-1", Hostname: "lve-x-1", User: "root"}
	iso, err := ci.SeedISO(k, "lve-x-1", dir)
	require.NoError(t, err)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, entries, "staging files removed (they hold the host key)")

	path := filepath.Join(t.TempDir(), "seed.iso")
	require.NoError(t, os.WriteFile(path, iso, 0o600))
	d, err := diskfs.Open(path, diskfs.WithOpenMode(diskfs.ReadOnly))
	require.NoError(t, err)
	fs, err := d.GetFilesystem(0)
	require.NoError(t, err)
	require.Equal(t, "cidata", strings.Trim(fs.Label(), " \x00"))
	want, err := ci.UserData(k, "lve-x-1")
	require.NoError(t, err)
	f, err := fs.OpenFile("/user-data", os.O_RDONLY)
	require.NoError(t, err)
	got, err := io.ReadAll(f)
	require.NoError(t, err)
	require.Equal(t, want, got)
	md, err := fs.OpenFile("/meta-data", os.O_RDONLY)
	require.NoError(t, err)
	gotMD, err := io.ReadAll(md)
	require.NoError(t, err)
	require.Contains(t, string(gotMD), `"instance-id":"lve-x-1"`)

	// blkid (util-linux, as the guest's udev uses) must see the label too.
	if _, err := exec.LookPath("blkid"); err == nil {
		out, err := exec.Command("blkid", "-p", "-o", "value", "-s", "LABEL", path).Output()
		require.NoError(t, err)
		require.Equal(t, "cidata", strings.TrimSpace(string(out)))
	}
}

func TestCloneCredentialDisk(t *testing.T) {
	k, err := NewKeys("c")
	require.NoError(t, err)
	now := time.Unix(1796000000, 0)
	disk := k.CloneCredentialDisk("lve-clone", now, []byte{1, 2, 3, 0xff})
	require.Zero(t, len(disk)%512, "whole sectors")
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimRight(string(disk), "\x00\n"), "\n") {
		kv := l[strings.IndexByte(l, ':')+1:]
		name, value, ok := strings.Cut(kv, "=")
		require.True(t, ok, l)
		if strings.HasPrefix(l, "io.systemd.credential.binary:") {
			b, err := base64.StdEncoding.DecodeString(value)
			require.NoError(t, err, l)
			value = string(b)
		} else {
			require.True(t, strings.HasPrefix(l, "io.systemd.credential:"), l)
		}
		got[name] = value
	}
	require.Equal(t, k.AuthorizedKey("lve-clone"), got["ssh.authorized_keys.root"])
	require.Equal(t, "1796000000", got[ClockCredential])
	require.Equal(t, "\x01\x02\x03\xff", got[EntropyCredential])
	hs, err := ssh.ParsePrivateKey([]byte(got[HostKeyCredential]))
	require.NoError(t, err)
	require.Equal(t, k.Host.Marshal(), hs.PublicKey().Marshal())

	// A comment cannot add a line (a credential of its own).
	disk = k.CloneCredentialDisk("x\nio.systemd.credential:libvirt-executor.clock=1", now, nil)
	clockLines := 0
	for _, l := range strings.Split(string(disk), "\n") {
		if strings.HasPrefix(l, "io.systemd.credential:"+ClockCredential+"=") {
			clockLines++
		}
	}
	require.Equal(t, 1, clockLines, "one clock line: the host's")
}
