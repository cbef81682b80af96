package panels

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/metrics"
)

// The repository's files under test, relative to this package.
const (
	dashboardFile  = "../../../deploy/grafana/libvirt-executor.json"
	alertsFile     = "../../../deploy/prometheus/alerts.yml"
	alertsTestFile = "../../../deploy/prometheus/alerts_test.yml"
	promConfigFile = "../../../deploy/prometheus/prometheus.example.yml"
)

// knownMetrics are the metrics the service exposes (its specification,
// metrics.Kinds) with their kind; a histogram is used through its _bucket,
// _count and _sum series. up is Prometheus' own. The dashboard and the
// alerts may use no other name.
var knownMetrics = func() map[string]string {
	k := metrics.Kinds()
	k["up"] = "gauge"
	return k
}()

// knownMetric says whether name is a series of a known metric, and which.
func knownMetric(name string) (string, bool) {
	if kind, ok := knownMetrics[name]; ok && kind != "histogram" {
		return name, true
	}
	for _, suffix := range []string{"_bucket", "_count", "_sum"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && knownMetrics[base] == "histogram" {
			return base, true
		}
	}
	return "", false
}

// --- Rendering ---------------------------------------------------------------

// A canned query_range answer: a hostile label value, a NaN that breaks
// the line (leaving a lone point) and a series with a metric name.
const cannedMatrix = `{"status":"success","data":{"resultType":"matrix","result":[
 {"metric":{"image":"<script>&\"","path":"warm"},
  "values":[[1700000000,"1.5"],[1700000015,"NaN"],[1700000030,"2"],[1700000045,"2.5"]]},
 {"metric":{"__name__":"libvirt_executor_vms","owner":"job"},
  "values":[[1700000000,"0.25"],[1700000015,"+Inf"],[1700000030,"0.5"],[1700000045,"0.75"]]}]}}`

func TestRenderSVG(t *testing.T) {
	// Read through the client, from a fake Prometheus that answers with it.
	srv := httptest.NewServer(&fakePrometheus{})
	defer srv.Close()
	c := fakeClient(t, srv.URL)
	ss, err := c.queryRange(context.Background(), "x", time.Unix(1700000000, 0), time.Unix(1700000045, 0), 15*time.Second)
	require.NoError(t, err)
	require.Len(t, ss, 2)
	require.Equal(t, `<script>&"`, ss[0].Labels["image"])

	var lines []line
	for _, s := range ss {
		lines = append(lines, line{Name: legend("{{image}} {{path}}", s.Labels, "x"), Points: s.Points})
	}
	require.Equal(t, `<script>&" warm`, lines[0].Name)
	require.Equal(t, "image path", lines[1].Name, "a missing label shows its name, as in Grafana")

	zero := 0.0
	from := time.Unix(1700000000, 0)
	pg := &page{Title: "libvirt-executor", Source: "http://127.0.0.1:9090", From: from, To: from.Add(time.Minute), Step: 15 * time.Second,
		Items: []item{
			{Row: "Latency & <more>"},
			{Title: "Prepare p95 <warm> & cold", Unit: "s", Min: &zero, Series: lines},
			{Title: "Empty panel\x07", Unit: "short"}, // a character XML cannot hold
			{Title: "Memory", Unit: "bytes", Series: []line{{Name: "used", Points: []point{{from, 3 << 30}, {from.Add(15 * time.Second), 5 << 30}}}}},
			{Title: "Hit ratio", Unit: "percentunit", Series: []line{{Name: "debian", Points: []point{{from, 0.5}}}}},
		}}
	var buf bytes.Buffer
	require.NoError(t, render(&buf, pg))
	raw := buf.String()

	// It is XML, and its text says what it should.
	texts := svgTexts(t, buf.Bytes())
	for _, want := range []string{"libvirt-executor", "Latency & <more>", "Prepare p95 <warm> & cold", "Empty panel\uFFFD",
		"Memory", "Hit ratio", "no data", `<script>&" warm`, "image path"} {
		require.Contains(t, texts, want)
	}
	require.NotContains(t, raw, "<script")
	require.Contains(t, raw, "&lt;script&gt;&amp;&#34; warm")
	require.Equal(t, 1, strings.Count(raw, "no data"), "only the empty panel has no data")
	// The first series: a lone point (a dot) then a line of two; the
	// second: likewise around its +Inf.
	require.Equal(t, 3, strings.Count(raw, "<polyline"), "hit ratio's single point is a dot too")
	require.Equal(t, 3, strings.Count(raw, "<circle"))
	require.Contains(t, texts, "4 GiB", "bytes tick labels in powers of 1024")
	require.Contains(t, texts, "60%", "a flat line: from 0 to above it")
	require.Contains(t, texts, "3 s")
}

