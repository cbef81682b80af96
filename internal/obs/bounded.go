package obs

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
)

// MaxLogText bounds guest-chosen text (GuestText) in a host log line or
// an error bound for one. Text that came from a guest (command output,
// the agent's and the holder's answers, console lines, a cache save's
// answer, garm's bootstrap status) reaches host logs as attributes and
// errors; a guest could otherwise write megabytes into the runner's log
// or the journal with one line.
const MaxLogText = 512

// MaxLogValue bounds every string a host log line carries through
// BoundedHandler (the message and each value, an error's text too): the
// backstop for guest text that reaches a log without GuestText, loose
// enough for the host's own long errors.
const MaxLogValue = 4096

// GuestText is guest-chosen text made fit for a host log line or an
// error that will reach one: quoted (strconv.Quote: newlines, ANSI
// escapes and bytes that are not UTF-8 written as escapes) and cut to
// about MaxLogText bytes, saying how much was left out.
func GuestText(s string) string {
	return strconv.Quote(Clip(s, MaxLogText))
}

// Clip is s cut to at most n bytes on a UTF-8 boundary, with
// "...(N bytes cut)" after it when anything was left out.
func Clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	c := cutUTF8(s, n)
	return c + "...(" + strconv.Itoa(len(s)-len(c)) + " bytes cut)"
}

// NewTextLogger is the host's slog logger on w: slog's text handler
// (which quotes every string that holds a space, a quote, a newline or
// any other control character, ANSI escapes included) behind
// BoundedHandler.
func NewTextLogger(w io.Writer, opts *slog.HandlerOptions) *slog.Logger {
	return slog.New(BoundedHandler{slog.NewTextHandler(w, opts)})
}

// BoundedHandler cuts the message and every string value of a record
// (attributes, groups, errors and other values as their text) to
// MaxLogValue bytes before its inner handler writes them.
type BoundedHandler struct{ Inner slog.Handler }

// Enabled implements slog.Handler.
func (h BoundedHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.Inner.Enabled(ctx, l)
}

// Handle implements slog.Handler.
func (h BoundedHandler) Handle(ctx context.Context, r slog.Record) error {
	out := slog.NewRecord(r.Time, r.Level, Clip(r.Message, MaxLogValue), r.PC)
	r.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(boundAttr(a))
		return true
	})
	return h.Inner.Handle(ctx, out)
}

// WithAttrs implements slog.Handler.
func (h BoundedHandler) WithAttrs(as []slog.Attr) slog.Handler {
	b := make([]slog.Attr, len(as))
	for i, a := range as {
		b[i] = boundAttr(a)
	}
	return BoundedHandler{h.Inner.WithAttrs(b)}
}

// WithGroup implements slog.Handler.
func (h BoundedHandler) WithGroup(name string) slog.Handler {
	return BoundedHandler{h.Inner.WithGroup(name)}
}

func boundAttr(a slog.Attr) slog.Attr {
	v := a.Value.Resolve()
	switch v.Kind() {
	case slog.KindString:
		if len(v.String()) > MaxLogValue {
			return slog.String(a.Key, Clip(v.String(), MaxLogValue))
		}
	case slog.KindGroup:
		g := v.Group()
		b := make([]any, len(g))
		for i, x := range g {
			b[i] = boundAttr(x)
		}
		return slog.Group(a.Key, b...)
	case slog.KindAny:
		var s string
		switch x := v.Any().(type) {
		case error:
			s = x.Error()
		case fmt.Stringer:
			s = x.String()
		case []byte:
			s = string(x)
		default:
			return slog.Attr{Key: a.Key, Value: v}
		}
		if len(s) > MaxLogValue {
			return slog.String(a.Key, Clip(s, MaxLogValue))
		}
	}
	return slog.Attr{Key: a.Key, Value: v}
}
