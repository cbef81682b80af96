//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/harness"
)

// Two GitLab instances sharing one host and one driver configuration hand
// out the same job id at the same time: each job gets its own VM and both
// pass. Before, the second prepare removed the first job's VM as a
// "leftover" and both failed as system failures.
func TestSameJobIDFromTwoGitLabInstances(t *testing.T) {
	r := setup(t)
	id := int64(700000 + time.Now().UnixNano()%99999)
	urls := []string{"https://gitlab-a.example.com", "https://gitlab-b.example.com"}
	results := make([]*harness.Result, len(urls))
	logs := make([]*logWriter, len(urls))
	var wg sync.WaitGroup
	for i, url := range urls {
		opts, lw := r.options(t)
		logs[i] = lw
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := harness.RunJob(context.Background(), opts, harness.Job{
				ID: id, ServerURL: url, Timeout: 10 * time.Minute,
				Script: []string{fmt.Sprintf("echo instance-%d-on-$(uname -n)", i), "sleep 5", "echo still-here-" + fmt.Sprint(i)},
			})
			require.NoError(t, err)
			results[i] = res
		}()
	}
	wg.Wait()
	for i, res := range results {
		require.Equal(t, harness.StateSuccess, res.State, "instance %d: %s: %s", i, res.FailureReason, res.Message)
		require.Contains(t, logs[i].buf.String(), fmt.Sprintf("still-here-%d", i))
	}
	a, b := results[0].Config.Hostname, results[1].Config.Hostname
	require.NotEqual(t, a, b, "equal job ids of two instances get different VMs")
	require.True(t, strings.HasSuffix(a, fmt.Sprint("-", id)) && strings.HasSuffix(b, fmt.Sprint("-", id)), "%s %s", a, b)
}

// image: $VM_IMAGE is expanded with the job's variables, as the runner does
// for CI_JOB_IMAGE, then checked against the allowlist.
func TestImageNameFromJobVariable(t *testing.T) {
	base := setup(t)
	r := base.withConfig(t, setKey("default_image", `"debian"`))
	opts, lw := r.options(t)
	res, err := harness.RunJob(context.Background(), opts, harness.Job{
		Image:     "$VM_IMAGE",
		Variables: map[string]string{"VM_IMAGE": "tiny"},
		Script:    []string{"echo image-ok"},
	})
	require.NoError(t, err)
	require.Equal(t, harness.StateSuccess, res.State, "%s: %s", res.FailureReason, res.Message)
	log := lw.buf.String()
	require.Contains(t, log, "Preparing a fresh tiny VM", "the expanded name chose the image, not default_image")

	// Expanded to a name that is not offered: the user's mistake, named
	// (as written: the harness's variables are project variables, not
	// public, so their values stay out of the message).
	opts, lw = r.options(t)
	res, err = harness.RunJob(context.Background(), opts, harness.Job{
		Image:     "${VM_IMAGE}-latest",
		Variables: map[string]string{"VM_IMAGE": "tiny"},
		Script:    []string{"echo never"},
	})
	require.NoError(t, err)
	require.Equal(t, harness.StateFailed, res.State)
	require.Equal(t, 1, stageExit(t, res, "config").ExitCode, "an image that is not offered is a build failure")
	require.Contains(t, lw.buf.String(), `image "${VM_IMAGE}-latest" (its expansion uses a masked or non-public variable and is not shown) is not offered`)
}

// Without JOB_RESPONSE_FILE the job's identity would come from
// CUSTOM_ENV_CI_JOB_ID, which the job controls: a system failure, nothing
// made.
func TestNoPayloadFileIsRefused(t *testing.T) {
	r := setup(t)
	s := newStageRunner(t, r)
	var env []string
	for _, e := range s.env {
		if !strings.HasPrefix(e, "JOB_RESPONSE_FILE=") {
			env = append(env, e)
		}
	}
	s.env = env
	for _, stage := range []string{"config", "prepare"} {
		res := s.run(t, stage)
		require.Equal(t, 2, res.code, "%s: SYSTEM_FAILURE", stage)
		require.Contains(t, res.stderr, "JOB_RESPONSE_FILE is not set")
		require.Contains(t, res.stderr, "insecure_job_id_from_env")
	}
}
