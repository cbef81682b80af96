// Package panels draws the panels of a Grafana dashboard into one
// self-contained SVG file, with the data of a Prometheus: a picture of
// deploy/grafana/libvirt-executor.json for the documentation, a review or
// a bug report, without a Grafana. It is the whole of lve-panels
// (cmd/lve-panels is its thin main). For every panel it runs each target's
// expression through Prometheus' HTTP API (/api/v1/query_range), with
// Grafana's variables replaced ($__rate_interval: 4 steps, at least 1m;
// $__interval: the step), and draws one line per series in a grid of two
// columns, with the panel's title, axes and a legend.
//
//	lve-panels -prometheus http://127.0.0.1:9090 -dashboard deploy/grafana/libvirt-executor.json \
//	  -from -30m [-to now] [-step 15s] -out docs/observability-dashboard.svg
//
// Run fails, naming the panel and the expression, when Prometheus cannot
// be reached or a query fails; a panel whose queries return nothing shows
// "no data". Its tests also hold the dashboard and the alerting rules in
// deploy/ to the service's metrics (and, with Prometheus installed, to
// Prometheus and promtool).
package panels

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Options is what the flags ask for.
type Options struct {
	Prometheus *url.URL
	Dashboard  string
	From, To   time.Time
	Step       time.Duration
	Out        string // "-": standard output
}

// ParseFlags reads lve-panels' command line (without the program name);
// relative times ("-30m", "now") are relative to now. An error, -h
// included (flag.ErrHelp), is a usage error: the flags' usage has been
// written to standard error.
func ParseFlags(args []string, now time.Time) (Options, error) {
	fs := flag.NewFlagSet("lve-panels", flag.ContinueOnError)
	prom := fs.String("prometheus", "http://127.0.0.1:9090", "Prometheus base URL")
	dash := fs.String("dashboard", "deploy/grafana/libvirt-executor.json", "Grafana dashboard JSON file")
	from := fs.String("from", "-1h", "start: a duration before now (-30m), now, or an RFC 3339 time")
	to := fs.String("to", "now", "end: like -from")
	step := fs.Duration("step", 0, "query resolution (default: the range / 300, at least 15s)")
	out := fs.String("out", "", "SVG file to write (- for standard output)")
	if err := fs.Parse(args); err != nil {
		return Options{}, err
	}
	if fs.NArg() > 0 {
		return Options{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var o Options
	u, err := url.Parse(*prom)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return o, fmt.Errorf("-prometheus %q: want an http(s) URL like http://127.0.0.1:9090", *prom)
	}
	o.Prometheus = u
	o.Dashboard = *dash
	if *out == "" {
		return o, errors.New("-out is required (an .svg file, or - for standard output)")
	}
	o.Out = *out
	if o.From, err = parseTime(*from, now); err != nil {
		return o, fmt.Errorf("-from: %w", err)
	}
	if o.To, err = parseTime(*to, now); err != nil {
		return o, fmt.Errorf("-to: %w", err)
	}
	if !o.From.Before(o.To) {
		return o, fmt.Errorf("-from (%s) is not before -to (%s)", o.From.Format(time.RFC3339), o.To.Format(time.RFC3339))
	}
	o.Step = *step
	if o.Step == 0 {
		o.Step = max(15*time.Second, o.To.Sub(o.From)/300).Round(time.Second)
	}
	if o.Step < time.Millisecond {
		return o, fmt.Errorf("-step %s: too small", o.Step)
	}
	// Prometheus refuses more than 11,000 points per series.
	if n := o.To.Sub(o.From) / o.Step; n > 11000 {
		return o, fmt.Errorf("-step %s gives %d points per series, Prometheus allows 11000: raise -step", o.Step, n)
	}
	return o, nil
}

// parseTime reads "now", a negative duration relative to now ("-30m",
// also Grafana's "now-30m") or an RFC 3339 time.
func parseTime(s string, now time.Time) (time.Time, error) {
	switch {
	case s == "now":
		return now, nil
	case strings.HasPrefix(s, "now-"), strings.HasPrefix(s, "-"):
		d, err := time.ParseDuration(strings.TrimPrefix(strings.TrimPrefix(s, "now"), "-"))
		if err != nil {
			return time.Time{}, fmt.Errorf("%q: %w", s, err)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q: want now, -DURATION (-30m) or an RFC 3339 time", s)
	}
	return t, nil
}

// Run fetches every panel's data and writes the SVG to o.Out, or to
// stdout when o.Out is "-".
func Run(ctx context.Context, o Options, stdout io.Writer) error {
	d, err := loadDashboard(o.Dashboard)
	if err != nil {
		return err
	}
	c, err := newClient(o.Prometheus)
	if err != nil {
		return err
	}
	// One trivial query first, so that an unreachable Prometheus is said
	// once and plainly rather than as the first panel's failure.
	if err := c.query(ctx, "1", o.To); err != nil {
		return fmt.Errorf("prometheus at %s does not answer queries: %w", o.Prometheus.Redacted(), err)
	}
	page, err := fetch(ctx, c, d, o)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := render(&buf, page); err != nil {
		return err
	}
	if o.Out == "-" {
		_, err := stdout.Write(buf.Bytes())
		return err
	}
	return writeFile(o.Out, buf.Bytes())
}

// writeFile replaces path with data through a temporary file in the same
// directory, so that a reader never sees half a picture.
func writeFile(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".lve-panels-*.svg")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(f.Name()) }() // after the rename: nothing left to remove
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// --- The dashboard -----------------------------------------------------

// dashboard is the part of a Grafana dashboard's JSON model this tool uses.
type dashboard struct {
	Title  string  `json:"title"`
	Panels []panel `json:"panels"`
}

type panel struct {
	ID      int    `json:"id"`
	Type    string `json:"type"`
	Title   string `json:"title"`
	GridPos struct {
		X, Y, W, H int
	} `json:"gridPos"`
	FieldConfig struct {
		Defaults struct {
			Unit string   `json:"unit"`
			Min  *float64 `json:"min"`
			Max  *float64 `json:"max"`
		} `json:"defaults"`
	} `json:"fieldConfig"`
	Targets []target `json:"targets"`
	Panels  []panel  `json:"panels"` // a collapsed row's panels
}

type target struct {
	RefID        string `json:"refId"`
	Expr         string `json:"expr"`
	LegendFormat string `json:"legendFormat"`
	Hide         bool   `json:"hide"`
}

func loadDashboard(path string) (*dashboard, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		return nil, fmt.Errorf("dashboard %s: %w", path, err)
	}
	return &d, nil
}

