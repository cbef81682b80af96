package metrics

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
)

// everyMetric is a collector whose scrape has a series of every metric the
// service exports: each folded counter and histogram counted once, every
// live gauge with a value, every limit set.
func everyMetric(t *testing.T) *Collector {
	t.Helper()
	f := newFolder(filepath.Join(t.TempDir(), "events"))
	f.t, f.loaded = newTotals(), true
	for name, d := range defs {
		labels := make([]string, len(d.labels))
		for i := range labels {
			labels[i] = "x"
		}
		if d.buckets == nil {
			f.t.add(name, 1, labels...)
		} else {
			f.t.observe(name, 0.5, labels...)
		}
	}
	return &Collector{Folder: f, Live: Live{
		VMs:      func(context.Context) (map[[2]string]int, error) { return map[[2]string]int{{"job", "running"}: 1}, nil },
		Pools:    func() ([]PoolGauge, error) { return []PoolGauge{{Image: "tiny", Idle: 1, Target: 2}}, nil },
		Capacity: func() (int, int, int, int, error) { return 1, 512, 8, 4096, nil },
		Orphans:  func(context.Context) (int, error) { return 0, nil },
		Cache:    func() (CacheGauge, error) { return CacheGauge{Projects: 1, Bytes: 1, Limit: 2}, nil },
		Images: func() ([]ImageGauge, error) {
			return []ImageGauge{{Image: "tiny", Digest: "sha256:ab", LastCheck: time.Unix(1700000000, 0)}}, nil
		},
	}}
}

// gatherOnly gathers c alone (the Go and process collectors are the
// client library's, named by it).
func gatherOnly(t *testing.T, c prometheus.Collector) []*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	return mfs
}

// nonBaseUnit matches a name part that is a unit other than Prometheus'
// base units (seconds, bytes; ratios for percentages).
var nonBaseUnit = regexp.MustCompile(`(^|_)(nanoseconds|microseconds|milliseconds|millis|ms|us|ns|minutes|hours|days|kb|mb|gb|kib|mib|gib|kilobytes|megabytes|gigabytes|bits|percent|percentage)(_|$)`)

// unitValue matches a label value that carries a unit: a metric whose
// series differ in unit by a label (one unit per metric).
var unitValue = regexp.MustCompile(`(^|_)(seconds|bytes|total)$`)

// conventionProblems is what breaks this project's naming conventions
// (Prometheus' own, https://prometheus.io/docs/practices/naming/): the
// prefix, help text, counters and only counters ending in _total,
// histograms in a base unit (durations in _seconds), base units only, one
// unit per metric, _timestamp in seconds, _info gauges of value 1.
func conventionProblems(mfs []*dto.MetricFamily) []string {
	var out []string
	bad := func(name, format string, args ...any) {
		out = append(out, name+": "+fmt.Sprintf(format, args...))
	}
	for _, mf := range mfs {
		name, typ := mf.GetName(), mf.GetType()
		if !strings.HasPrefix(name, "libvirt_executor_") {
			bad(name, "not prefixed libvirt_executor_")
		}
		if strings.TrimSpace(mf.GetHelp()) == "" {
			bad(name, "no help text")
		}
		isCounter := typ == dto.MetricType_COUNTER
		if isCounter && !strings.HasSuffix(name, "_total") {
			bad(name, "a counter's name must end in _total")
		}
		if !isCounter && strings.HasSuffix(name, "_total") {
			bad(name, "only a counter's name ends in _total (this is a %s)", strings.ToLower(typ.String()))
		}
		if typ == dto.MetricType_HISTOGRAM || typ == dto.MetricType_SUMMARY {
			if !strings.HasSuffix(name, "_seconds") && !strings.HasSuffix(name, "_bytes") {
				bad(name, "a histogram's name ends in its base unit (_seconds for durations, _bytes for sizes)")
			}
		}
		if (strings.Contains(name, "duration") || strings.Contains(name, "latency")) && !strings.HasSuffix(strings.TrimSuffix(name, "_total"), "_seconds") {
			bad(name, "a duration is in seconds: the name ends in _seconds")
		}
		if strings.Contains(name, "_timestamp") && !strings.HasSuffix(name, "_timestamp_seconds") {
			bad(name, "a timestamp is in seconds since the epoch: _timestamp_seconds")
		}
		if m := nonBaseUnit.FindString(name); m != "" {
			bad(name, "unit %q is not a base unit (seconds, bytes, ratios)", strings.Trim(m, "_"))
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if unitValue.MatchString(l.GetValue()) {
					bad(name, "label %s=%q carries a unit: one unit per metric, a metric of its own per unit", l.GetName(), l.GetValue())
				}
			}
			if strings.HasSuffix(name, "_info") && (typ != dto.MetricType_GAUGE || m.GetGauge().GetValue() != 1) {
				bad(name, "an _info metric is a gauge of value 1")
			}
		}
	}
	sort.Strings(out)
	return out
}

