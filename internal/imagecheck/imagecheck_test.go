package imagecheck

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// qemuImg runs qemu-img create in dir and returns the image's path.
func qemuImg(t *testing.T, dir, name string, args ...string) string {
	t.Helper()
	bin, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Fatalf("qemu-img is needed (make deps installs qemu-utils): %v", err)
	}
	p := filepath.Join(dir, name)
	out, err := exec.Command(bin, append(append([]string{"create", "-q"}, args[:len(args)-1]...), p, args[len(args)-1])...).CombinedOutput()
	require.NoError(t, err, "qemu-img: %s", out)
	return p
}

func refusedField(t *testing.T, err error) *Refused {
	t.Helper()
	var r *Refused
	require.True(t, errors.As(err, &r), "want a refusal, got %v", err)
	require.ErrorIs(t, err, ErrRefused)
	return r
}

func TestCheckAcceptsStandaloneImages(t *testing.T) {
	dir := t.TempDir()
	q := qemuImg(t, dir, "ok.qcow2", "-f", "qcow2", "1G")
	info, err := Check(q, "qcow2", 2<<30)
	require.NoError(t, err)
	require.Equal(t, Info{Format: "qcow2", VirtualSize: 1 << 30}, info)

	q2 := qemuImg(t, dir, "v2.qcow2", "-f", "qcow2", "-o", "compat=0.10", "64M")
	info, err = Check(q2, "qcow2", 0)
	require.NoError(t, err)
	require.Equal(t, uint64(64<<20), info.VirtualSize)

	z := qemuImg(t, dir, "zstd.qcow2", "-f", "qcow2", "-o", "compression_type=zstd,extended_l2=on", "64M")
	_, err = Check(z, "qcow2", 0)
	require.NoError(t, err, "known incompatible features (zstd, extended L2) are fine")

	r := qemuImg(t, dir, "ok.raw", "-f", "raw", "16M")
	info, err = Check(r, "raw", 0)
	require.NoError(t, err)
	require.Equal(t, Info{Format: "raw", VirtualSize: 16 << 20}, info)
}

func TestCheckRefusesABackingFile(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	require.NoError(t, os.WriteFile(secret, []byte("root only"), 0o600))
	img := qemuImg(t, dir, "evil.qcow2", "-f", "qcow2", "-b", secret, "-F", "raw", "1M")
	_, err := Check(img, "qcow2", 0)
	r := refusedField(t, err)
	require.Equal(t, "backing file", r.Field)
	require.Contains(t, r.Value, secret)
	require.Contains(t, err.Error(), img)
}

func TestCheckRefusesAnExternalDataFile(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "host-file")
	require.NoError(t, os.WriteFile(data, make([]byte, 1<<20), 0o600))
	img := qemuImg(t, dir, "evil.qcow2", "-f", "qcow2", "-o", "data_file="+data+",data_file_raw=on", "1M")
	_, err := Check(img, "qcow2", 0)
	r := refusedField(t, err)
	require.Contains(t, []string{"incompatible features", "external data file"}, r.Field)
	require.Contains(t, err.Error(), "data")
}

func TestCheckRefusesAHugeVirtualSize(t *testing.T) {
	dir := t.TempDir()
	img := qemuImg(t, dir, "huge.qcow2", "-f", "qcow2", "1P")
	_, err := Check(img, "qcow2", 0)
	r := refusedField(t, err)
	require.Equal(t, "virtual size", r.Field)
	require.Contains(t, r.Value, "1125899906842624")

	small := qemuImg(t, dir, "small.qcow2", "-f", "qcow2", "3G")
	_, err = Check(small, "qcow2", 2<<30)
	require.Equal(t, "virtual size", refusedField(t, err).Field)
}

func TestCheckRefusesAFormatOtherThanDeclared(t *testing.T) {
	dir := t.TempDir()
	q := qemuImg(t, dir, "disguised.img", "-f", "qcow2", "1M")
	_, err := Check(q, "raw", 0)
	r := refusedField(t, err)
	require.Equal(t, "format", r.Field)
	require.Contains(t, r.Why, "qcow2")

	raw := qemuImg(t, dir, "plain.raw", "-f", "raw", "1M")
	_, err = Check(raw, "qcow2", 0)
	require.Equal(t, "format", refusedField(t, err).Field)

	_, err = Check(raw, "vmdk", 0)
	r = refusedField(t, err)
	require.True(t, strings.Contains(r.Why, "qcow2, raw"), r.Why)
}

func TestCheckRefusesUnknownIncompatibleFeatures(t *testing.T) {
	dir := t.TempDir()
	img := qemuImg(t, dir, "future.qcow2", "-f", "qcow2", "1M")
	b, err := os.ReadFile(img)
	require.NoError(t, err)
	b[72+7] |= 1 << 6 // incompatible_features bit 6: not known
	require.NoError(t, os.WriteFile(img, b, 0o600))
	_, err = Check(img, "qcow2", 0)
	r := refusedField(t, err)
	require.Equal(t, "incompatible features", r.Field)
	require.Contains(t, r.Value, "unknown bits 0x40")
}

func TestCheckRefusesADevice(t *testing.T) {
	_, err := Check("/dev/null", "raw", 0)
	require.Equal(t, "file type", refusedField(t, err).Field)
}