// svgTexts parses doc as XML (failing the test if it is not) and returns
// its character data, one string per element.
func svgTexts(t *testing.T, doc []byte) []string {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(doc))
	var out []string
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return out
		}
		require.NoError(t, err, "the SVG is not well-formed XML")
		if cd, ok := tok.(xml.CharData); ok {
			if s := strings.TrimSpace(string(cd)); s != "" {
				out = append(out, s)
			}
		}
	}
}

func TestFormatValue(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		unit string
		want string
	}{
		{0, "s", "0"},
		{0.25, "s", "250 ms"},
		{2.5e-5, "s", "25 µs"},
		{42, "s", "42 s"},
		{600, "s", "10 min"},
		{1536, "bytes", "1.5 KiB"},
		{0.125, "percentunit", "12.5%"},
		{1500, "short", "1.5 k"},
		{3, "", "3"},
	} {
		require.Equal(t, tc.want, formatValue(tc.v, tc.unit), "%v %s", tc.v, tc.unit)
	}
}

func TestValueTicks(t *testing.T) {
	require.Equal(t, []float64{0, 1, 2, 3}, valueTicks(0, 2.3, "s"))
	require.Equal(t, []float64{0.4, 0.5, 0.6, 0.7, 0.8}, valueTicks(0.42, 0.8, ""))
	ticks := valueTicks(0, 5<<30, "bytes")
	require.Equal(t, float64(0), ticks[0])
	require.GreaterOrEqual(t, ticks[len(ticks)-1], float64(5<<30))
	require.Equal(t, float64(2<<30), ticks[1], "steps of whole GiB")
}

// --- Queries -------------------------------------------------------------------

func TestExpandVars(t *testing.T) {
	for _, tc := range []struct {
		expr string
		step time.Duration
		want string
	}{
		{"rate(x[$__rate_interval])", 15 * time.Second, "rate(x[1m])"},
		{"rate(x[$__rate_interval])", 30 * time.Second, "rate(x[2m])"},
		{"rate(x[${__rate_interval}])", 20 * time.Second, "rate(x[80s])"},
		{"avg_over_time(x[$__interval])", 1500 * time.Millisecond, "avg_over_time(x[1500ms])"},
		{"x[[[__interval]]]", 15 * time.Second, "x[15s]"},
		{`x{ds="$datasource"}`, 15 * time.Second, `x{ds=""}`},
	} {
		got, err := expandVars(tc.expr, tc.step)
		require.NoError(t, err, tc.expr)
		require.Equal(t, tc.want, got, tc.expr)
	}
	got, err := expandVars(`x{instance=~"$instance"}`, 15*time.Second)
	require.NoError(t, err)
	require.Equal(t, `x{instance=~".*"}`, got, "the host variable's All")
	_, err = expandVars(`x{host=~"$host"}`, 15*time.Second)
	require.ErrorContains(t, err, "unknown dashboard variable $host")
}

func TestLegend(t *testing.T) {
	labels := map[string]string{"__name__": "m", "image": "debian", "path": "cold"}
	require.Equal(t, "p95 debian cold", legend("p95 {{image}} {{ path }}", labels, "e"))
	require.Equal(t, `m{image="debian", path="cold"}`, legend("", labels, "e"))
	require.Equal(t, `m{image="debian", path="cold"}`, legend("__auto", labels, "e"))
	require.Equal(t, "sum(x)", legend("", nil, "sum(x)"))
}

