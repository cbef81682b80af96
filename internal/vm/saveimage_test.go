package vm

import (
	"bytes"
	"encoding/binary"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const templateXML = `<domain type="qemu"><name>lve-snap-tiny</name><uuid>11111111-2222-3333-4444-555555555555</uuid><memory unit="KiB">524288</memory>` +
	`<os><type arch="x86_64" machine="pc">hvm</type></os><devices>` +
	`<disk type="file" device="disk"><driver name="qemu" type="qcow2"></driver><source file="/pool/lve-snap-tiny.qcow2"></source><target dev="vda" bus="virtio"></target></disk>` +
	`<disk type="file" device="disk"><driver name="qemu" type="raw"></driver><source file="/pool/tools.iso"></source><target dev="vdb" bus="virtio"></target><readonly></readonly></disk>` +
	`<serial type="file"><source path="/state/lve-snap-tiny/console.log"></source><target port="0"></target></serial>` +
	`</devices></domain>`

// saveFile is a save file as libvirt writes one: header, XML, cookie,
// padding, stream.
func saveFile(t *testing.T, magic string, version, format uint32, xml, cookie string, pad int, stream []byte) []byte {
	t.Helper()
	var hdr [saveHeaderLen]byte
	copy(hdr[:], magic)
	le := binary.LittleEndian
	block := append([]byte(xml), 0)
	cookieOff := 0
	if cookie != "" {
		cookieOff = len(block)
		block = append(block, append([]byte(cookie), 0)...)
	}
	block = append(block, make([]byte, pad)...)
	le.PutUint32(hdr[16:], version)
	le.PutUint32(hdr[20:], uint32(len(block)))
	le.PutUint32(hdr[24:], 1)
	le.PutUint32(hdr[28:], format)
	le.PutUint32(hdr[32:], uint32(cookieOff))
	return append(append(hdr[:], block...), stream...)
}

func TestSaveHeadRoundTrip(t *testing.T) {
	stream := []byte("QEVM\x00\x00\x00\x03 the migration stream, untouched")
	f := saveFile(t, saveMagic, 2, 0, templateXML, "<qemu-migration/>", 65536, stream)
	r := bytes.NewReader(f)
	h, err := ReadSaveHead(r)
	require.NoError(t, err)
	require.Equal(t, templateXML, h.XML)
	require.True(t, h.Running)
	rest := make([]byte, r.Len())
	_, _ = r.Read(rest)
	require.Equal(t, stream, rest, "the reader is left at the stream's first byte")

	// A longer XML moves the cookie; the block keeps its length.
	longer := strings.Replace(templateXML, "lve-snap-tiny</name>", "lve-0123456789abcdef-snapshot-clone-7</name>", 1)
	c, err := h.WithXML(longer)
	require.NoError(t, err)
	var out bytes.Buffer
	src := bytes.NewReader(f)
	head, err := ReadSaveHead(src)
	require.NoError(t, err)
	ch, err := head.WithXML(longer)
	require.NoError(t, err)
	_, err = ch.WriteTo(&out)
	require.NoError(t, err)
	_, err = io.Copy(&out, src)
	require.NoError(t, err)
	require.Equal(t, len(f), out.Len(), "a clone's file is as long as the template's")
	back, err := ReadSaveHead(bytes.NewReader(out.Bytes()))
	require.NoError(t, err)
	require.Equal(t, longer, back.XML)
	require.Equal(t, "<qemu-migration/>\x00", string(back.cookie), "the cookie follows the new XML")
	require.Equal(t, c.dataLen, back.dataLen)
	require.True(t, bytes.HasSuffix(out.Bytes(), stream), "the stream follows unchanged")
}

func TestSaveHeadRefusals(t *testing.T) {
	for _, tc := range []struct {
		name string
		file []byte
		want string
	}{
		{"partial", saveFile(t, savePartial, 2, 0, templateXML, "", 16, nil), "did not finish"},
		{"not a save file", saveFile(t, "QFI\xfbxxxxxxxxxxxx", 2, 0, templateXML, "", 16, nil), "not a libvirt save file"},
		{"newer version", saveFile(t, saveMagic, 3, 0, templateXML, "", 16, nil), "version 3"},
		{"compressed", saveFile(t, saveMagic, 2, 1, templateXML, "", 16, nil), "compressed"},
		{"short", saveFile(t, saveMagic, 2, 0, templateXML, "", 16, nil)[:saveHeaderLen+10], "XML block"},
		{"truncated header", []byte(saveMagic), "header"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadSaveHead(bytes.NewReader(tc.file))
			require.ErrorIs(t, err, ErrSaveImage)
			require.ErrorContains(t, err, tc.want)
		})
	}
	t.Run("block beyond the bound", func(t *testing.T) {
		f := saveFile(t, saveMagic, 2, 0, "<domain/>", "", 16, nil)
		binary.LittleEndian.PutUint32(f[20:], maxSaveData+1)
		_, err := ReadSaveHead(bytes.NewReader(f))
		require.ErrorContains(t, err, "1 to 4194304 allowed")
	})
	t.Run("empty cookie at the block's end", func(t *testing.T) {
		f := saveFile(t, saveMagic, 2, 0, "<domain/>", "", 0, nil)
		binary.LittleEndian.PutUint32(f[32:], binary.LittleEndian.Uint32(f[20:])) // offset == block length
		h, err := ReadSaveHead(bytes.NewReader(f))
		require.NoError(t, err)
		var out bytes.Buffer
		_, err = h.WriteTo(&out)
		require.NoError(t, err)
		require.Zero(t, binary.LittleEndian.Uint32(out.Bytes()[32:]), "no cookie offset is written for no cookie")
	})
	t.Run("XML without its NUL", func(t *testing.T) {
		f := saveFile(t, saveMagic, 2, 0, "<domain/>", "", 0, nil)
		f[len(f)-1] = '>'
		_, err := ReadSaveHead(bytes.NewReader(f))
		require.ErrorContains(t, err, "not terminated")
	})
	t.Run("new XML too long for the block", func(t *testing.T) {
		h, err := ReadSaveHead(bytes.NewReader(saveFile(t, saveMagic, 2, 0, templateXML, "", 8, nil)))
		require.NoError(t, err)
		_, err = h.WithXML(templateXML + strings.Repeat(" ", 9))
		require.ErrorContains(t, err, "block holds")
		_, err = h.WithXML("<domain>\x00</domain>")
		require.ErrorContains(t, err, "NUL")
	})
}

