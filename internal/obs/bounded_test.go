package obs

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// hostileLine is what a guest may print: a forged log line after a newline,
// ANSI escapes (clear screen, a title), a CR, a byte that is not UTF-8
// and a megabyte on one line.
var hostileLine = "ok\nlevel=ERROR msg=\"forged\" vm=other\x1b[2J\x1b]0;pwned\x07\r\xff" + strings.Repeat("A", 1<<20)

func TestGuestText(t *testing.T) {
	g := GuestText(hostileLine)
	require.LessOrEqual(t, len(g), 2*MaxLogText, "bounded")
	require.True(t, strings.HasPrefix(g, `"ok\nlevel=ERROR msg=\"forged\" vm=other\x1b[2J\x1b]0;pwned\a\r\xff`), g)
	require.Contains(t, g, "bytes cut)")
	for _, c := range []string{"\n", "\r", "\x1b", "\x07", "\xff"} {
		require.NotContains(t, g, c)
	}
	require.Equal(t, `"short"`, GuestText("short"))
	// Cut on a rune boundary.
	require.True(t, strings.HasPrefix(Clip("é"+strings.Repeat("é", 600), 3), "é..."))
}

// Whatever reaches the host's logger, as a message, a string, an error or
// in a group: one line, no control character, bounded.
func TestBoundedLogger(t *testing.T) {
	var buf bytes.Buffer
	log := NewTextLogger(&buf, nil).With("exe", "test", "pre", hostileLine)
	log.Error(hostileLine, "out", hostileLine, "err", errors.New("guest said: "+hostileLine),
		slog.Group("g", "line", hostileLine), "raw", []byte(hostileLine), "n", 3)
	line := buf.String()
	require.Equal(t, 1, strings.Count(line, "\n"), "one line: %.300q", line)
	require.True(t, strings.HasSuffix(line, "\n"))
	require.Less(t, len(line), 7*2*MaxLogValue, "bounded")
	for _, c := range []string{"\r", "\x1b", "\x07", "\xff"} {
		require.NotContains(t, line, c)
	}
	require.Contains(t, line, `out="ok\nlevel=ERROR`, "quoted, the newline escaped")
	require.Contains(t, line, " n=3")
	require.Equal(t, 6, strings.Count(line, "bytes cut)"), "message, pre, out, err, g.line, raw")
}
