package frame

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
)

func limits(typ byte) int {
	switch typ {
	case 'O':
		return 4
	case 'X':
		return 64
	}
	return -1
}

// Frames go through as written; a frame over its type's limit and one of
// an unknown type are refused before their payload is read; a stream cut
// inside a payload is an unexpected EOF, a clean end between frames EOF.
func TestFrames(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, Write(&b, 'O', []byte("abcd")))
	require.NoError(t, WriteJSON(&b, 'X', map[string]int{"code": 3}))
	typ, p, err := Read(&b, limits)
	require.NoError(t, err)
	require.Equal(t, byte('O'), typ)
	require.Equal(t, "abcd", string(p))
	typ, p, err = Read(&b, limits)
	require.NoError(t, err)
	require.Equal(t, byte('X'), typ)
	require.JSONEq(t, `{"code":3}`, string(p))
	_, _, err = Read(&b, limits)
	require.ErrorIs(t, err, io.EOF)

	require.NoError(t, Write(&b, 'O', []byte("abcde")))
	_, _, err = Read(&b, limits)
	var big *TooLarge
	require.True(t, errors.As(err, &big), "%v", err)
	require.Equal(t, TooLarge{Type: 'O', Size: 5, Max: 4}, *big)
	require.Equal(t, 5, b.Len(), "the payload was not read")

	b.Reset()
	require.NoError(t, Write(&b, 'Z', nil))
	_, _, err = Read(&b, limits)
	var unknown *UnknownType
	require.True(t, errors.As(err, &unknown), "%v", err)

	b.Reset()
	require.NoError(t, Write(&b, 'O', []byte("abcd")))
	_, _, err = Read(bytes.NewReader(b.Bytes()[:7]), limits)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	_, _, err = Read(bytes.NewReader(b.Bytes()[:7]), Max(4))
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
}
