package vm

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"regexp"

	"libvirt.org/go/libvirtxml"
)

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// A libvirt save file (virDomainSave, QEMU driver) is a fixed header, the
// saved domain's XML (and libvirt's cookie) in a padded block, then QEMU's
// migration stream. The stream names neither the domain nor its disks, so a
// clone of a saved machine is the same file with its own name, UUID and disk
// paths in the XML (issue #48; docs/pool.md has the trial): libvirt's own
// restore call refuses another name or UUID in the XML it is given beside
// the file, but restores what the file's header says. The format is
// libvirt's (src/qemu/qemu_saveimage.h); what this code does not know for
// certain (another magic, version or format, a block that does not hold the
// new XML) it refuses, and the caller boots cold.

const (
	saveMagic     = "LibvirtQemudSave"
	savePartial   = "LibvirtQemudPart" // a save cut short: libvirt never finished it
	saveHeaderLen = 92                 // magic[16], version, data_len, was_running, format, cookie offset, unused[14]
	saveVersion   = 2
	saveFormatRaw = 0
	// maxSaveData bounds the block read from a save file: libvirt writes
	// the XML and cookie plus 64 KiB of padding.
	maxSaveData = 4 << 20
)

// ErrSaveImage is the refusal of a save file this code does not rewrite:
// the caller does not restore from it.
var ErrSaveImage = errors.New("save file not usable for a clone")

// SaveHead is the header and XML block of a libvirt save file, read by
// ReadSaveHead; the migration stream follows it in the file.
type SaveHead struct {
	header  [saveHeaderLen]byte
	dataLen uint32
	// XML is the saved domain's XML.
	XML string
	// cookie is libvirt's cookie (nil for none).
	cookie []byte
	// Running says the domain ran when it was saved (a restore runs it).
	Running bool
}

// ReadSaveHead reads the header and XML block at the start of a save
// file; r is then at the migration stream's first byte. It accepts only a
// complete, uncompressed file of version 2 in this host's byte order, with
// its block within maxSaveData.
func ReadSaveHead(r io.Reader) (*SaveHead, error) {
	var h SaveHead
	if _, err := io.ReadFull(r, h.header[:]); err != nil {
		return nil, fmt.Errorf("%w: header: %w", ErrSaveImage, err)
	}
	switch string(h.header[:16]) {
	case saveMagic:
	case savePartial:
		return nil, fmt.Errorf("%w: libvirt did not finish writing it", ErrSaveImage)
	default:
		return nil, fmt.Errorf("%w: not a libvirt save file (magic %q)", ErrSaveImage, h.header[:16])
	}
	le := binary.LittleEndian
	version, dataLen := le.Uint32(h.header[16:]), le.Uint32(h.header[20:])
	running, format, cookieOff := le.Uint32(h.header[24:]), le.Uint32(h.header[28:]), le.Uint32(h.header[32:])
	if version != saveVersion {
		return nil, fmt.Errorf("%w: version %d (only %d is known)", ErrSaveImage, version, saveVersion)
	}
	if format != saveFormatRaw {
		return nil, fmt.Errorf("%w: compressed (format %d; only raw, 0, is restored by a pipe)", ErrSaveImage, format)
	}
	if dataLen == 0 || dataLen > maxSaveData {
		return nil, fmt.Errorf("%w: XML block of %d bytes (1 to %d allowed)", ErrSaveImage, dataLen, maxSaveData)
	}
	if cookieOff > dataLen {
		return nil, fmt.Errorf("%w: cookie offset %d beyond the block (%d bytes)", ErrSaveImage, cookieOff, dataLen)
	}
	data := make([]byte, dataLen)
	if _, err := io.ReadFull(r, data); err != nil {
		return nil, fmt.Errorf("%w: XML block: %w", ErrSaveImage, err)
	}
	xmlPart := data
	if cookieOff != 0 {
		xmlPart = data[:cookieOff]
		cookie := data[cookieOff:]
		if i := bytes.IndexByte(cookie, 0); i >= 0 {
			cookie = cookie[:i+1]
		}
		if len(cookie) > 0 && cookie[0] != 0 {
			h.cookie = cookie // else none: an empty cookie is not written back
		}
	}
	end := bytes.IndexByte(xmlPart, 0)
	if end < 0 {
		return nil, fmt.Errorf("%w: the XML is not terminated within its block", ErrSaveImage)
	}
	h.XML, h.dataLen, h.Running = string(xmlPart[:end]), dataLen, running != 0
	return &h, nil
}

// WithXML is the head with xml in place of the saved XML, in a block of
// the same length (the stream's offset stays): an error if xml and the
// cookie do not fit in it.
func (h *SaveHead) WithXML(xml string) (*SaveHead, error) {
	if bytes.IndexByte([]byte(xml), 0) >= 0 {
		return nil, fmt.Errorf("%w: the new XML holds a NUL byte", ErrSaveImage)
	}
	need := uint64(len(xml)) + 1 + uint64(len(h.cookie))
	if need > uint64(h.dataLen) {
		return nil, fmt.Errorf("%w: the new XML and cookie need %d bytes; the file's block holds %d", ErrSaveImage, need, h.dataLen)
	}
	n := *h
	n.XML = xml
	return &n, nil
}