func TestParseFlags(t *testing.T) {
	now := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	o, err := ParseFlags([]string{"-prometheus", "http://127.0.0.1:9999", "-from", "-30m", "-out", "x.svg"}, now)
	require.NoError(t, err)
	require.Equal(t, now.Add(-30*time.Minute), o.From)
	require.Equal(t, now, o.To)
	require.Equal(t, 15*time.Second, o.Step, "auto step: at least 15s")
	o, err = ParseFlags([]string{"-from", "now-7d", "-out", "x.svg"}, now)
	require.Error(t, err, "Go durations have no d")
	o, err = ParseFlags([]string{"-from", "-168h", "-out", "x.svg"}, now)
	require.NoError(t, err)
	require.Equal(t, 168*time.Hour/300, o.Step, "auto step: 300 points")
	_, err = ParseFlags([]string{"-from", "-30m"}, now)
	require.ErrorContains(t, err, "-out is required")
	_, err = ParseFlags([]string{"-from", "-24h", "-step", "1s", "-out", "x"}, now)
	require.ErrorContains(t, err, "raise -step")
	_, err = ParseFlags([]string{"-prometheus", "127.0.0.1:9090", "-out", "x"}, now)
	require.ErrorContains(t, err, "http(s) URL")
}

// fakePrometheus answers the API with canned data; query_range answers
// with fail's error for expressions that contain failOn.
type fakePrometheus struct {
	failOn string
	mu     sync.Mutex
	ranges []url.Values
}

func (f *fakePrometheus) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	switch r.URL.Path {
	case "/api/v1/query":
		_, _ = io.WriteString(w, `{"status":"success","data":{"resultType":"scalar","result":[1700000000,"1"]}}`)
	case "/api/v1/query_range":
		f.mu.Lock()
		f.ranges = append(f.ranges, r.Form)
		f.mu.Unlock()
		if f.failOn != "" && strings.Contains(r.Form.Get("query"), f.failOn) {
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"status":"error","errorType":"bad_data","error":"1:10: parse error: unexpected <by>"}`)
			return
		}
		_, _ = io.WriteString(w, cannedMatrix)
	default:
		http.NotFound(w, r)
	}
}

// unixParam reads a query's time parameter (Unix seconds).
func unixParam(t *testing.T, f url.Values, name string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(f.Get(name), 64)
	require.NoError(t, err, "%s=%q", name, f.Get(name))
	return v
}

// fakeClient returns a client of the Prometheus at base.
func fakeClient(t *testing.T, base string) *client {
	t.Helper()
	u, err := url.Parse(base)
	require.NoError(t, err)
	c, err := newClient(u)
	require.NoError(t, err)
	return c
}

func fakeOptions(t *testing.T, base string) Options {
	t.Helper()
	u, err := url.Parse(base)
	require.NoError(t, err)
	to := time.Unix(1700000052, 0)
	return Options{Prometheus: u, Dashboard: dashboardFile, From: to.Add(-time.Minute), To: to,
		Step: 15 * time.Second, Out: filepath.Join(t.TempDir(), "panels.svg")}
}

func TestRunWithFakePrometheus(t *testing.T) {
	fake := &fakePrometheus{}
	srv := httptest.NewServer(fake)
	defer srv.Close()
	o := fakeOptions(t, srv.URL)
	require.NoError(t, Run(context.Background(), o, io.Discard))

	doc, err := os.ReadFile(o.Out)
	require.NoError(t, err)
	texts := svgTexts(t, doc)
	d, err := loadDashboard(dashboardFile)
	require.NoError(t, err)
	n := 0
	for _, p := range d.ordered() {
		require.Contains(t, texts, p.Title)
		n += len(p.Targets)
	}
	require.Contains(t, string(doc), "&lt;script&gt;&amp;&#34;")

	// Every target was asked for, over the range, with the variables replaced.
	require.Len(t, fake.ranges, n)
	for _, f := range fake.ranges {
		q := f.Get("query")
		require.NotContains(t, q, "$", q)
		require.Equal(t, "15", f.Get("step"))
		require.Equal(t, 1699999980.0, unixParam(t, f, "start"), "start aligned to the step")
		require.Equal(t, 1700000052.0, unixParam(t, f, "end"))
		if strings.Contains(q, "rate(") {
			require.Regexp(t, `\[(1m|1h)\]`, q)
		}
	}
}

func TestRunToStdout(t *testing.T) {
	srv := httptest.NewServer(&fakePrometheus{})
	defer srv.Close()
	o := fakeOptions(t, srv.URL)
	o.Out = "-"
	var out bytes.Buffer
	require.NoError(t, Run(context.Background(), o, &out))
	require.True(t, strings.HasPrefix(out.String(), `<?xml version="1.0" encoding="UTF-8"?>`), "-out - writes the SVG to the writer")
	require.Contains(t, svgTexts(t, out.Bytes()), "Jobs per hour by result")
}

func TestQueryRangeWantsAMatrix(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"status":"success","data":{"resultType":"vector","result":[]}}`)
	}))
	defer srv.Close()
	_, err := fakeClient(t, srv.URL).queryRange(context.Background(), "x", time.Unix(1700000000, 0), time.Unix(1700000060, 0), 15*time.Second)
	require.EqualError(t, err, `result type "vector", want matrix`)
}

