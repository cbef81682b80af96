// Package progress shows long work (image push, pull) as it goes: on a
// terminal one line per step redrawn with its bytes, total and rate;
// otherwise (a log, a pipe) one line per step when it ends.
package progress

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Reporter hears the steps of long work and the bytes each has done.
type Reporter interface {
	// Step ends the step in progress, if any, and starts name, of total
	// bytes (0: no byte count, or unknown).
	Step(name string, total int64)
	// Add counts n more bytes of the step in progress.
	Add(n int64)
	// Done ends the step in progress.
	Done()
}

type key struct{}

// With is ctx carrying r, for the work below it (From).
func With(ctx context.Context, r Reporter) context.Context {
	return context.WithValue(ctx, key{}, r)
}

// From is the Reporter ctx carries, or one that shows nothing.
func From(ctx context.Context) Reporter {
	if r, ok := ctx.Value(key{}).(Reporter); ok && r != nil {
		return r
	}
	return nop{}
}

type nop struct{}

func (nop) Step(string, int64) {}
func (nop) Add(int64)          {}
func (nop) Done()              {}

// IsTerminal says whether f is a terminal (as golang.org/x/term does on
// Linux: it answers the terminal's ioctl).
func IsTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS) //nolint:gosec // G115: a file descriptor fits an int
	return err == nil
}

// ForFile is a Meter on f, in terminal mode when f is a terminal.
func ForFile(f *os.File) *Meter { return New(f, IsTerminal(f)) }

// Meter writes progress to w: redrawn in place (terminal) or one line per
// step at its end. Safe for concurrent use.
type Meter struct {
	w        io.Writer
	terminal bool
	// Now is the clock (tests); Every is how often a terminal line is
	// redrawn at most.
	Now   func() time.Time
	Every time.Duration

	mu     sync.Mutex
	n      int // steps started
	name   string
	total  int64
	done   int64
	start  time.Time
	drawn  time.Time
	active bool
}

// New is a Meter on w; terminal picks the mode.
func New(w io.Writer, terminal bool) *Meter {
	return &Meter{w: w, terminal: terminal, Now: time.Now, Every: 100 * time.Millisecond}
}

// Step implements Reporter.
func (m *Meter) Step(name string, total int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.end()
	m.n++
	m.name, m.total, m.done, m.start, m.active = name, total, 0, m.Now(), true
	if m.terminal {
		m.draw(false)
	}
}

// Add implements Reporter.
func (m *Meter) Add(n int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.active {
		return
	}
	m.done += n
	if m.terminal && m.Now().Sub(m.drawn) >= m.Every {
		m.draw(false)
	}
}

// Done implements Reporter.
func (m *Meter) Done() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.end()
}

// end ends the step in progress: its final line.
func (m *Meter) end() {
	if !m.active {
		return
	}
	m.active = false
	m.draw(true)
}

// draw writes the step's line: on a terminal over the last one (final:
// and a newline), otherwise only the final line.
func (m *Meter) draw(final bool) {
	now := m.Now()
	m.drawn = now
	took := now.Sub(m.start)
	line := fmt.Sprintf("[%d] %s", m.n, m.name)
	if m.total > 0 || m.done > 0 {
		line += ": " + Bytes(m.done)
		if m.total > 0 {
			line += " / " + Bytes(m.total)
			if !final {
				line += fmt.Sprintf(" (%d%%)", m.done*100/m.total)
			}
		}
		if took > 0 {
			line += ", " + Bytes(int64(float64(m.done)/took.Seconds())) + "/s"
		}
	}
	if final {
		line += ", " + took.Round(time.Millisecond).String()
	}
	switch {
	case m.terminal && final:
		fmt.Fprintf(m.w, "\r\033[K%s\n", line)
	case m.terminal:
		fmt.Fprintf(m.w, "\r\033[K%s", line)
	case final:
		fmt.Fprintln(m.w, line)
	}
}

// Bytes is n in B, KiB, MiB or GiB with one decimal.
func Bytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// Reader counts what is read through it as the step's bytes.
type Reader struct {
	R io.Reader
	P Reporter
}

func (r Reader) Read(p []byte) (int, error) {
	n, err := r.R.Read(p)
	if n > 0 {
		r.P.Add(int64(n))
	}
	return n, err
}
