// Package guestinit makes a guest's per-job identity: a fresh client key the
// driver logs in with and a fresh host key the guest's SSH server presents,
// and the boot-time media that deliver them (SMBIOS systemd credentials or a
// cloud-init NoCloud seed). Nothing here is baked into an image.
package guestinit

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"strconv"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"
)

// HostKeyCredential is the systemd credential that carries the guest's SSH
// host key (base64 of an OpenSSH private key). Image recipes install it; see
// docs/images.md.
const HostKeyCredential = "libvirt-executor.ssh_host_ed25519_key" //nolint:gosec // G101: a credential's name, not a credential

// Keys is one job's key material.
type Keys struct {
	// Client logs in to the guest.
	Client ssh.Signer
	// ClientPEM is Client in OpenSSH private key format.
	ClientPEM []byte
	// Host is the guest's host key; HostPEM its OpenSSH private key.
	Host    ssh.PublicKey
	HostPEM []byte
}

// NewKeys generates fresh ed25519 client and host keys.
func NewKeys(comment string) (*Keys, error) {
	cpriv, cpem, err := newKey(comment)
	if err != nil {
		return nil, err
	}
	hpriv, hpem, err := newKey(comment)
	if err != nil {
		return nil, err
	}
	cs, err := ssh.NewSignerFromKey(cpriv)
	if err != nil {
		return nil, err
	}
	hpub, err := ssh.NewPublicKey(hpriv.Public())
	if err != nil {
		return nil, err
	}
	return &Keys{Client: cs, ClientPEM: cpem, Host: hpub, HostPEM: hpem}, nil
}

func newKey(comment string) (ed25519.PrivateKey, []byte, error) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	block, err := ssh.MarshalPrivateKey(priv, comment)
	if err != nil {
		return nil, nil, fmt.Errorf("encode key: %w", err)
	}
	return priv, pem.EncodeToMemory(block), nil
}

// AuthorizedKey is the client's public key as an authorized_keys line.
func (k *Keys) AuthorizedKey(comment string) string {
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k.Client.PublicKey()))) + " " + comment
}

// HostPublicLine is the host key as an authorized_keys-style line.
func (k *Keys) HostPublicLine() string {
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k.Host)))
}

// CredentialDiskSerial is the serial of the credentials disk; the guest finds
// it as /dev/disk/by-id/virtio-lve-credentials (or by /sys/block/*/serial).
const CredentialDiskSerial = "lve-credentials"

// OEMStrings are the SMBIOS type 11 strings for a systemd (>= 252) guest:
// root's authorized key through systemd's stock ssh.authorized_keys.root
// credential. Only public material goes here: SMBIOS strings end up in the
// domain XML and on QEMU's command line, which every local user can read.
func (k *Keys) OEMStrings(comment string) []string {
	return []string{"io.systemd.credential:ssh.authorized_keys.root=" + k.AuthorizedKey(comment)}
}

// CredentialDisk is the content of the read-only credentials disk that
// carries the private host key: lines in the SMBIOS credential syntax
// ("io.systemd.credential.binary:NAME=BASE64"), padded with NULs to a whole
// number of 512-byte sectors. It travels as a storage volume, never as text
// in XML or on a command line.
func (k *Keys) CredentialDisk() []byte {
	line := "io.systemd.credential.binary:" + HostKeyCredential + "=" + base64.StdEncoding.EncodeToString(k.HostPEM) + "\n"
	size := (len(line) + 511) / 512 * 512
	b := make([]byte, size)
	copy(b, line)
	return b
}

// Credentials the host gives a clone restored from a snapshot template
// (issue #48): its clock and entropy, which would otherwise be the
// template's.
const (
	ClockCredential   = "libvirt-executor.clock"   //nolint:gosec // G101: a credential's name
	EntropyCredential = "libvirt-executor.entropy" //nolint:gosec // G101: a credential's name
)

// CloneCredentialDisk is the credentials disk of a clone restored from a
// snapshot template, which got no SMBIOS strings of its own: the host key
// (CredentialDisk's line), root's authorized key, the host's clock (seconds
// since the epoch, now) and entropy (random bytes for the guest's pool), in
// the same syntax and padding. The guest waits for it, so it is plugged in
// last.
func (k *Keys) CloneCredentialDisk(comment string, now time.Time, entropy []byte) []byte {
	comment = strings.Map(func(r rune) rune { // one line each: no credential of the comment's
		if r < 0x20 || r == 0x7f {
			return '_'
		}
		return r
	}, comment)
	lines := "io.systemd.credential:ssh.authorized_keys.root=" + k.AuthorizedKey(comment) + "\n" +
		"io.systemd.credential.binary:" + HostKeyCredential + "=" + base64.StdEncoding.EncodeToString(k.HostPEM) + "\n" +
		"io.systemd.credential:" + ClockCredential + "=" + strconv.FormatInt(now.Unix(), 10) + "\n" +
		"io.systemd.credential.binary:" + EntropyCredential + "=" + base64.StdEncoding.EncodeToString(entropy) + "\n"
	size := (len(lines) + 511) / 512 * 512
	b := make([]byte, size)
	copy(b, lines)
	return b
}