func TestRunFailures(t *testing.T) {
	// A query Prometheus refuses: the panel and the expression are named.
	srv := httptest.NewServer(&fakePrometheus{failOn: "libvirt_executor_jobs_total"})
	defer srv.Close()
	o := fakeOptions(t, srv.URL)
	err := Run(context.Background(), o, io.Discard)
	require.ErrorContains(t, err, `panel "Jobs per hour by result": query "sum by (result) (rate(libvirt_executor_jobs_total{instance=~\".*\"}[1m])) * 3600"`)
	require.ErrorContains(t, err, "HTTP 400: bad_data: 1:10: parse error")
	require.NoFileExists(t, o.Out, "no half picture")

	// Not the API.
	srv404 := httptest.NewServer(http.NotFoundHandler())
	defer srv404.Close()
	err = Run(context.Background(), fakeOptions(t, srv404.URL+"/prom"), io.Discard)
	require.ErrorContains(t, err, "HTTP 404, not a Prometheus API answer")

	// Nobody listening.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	err = Run(context.Background(), fakeOptions(t, "http://"+addr), io.Discard)
	require.ErrorContains(t, err, "prometheus at http://"+addr+" does not answer queries: unreachable")
}

// --- The dashboard and the alerts -------------------------------------------------

func TestDashboardShape(t *testing.T) {
	raw, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var d struct {
		UID           string `json:"uid"`
		SchemaVersion int    `json:"schemaVersion"`
		Templating    struct {
			List []struct {
				Name, Type, Definition, AllValue string
				Query                            any
				Multi, IncludeAll                bool
			}
		}
		Panels []struct {
			ID         int
			Type       string
			Title      string
			GridPos    struct{ X, Y, W, H int }
			Datasource struct{ Type, UID string }
			Targets    []struct {
				RefID      string
				Datasource struct{ Type, UID string }
				Expr       string
			}
		}
	}
	require.NoError(t, json.Unmarshal(raw, &d))
	require.Equal(t, "libvirt-executor", d.UID)
	require.Equal(t, 38, d.SchemaVersion)
	require.Len(t, d.Templating.List, 2)
	require.Equal(t, "datasource", d.Templating.List[0].Name)
	require.Equal(t, "datasource", d.Templating.List[0].Type)
	require.Equal(t, "prometheus", d.Templating.List[0].Query.(string))
	// The host variable: every panel shows the hosts chosen (all by default).
	require.Equal(t, "instance", d.Templating.List[1].Name)
	require.Equal(t, "query", d.Templating.List[1].Type)
	require.Equal(t, "label_values(libvirt_executor_build_info, instance)", d.Templating.List[1].Definition)
	require.True(t, d.Templating.List[1].Multi && d.Templating.List[1].IncludeAll)
	require.Equal(t, ".*", d.Templating.List[1].AllValue)
	ids := map[int]bool{}
	for _, p := range d.Panels {
		require.False(t, ids[p.ID], "panel id %d twice", p.ID)
		ids[p.ID] = true
		require.LessOrEqual(t, p.GridPos.X+p.GridPos.W, 24, p.Title)
		if p.Type == "row" {
			continue
		}
		require.Equal(t, "timeseries", p.Type, p.Title)
		require.Equal(t, "${datasource}", p.Datasource.UID, p.Title)
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			require.Equal(t, "${datasource}", tg.Datasource.UID, p.Title)
			require.NotEmpty(t, tg.Expr, p.Title)
			// Every series selector takes the host variable.
			for _, name := range metricNames(tg.Expr) {
				require.Regexp(t, regexp.QuoteMeta(name)+`\{instance=~"\$instance"`, tg.Expr, "panel %q: %s without the host variable", p.Title, name)
			}
		}
	}
}