func TestCloneXML(t *testing.T) {
	id := CloneIdentity{Name: "lve-c0ffee-snap-1", UUID: "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
		Disks: map[string]string{"/pool/lve-snap-tiny.qcow2": "/pool/lve-c0ffee-snap-1.qcow2"}, ConsoleLog: "/state/lve-c0ffee-snap-1/console.log"}
	x, err := CloneXML(templateXML, id)
	require.NoError(t, err)
	require.Contains(t, x, "<name>lve-c0ffee-snap-1</name>")
	require.Contains(t, x, "<uuid>aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee</uuid>")
	require.Contains(t, x, `<source file="/pool/lve-c0ffee-snap-1.qcow2">`)
	require.Contains(t, x, `<source file="/pool/tools.iso">`, "a read-only disk is shared")
	require.Contains(t, x, `<source path="/state/lve-c0ffee-snap-1/console.log">`)
	require.NotContains(t, x, "lve-snap-tiny.qcow2")

	_, err = CloneXML(templateXML, CloneIdentity{Name: id.Name, UUID: id.UUID})
	require.ErrorContains(t, err, "writable disk /pool/lve-snap-tiny.qcow2 is not given a file")
	withNIC := strings.Replace(templateXML, "</devices>", `<interface type="network"><source network="ci"></source></interface></devices>`, 1)
	_, err = CloneXML(withNIC, id)
	require.ErrorContains(t, err, "network interface")
	withFS := strings.Replace(templateXML, "</devices>", `<filesystem type="mount"><source dir="/srv"></source><target dir="srv"></target></filesystem></devices>`, 1)
	_, err = CloneXML(withFS, id)
	require.ErrorContains(t, err, "shares 1 host directories")
	withBlock := strings.Replace(templateXML, "</devices>", `<disk type="block" device="disk"><source dev="/dev/sdz"></source><target dev="vdc" bus="virtio"></target></disk></devices>`, 1)
	_, err = CloneXML(withBlock, id)
	require.ErrorContains(t, err, "writable disk (disk) that is not a file")
	_, err = CloneXML(templateXML, CloneIdentity{Name: "Bad Name", UUID: id.UUID, Disks: id.Disks})
	require.ErrorContains(t, err, "machine name")
	_, err = CloneXML(templateXML, CloneIdentity{Name: id.Name, UUID: "x'/><evil/>", Disks: id.Disks})
	require.ErrorContains(t, err, "UUID")
}
