package gitlab

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/exitcodes"
)

// servicesPlan: nothing when services are off or the job has none; the
// payload's services planned when on; an image the admin does not allow is
// the job's failure (a build failure), decided before any machine.
func TestServicesPlan(t *testing.T) {
	dir := t.TempDir()
	payload := filepath.Join(dir, "job.json")
	require.NoError(t, os.WriteFile(payload, []byte(`{"id": 7,
		"services": [{"name": "postgres:15", "alias": "db"}, {"name": "redis:7"}],
		"variables": [{"key": "MARKER", "value": "m", "public": true}]}`), 0o600))
	getenv := func(k string) string {
		if k == "JOB_RESPONSE_FILE" {
			return payload
		}
		return ""
	}
	img := &config.Image{Name: "podman", User: "root"}
	j := &job{job: &Job{ID: 7, Services: Services{Count: 2}}}

	off := &config.Config{}
	plan, _, err := servicesPlan(off, j, img, getenv)
	require.NoError(t, err)
	require.Nil(t, plan, "services off: checkServices speaks")

	on := &config.Config{Services: config.Services{Enabled: true, WaitTimeout: config.Duration(30e9)}}
	none := &job{job: &Job{ID: 7}}
	plan, _, err = servicesPlan(on, none, img, getenv)
	require.NoError(t, err)
	require.Nil(t, plan, "a job without services")

	plan, o, err := servicesPlan(on, j, img, getenv)
	require.NoError(t, err)
	require.Len(t, plan.Services, 2)
	require.Equal(t, int64(7), o.JobID)

	strict := &config.Config{Services: config.Services{Enabled: true, WaitTimeout: config.Duration(30e9), AllowedImages: []string{"postgres:*"}}}
	_, _, err = servicesPlan(strict, j, img, getenv)
	require.Error(t, err)
	var ue *exitcodes.UserError
	require.True(t, errors.As(err, &ue), "the job's to fix: %v", err)
	require.Contains(t, err.Error(), "redis:7")
}

// lineWriter hands complete lines to the job log, whatever the writes' cuts.
func TestLineWriter(t *testing.T) {
	var got []string
	w := &lineWriter{say: func(f string, a ...any) { got = append(got, a[0].(string)) }}
	for _, p := range []string{"one\ntw", "o\n", "three\n\nfour"} {
		_, _ = w.Write([]byte(p))
	}
	require.Equal(t, []string{"one", "two", "three", ""}, got)
}
