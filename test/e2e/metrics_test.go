//go:build e2e

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// requirePrometheus finds Debian's prometheus and promtool; without them
// the test skips, or fails with LVE_E2E_REQUIRED=1 (make deps installs
// them).
func requirePrometheus(t *testing.T) (prom, promtool string) {
	t.Helper()
	prom, err1 := exec.LookPath("prometheus")
	promtool, err2 := exec.LookPath("promtool")
	if err1 != nil || err2 != nil {
		if os.Getenv("LVE_E2E_REQUIRED") == "1" {
			t.Fatalf("prometheus/promtool not found although LVE_E2E_REQUIRED=1 (make deps installs Debian's prometheus)")
		}
		t.Skip("prometheus/promtool not found: apt-get install prometheus (make deps)")
	}
	return prom, promtool
}

// loopbackAddr is a free TCP address on 127.0.0.1 (in the rig's
// namespace: the test runs there).
func loopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// promServer is a Prometheus server started by the test.
type promServer struct {
	base string
	cmd  *exec.Cmd
	log  sshtest.Buffer
}

// startPrometheus starts prometheus scraping target every second, with the
// shipped alert rules loaded; the test's cleanup stops it.
func startPrometheus(t *testing.T, bin, target string) *promServer {
	t.Helper()
	dir := t.TempDir()
	rules, err := filepath.Abs("../../deploy/prometheus/alerts.yml")
	require.NoError(t, err)
	conf := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [%q]
scrape_configs:
  - job_name: libvirt-executor
    static_configs:
      - targets: [%q]
`, rules, target)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(conf), 0o600))
	listen := loopbackAddr(t)
	p := &promServer{base: "http://" + listen}
	p.cmd = exec.Command(bin, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+listen)
	p.cmd.Stdout, p.cmd.Stderr = &p.log, &p.log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, p.cmd.Start())
	t.Cleanup(func() {
		_ = syscall.Kill(p.cmd.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("prometheus log:\n%s", p.log.String())
		}
	})
	waitFor(t, 60*time.Second, "prometheus ready", func() bool {
		resp, err := http.Get(p.base + "/-/ready")
		if err != nil {
			return false
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return p
}

// query runs an instant query and returns the sum of the vector's values,
// and whether the vector had any.
func (p *promServer) query(t *testing.T, q string) (float64, bool) {
	t.Helper()
	resp, err := http.Get(p.base + "/api/v1/query?query=" + url.QueryEscape(q))
	require.NoError(t, err)
	defer resp.Body.Close()
	var out struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Value [2]any `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
	require.Equal(t, "success", out.Status, "query %s: %s", q, out.Error)
	sum := 0.0
	for _, r := range out.Data.Result {
		s, _ := r.Value[1].(string)
		v, err := strconv.ParseFloat(s, 64)
		require.NoError(t, err)
		sum += v
	}
	return sum, len(out.Data.Result) > 0
}

// value is query's sum, 0 for an empty vector.
func (p *promServer) value(t *testing.T, q string) float64 {
	v, _ := p.query(t, q)
	return v
}

