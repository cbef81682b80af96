//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"libvirt.org/go/libvirt"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

// TestFaultKeepaliveUnderLoad measures the default keepalive on a loaded host:
// four TCG guests on two cores, each running a CPU-bound script, so vCPU
// threads, QEMU and the guests' sshd all compete. No stage may be taken for
// a dead guest (false positive); then one guest is destroyed while the
// others keep the host loaded, and its stage must fail as a system failure
// within 15 s. LVE_E2E_KEEPALIVE="interval,count" (e.g. "1s,3") measures
// other settings; LVE_E2E_LOAD_SECONDS the length of the load (default 40);
// LVE_E2E_HOST_HOGS how many busy loops also run on the host itself while
// the guests are loaded (default 2: one per core).
func TestFaultKeepaliveUnderLoad(t *testing.T) {
	base := setup(t)
	r := base.withConfig(t, func(s string) string {
		s = regexp.MustCompile(`(?m)^keepalive_(interval|count) = .*$`).ReplaceAllString(s, "")
		if v := os.Getenv("LVE_E2E_KEEPALIVE"); v != "" {
			iv, count, _ := strings.Cut(v, ",")
			s = strings.Replace(s, "[ssh]\n", fmt.Sprintf("[ssh]\nkeepalive_interval = %q\nkeepalive_count = %s\n", iv, count), 1)
		}
		return s
	})
	window := r.cfg.SSH.KeepaliveInterval.D() * time.Duration(r.cfg.SSH.KeepaliveCount)
	loadSeconds := 40
	if v := os.Getenv("LVE_E2E_LOAD_SECONDS"); v != "" {
		_, _ = fmt.Sscan(v, &loadSeconds)
	}
	const jobs = 4
	// A busy loop in the guest's shell for loadSeconds, with a line every
	// 10 s; the victim's loop runs longer: it is destroyed mid-way.
	hog := func(seconds int) []string {
		return []string{
			"echo HOG-START",
			fmt.Sprintf(`end=$(( $(date +%%s) + %d )); n=0; while [ $(date +%%s) -lt $end ]; do i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; n=$((n+1)); done; echo HOG-DONE-$n`, seconds),
		}
	}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		started  = map[int]time.Time{}
		results  = make([]*harness.Result, jobs)
		logs     = make([]*logWriter, jobs)
		victimID = int64(900000 + time.Now().UnixNano()%99999)
	)
	for i := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opts, lw := r.options(t)
			mu.Lock()
			logs[i] = lw
			mu.Unlock()
			opts.OnStage = func(name string, _ int) {
				if name == "build_script" {
					mu.Lock()
					started[i] = time.Now()
					mu.Unlock()
				}
			}
			job := harness.Job{Timeout: 10 * time.Minute, Script: hog(loadSeconds)}
			if i == 0 {
				job.ID = victimID
				job.Script = hog(loadSeconds + 120)
			}
			res, err := harness.RunJob(context.Background(), opts, job)
			require.NoError(t, err)
			results[i] = res
		}()
	}
	// Destroy the victim once every job has been loading the host for most
	// of its load period.
	waitFor(t, 10*time.Minute, "all jobs loading the host", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, lw := range logs {
			if lw == nil {
				return false
			}
			if !strings.Contains(lw.buf.String(), "HOG-START") {
				return false
			}
		}
		return true
	})
	hogs := 2
	if v := os.Getenv("LVE_E2E_HOST_HOGS"); v != "" {
		_, _ = fmt.Sscan(v, &hogs)
	}
	for range hogs {
		hog := exec.Command("sh", "-c", "while :; do :; done")
		require.NoError(t, hog.Start())
		t.Cleanup(func() { _ = hog.Process.Kill(); _ = hog.Wait() })
	}
	// Destroyed half-way through the load of the job that started first,
	// so that every guest is still loaded until the destroyed one's stage
	// has been decided (detection takes at most 15 s; the load is 40 s).
	mu.Lock()
	first := time.Now()
	for _, at := range started {
		if at.Before(first) {
			first = at
		}
	}
	mu.Unlock()
	time.Sleep(time.Until(first.Add(time.Duration(loadSeconds) * time.Second / 2)))
	destroyed := r.destroyDomainWithSuffix(t, fmt.Sprintf("-%d", victimID))
	wg.Wait()

	falsePositives := 0
	for i := 1; i < jobs; i++ {
		build := stageExit(t, results[i], "build_script")
		if build.ExitCode != 0 {
			falsePositives++
			t.Logf("job %d: build_script exited %d under load: %s", i, build.ExitCode, results[i].Message)
		}
	}
	build := stageExit(t, results[0], "build_script")
	detection := started[0].Add(build.Duration).Sub(destroyed)
	figures.fault()
	figures.class(build.ExitCode, 2)
	figures.detected(detection)
	t.Logf("keepalive %s x %d (window %s), %d TCG guests busy on this host plus %d host busy loops, %d s of load each: %d false positives in %d loaded stages; destroyed guest detected after %s",
		r.cfg.SSH.KeepaliveInterval.D(), r.cfg.SSH.KeepaliveCount, window, jobs, hogs, loadSeconds, falsePositives, jobs-1, detection.Round(100*time.Millisecond))
	require.Zero(t, falsePositives, "a loaded but live guest was taken for dead")
	require.Equal(t, 2, build.ExitCode, "the destroyed guest's stage is a system failure")
	require.Less(t, detection, 15*time.Second, "dead guest noticed within 15 s on a loaded host")
}

// destroyDomainWithSuffix destroys the one running domain of this rig whose
// name ends with suffix, and returns when it did.
func (r *rig) destroyDomainWithSuffix(t *testing.T, suffix string) time.Time {
	t.Helper()
	doms, err := r.conn.ListAllDomains(libvirt.CONNECT_LIST_DOMAINS_ACTIVE)
	require.NoError(t, err)
	var at time.Time
	for _, d := range doms {
		name, _ := d.GetName()
		if strings.HasPrefix(name, r.cfg.NamePrefix+"-") && strings.HasSuffix(name, suffix) {
			at = time.Now()
			require.NoError(t, d.Destroy())
		}
		_ = d.Free()
	}
	require.False(t, at.IsZero(), "no running domain ending in %s", suffix)
	return at
}