// WriteTo writes the head: the header (the cookie's offset set to follow
// the XML) and the XML block, padded with zeros to its length.
func (h *SaveHead) WriteTo(w io.Writer) (int64, error) {
	hdr := h.header
	cookieOff := uint32(0)
	if h.cookie != nil {
		cookieOff = uint32(len(h.XML) + 1) //nolint:gosec // G115: WithXML and ReadSaveHead keep it within dataLen (<= maxSaveData)
	}
	binary.LittleEndian.PutUint32(hdr[32:], cookieOff)
	block := make([]byte, h.dataLen)
	copy(block, h.XML)
	if h.cookie != nil {
		copy(block[cookieOff:], h.cookie)
	}
	n, err := w.Write(hdr[:])
	if err != nil {
		return int64(n), err
	}
	m, err := w.Write(block)
	return int64(n + m), err
}

// CloneIdentity is what a clone of a saved machine has of its own.
type CloneIdentity struct {
	// Name and UUID are the clone's domain name and UUID.
	Name, UUID string
	// Disks maps a disk's file in the saved XML to the clone's (its
	// overlay over the frozen one): every file-backed disk of the saved
	// domain that is writable must be mapped.
	Disks map[string]string
	// ConsoleLog, if set, is the clone's serial console log file.
	ConsoleLog string
	// Owner, if set, is the clone's ownership record (MarshalOwner), in
	// place of the template's.
	Owner string
}

// CloneXML is the saved domain's XML with the clone's identity: its name,
// UUID, disk files and console log. A writable disk the identity does not
// map is refused (two machines would write one file), and so is a domain
// with an interface (the template has none: a clone's NIC is plugged in
// after its restore, with its own MAC and filter) or a shared host
// directory. The UUID is libvirt's: the guest's SMBIOS UUID is the
// template's (its memory was made with it).
func CloneXML(saved string, id CloneIdentity) (string, error) {
	if err := CheckName(id.Name); err != nil {
		return "", err
	}
	if !uuidRE.MatchString(id.UUID) {
		return "", fmt.Errorf("clone UUID %q: not of the form xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (hexadecimal)", id.UUID)
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(saved); err != nil {
		return "", fmt.Errorf("%w: its XML: %v", ErrSaveImage, err)
	}
	d.Name, d.UUID = id.Name, id.UUID
	if d.Devices == nil {
		return "", fmt.Errorf("%w: its domain has no devices", ErrSaveImage)
	}
	if len(d.Devices.Interfaces) != 0 {
		return "", fmt.Errorf("%w: its domain has %d network interface(s); a template has none", ErrSaveImage, len(d.Devices.Interfaces))
	}
	if len(d.Devices.Filesystems) != 0 {
		return "", fmt.Errorf("%w: its domain shares %d host directories; a template shares none", ErrSaveImage, len(d.Devices.Filesystems))
	}
	for i := range d.Devices.Disks {
		disk := &d.Devices.Disks[i]
		if disk.Source == nil || disk.Source.File == nil {
			if disk.ReadOnly == nil && disk.Shareable == nil && disk.Device != "cdrom" {
				return "", fmt.Errorf("%w: a writable disk (%s) that is not a file; a template's writable disks are files", ErrSaveImage, disk.Device)
			}
			continue
		}
		if to, ok := id.Disks[disk.Source.File.File]; ok {
			disk.Source.File.File = to
			// The backing chain the saved XML recorded stays as it was:
			// the clone's overlay is over the same frozen file.
			continue
		}
		if disk.ReadOnly == nil && disk.Shareable == nil {
			return "", fmt.Errorf("%w: the writable disk %s is not given a file of the clone's", ErrSaveImage, disk.Source.File.File)
		}
	}
	if id.Owner != "" {
		d.Metadata = &libvirtxml.DomainMetadata{XML: id.Owner}
	}
	if id.ConsoleLog != "" {
		for i := range d.Devices.Serials {
			if s := d.Devices.Serials[i].Source; s != nil && s.File != nil {
				s.File.Path = id.ConsoleLog
			}
			if l := d.Devices.Serials[i].Log; l != nil {
				l.File = id.ConsoleLog
			}
		}
		for i := range d.Devices.Consoles {
			if s := d.Devices.Consoles[i].Source; s != nil && s.File != nil {
				s.File.Path = id.ConsoleLog
			}
			if l := d.Devices.Consoles[i].Log; l != nil {
				l.File = id.ConsoleLog
			}
		}
	}
	return d.Marshal()
}

// SaveStream is a save volume being read through libvirt (the runner's
// unprivileged user cannot read the pool's files): its head, then the
// rest of the file in Rest. Close ends the stream and waits for it.
type SaveStream struct {
	Head *SaveHead
	// Rest is the file after its head: QEMU's migration stream.
	Rest   io.Reader
	cancel context.CancelFunc
	pr     *io.PipeReader
	done   chan struct{}
}

// Close stops the stream (a stream still running ends on its next write)
// and waits for it.
func (s *SaveStream) Close() {
	s.cancel()
	_ = s.pr.Close()
	<-s.done
}

// OpenSave streams the save volume of template from pool and reads its
// head (ReadSaveHead); the caller reads the rest or not, and closes it.
// An error of the stream reaches the reader.
func OpenSave(ctx context.Context, hv Hypervisor, pool, template string) (*SaveStream, error) {
	pr, pw := io.Pipe()
	sctx, cancel := context.WithCancel(ctx)
	s := &SaveStream{Rest: pr, cancel: cancel, pr: pr, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		_ = pw.CloseWithError(hv.StreamFromVolume(sctx, pool, SaveVolume(template), pw))
	}()
	head, err := ReadSaveHead(pr)
	if err != nil {
		s.Close()
		return nil, err
	}
	s.Head = head
	return s, nil
}
