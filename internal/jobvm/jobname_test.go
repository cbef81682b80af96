package jobvm

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// The sweep removes a job name record only when its job has neither a
// mapping nor a machine and the record is older than staleJobName (a
// younger one may be a prepare between NameJob and its mapping).
func TestSweepJobNames(t *testing.T) {
	hv := vmtest.New()
	m, _, _ := poolManager(t, hv, bannerServer(t), "")
	old := time.Now().Add(-2 * staleJobName)
	name := func(key, job string, at time.Time) {
		require.NoError(t, m.Manager().Store.NameJob(key, state.JobName{Job: job, At: at}))
	}
	name("gitlab-0123abcd-1", "lve-0123abcd-1", old)        // stale: swept
	name("gitlab-0123abcd-2", "lve-0123abcd-2", time.Now()) // young: kept
	name("gitlab-0123abcd-3", "lve-0123abcd-3", old)        // mapped: kept
	require.NoError(t, m.Manager().Store.MapJob("lve-0123abcd-3", state.JobMachine{Machine: "lve-0123abcd-3", At: old}))
	name("gitlab-0123abcd-4", "lve-0123abcd-4", old) // its machine's state exists: kept
	_, err := m.Manager().Store.Create("lve-0123abcd-4")
	require.NoError(t, err)

	// Records that do not decode: an old one is swept, a young one kept.
	for _, k := range []string{"gitlab-0123abcd-5", "gitlab-0123abcd-6"} {
		require.NoError(t, os.WriteFile(filepath.Join(m.Manager().Store.Dir, state.JobNamePath(k)), []byte(`{"format":1,"jo`), 0o600))
	}
	require.NoError(t, os.Chtimes(filepath.Join(m.Manager().Store.Dir, state.JobNamePath("gitlab-0123abcd-5")), old, old))

	require.NoError(t, sweepJobNames(m.Manager()))
	keys, err := m.Manager().Store.JobNameKeys()
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"gitlab-0123abcd-2", "gitlab-0123abcd-3", "gitlab-0123abcd-4", "gitlab-0123abcd-6"}, keys)
}
