package progress

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func meter(terminal bool) (*Meter, *bytes.Buffer, *clock) {
	var b bytes.Buffer
	c := &clock{t: time.Unix(1000, 0)}
	m := New(&b, terminal)
	m.Now = c.now
	return m, &b, c
}

// Not a terminal: one line per step, when it ends, with bytes, rate and
// time.
func TestMeterLines(t *testing.T) {
	m, b, c := meter(false)
	m.Step("compress disk.qcow2", 4<<20)
	for range 4 {
		c.t = c.t.Add(time.Second)
		m.Add(1 << 20)
	}
	require.Empty(t, b.String(), "nothing until the step ends")
	m.Step("push the manifest", 0)
	c.t = c.t.Add(20 * time.Millisecond)
	m.Done()
	m.Done() // once
	require.Equal(t, "[1] compress disk.qcow2: 4.0 MiB / 4.0 MiB, 1.0 MiB/s, 4s\n[2] push the manifest, 20ms\n", b.String())
}

// A terminal: the step's line redrawn in place (at most every Every) with
// its share done, and a newline at its end.
func TestMeterTerminal(t *testing.T) {
	m, b, c := meter(true)
	m.Step("upload disk.qcow2", 2<<20)
	c.t = c.t.Add(time.Second)
	m.Add(1 << 20)
	m.Add(1) // within Every: not drawn
	c.t = c.t.Add(time.Second)
	m.Done()
	out := b.String()
	require.Equal(t, 3, strings.Count(out, "\r\033[K"), "%q", out)
	require.Contains(t, out, "\r\033[K[1] upload disk.qcow2: 0 B / 2.0 MiB (0%)")
	require.Contains(t, out, "\r\033[K[1] upload disk.qcow2: 1.0 MiB / 2.0 MiB (50%), 1.0 MiB/s")
	require.True(t, strings.HasSuffix(out, "\r\033[K[1] upload disk.qcow2: 1.0 MiB / 2.0 MiB, 512.0 KiB/s, 2s\n"), "%q", out)
}

func TestFromAndReader(t *testing.T) {
	From(context.Background()).Step("nothing", 1) // a context without one: no-op
	m, b, _ := meter(false)
	ctx := With(context.Background(), m)
	From(ctx).Step("read", 5)
	n, err := io.Copy(io.Discard, Reader{R: strings.NewReader("hello"), P: From(ctx)})
	require.NoError(t, err)
	require.EqualValues(t, 5, n)
	From(ctx).Done()
	require.Equal(t, "[1] read: 5 B / 5 B, 0s\n", b.String())
}
