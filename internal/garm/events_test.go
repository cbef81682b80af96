package garm

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/metrics"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
)

// garm's creates, deletes and failures reach the metrics as GitLab's
// stages do: through the event spool the service folds.
func TestInstanceEventsReachTheMetrics(t *testing.T) {
	r := newRig(t)
	in := create(r, ctrlA, poolA, "garm-Ev1")
	// A create that fails (the host's capacity: max_vms) and one refused
	// for its input.
	out, code := r.call(map[string]string{"GARM_COMMAND": CmdCreate, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA},
		bootstrap("garm-Ev2", func(b map[string]any) { b["image"] = "nope" }))
	require.NotEqual(t, ExitOK, code, out)
	out, code = r.call(map[string]string{"GARM_COMMAND": CmdDelete, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": in.ProviderID}, "")
	require.Equal(t, ExitOK, code, out)

	f := &metrics.Folder{Spool: r.m.Events(), Images: r.cfg.ImageNames(), Log: slog.New(slog.DiscardHandler)}
	require.NoError(t, f.Fold(time.Now()))
	tot := f.Snapshot()
	require.Equal(t, 1.0, tot.Counter(metrics.GarmInstancesTotal, OpCreate, obs.ResultSuccess, "none"))
	require.Equal(t, 1.0, tot.Counter(metrics.GarmInstancesTotal, OpCreate, obs.ResultSystem, "other"))
	require.Equal(t, 1.0, tot.Counter(metrics.GarmInstancesTotal, OpDelete, obs.ResultSuccess, "none"))
	// Not counted as GitLab stages or jobs.
	require.Empty(t, tot.Counters[metrics.StagesTotal])
	require.Empty(t, tot.Counters[metrics.JobsTotal])
}

// A SIGTERM (the command's context ending) while the delete is under way
// does not cut it short: the teardown runs on a deadline of its own. The
// hypervisor here blocks the domain's destroy until the signal has come;
// a teardown on the signal's context gives up then, and the machine stays.
func TestDeleteCompletesAfterSIGTERM(t *testing.T) {
	r := newRig(t)
	in := create(r, ctrlA, poolA, "garm-Term")
	ctx, sigterm := context.WithCancel(context.Background())
	defer sigterm()
	r.hv.BeforeCall = func(method string) {
		if method == "Destroy" {
			sigterm()
			<-ctx.Done()
		}
	}
	e, err := ReadEnv(func(k string) string {
		return map[string]string{"GARM_PROVIDER_CONFIG_FILE": "/unused", "GARM_INTERFACE_VERSION": V011,
			"GARM_COMMAND": CmdDelete, "GARM_CONTROLLER_ID": ctrlA, "GARM_POOL_ID": poolA, "GARM_INSTANCE_ID": in.ProviderID}[k]
	})
	require.NoError(t, err)
	var out strings.Builder
	p := &Provider{M: r.m, Cfg: r.cfg, Env: e, Out: &out}
	require.NoError(t, p.Run(ctx, strings.NewReader("")))
	require.Error(t, ctx.Err(), "the signal came during the delete")
	r.hv.Lock()
	_, left := r.hv.Domains[in.ProviderID]
	r.hv.Unlock()
	require.False(t, left, "the instance's domain was removed")
	require.NoDirExists(t, r.m.Store.MachineDir(in.ProviderID))
}
