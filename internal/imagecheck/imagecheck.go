// Package imagecheck looks inside a base disk image before any VM uses it.
//
// A disk image is input: a qcow2 header can name another file (a backing
// file, an external data file) that libvirt then labels for the VM's QEMU
// user and QEMU reads for the guest, and it can claim a virtual size of
// petabytes that every job's overlay inherits. Check reads the header
// itself (it never runs qemu-img, which would open the files the header
// names) and refuses an image that is not the format it is declared as,
// names any other file, uses an incompatible feature this version does
// not know, or is larger than the bound given.
package imagecheck

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// Version is the version of the check. A store that recorded an older
// one checks its images again.
const Version = 1

// DefaultMaxVirtual is the bound on a base image's virtual size when the
// caller has none of its own: the largest limits.max_disk_gib allowed.
const DefaultMaxVirtual = 4096 << 30

// Info is what the check found.
type Info struct {
	Format      string // "qcow2" or "raw"
	VirtualSize uint64 // bytes
}

// Refused is an image the check refuses: the file, the field of its header
// and the value found there, and why.
type Refused struct {
	Path  string
	Field string
	Value string
	Why   string
}

func (r *Refused) Error() string {
	return fmt.Sprintf("%s: %s %s: %s", r.Path, r.Field, r.Value, r.Why)
}

// ErrRefused matches every *Refused (errors.Is).
var ErrRefused = errors.New("image refused")

// Is makes errors.Is(err, ErrRefused) true for a *Refused.
func (r *Refused) Is(target error) bool { return target == ErrRefused }

// qcow2 header fields (docs/interop/qcow2.txt of QEMU).
const (
	qcowMagic          = "QFI\xfb"
	qcowV2HeaderLen    = 72
	qcowV3MinHeaderLen = 104
	maxHeaderLen       = 1 << 16 // header and its extensions must fit in the first cluster (at most 2 MiB); 64 KiB here
	maxBackingName     = 1023

	extEnd          = 0x00000000
	extBackingFmt   = 0xe2792aca
	extFeatureTable = 0x6803f857
	extBitmaps      = 0x23852875
	extCrypto       = 0x0537be77
	extDataFile     = 0x44415441

	incompatDirty     = 1 << 0
	incompatCorrupt   = 1 << 1
	incompatDataFile  = 1 << 2
	incompatCompress  = 1 << 3
	incompatExtL2     = 1 << 4
	knownIncompatible = incompatDirty | incompatCorrupt | incompatDataFile | incompatCompress | incompatExtL2
)

// otherMagics are headers of formats that can name other files, which a
// file declared raw must not start with (a raw disk is opened as raw, but
// such a file is never what an admin meant).
var otherMagics = map[string]string{
	qcowMagic:               "qcow2",
	"QED\x00":               "qed",
	"KDMV":                  "vmdk",
	"# Disk DescriptorFile": "vmdk descriptor",
	"conectix":              "vpc",
	"vhdxfile":              "vhdx",
}

