package gitlab

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// A job prepared by a version that named its machine otherwise (an upgrade
// between its stages) is found by the later stages under the name its
// prepare recorded, and its cleanup removes that machine and the record.
func TestLaterStagesUseTheNamePrepareRecorded(t *testing.T) {
	cfg := testConfig(t)
	cfg.StoragePool = "jobs"
	hv := vmtest.New()
	e := Env{Getenv: envOf(map[string]string{"JOB_RESPONSE_FILE": "testdata/response.json"}), Stdout: &bytes.Buffer{}, Stderr: &bytes.Buffer{},
		Log: slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)), Connect: fake(hv)}
	j, err := e.load(cfg)
	require.NoError(t, err)
	nameNow, key := j.name, lifecycle.JobKey(Frontend, j.job.Instance, j.job.ID)
	require.Equal(t, lifecycle.JobKey(Frontend, j.job.Instance, j.job.ID), key)
	require.NoError(t, j.jobs.Close())

	// The name an earlier version gave the job (another shape, same prefix).
	old := lifecycle.MachinePrefix(cfg.NamePrefix, j.jobs.Controller()) + "1000"
	require.NotEqual(t, nameNow, old)
	store := state.Store{Dir: cfg.StateDir}
	require.NoError(t, store.NameJob(key, state.JobName{Job: old, Version: "0.0.1", At: time.Now()}))
	x, err := vm.MarshalOwner(vm.Owner{Controller: j.jobs.Controller(), Job: "1000", Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	hv.Domains[old] = &vmtest.Domain{OwnerXML: x, Active: true}

	j, err = e.load(cfg)
	require.NoError(t, err)
	require.Equal(t, old, j.name, "the recorded name wins")
	require.NoError(t, j.jobs.Close())

	require.NoError(t, Cleanup(context.Background(), e, cfg))
	require.NotContains(t, hv.Domains, old, "cleanup removed the machine under its recorded name")
	rec, err := store.JobNameOf(key)
	require.NoError(t, err)
	require.Nil(t, rec, "cleanup removed the record")

	// A record naming a machine that is not this installation's is refused.
	require.NoError(t, store.NameJob(key, state.JobName{Job: "other-1234", At: time.Now()}))
	_, err = e.load(cfg)
	require.ErrorContains(t, err, "job name record")
	// So is one of a newer format than this version reads.
	require.NoError(t, store.NameJob(key, state.JobName{Format: state.JobNameFormat + 1, Job: old, At: time.Now()}))
	_, err = e.load(cfg)
	require.ErrorIs(t, err, state.ErrNewerFormat)
	// One that cannot be read (permissions) is an error, not a guess.
	path := filepath.Join(cfg.StateDir, "job-names", key+".json")
	require.NoError(t, os.Remove(path))
	require.NoError(t, os.Mkdir(path, 0o700)) // reading a directory fails (as root too)
	_, err = e.load(cfg)
	require.ErrorContains(t, err, "job name record")
	require.NoError(t, os.Remove(path))
	// One that does not decode (cut short by a crash) is as if there were none.
	require.NoError(t, os.WriteFile(path, []byte(`{"format":1,"jo`), 0o600))
	j, err = e.load(cfg)
	require.NoError(t, err)
	require.Equal(t, nameNow, j.name)
	require.NoError(t, j.jobs.Close())
}
