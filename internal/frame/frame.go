// Package frame owns the one wire format that the connection holder's
// socket (internal/holder) and the guest agent's channel (internal/agent)
// share: a sequence of frames, each one type byte, a 4-byte big-endian
// length and the payload. The reader bounds every payload by its type
// before it reads it (a peer may be hostile: a guest); what the types mean
// is each protocol's own.
package frame

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Write writes one frame of type typ.
func Write(w io.Writer, typ byte, payload []byte) error {
	var hdr [5]byte
	hdr[0] = typ
	binary.BigEndian.PutUint32(hdr[1:], uint32(len(payload))) //nolint:gosec // G115: frames are bounded far below 4 GiB
	if _, err := w.Write(append(hdr[:], payload...)); err != nil {
		return err
	}
	return nil
}

// WriteJSON writes one frame of type typ holding v as JSON.
func WriteJSON(w io.Writer, typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return Write(w, typ, b)
}

// UnknownType is a frame whose type the reader does not take.
type UnknownType struct{ Type byte }

func (e *UnknownType) Error() string { return fmt.Sprintf("unknown frame type %q", e.Type) }

// TooLarge is a frame whose payload is larger than its type allows; its
// payload was not read.
type TooLarge struct {
	Type      byte
	Size, Max uint64
}

func (e *TooLarge) Error() string {
	return fmt.Sprintf("frame of %d bytes exceeds the limit of %d", e.Size, e.Max)
}

// Read reads one frame whose payload is at most limit(type) bytes; a type
// with a negative limit is refused (UnknownType), a payload over its limit
// too (TooLarge), before its payload is read. A stream that ends inside a
// frame's payload is io.ErrUnexpectedEOF; one that ends before a frame
// is the header's read error (io.EOF when it ended cleanly).
func Read(r io.Reader, limit func(typ byte) int) (byte, []byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	max := limit(hdr[0])
	if max < 0 {
		return 0, nil, &UnknownType{Type: hdr[0]}
	}
	if uint64(n) > uint64(max) {
		return 0, nil, &TooLarge{Type: hdr[0], Size: uint64(n), Max: uint64(max)}
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return hdr[0], b, nil
}

// Max is a limit for Read: every type, at most n bytes.
func Max(n int) func(byte) int { return func(byte) int { return n } }