// metricNames returns the metric names a PromQL expression selects. It
// is a small scanner for the expressions of this repository, not a
// parser: it drops strings, label matchers ({...}), ranges ([...]) and
// the label lists of by, without, on, ignoring, group_left and
// group_right; of the identifiers left, those before "(" are functions
// and aggregations, a few are keywords, and the rest are metric names.
func metricNames(expr string) []string {
	for _, re := range []*regexp.Regexp{
		regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'` + "|`[^`]*`"),
		regexp.MustCompile(`\{[^}]*\}|\[[^\]]*\]`),
		regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`),
	} {
		expr = re.ReplaceAllString(expr, " ")
	}
	keywords := map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true,
		"group_left": true, "group_right": true, "atan2": true, "inf": true, "nan": true}
	var out []string
	for _, tok := range regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*(?:\s*\()?|\d[\w.]*`).FindAllString(expr, -1) {
		if tok[0] >= '0' && tok[0] <= '9' || strings.HasSuffix(tok, "(") || keywords[strings.ToLower(tok)] {
			continue
		}
		out = append(out, tok)
	}
	return out
}

func TestMetricNamesScanner(t *testing.T) {
	require.Equal(t, []string{"a_bucket"},
		metricNames(`histogram_quantile(0.95, sum by (le, image) (rate(a_bucket{x="}", y=~"a|b"}[5m])))`))
	require.Equal(t, []string{"a", "b", "up"},
		metricNames(`a > 0 unless on (job, image) b{state="idle"} offset 5m > 1e3 or absent(up)`))
	require.Equal(t, []string{"x", "y"}, metricNames(`x / ignoring(reason) group_left sum without (le) (y)`))
}

// alertRules is a rule file's rules: name, expression, annotations.
type alertRules struct {
	Groups []struct {
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func loadRules(t *testing.T, path string) alertRules {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var r alertRules
	require.NoError(t, yaml.Unmarshal(raw, &r), path)
	return r
}

// alertExprs returns the expr of every rule in a rule file.
func alertExprs(t *testing.T, path string) []string {
	t.Helper()
	var out []string
	for _, g := range loadRules(t, path).Groups {
		for _, r := range g.Rules {
			out = append(out, r.Expr)
		}
	}
	return out
}

// checkMetricNames fails the test for every name in the dashboard's and
// the alerts' expressions (and the alert tests' series) that the service
// does not expose, and for every metric the dashboard does not show.
func checkMetricNames(t *testing.T, d *dashboard) {
	t.Helper()
	shown := map[string]bool{}
	for _, p := range d.ordered() {
		for _, tg := range p.Targets {
			for _, n := range metricNames(tg.Expr) {
				base, ok := knownMetric(n)
				require.True(t, ok, "panel %q: metric %q is not in the specification (knownMetrics)", p.Title, n)
				shown[base] = true
			}
		}
	}
	for n := range knownMetrics {
		require.True(t, shown[n], "the dashboard shows no panel of metric %s", n)
	}

	exprs := alertExprs(t, alertsFile)
	raw, err := os.ReadFile(alertsFile)
	require.NoError(t, err)
	require.Equal(t, strings.Count(string(raw), "- alert:"), len(exprs), "one expr per alert")
	for _, e := range exprs {
		names := metricNames(e)
		require.NotEmpty(t, names, e)
		for _, n := range names {
			_, ok := knownMetric(n)
			require.True(t, ok, "alerts.yml: metric %q is not in the specification (knownMetrics), in %s", n, e)
		}
	}

	raw, err = os.ReadFile(alertsTestFile)
	require.NoError(t, err)
	for _, m := range regexp.MustCompile(`series:\s*['"]([a-zA-Z_:][a-zA-Z0-9_:]*)`).FindAllStringSubmatch(string(raw), -1) {
		_, ok := knownMetric(m[1])
		require.True(t, ok, "alerts_test.yml: metric %q is not in the specification", m[1])
	}
}

// needBinary returns the path of a tool the test needs; without it the
// test is skipped, or fails when LVE_E2E_REQUIRED=1 or LVE_REQUIRE_PROMETHEUS=1
// (make test, which installs it first).
func needBinary(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	if os.Getenv("LVE_E2E_REQUIRED") == "1" || os.Getenv("LVE_REQUIRE_PROMETHEUS") == "1" {
		t.Fatalf("%v, and LVE_E2E_REQUIRED or LVE_REQUIRE_PROMETHEUS is 1 (Debian: apt-get install prometheus; make deps)", err)
	}
	t.Skipf("%v: install it (Debian: apt-get install prometheus) or set LVE_E2E_REQUIRED=1 to make this a failure", err)
	return ""
}

// startPrometheus runs a Prometheus with nothing to scrape on a free port
// of 127.0.0.1 until the test ends, and returns its URL.
func startPrometheus(t *testing.T) string {
	t.Helper()
	return startPrometheusWith(t, "scrape_configs: []\n")
}

// startPrometheusWith is startPrometheus with the configuration given.
func startPrometheusWith(t *testing.T, config string) string {
	t.Helper()
	bin := needBinary(t, "prometheus")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	require.NoError(t, os.WriteFile(cfg, []byte(config), 0o600))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	logf, err := os.Create(filepath.Join(dir, "prometheus.log"))
	require.NoError(t, err)
	cmd := exec.Command(bin, "--config.file="+cfg, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	// Stop it (this PID only) and wait, before t.TempDir removes its files.
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		logf.Close()
	})

	base := "http://" + addr
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(base + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return base
			}
		}
		select {
		case <-exited:
			log, _ := os.ReadFile(logf.Name())
			t.Fatalf("prometheus exited before it was ready:\n%s", log)
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(logf.Name())
			t.Fatalf("prometheus not ready at %s after 30s:\n%s", base, log)
		}
	}
}

