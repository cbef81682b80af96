//go:build e2e && bench

package e2e

// The services benchmark (#46 item 6), run by `make bench` (build tags e2e
// and bench; never part of make test): what a job with one small service
// pays over the same job without it, cold and warm, and a container job
// (image: alpine:3.19, its script in the job's container) against the same
// script on the VM's own OS. Every job is a real job through a real
// gitlab-runner run-single, on the podman VM image, its service and
// container images pulled from a registry of the test's own (the podman VM
// reaches it as docker.io's mirror). The table goes to the test log and to
// LVE_BENCH_SERVICES_OUT (JSON to LVE_BENCH_SERVICES_JSON).

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobapi"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/poolsvc"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/registrytest"
)

// benchMode is one kind of job and its measured runs.
type benchMode struct {
	Name string
	Warm bool
	job  jobapi.Job
	// Job is each job's wall time (s) from the runner taking it to its
	// final update; Ready prepare's "Machine ready in"; Services the
	// driver's "Services ready in" (0 without services).
	Job, Ready, Services []float64
}

var (
	benchReadyRE    = regexp.MustCompile(`Machine ready in ([0-9.]+(?:ms|s|m[0-9.]*s?))`)
	benchServicesRE = regexp.MustCompile(`Services ready in ([0-9.]+(?:ms|s|m[0-9.]*s?))`)
)

func benchDuration(re *regexp.Regexp, trace string) float64 {
	m := re.FindStringSubmatch(trace)
	if m == nil {
		return 0
	}
	d, _ := time.ParseDuration(m[1])
	return d.Seconds()
}

func benchMedian(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func benchCell(v []float64) string {
	if len(v) == 0 {
		return "-"
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return fmt.Sprintf("%.2f (%.2f-%.2f)", benchMedian(v), s[0], s[len(s)-1])
}

func TestBenchServices(t *testing.T) {
	runs := 3
	if v, err := strconv.Atoi(os.Getenv("LVE_BENCH_SERVICES_RUNS")); err == nil && v > 0 {
		runs = v
	}
	rr := newRealRunner(t)
	podman := podmanImage(t, rr.r)
	ln := rr.r.serviceListener(t)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	reg := registrytest.StartAt(t, addr)
	pushServiceImage(t, reg.Host, "library/postgres", "15")
	pushShellImage(t, reg.Host, "library/alpine", "3.19")
	cold := rr.r.withConfig(t, func(s string) string {
		return s + "\n" + podman + servicesConfig(reg.Host, "60s", "postgres:*", "alpine:*")
	})
	// The same script in every mode: on the VM's OS it reads Debian's
	// os-release, in the container the image's.
	script := []string{"grep '^ID=' /etc/os-release"}
	modes := []*benchMode{
		{Name: "script on the VM's OS", job: jobapi.Job{Image: "podman", Script: script}},
		{Name: "+ one service (postgres:15)", job: jobapi.Job{Image: "podman", Script: script, Services: []jobapi.Service{{Name: "postgres:15"}}}},
		{Name: "container job (alpine:3.19)", job: jobapi.Job{Image: "alpine:3.19", Script: script}},
		{Name: "script on the VM's OS", Warm: true, job: jobapi.Job{Image: "podman", Script: script}},
		{Name: "+ one service (postgres:15)", Warm: true, job: jobapi.Job{Image: "podman", Script: script, Services: []jobapi.Service{{Name: "postgres:15"}}}},
		{Name: "container job (alpine:3.19)", Warm: true, job: jobapi.Job{Image: "alpine:3.19", Script: script}},
	}
	record := func(m *benchMode, run int) {
		j := m.job
		j.Name = fmt.Sprintf("bench-%d", run)
		res := rr.runJobs(t, j)[0]
		require.Equal(t, jobapi.StateSuccess, res.State, res.Trace)
		if m.Warm {
			require.NotEmpty(t, warmVM(res.Trace), "a warm job claimed an idle VM: %s", res.Trace)
		} else {
			require.Empty(t, warmVM(res.Trace), "a cold job booted its own VM")
		}
		if len(j.Services) > 0 {
			require.Contains(t, res.Trace, "Services ready in")
		}
		// Where the script ran: the container's os-release, or Debian's.
		if strings.HasPrefix(j.Image, "alpine") {
			require.Contains(t, res.Trace, "ID=lve-container-test", "the script ran in the job's container")
		} else {
			require.Contains(t, res.Trace, "ID=debian", "the script ran on the VM's OS")
		}
		m.Job = append(m.Job, res.Duration.Seconds())
		m.Ready = append(m.Ready, benchDuration(benchReadyRE, res.Trace))
		m.Services = append(m.Services, benchDuration(benchServicesRE, res.Trace))
		t.Logf("[bench] %s%s run %d: job %.2fs, ready %.2fs, services %.2fs", m.Name, map[bool]string{true: " (warm)"}[m.Warm], run+1,
			m.Job[len(m.Job)-1], m.Ready[len(m.Ready)-1], m.Services[len(m.Services)-1])
	}
	// Cold: no pool; the order turns each round.
	rr.cfgPath = cold.cfgPath
	for i := range runs {
		order := []*benchMode{modes[0], modes[1], modes[2]}
		for range i % 3 {
			order = append(order[1:], order[0])
		}
		for _, m := range order {
			record(m, i)
		}
	}
	// Warm: one idle podman VM with both images pre-pulled; each job
	// claims it once it is idle again.
	warm := cold.withConfig(t, func(s string) string {
		return strings.Replace(poolsvc.WithPool(s, "podman", 1), "[images.podman.pool]\n",
			"[images.podman.pool]\nprepull = [\"postgres:15\", \"alpine:3.19\"]\n", 1)
	})
	rr.cfgPath = warm.cfgPath
	warm.serve(t)
	for i := range runs {
		order := []*benchMode{modes[3], modes[4], modes[5]}
		for range i % 3 {
			order = append(order[1:], order[0])
		}
		for _, m := range order {
			warm.waitIdle(t, 1, 5*time.Minute)
			record(m, i)
		}
	}

	var b strings.Builder
	fmt.Fprintf(&b, "Services and container jobs on the podman VM image, %d run(s) each, through gitlab-runner run-single (median, min-max, seconds):\n", runs)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tSTART\tWHOLE JOB\tMACHINE READY\tSERVICES READY")
	for _, m := range modes {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", m.Name, map[bool]string{true: "warm", false: "cold"}[m.Warm], benchCell(m.Job), benchCell(m.Ready), benchCell(m.Services))
	}
	require.NoError(t, tw.Flush())
	for _, w := range []struct {
		what    string
		base, m int
	}{{"one service's cost, cold", 0, 1}, {"one service's cost, warm", 3, 4}, {"container job against the VM's OS, cold", 0, 2}, {"container job against the VM's OS, warm", 3, 5}} {
		base, m := benchMedian(modes[w.base].Job), benchMedian(modes[w.m].Job)
		fmt.Fprintf(&b, "%s (medians): job %+.2f s (%.2fx)\n", w.what, m-base, m/base)
	}
	t.Log("\n" + b.String())
	if p := os.Getenv("LVE_BENCH_SERVICES_OUT"); p != "" {
		require.NoError(t, os.WriteFile(p, []byte(b.String()), 0o644))
	}
	if p := os.Getenv("LVE_BENCH_SERVICES_JSON"); p != "" {
		js, err := json.MarshalIndent(map[string]any{"runs": runs, "modes": modes}, "", "  ")
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(p, js, 0o644))
	}
}