// ordered returns the dashboard's panels top to bottom, left to right,
// each row followed by the panels of it that a collapsed row holds.
func (d *dashboard) ordered() []panel {
	ps := append([]panel(nil), d.Panels...)
	sort.SliceStable(ps, func(i, j int) bool {
		a, b := ps[i].GridPos, ps[j].GridPos
		if a.Y != b.Y {
			return a.Y < b.Y
		}
		return a.X < b.X
	})
	var out []panel
	for _, p := range ps {
		out = append(out, p)
		if p.Type == "row" {
			out = append(out, (&dashboard{Panels: p.Panels}).ordered()...)
		}
	}
	return out
}

// queries returns the targets of p that run, with Grafana's variables
// replaced for this step.
func (p panel) queries(step time.Duration) ([]target, error) {
	var out []target
	for _, t := range p.Targets {
		if t.Hide || strings.TrimSpace(t.Expr) == "" {
			continue
		}
		expr, err := expandVars(t.Expr, step)
		if err != nil {
			return nil, fmt.Errorf("panel %q: query %q: %w", p.Title, t.Expr, err)
		}
		t.Expr = expr
		out = append(out, t)
	}
	return out, nil
}

var varRE = regexp.MustCompile(`\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)\]\]`)

// expandVars replaces Grafana's variables in a query the way Grafana
// would for a graph drawn at this step: $__interval is the step,
// $__rate_interval four steps but at least 1m (four scrapes at 15s).
// $datasource names the data source, never part of an expression: it
// becomes empty. Any other variable is an error.
func expandVars(expr string, step time.Duration) (string, error) {
	vals := map[string]string{
		"__interval":      promDuration(step),
		"__interval_ms":   strconv.FormatInt(step.Milliseconds(), 10),
		"__rate_interval": promDuration(max(4*step, time.Minute)),
		"datasource":      "",
		// The host variable, as Grafana's "All" writes it: every host.
		"instance": ".*",
	}
	var bad []string
	out := varRE.ReplaceAllStringFunc(expr, func(m string) string {
		sub := varRE.FindStringSubmatch(m)
		name := sub[1] + sub[2] + sub[3]
		v, ok := vals[name]
		if !ok {
			bad = append(bad, m)
			return m
		}
		return v
	})
	if bad != nil {
		return "", fmt.Errorf("unknown dashboard variable %s", strings.Join(bad, ", "))
	}
	return out, nil
}