// TestDashboardQueriesValid checks the dashboard's and the alerts' metric
// names against the specification, then has a real Prometheus evaluate
// every panel's expressions (a syntax or type error is an HTTP 400) and
// draws the whole dashboard from it (all "no data").
func TestDashboardQueriesValid(t *testing.T) {
	d, err := loadDashboard(dashboardFile)
	require.NoError(t, err)
	checkMetricNames(t, d)

	base := startPrometheus(t)
	c := fakeClient(t, base)
	ctx := context.Background()
	now := time.Now()

	// The check can fail: Prometheus refuses a broken expression.
	err = c.query(ctx, "sum(rate(libvirt_executor_jobs_total[1m])", now)
	require.ErrorContains(t, err, "HTTP 400: bad_data")

	n := 0
	for _, p := range d.ordered() {
		qs, err := p.queries(15 * time.Second)
		require.NoError(t, err)
		for _, q := range qs {
			err := c.query(ctx, q.Expr, now)
			require.NoError(t, err, "panel %q: query %q", p.Title, q.Expr)
			n++
		}
	}
	require.Greater(t, n, 20)

	o, err := ParseFlags([]string{"-prometheus", base, "-dashboard", dashboardFile, "-from", "-30m",
		"-out", filepath.Join(t.TempDir(), "panels.svg")}, time.Now())
	require.NoError(t, err)
	require.NoError(t, Run(ctx, o, io.Discard))
	doc, err := os.ReadFile(o.Out)
	require.NoError(t, err)
	texts := svgTexts(t, doc)
	require.Contains(t, texts, "no data")
}

