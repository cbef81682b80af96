package panels

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/metrics"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// fleetHost is one host's metrics endpoint: the service's real collector
// over an event spool the test writes as stages do.
type fleetHost struct {
	spool obs.Spool
	srv   *httptest.Server
	jobs  int
}

func newFleetHost(t *testing.T, vms int) *fleetHost {
	t.Helper()
	h := &fleetHost{spool: obs.Spool{Dir: t.TempDir()}}
	col := &metrics.Collector{
		Folder: &metrics.Folder{Spool: h.spool, Images: []string{"tiny"}, Log: slog.New(slog.DiscardHandler)},
		Live:   metrics.Live{Capacity: func() (int, int, int, int, error) { return vms, vms * 512, 8, 0, nil }},
	}
	handler, err := metrics.Handler(col)
	require.NoError(t, err)
	h.srv = httptest.NewServer(handler)
	t.Cleanup(h.srv.Close)
	return h
}

// job records one job as its stages do: a prepare (warm or cold), a
// stage that found its guest dead, cleanup.
func (h *fleetHost) job(t *testing.T, path string) {
	t.Helper()
	h.jobs++
	key := fmt.Sprintf("job-%d", h.jobs)
	ev := func(stage string, secs float64) obs.Event {
		return obs.Event{Kind: obs.KindStage, Job: key, Stage: stage, Image: "tiny", Result: obs.ResultSuccess, Seconds: secs}
	}
	require.NoError(t, h.spool.Append(ev("config", 0.01)))
	p := ev("prepare", 6.5)
	p.Path = path
	if path == obs.PathWarm {
		p.Seconds, p.Pool = 0.08, "hit"
	}
	require.NoError(t, h.spool.Append(p))
	dead := ev("build_script", 9.2)
	dead.Result, dead.Reason, dead.DeadAfterSeconds = obs.ResultSystem, "dead_guest", 9.1
	require.NoError(t, h.spool.Append(dead))
	require.NoError(t, h.spool.Append(ev("cleanup", 0.05)))
}

func (h *fleetHost) target(t *testing.T) string {
	u, err := url.Parse(h.srv.URL)
	require.NoError(t, err)
	return u.Host
}

// TestFleetPanelsSeeEveryHost: a real Prometheus scrapes two hosts'
// metrics endpoints (the service's collector, each over its own event
// spool); every query of the dashboard's fleet row returns a line for
// each host, told apart by the target's instance label.
func TestFleetPanelsSeeEveryHost(t *testing.T) {
	hosts := []*fleetHost{newFleetHost(t, 2), newFleetHost(t, 5)}
	var targets []string
	for _, h := range hosts {
		h.job(t, obs.PathCold)
		targets = append(targets, fmt.Sprintf("%q", h.target(t)))
	}
	base := startPrometheusWith(t, "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: libvirt-executor\n    static_configs:\n      - targets: ["+strings.Join(targets, ", ")+"]\n")
	c := fakeClient(t, base)
	ctx := context.Background()
	instant := func(expr string) model.Vector {
		v, _, _, err := c.api.Query(ctx, expr, time.Now())
		require.NoError(t, err, expr)
		vec, ok := v.(model.Vector)
		require.True(t, ok, "%s: %s", expr, v.Type())
		return vec
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			require.True(t, time.Now().Before(deadline), "%s within 30 s", what)
			time.Sleep(200 * time.Millisecond) // the poll's interval
		}
	}
	total := func() float64 {
		vec := instant(`sum(libvirt_executor_jobs_total)`)
		if len(vec) == 0 {
			return 0
		}
		return float64(vec[0].Value)
	}
	waitFor("both hosts scraped with their first job", func() bool { return total() == 2 })
	// More jobs between scrapes: the counters grow, so rates are not 0.
	for _, h := range hosts {
		h.job(t, obs.PathWarm)
		h.job(t, obs.PathCold)
	}
	waitFor("the new jobs scraped", func() bool { return total() == 6 })

	d, err := loadDashboard(dashboardFile)
	require.NoError(t, err)
	want := []string{hosts[0].target(t), hosts[1].target(t)}
	slices.Sort(want)
	n := 0
	for _, p := range d.ordered() {
		if !strings.HasPrefix(p.Title, "Fleet:") {
			continue
		}
		qs, err := p.queries(time.Second)
		require.NoError(t, err)
		for _, q := range qs {
			vec := instant(q.Expr)
			var got []string
			for _, s := range vec {
				if inst := string(s.Metric["instance"]); !slices.Contains(got, inst) {
					got = append(got, inst)
				}
			}
			slices.Sort(got)
			require.Equal(t, want, got, "panel %q: query %s: a line for each host (%v)", p.Title, q.Expr, vec)
			n++
		}
	}
	require.Equal(t, 6, n, "the fleet row's queries")
	// The host variable narrows a panel to the hosts chosen.
	one := `sum by (instance) (rate(libvirt_executor_jobs_total{instance=~"` + strings.ReplaceAll(regexp.QuoteMeta(hosts[1].target(t)), `\`, `\\`) + `"}[1m]))`
	vec := instant(one)
	require.Len(t, vec, 1, one)
	require.Equal(t, hosts[1].target(t), string(vec[0].Metric["instance"]))
	// The values are each host's own.
	vms := instant(`max by (instance) (libvirt_executor_capacity_used_vms)`)
	byHost := map[string]float64{}
	for _, s := range vms {
		byHost[string(s.Metric["instance"])] = float64(s.Value)
	}
	require.Equal(t, map[string]float64{hosts[0].target(t): 2, hosts[1].target(t): 5}, byHost)
}