// promDuration writes d as PromQL reads it: whole minutes, seconds or
// milliseconds.
func promDuration(d time.Duration) string {
	if d%time.Minute == 0 {
		return strconv.FormatInt(int64(d/time.Minute), 10) + "m"
	}
	if d%time.Second == 0 {
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	}
	return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
}

// --- What to draw ----------------------------------------------------------

// page is everything the SVG shows.
type page struct {
	Title    string
	Source   string // where the data came from
	From, To time.Time
	Step     time.Duration
	Items    []item
}

// item is a row heading (Row set) or a panel.
type item struct {
	Row    string
	Title  string
	Unit   string
	Min    *float64
	Max    *float64
	Series []line
}

// line is a series with its legend text.
type line struct {
	Name   string
	Points []point
}

// fetch runs every panel's queries.
func fetch(ctx context.Context, c *client, d *dashboard, o Options) (*page, error) {
	// The start aligned to the step like Grafana's, so that reruns draw
	// the same points.
	start := o.From.Truncate(o.Step)
	pg := &page{Title: d.Title, Source: o.Prometheus.Redacted(), From: start, To: o.To, Step: o.Step}
	for _, p := range d.ordered() {
		if p.Type == "row" {
			pg.Items = append(pg.Items, item{Row: p.Title})
			continue
		}
		qs, err := p.queries(o.Step)
		if err != nil {
			return nil, err
		}
		if len(qs) == 0 {
			continue // text panels and the like: nothing to draw
		}
		it := item{Title: p.Title, Unit: p.FieldConfig.Defaults.Unit, Min: p.FieldConfig.Defaults.Min, Max: p.FieldConfig.Defaults.Max}
		for _, q := range qs {
			ss, err := c.queryRange(ctx, q.Expr, start, o.To, o.Step)
			if err != nil {
				return nil, fmt.Errorf("panel %q: query %q: %w", p.Title, q.Expr, err)
			}
			sort.SliceStable(ss, func(i, j int) bool { return labelSet(ss[i].Labels) < labelSet(ss[j].Labels) })
			for _, s := range ss {
				it.Series = append(it.Series, line{Name: legend(q.LegendFormat, s.Labels, q.Expr), Points: s.Points})
			}
		}
		pg.Items = append(pg.Items, it)
	}
	return pg, nil
}

var legendRE = regexp.MustCompile(`\{\{\s*(.+?)\s*\}\}`)

// legend names a series as Grafana does: the legend format with
// {{label}} replaced by the label's value (by its name when the series
// has no such label), else the label set, else the expression.
func legend(format string, labels map[string]string, expr string) string {
	if format != "" && format != "__auto" {
		return legendRE.ReplaceAllStringFunc(format, func(m string) string {
			name := legendRE.FindStringSubmatch(m)[1]
			if v, ok := labels[name]; ok {
				return v
			}
			return name
		})
	}
	if len(labels) == 0 {
		return expr
	}
	return labelSet(labels)
}

// labelSet writes labels as PromQL does: name{a="1", b="2"}.
func labelSet(labels map[string]string) string {
	names := make([]string, 0, len(labels))
	for k := range labels {
		if k != "__name__" {
			names = append(names, k)
		}
	}
	sort.Strings(names)
	parts := make([]string, len(names))
	for i, k := range names {
		parts[i] = k + "=" + strconv.Quote(labels[k])
	}
	return labels["__name__"] + "{" + strings.Join(parts, ", ") + "}"
}

// --- Drawing -----------------------------------------------------------------