// TestAlertRules runs promtool over the alerting rules, their unit tests
// and the example configuration, and checks that every alert has a test
// where it fires and one where it stays silent.
func TestAlertRules(t *testing.T) {
	raw, err := os.ReadFile(alertsFile)
	require.NoError(t, err)
	var alerts []string
	for _, m := range regexp.MustCompile(`(?m)^\s*- alert:\s*(\S+)`).FindAllStringSubmatch(string(raw), -1) {
		alerts = append(alerts, m[1])
	}
	require.NotEmpty(t, alerts)
	fires, silent := map[string]bool{}, map[string]bool{}
	tests, err := os.ReadFile(alertsTestFile)
	require.NoError(t, err)
	lines := strings.Split(string(tests), "\n")
	for i, l := range lines {
		name, ok := strings.CutPrefix(strings.TrimSpace(l), "alertname:")
		if !ok || i+1 >= len(lines) {
			continue
		}
		name = strings.TrimSpace(name)
		if strings.TrimSpace(lines[i+1]) == "exp_alerts: []" {
			silent[name] = true
		} else {
			fires[name] = true
		}
	}
	sort.Strings(alerts)
	for _, a := range alerts {
		require.True(t, fires[a], "alerts_test.yml has no case where %s fires", a)
		require.True(t, silent[a], "alerts_test.yml has no case where %s stays silent", a)
	}

	promtool := needBinary(t, "promtool")
	for _, args := range [][]string{
		{"check", "rules", alertsFile},
		{"test", "rules", alertsTestFile},
		{"check", "config", promConfigFile},
	} {
		out, err := exec.Command(promtool, args...).CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
		require.Contains(t, string(out), "SUCCESS", "promtool %s", strings.Join(args, " "))
	}
}

// runbookBase is where the alerts' runbook_url point: docs/troubleshooting.md
// in the project's repository, at the alert's own section.
const (
	runbookBase     = "https://gitlab.com/libvirt-executor/libvirt-executor/-/blob/main/docs/troubleshooting.md#"
	troubleshooting = "../../../docs/troubleshooting.md"
)

// headingAnchors are the anchors GitLab (and GitHub) give a Markdown file's
// headings: lower case, punctuation other than - and _ dropped, spaces as -,
// a repeated heading's anchor suffixed -1, -2, ...; with each heading's text
// and the text of its section (up to the next heading of any level).
func headingAnchors(md string) map[string][2]string {
	out := map[string][2]string{}
	seen := map[string]int{}
	lines := strings.Split(md, "\n")
	inFence := false
	for i, l := range lines {
		if strings.HasPrefix(l, "```") {
			inFence = !inFence
		}
		if inFence || !strings.HasPrefix(l, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(l, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
				b.WriteRune(r)
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			seen[a]++
			a = a + "-" + strconv.Itoa(n)
		} else {
			seen[a] = 1
		}
		var body []string
		for _, m := range lines[i+1:] {
			if strings.HasPrefix(m, "#") {
				break
			}
			body = append(body, m)
		}
		out[a] = [2]string{text, strings.Join(body, "\n")}
	}
	return out
}

func TestHeadingAnchors(t *testing.T) {
	a := headingAnchors("# Trouble shooting\n\n## In `the` job log\nx\n## LibvirtExecutorDown\nbody\n### LibvirtExecutorDown\n```\n# not a heading\n```\n")
	require.Equal(t, []string{"in-the-job-log", "libvirtexecutordown", "libvirtexecutordown-1", "trouble-shooting"}, slices.Sorted(maps.Keys(a)))
	require.Equal(t, "LibvirtExecutorDown", a["libvirtexecutordown"][0])
	require.Equal(t, "body", a["libvirtexecutordown"][1])
}

// Every alert has a runbook_url into docs/troubleshooting.md whose anchor
// exists, at a section of the alert's own name that says what it means, what
// to check and what to do.
func TestAlertRunbooks(t *testing.T) {
	raw, err := os.ReadFile(alertsFile)
	require.NoError(t, err)
	rules := loadRules(t, alertsFile)
	md, err := os.ReadFile(troubleshooting)
	require.NoError(t, err)
	anchors := headingAnchors(string(md))
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			n++
			url := r.Annotations["runbook_url"]
			anchor, ok := strings.CutPrefix(url, runbookBase)
			require.True(t, ok, "alert %s: runbook_url %q is not %s<anchor>", r.Alert, url, runbookBase)
			sec, ok := anchors[anchor]
			require.True(t, ok, "alert %s: docs/troubleshooting.md has no heading with anchor #%s", r.Alert, anchor)
			require.Equal(t, r.Alert, sec[0], "alert %s: runbook_url points at the section of another heading", r.Alert)
			for _, part := range []string{"**Means**", "**Check**", "**Do**"} {
				require.Contains(t, sec[1], part, "docs/troubleshooting.md, section %s: says what it means, what to check, what to do", r.Alert)
			}
		}
	}
	require.Equal(t, strings.Count(string(raw), "- alert:"), n, "every alert was read")
}
