package stagecli

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
)

// The run stage asks the admin tool for the restore disk from its argv
// (no shell), without the job's variables, and reads its "FILES BYTES".
func TestCacheDiskThroughTheAdminTool(t *testing.T) {
	dir := installFake(t)
	cfgPath := filepath.Join(t.TempDir(), "config.toml")
	argv := func() []string {
		b, err := os.ReadFile(filepath.Join(dir, "argv"))
		require.NoError(t, err)
		return strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
	}
	name, project := "lve-0123abcd-89abcdef-42", "dfe2eead3cf71594-7-p"

	a, _ := testExplainer(t, dir, cfgPath, withoutJobVariables([]string{"FAKE_MODE=attach", "CUSTOM_ENV_CI_JOB_TOKEN=secret"})...)
	res, err := adminCacheDisk{a}.Attach(context.Background(), name, project, []string{"lve/p/k 1/cache.zip", "lve/p/k2/cache.zip"})
	require.NoError(t, err)
	require.Equal(t, hostcache.RestoreResult{Files: 3, Bytes: 1234}, res)
	require.Equal(t, []string{"--config=" + cfgPath, jobvm.CacheDiskCommand, jobvm.CacheDiskAttach, "--", name, project, "lve/p/k 1/cache.zip", "lve/p/k2/cache.zip"}, argv())
	env, err := os.ReadFile(filepath.Join(dir, "env"))
	require.NoError(t, err)
	require.NotContains(t, string(env), "CUSTOM_ENV_", "the job's variables stay out")

	require.NoError(t, adminCacheDisk{a}.Drop(context.Background(), name))
	require.Equal(t, []string{"--config=" + cfgPath, jobvm.CacheDiskCommand, jobvm.CacheDiskDrop, "--", name}, argv())

	require.NoError(t, adminCacheDisk{a}.AttachScratch(context.Background(), name))
	require.Equal(t, []string{"--config=" + cfgPath, jobvm.CacheDiskCommand, jobvm.CacheDiskScratch, "--", name}, argv())

	// keep: the save's result and its error class cross the process
	// boundary, and so does the drop's outcome after it.
	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=keep")
	kept := adminCacheDisk{a}.Keep(context.Background(), name, project, []string{"lve/p/k 1-protected/cache.zip"})
	require.ErrorContains(t, kept.DropErr, "volume busy")
	require.ErrorIs(t, kept.Err, hostcache.ErrProjectLimit)
	require.ErrorContains(t, kept.Err, "too big")
	require.Equal(t, hostcache.SaveResult{Files: 2, Bytes: 10, Unchanged: 1}, kept.Result)
	require.False(t, kept.FromFile)
	require.Equal(t, []string{"--config=" + cfgPath, jobvm.CacheDiskCommand, jobvm.CacheDiskKeep, "--", name, project, "lve/p/k 1-protected/cache.zip"}, argv(),
		"the archives the runner's script names go to the admin tool as arguments of their own")
	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=kept")
	kept = adminCacheDisk{a}.Keep(context.Background(), name, project, nil)
	require.NoError(t, kept.Err)
	require.NoError(t, kept.DropErr)
	require.Equal(t, hostcache.SaveResult{Files: 1, Bytes: 3}, kept.Result)
	require.True(t, kept.FromFile, "read from the volume's file")
	// An admin tool from before keep deleted the volumes says nothing of
	// them: the stage deletes them itself.
	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=kept-old")
	kept = adminCacheDisk{a}.Keep(context.Background(), name, project, nil)
	require.NoError(t, kept.Err)
	require.ErrorContains(t, kept.DropErr, "did not say")

	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=garbage")
	_, err = adminCacheDisk{a}.Attach(context.Background(), name, project, nil)
	require.ErrorContains(t, err, `answer "3 lots", want "FILES BYTES"`)

	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=fail")
	_, err = adminCacheDisk{a}.Attach(context.Background(), name, project, nil)
	require.ErrorContains(t, err, "libvirt said no", "the tool's own words reach the job log")

	a, _ = testExplainer(t, t.TempDir(), cfgPath) // no tool there, none on PATH
	_, err = adminCacheDisk{a}.Attach(context.Background(), name, project, nil)
	require.ErrorContains(t, err, "was not found")
}