// Layout, in SVG pixels.
const (
	pageWidth    = 1400
	margin       = 20
	gap          = 20
	panelWidth   = (pageWidth - 2*margin - gap) / 2
	headerHeight = 64
	rowHeight    = 34
	titleHeight  = 28
	plotHeight   = 180
	axisHeight   = 22
	legendLine   = 16
	maxLegend    = 8
	plotLeft     = 72 // room for the value labels
	plotRight    = 16
)

// Grafana's classic palette.
var palette = []string{"#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1",
	"#BA43A9", "#705DA0", "#508642", "#CCA300", "#447EBC", "#C15C17"}

// svg builds the document; every text that is not the program's own goes
// through esc.
type svg struct{ b bytes.Buffer }

func (s *svg) f(format string, args ...any) { fmt.Fprintf(&s.b, format, args...) }

// text writes a text element; class and anchor are the program's own.
func (s *svg) text(x, y float64, class, anchor, content string) {
	s.f(`<text x="%.1f" y="%.1f" class="%s" text-anchor="%s">%s</text>`+"\n", x, y, class, anchor, esc(content))
}

// esc escapes text for XML; characters XML cannot hold become U+FFFD.
func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s)) // a strings.Builder does not fail
	return b.String()
}

// render writes the page as one SVG document.
func render(w io.Writer, pg *page) error {
	// Lay out first: panels two by two, a row heading across both.
	type placed struct {
		it   item
		x, y float64
		h    float64
	}
	var ps []placed
	y := float64(headerHeight)
	col := 0
	var pairH float64
	flush := func() {
		if col == 1 {
			y += pairH + gap
			col, pairH = 0, 0
		}
	}
	for _, it := range pg.Items {
		if it.Row != "" {
			flush()
			ps = append(ps, placed{it: it, x: margin, y: y, h: rowHeight})
			y += rowHeight
			continue
		}
		h := panelHeight(it)
		ps = append(ps, placed{it: it, x: float64(margin + col*(panelWidth+gap)), y: y, h: h})
		pairH = max(pairH, h)
		if col == 1 {
			y += pairH + gap
			col, pairH = 0, 0
		} else {
			col = 1
		}
	}
	flush()
	// The second of a pair may be taller: panels of a pair get the same height.
	for i := range ps {
		if ps[i].it.Row != "" {
			continue
		}
		for j := range ps {
			if j != i && ps[j].it.Row == "" && ps[j].y == ps[i].y {
				ps[i].h = max(ps[i].h, ps[j].h)
			}
		}
	}
	height := y + margin

	s := &svg{}
	s.f(`<?xml version="1.0" encoding="UTF-8"?>` + "\n")
	s.f(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%.0f" viewBox="0 0 %d %.0f" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">`+"\n",
		pageWidth, height, pageWidth, height)
	s.f(`<style>
.h1 { font-size: 20px; font-weight: bold; fill: #222; }
.sub { font-size: 12px; fill: #555; }
.row { font-size: 15px; font-weight: bold; fill: #333; }
.title { font-size: 13px; font-weight: bold; fill: #222; }
.tick { font-size: 10px; fill: #666; }
.legend { font-size: 11px; fill: #333; }
.nodata { font-size: 14px; fill: #999; }
</style>
`)
	s.f(`<rect x="0" y="0" width="%d" height="%.0f" fill="#fafafa"/>`+"\n", pageWidth, height)
	s.text(margin, 30, "h1", "start", pg.Title)
	zone, _ := pg.From.Zone()
	s.text(margin, 50, "sub", "start", fmt.Sprintf("%s to %s (%s), step %s, from %s",
		pg.From.Format("2006-01-02 15:04:05"), pg.To.Format("2006-01-02 15:04:05"), zone, pg.Step, pg.Source))
	for _, p := range ps {
		if p.it.Row != "" {
			s.text(p.x, p.y+22, "row", "start", p.it.Row)
			s.f(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ccc"/>`+"\n", margin, p.y+28, pageWidth-margin, p.y+28)
			continue
		}
		drawPanel(s, p.it, p.x, p.y, p.h, pg.From, pg.To, pg.Step)
	}
	s.f("</svg>\n")
	_, err := w.Write(s.b.Bytes())
	return err
}

// panelHeight is a panel's height with its legend.
func panelHeight(it item) float64 {
	n := min(len(it.Series), maxLegend)
	if len(it.Series) > maxLegend {
		n++ // "and N more"
	}
	return titleHeight + plotHeight + axisHeight + float64(n)*legendLine + 10
}

// drawPanel draws one panel: frame, title, axes, lines and legend.
func drawPanel(s *svg, it item, x, y, h float64, from, to time.Time, step time.Duration) {
	s.f(`<g>` + "\n")
	s.f(`<rect x="%.1f" y="%.1f" width="%d" height="%.1f" fill="#fff" stroke="#ddd" rx="3"/>`+"\n", x, y, panelWidth, h)
	s.text(x+10, y+19, "title", "start", it.Title)
	px, py := x+plotLeft, y+titleHeight
	pw, ph := float64(panelWidth-plotLeft-plotRight), float64(plotHeight)
	s.f(`<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#eee"/>`+"\n", px, py, pw, ph)

	// Time axis.
	t0, t1 := from.UnixMilli(), to.UnixMilli()
	xOf := func(t time.Time) float64 { return px + pw*float64(t.UnixMilli()-t0)/float64(t1-t0) }
	for _, t := range timeTicks(from, to) {
		tx := xOf(t)
		s.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", tx, py, tx, py+ph)
		if tx-px >= 22 && px+pw-tx >= 22 { // a label at an end would stick out
			s.text(tx, py+ph+14, "tick", "middle", t.Format("15:04:05"))
		}
	}

	lo, hi, ok := valueRange(it, from, to)
	if !ok {
		s.text(px+pw/2, py+ph/2, "nodata", "middle", "no data")
		s.f("</g>\n")
		return
	}
	ticks := valueTicks(lo, hi, it.Unit)
	lo, hi = min(lo, ticks[0]), max(hi, ticks[len(ticks)-1])
	yOf := func(v float64) float64 { return py + ph - ph*(v-lo)/(hi-lo) }
	for _, v := range ticks {
		ty := yOf(v)
		s.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", px, ty, px+pw, ty)
		s.text(px-6, ty+3.5, "tick", "end", formatValue(v, it.Unit))
	}

	// One line per series, broken where values are missing or not finite.
	for i, l := range it.Series {
		color := palette[i%len(palette)]
		s.f(`<g stroke="%s" fill="%s"><title>%s</title>`+"\n", color, color, esc(l.Name))
		var seg []point
		end := func() {
			switch len(seg) {
			case 0:
			case 1: // a lone point: a dot
				s.f(`<circle cx="%.1f" cy="%.1f" r="1.5" stroke="none"/>`+"\n", xOf(seg[0].T), yOf(seg[0].V))
			default:
				s.f(`<polyline fill="none" stroke-width="1.5" points="`)
				for i, p := range seg {
					if i > 0 {
						s.f(" ")
					}
					s.f("%.1f,%.1f", xOf(p.T), yOf(p.V))
				}
				s.f(`"/>` + "\n")
			}
			seg = seg[:0]
		}
		for _, p := range l.Points {
			if !drawable(p, from, to) {
				end()
				continue
			}
			if len(seg) > 0 && p.T.Sub(seg[len(seg)-1].T) > step*3/2 {
				end() // no sample for more than a step
			}
			seg = append(seg, p)
		}
		end()
		s.f("</g>\n")
	}

	// Legend.
	ly := py + ph + axisHeight + 10
	maxChars := (panelWidth - 50) * 2 / 13 // at about 6.5 pixels a character
	for i, l := range it.Series {
		if i == maxLegend {
			s.text(x+12, ly+4, "legend", "start", fmt.Sprintf("and %d more series", len(it.Series)-maxLegend))
			break
		}
		color := palette[i%len(palette)]
		s.f(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="3"/>`+"\n", x+12, ly, x+28, ly, color)
		s.text(x+34, ly+4, "legend", "start", truncate(l.Name, maxChars))
		ly += legendLine
	}
	s.f("</g>\n")
}

// drawable says whether a point is drawn: a finite value in the range.
func drawable(p point, from, to time.Time) bool {
	return !math.IsNaN(p.V) && !math.IsInf(p.V, 0) && !p.T.Before(from) && !p.T.After(to)
}

// valueRange is the span of a panel's drawable values, with the panel's
// minimum and maximum if set (Grafana's min 0 keeps counts anchored).
func valueRange(it item, from, to time.Time) (lo, hi float64, ok bool) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, l := range it.Series {
		for _, p := range l.Points {
			if drawable(p, from, to) {
				lo, hi, ok = min(lo, p.V), max(hi, p.V), true
			}
		}
	}
	if !ok {
		return 0, 0, false
	}
	if it.Min != nil {
		lo = min(lo, *it.Min)
	}
	if it.Max != nil {
		hi = max(hi, *it.Max)
	}
	if hi == lo { // a flat line: from zero to it
		switch {
		case lo > 0:
			lo = 0
		case lo < 0:
			hi = 0
		default:
			hi = 1
		}
	}
	return lo, hi, true
}

// valueTicks returns 3 to 6 round values covering lo..hi; for bytes
// round in powers of 1024.
func valueTicks(lo, hi float64, unit string) []float64 {
	scale := 1.0
	if unit == "bytes" {
		for m := max(math.Abs(lo), math.Abs(hi)); m/scale >= 1024; scale *= 1024 {
		}
	}
	lo, hi = lo/scale, hi/scale
	raw := (hi - lo) / 4
	// A step of f·10^e; a tick is k steps, divided rather than multiplied
	// by a power of ten below 1 so that 0.6 is 0.6, not 0.6000000000000001.
	e := math.Floor(math.Log10(raw))
	pow := math.Pow(10, math.Abs(e))
	tick := func(k, f float64) float64 {
		if e < 0 {
			return k * f / pow * scale
		}
		return k * f * pow * scale
	}
	f := 10.0
	for _, c := range []float64{1, 2, 2.5, 5} {
		if tick(1, c)/scale >= raw {
			f = c
			break
		}
	}
	step := tick(1, f) / scale
	var out []float64
	k := math.Floor(lo / step)
	for ; k*step <= hi+step*1e-9; k++ {
		out = append(out, tick(k, f))
	}
	if out[len(out)-1] < hi*scale {
		out = append(out, tick(k, f))
	}
	return out
}

// timeTicks returns round times between from and to, 3 to 6 of them.
func timeTicks(from, to time.Time) []time.Time {
	span := to.Sub(from)
	every := 24 * time.Hour
	for _, d := range []time.Duration{time.Second, 5 * time.Second, 15 * time.Second, 30 * time.Second,
		time.Minute, 2 * time.Minute, 5 * time.Minute, 10 * time.Minute, 15 * time.Minute, 30 * time.Minute,
		time.Hour, 2 * time.Hour, 3 * time.Hour, 6 * time.Hour, 12 * time.Hour, 24 * time.Hour} {
		if span/d <= 6 {
			every = d
			break
		}
	}
	var out []time.Time
	for t := from.Truncate(every); !t.After(to); t = t.Add(every) {
		if !t.Before(from) {
			out = append(out, t)
		}
	}
	return out
}

// formatValue writes a tick value in the panel's unit: s (seconds),
// bytes, percentunit (0..1), anything else as a short number.
func formatValue(v float64, unit string) string {
	num := func(x float64) string { return strconv.FormatFloat(x, 'g', 3, 64) }
	a := math.Abs(v)
	switch unit {
	case "s":
		switch {
		case v == 0:
			return "0"
		case a < 1e-3:
			return num(v*1e6) + " µs"
		case a < 1:
			return num(v*1e3) + " ms"
		case a < 120:
			return num(v) + " s"
		case a < 7200:
			return num(v/60) + " min"
		default:
			return num(v/3600) + " h"
		}
	case "bytes":
		units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
		i := 0
		for a >= 1024 && i < len(units)-1 {
			v, a = v/1024, a/1024
			i++
		}
		return num(v) + " " + units[i]
	case "percentunit":
		return num(v*100) + "%"
	default:
		for _, u := range []struct {
			f float64
			s string
		}{{1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}} {
			if a >= u.f {
				return num(v/u.f) + " " + u.s
			}
		}
		return num(v)
	}
}

// truncate shortens s to n characters, marking the cut.
func truncate(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}