// Check checks the image at path, declared to be format ("qcow2" or
// "raw"), against maxVirtual bytes of virtual size (0: DefaultMaxVirtual).
// The path must be a regular file (a symlink to one is followed: an
// admin's configuration may name one). A refusal is a *Refused.
func Check(path, format string, maxVirtual uint64) (Info, error) {
	if maxVirtual == 0 {
		maxVirtual = DefaultMaxVirtual
	}
	f, err := os.Open(path)
	if err != nil {
		return Info{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return Info{}, err
	}
	if !fi.Mode().IsRegular() {
		return Info{}, &Refused{Path: path, Field: "file type", Value: fi.Mode().Type().String(), Why: "a base image must be a regular file"}
	}
	head := make([]byte, maxHeaderLen)
	n, err := io.ReadFull(f, head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return Info{}, err
	}
	head = head[:n]
	var info Info
	switch format {
	case "qcow2":
		info, err = checkQcow2(path, f, head)
	case "raw":
		info, err = checkRaw(path, head, fi.Size())
	default:
		return Info{}, &Refused{Path: path, Field: "format", Value: fmt.Sprintf("%q", format), Why: "allowed: qcow2, raw"}
	}
	if err != nil {
		return Info{}, err
	}
	if info.VirtualSize > maxVirtual {
		return Info{}, &Refused{Path: path, Field: "virtual size", Value: fmt.Sprintf("%d bytes (%s)", info.VirtualSize, gib(info.VirtualSize)),
			Why: fmt.Sprintf("at most %d bytes (%s, limits.max_disk_gib)", maxVirtual, gib(maxVirtual))}
	}
	return info, nil
}

func gib(b uint64) string { return fmt.Sprintf("%.1f GiB", float64(b)/(1<<30)) }

func checkRaw(path string, head []byte, size int64) (Info, error) {
	for magic, name := range otherMagics {
		if bytes.HasPrefix(head, []byte(magic)) {
			return Info{}, &Refused{Path: path, Field: "format", Value: "raw", Why: "the file starts with a " + name + " header: declare its real format (or convert it to a standalone qcow2 with qemu-img convert)"}
		}
	}
	return Info{Format: "raw", VirtualSize: uint64(size)}, nil //nolint:gosec // G115: a file's size is not negative
}

func checkQcow2(path string, f io.ReaderAt, head []byte) (Info, error) {
	refuse := func(field, value, why string) (Info, error) {
		return Info{}, &Refused{Path: path, Field: field, Value: value, Why: why}
	}
	if len(head) < qcowV2HeaderLen || string(head[:4]) != qcowMagic {
		magic := head[:min(len(head), 4)]
		return refuse("format", fmt.Sprintf("%q (magic %q)", "qcow2", magic), "not a qcow2 image: declare its real format")
	}
	be := binary.BigEndian
	version := be.Uint32(head[4:])
	backingOff, backingLen := be.Uint64(head[8:]), be.Uint32(head[16:])
	size := be.Uint64(head[24:])
	crypt := be.Uint32(head[32:])
	info := Info{Format: "qcow2", VirtualSize: size}
	if version != 2 && version != 3 {
		return refuse("version", fmt.Sprint(version), "qcow2 versions 2 and 3 are known")
	}
	if backingOff != 0 || backingLen != 0 {
		name := "(unreadable)"
		if backingLen > 0 && backingLen <= maxBackingName {
			b := make([]byte, backingLen)
			if _, err := f.ReadAt(b, int64(backingOff)); err == nil { //nolint:gosec // G115: an offset past the file fails the read
				name = fmt.Sprintf("%q", b)
			}
		} else if backingLen > maxBackingName {
			name = fmt.Sprintf("(%d bytes long)", backingLen)
		}
		return refuse("backing file", name, "a base image must stand alone: every job's VM would read that file (make it standalone: qemu-img convert -O qcow2 IMAGE NEW)")
	}
	if crypt != 0 {
		return refuse("encryption method", fmt.Sprint(crypt), "an encrypted base image needs a secret this driver does not give: use an unencrypted image")
	}
	extStart := qcowV2HeaderLen
	if version == 3 {
		if len(head) < qcowV3MinHeaderLen {
			return refuse("header length", fmt.Sprint(len(head)), "shorter than a qcow2 version 3 header")
		}
		incompat := be.Uint64(head[72:])
		hlen := be.Uint32(head[100:])
		if hlen < qcowV3MinHeaderLen || hlen%8 != 0 || int(hlen) > len(head) {
			return refuse("header length", fmt.Sprint(hlen), fmt.Sprintf("want a multiple of 8 from %d to %d", qcowV3MinHeaderLen, len(head)))
		}
		extStart = int(hlen)
		if incompat&incompatDataFile != 0 {
			return refuse("incompatible features", fmt.Sprintf("0x%x (external data file)", incompat), "a base image must keep its data in itself, not in another file")
		}
		if incompat&incompatCorrupt != 0 {
			return refuse("incompatible features", fmt.Sprintf("0x%x (corrupt)", incompat), "QEMU marked the image corrupt: qemu-img check -r all IMAGE, or rebuild it")
		}
		if incompat&incompatDirty != 0 {
			return refuse("incompatible features", fmt.Sprintf("0x%x (dirty)", incompat), "the image was not closed cleanly: qemu-img check -r all IMAGE")
		}
		if unknown := incompat &^ knownIncompatible; unknown != 0 {
			return refuse("incompatible features", fmt.Sprintf("0x%x (unknown bits 0x%x)", incompat, unknown), "features this version does not know: convert the image with this host's qemu-img")
		}
	}
	// Header extensions: type, length, data padded to 8 bytes, up to an
	// end marker.
	for off := extStart; ; {
		if off+8 > len(head) {
			return refuse("header extensions", fmt.Sprintf("past byte %d", off), "no end marker within the first 64 KiB")
		}
		typ, l := be.Uint32(head[off:]), int(be.Uint32(head[off+4:]))
		if typ == extEnd {
			break
		}
		switch typ {
		case extDataFile:
			name := "(unreadable)"
			if off+8+l <= len(head) {
				name = fmt.Sprintf("%q", cut(head[off+8:off+8+l], maxBackingName))
			}
			return refuse("external data file", name, "a base image must keep its data in itself, not in another file")
		case extCrypto:
			return refuse("encryption header", "present", "an encrypted base image needs a secret this driver does not give")
		case extBackingFmt, extFeatureTable, extBitmaps:
		}
		next := off + 8 + (l+7)/8*8
		if l < 0 || next > len(head) || next <= off {
			return refuse("header extension", fmt.Sprintf("0x%08x of %d bytes", typ, l), "runs past the first 64 KiB")
		}
		off = next
	}
	return info, nil
}

func cut(b []byte, n int) string {
	s := string(b[:min(len(b), n)])
	return strings.ToValidUTF8(s, "?")
}
