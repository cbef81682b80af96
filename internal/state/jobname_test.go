package state

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestJobNameRecords(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	key := "gitlab-0123abcd-1000"
	got, err := s.JobNameOf(key)
	require.NoError(t, err)
	require.Nil(t, got, "none yet")

	at := time.Date(2026, 11, 27, 21, 0, 0, 0, time.UTC)
	require.NoError(t, s.NameJob(key, JobName{Job: "lve-12345678-0123abcd-1000", Version: "0.0.1", At: at}))
	got, err = s.JobNameOf(key)
	require.NoError(t, err)
	require.Equal(t, &JobName{Format: JobNameFormat, Job: "lve-12345678-0123abcd-1000", Version: "0.0.1", At: at}, got)
	st, err := os.Stat(filepath.Join(s.Dir, jobNameDir, key+".json"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	keys, err := s.JobNameKeys()
	require.NoError(t, err)
	require.Equal(t, []string{key}, keys)

	// A newer version's record with fields this one does not know is read.
	require.NoError(t, os.WriteFile(filepath.Join(s.Dir, jobNameDir, key+".json"),
		[]byte(`{"format":1,"job":"lve-x-1000","version":"9","at":"2026-11-27T21:00:00Z","added_later":{"a":1}}`), 0o600))
	got, err = s.JobNameOf(key)
	require.NoError(t, err)
	require.Equal(t, "lve-x-1000", got.Job)

	require.NoError(t, s.ForgetJobName(key))
	require.NoError(t, s.ForgetJobName(key), "idempotent")
	got, err = s.JobNameOf(key)
	require.NoError(t, err)
	require.Nil(t, got)

	for _, bad := range []string{"", "../x-1-1", "gitlab-0123abcd-1000/..", "gitlab-XYZ-1", "gitlab-0123abcd-"} {
		require.Error(t, s.NameJob(bad, JobName{Job: "x"}), bad)
	}
}

// TestJobNameKeys: a front end's name may hold '-' (github-hooks); a key
// is never a path.
func TestJobNameKeys(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	for _, k := range []string{"gitlab-0123abcd-1", "github-hooks-5774bcb7-2738330466436720794"} {
		require.NoError(t, s.NameJob(k, JobName{Job: "lve-x-1"}), k)
	}
	for _, k := range []string{"../x-0123abcd-1", "gitlab-0123abcd-", "-0123abcd-1", "github--hooks-0123abcd-1", "gitlab-0123abcd-1/../../x"} {
		require.Error(t, s.NameJob(k, JobName{Job: "lve-x-1"}), k)
	}
}