// Every metric the service exports follows the conventions, by the client
// library's linter (what promtool check metrics runs) and by ours; the
// scrape holds every metric of the specification (Kinds), with its kind,
// so that none escapes the check.
func TestMetricNamesFollowConventions(t *testing.T) {
	c := everyMetric(t)
	mfs := gatherOnly(t, c)
	// And a scrape where a part fails (scrape_errors).
	c.Live.Orphans = func(context.Context) (int, error) { return 0, errors.New("libvirt gone") }
	for _, mf := range gatherOnly(t, c) {
		if mf.GetName() == "libvirt_executor_scrape_errors" {
			mfs = append(mfs, mf)
		}
	}

	got := map[string]string{}
	for _, mf := range mfs {
		got[mf.GetName()] = strings.ToLower(mf.GetType().String())
	}
	require.Equal(t, Kinds(), got, "the scrape holds exactly the metrics of Kinds(), of their kinds")

	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	require.NoError(t, err)
	require.Empty(t, problems, "promlint")
	require.Empty(t, conventionProblems(mfs))

	// build_info: version, revision, Go version.
	for _, mf := range mfs {
		if mf.GetName() != "libvirt_executor_build_info" {
			continue
		}
		require.Len(t, mf.GetMetric(), 1)
		labels := map[string]string{}
		for _, l := range mf.GetMetric()[0].GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		require.Equal(t, map[string]string{"version": versionForTest(), "revision": revision(), "goversion": runtime.Version()}, labels)
	}
}

// The check fails on each kind of broken name.
func TestConventionProblemsFindBrokenNames(t *testing.T) {
	family := func(name string, typ dto.MetricType, help string, labels ...string) *dto.MetricFamily {
		m := &dto.Metric{}
		for i := 0; i+1 < len(labels); i += 2 {
			m.Label = append(m.Label, &dto.LabelPair{Name: proto.String(labels[i]), Value: proto.String(labels[i+1])})
		}
		switch typ {
		case dto.MetricType_COUNTER:
			m.Counter = &dto.Counter{Value: proto.Float64(1)}
		case dto.MetricType_HISTOGRAM:
			m.Histogram = &dto.Histogram{SampleCount: proto.Uint64(1), SampleSum: proto.Float64(1)}
		default:
			m.Gauge = &dto.Gauge{Value: proto.Float64(2)}
		}
		return &dto.MetricFamily{Name: proto.String(name), Help: proto.String(help), Type: typ.Enum(), Metric: []*dto.Metric{m}}
	}
	for _, tc := range []struct {
		mf   *dto.MetricFamily
		want string
	}{
		{family("libvirt_executor_jobs", dto.MetricType_COUNTER, "h"), "must end in _total"},
		{family("libvirt_executor_vms_total", dto.MetricType_GAUGE, "h"), "only a counter's name ends in _total"},
		{family("libvirt_executor_prepare_time", dto.MetricType_HISTOGRAM, "h"), "ends in its base unit"},
		{family("libvirt_executor_prepare_duration_milliseconds", dto.MetricType_HISTOGRAM, "h"), "not a base unit"},
		{family("libvirt_executor_cleanup_duration", dto.MetricType_GAUGE, "h"), "a duration is in seconds"},
		{family("libvirt_executor_cache_mib", dto.MetricType_GAUGE, "h"), `unit "mib"`},
		{family("libvirt_executor_vms", dto.MetricType_GAUGE, ""), "no help text"},
		{family("lve_vms", dto.MetricType_GAUGE, "h"), "not prefixed"},
		{family("libvirt_executor_capacity_used", dto.MetricType_GAUGE, "h", "resource", "memory_bytes"), "carries a unit"},
		{family("libvirt_executor_image_last_check_timestamp", dto.MetricType_GAUGE, "h"), "_timestamp_seconds"},
		{family("libvirt_executor_build_info", dto.MetricType_GAUGE, "h"), "gauge of value 1"},
	} {
		got := conventionProblems([]*dto.MetricFamily{tc.mf})
		require.NotEmpty(t, got, tc.mf.GetName())
		require.True(t, slices.ContainsFunc(got, func(p string) bool { return strings.Contains(p, tc.want) }), "%s: %q in %q", tc.mf.GetName(), tc.want, got)
	}
	require.Empty(t, conventionProblems([]*dto.MetricFamily{family("libvirt_executor_cache_bytes_total", dto.MetricType_COUNTER, "h", "op", "restore")}))
}

// docs/observability.md documents every metric, and no other of ours.
func TestMetricsDocumented(t *testing.T) {
	raw, err := os.ReadFile("../../docs/observability.md")
	require.NoError(t, err)
	kinds := Kinds()
	documented := map[string]bool{}
	for _, n := range regexp.MustCompile("`(libvirt_executor_[a-z_]+)").FindAllStringSubmatch(string(raw), -1) {
		name := n[1]
		if _, ok := kinds[name]; !ok {
			for _, suffix := range []string{"_bucket", "_count", "_sum"} {
				if base, cut := strings.CutSuffix(name, suffix); cut && kinds[base] == "histogram" {
					name = base
				}
			}
		}
		require.Contains(t, kinds, name, "docs/observability.md names %s, which the service does not export", n[1])
		documented[name] = true
	}
	for name := range kinds {
		require.True(t, documented[name], "docs/observability.md does not document %s", name)
	}
}