// waitValue waits until q's value is want.
func (p *promServer) waitValue(t *testing.T, q string, want float64, within time.Duration) {
	t.Helper()
	var got float64
	deadline := time.Now().Add(within)
	for {
		if got = p.value(t, q); got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus: %s is %v after %s, want %v", q, got, within, want)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// TestMetricsScrapedByPrometheus: a real Prometheus scrapes the service
// while jobs run (warm and failing through the pool, a cold one while the
// service is SIGKILLed); it finds the job counts, the prepare histogram by
// path, the VM and pool gauges, build_info, the capacity gauges, and
// counters that neither reset nor count twice across the restart. promtool accepts the endpoint's output; the
// shipped alert rules load and evaluate; the step log has a record per
// step; the job token is in none of it.
func TestMetricsScrapedByPrometheus(t *testing.T) {
	promBin, promtool := requirePrometheus(t)
	metricsAddr := loopbackAddr(t)
	base := setup(t)
	stepLog := filepath.Join(base.userDir(t), "log", "steps.jsonl")
	serveHeader := regexp.MustCompile(`(?m)^\[serve\][ \t]*$`)
	r := base.withPool(t, 1).withConfig(t, func(s string) string {
		s = serveHeader.ReplaceAllString(s, fmt.Sprintf("[serve]\nmetrics_listen = %q", metricsAddr))
		return s + fmt.Sprintf("\n[log]\nsteps = \"file\"\nsteps_file = %q\n", stepLog)
	})
	require.Equal(t, metricsAddr, r.cfg.Serve.MetricsListen)
	svc := r.serve(t)
	r.waitIdle(t, 1, 3*time.Minute)
	prom := startPrometheus(t, promBin, metricsAddr)
	waitFor(t, 30*time.Second, "the first scrape", func() bool {
		v, ok := prom.query(t, `up{job="libvirt-executor"}`)
		return ok && v == 1
	})
	prom.waitValue(t, `libvirt_executor_pool_vms{image="tiny",state="idle"}`, 1, 30*time.Second)
	prom.waitValue(t, `libvirt_executor_vms{owner="standby",state="running"}`, 1, 30*time.Second)
	// build_info names the version, the git revision and the Go version; the
	// capacity gauges are one metric per unit (#44 item 6), the old
	// capacity_used/capacity_limit with a resource label are gone.
	prom.waitValue(t, `count(libvirt_executor_build_info{version!="",revision!="",goversion=~"go[0-9].+"} == 1)`, 1, 10*time.Second)
	for _, q := range []string{`libvirt_executor_capacity_used_vms`, `libvirt_executor_capacity_used_memory_bytes`} {
		_, ok := prom.query(t, q)
		require.True(t, ok, "%s has a series", q)
	}
	for _, q := range []string{`libvirt_executor_capacity_used`, `libvirt_executor_capacity_limit`} {
		_, ok := prom.query(t, q)
		require.False(t, ok, "%s (the name before #44) has no series", q)
	}

	queries := map[string]string{
		"success":   `sum(libvirt_executor_jobs_total{result="success"})`,
		"script":    `sum(libvirt_executor_jobs_total{result="build_failure",reason="script"})`,
		"warm":      `sum(libvirt_executor_prepare_duration_seconds_count{image="tiny",path="warm"})`,
		"cold":      `sum(libvirt_executor_prepare_duration_seconds_count{image="tiny",path="cold"})`,
		"hit":       `sum(libvirt_executor_pool_claims_total{image="tiny",result="hit"})`,
		"down":      `sum(libvirt_executor_pool_claims_total{image="tiny",result="miss",reason="service_down"})`,
		"stepfail":  `sum(libvirt_executor_stages_total{stage=~"step_script|build_script",result="build_failure",reason="script"})`,
		"overhead":  `sum(libvirt_executor_run_overhead_seconds_count{image="tiny"})`,
		"cleanups":  `sum(libvirt_executor_cleanup_duration_seconds_count)`,
		"removals":  `sum(libvirt_executor_vm_removal_seconds_count)`,
		"preparing": `sum(libvirt_executor_stages_total{stage="prepare"})`,
	}
	before := map[string]float64{}
	for k, q := range queries {
		before[k] = prom.value(t, q)
	}
	delta := func(k string) float64 { return prom.value(t, queries[k]) - before[k] }
	waitDelta := func(k string, want float64) {
		t.Helper()
		prom.waitValue(t, queries[k], before[k]+want, 30*time.Second)
	}

	token := "glcbt-metrics-secret-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	// Job A passes, warm; while it runs, the VM gauge shows a job's VM.
	optsA, lwA := r.options(t)
	doneA := make(chan *harness.Result, 1)
	go func() {
		res, err := harness.RunJob(context.Background(), optsA, harness.Job{Token: token, Script: []string{"sleep 6", "echo job-a"}})
		if err != nil {
			t.Error(err)
		}
		doneA <- res
	}()
	waitFor(t, 60*time.Second, "a job's VM in libvirt_executor_vms", func() bool {
		v, _ := prom.query(t, `libvirt_executor_vms{owner="job",state="running"}`)
		return v >= 1
	})
	resA := <-doneA
	require.NotNil(t, resA)
	require.Equal(t, harness.StateSuccess, resA.State, lwA.buf.String())
	require.NotEmpty(t, warmVM(lwA.buf.String()), "job A ran warm")

	// Job B fails (exit 3), warm.
	r.waitIdle(t, 1, 3*time.Minute)
	optsB, lwB := r.options(t)
	resB, err := harness.RunJob(context.Background(), optsB, harness.Job{Token: token, Script: []string{"exit 3"}})
	require.NoError(t, err)
	require.Equal(t, harness.StateFailed, resB.State)
	require.NotEmpty(t, warmVM(lwB.buf.String()), "job B ran warm")

	waitDelta("success", 1)
	waitDelta("script", 1)
	waitDelta("warm", 2)
	waitDelta("hit", 2)
	waitDelta("stepfail", 1)
	waitDelta("cleanups", 2)
	require.GreaterOrEqual(t, delta("overhead"), 3.0, "each run stage's overhead is observed")
	prom.waitValue(t, `libvirt_executor_pool_vms{image="tiny",state="idle"}`, 1, 3*time.Minute)

	// The service dies (SIGKILL); job C runs cold meanwhile; its records
	// wait in the spool for the next service.
	svc.kill()
	<-svc.Done()
	optsC, lwC := r.options(t)
	resC, err := harness.RunJob(context.Background(), optsC, harness.Job{Token: token, Script: []string{"echo job-c"}})
	require.NoError(t, err)
	require.Equal(t, harness.StateSuccess, resC.State, lwC.buf.String())
	require.Contains(t, lwC.buf.String(), "Cold start: the pool service")
	r.serve(t)
	waitDelta("success", 2)
	waitDelta("cold", 1)
	waitDelta("down", 1)
	waitDelta("preparing", 3)
	waitDelta("removals", 3)
	// Nothing counted twice, nothing reset by the restart.
	require.Equal(t, 1.0, delta("script"))
	require.Equal(t, 2.0, delta("warm"))
	v, _ := prom.query(t, `sum(resets(libvirt_executor_jobs_total[10m])) + sum(resets(libvirt_executor_stages_total[10m]))`)
	require.Zero(t, v, "the counters go on across the service's restart")

	// promtool accepts the exposition; the shipped rules load and evaluate.
	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.NoError(t, err)
	check := exec.Command(promtool, "check", "metrics")
	check.Stdin = strings.NewReader(string(body))
	out, err := check.CombinedOutput()
	require.NoError(t, err, "promtool check metrics:\n%s", out)
	rresp, err := http.Get(prom.base + "/api/v1/rules")
	require.NoError(t, err)
	var rules struct {
		Data struct {
			Groups []struct {
				Rules []struct {
					Name, Health, LastError string
				} `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	require.NoError(t, json.NewDecoder(rresp.Body).Decode(&rules))
	_ = rresp.Body.Close()
	require.NotEmpty(t, rules.Data.Groups, "the shipped alert rules are loaded")
	waitFor(t, 30*time.Second, "every rule evaluated", func() bool {
		rresp, err := http.Get(prom.base + "/api/v1/rules")
		require.NoError(t, err)
		defer rresp.Body.Close()
		rules.Data.Groups = nil
		require.NoError(t, json.NewDecoder(rresp.Body).Decode(&rules))
		for _, g := range rules.Data.Groups {
			for _, rl := range g.Rules {
				if rl.Health != "ok" {
					return false
				}
			}
		}
		return true
	})

	// The step log: one record per step, the job's identity, no secret.
	f, err := os.Open(stepLog)
	require.NoError(t, err)
	defer f.Close()
	type rec struct {
		Stage, Step, VM, Image, Outcome, Class, Reason string
		Job                                            string  `json:"job_id"`
		Duration                                       float64 `json:"duration_ms"`
	}
	var recs []rec
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var x rec
		require.NoError(t, json.Unmarshal(sc.Bytes(), &x), sc.Text())
		recs = append(recs, x)
	}
	has := func(pred func(rec) bool) bool {
		for _, x := range recs {
			if pred(x) {
				return true
			}
		}
		return false
	}
	require.True(t, has(func(x rec) bool {
		return x.Stage == "prepare" && x.Step == "claim" && x.Outcome == "ok" && x.Image == "tiny" && strings.HasPrefix(x.VM, r.cfg.NamePrefix)
	}), "a warm prepare's claim step")
	require.True(t, has(func(x rec) bool {
		return x.Stage == "prepare" && x.Step == "ssh" && x.Outcome == "ok" && x.Duration > 0
	}), "a cold prepare's ssh step")
	require.True(t, has(func(x rec) bool {
		return (x.Stage == "step_script" || x.Stage == "build_script") && x.Step == "stage" && x.Outcome == "failed" && x.Class == "build_failure" && x.Reason == "script" && x.Job != ""
	}), "the failed script stage (build_script as the harness's runner names it, step_script in newer ones)")
	require.True(t, has(func(x rec) bool { return x.Stage == "cleanup" && x.Step == "stop" && x.Outcome == "ok" }), "cleanup's stop step")
	logText, err := os.ReadFile(stepLog)
	require.NoError(t, err)
	require.NotContains(t, string(logText), token, "the job token is not in the step log")
	events, _ := filepath.Glob(filepath.Join(r.cfg.StateDir, "events", "*"))
	require.NotEmpty(t, events)
	for _, e := range events {
		b, err := os.ReadFile(e)
		require.NoError(t, err)
		require.NotContains(t, string(b), token, "the job token is not in the event spool (%s)", e)
		st, err := os.Stat(e)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "%s is owner-only", e)
	}
	require.NotContains(t, string(body), token, "the job token is not in the metrics")
}
