package stagecli

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachexfer"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
)

// The run stage asks the admin tool for the cache disks with one typed
// request as JSON on its stdin (nothing of it on argv, no shell), without
// the job's variables, and reads one typed answer from its stdout: bounded,
// checked against the operation asked.
func TestCacheDiskThroughTheAdminTool(t *testing.T) {
	dir := installFake(t)
	cfgPath := filepath.Join(t.TempDir(), "config.toml")
	argv := func() []string {
		b, err := os.ReadFile(filepath.Join(dir, "argv"))
		require.NoError(t, err)
		return strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
	}
	request := func() cachexfer.AdminRequest {
		b, err := os.ReadFile(filepath.Join(dir, "stdin"))
		require.NoError(t, err)
		var r cachexfer.AdminRequest
		require.NoError(t, json.Unmarshal(b, &r), "%s", b)
		return r
	}
	wantArgv := []string{"--config=" + cfgPath, cachexfer.AdminCommand}
	name, project := "lve-0123abcd-89abcdef-42", "dfe2eead3cf71594-7-p"
	ctx := context.Background()

	a, _ := testExplainer(t, dir, cfgPath, withoutJobVariables([]string{"FAKE_MODE=attach", "CUSTOM_ENV_CI_JOB_TOKEN=secret"})...)
	res, err := adminCacheDisk(a).Attach(ctx, name, project, []string{"lve/p/k 1/cache.zip", "lve/p/k2/cache.zip"})
	require.NoError(t, err)
	require.Equal(t, hostcache.RestoreResult{Files: 3, Bytes: 1234}, res)
	require.Equal(t, wantArgv, argv(), "nothing of the request on argv")
	require.Equal(t, cachexfer.AdminRequest{Op: cachexfer.OpAttach, Machine: name, Project: project, Files: []string{"lve/p/k 1/cache.zip", "lve/p/k2/cache.zip"}}, request())
	env, err := os.ReadFile(filepath.Join(dir, "env"))
	require.NoError(t, err)
	require.NotContains(t, string(env), "CUSTOM_ENV_", "the job's variables stay out")

	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=done")
	require.NoError(t, adminCacheDisk(a).Drop(ctx, name))
	require.Equal(t, cachexfer.AdminRequest{Op: cachexfer.OpDrop, Machine: name}, request())
	require.NoError(t, adminCacheDisk(a).AttachScratch(ctx, name))
	require.Equal(t, cachexfer.AdminRequest{Op: cachexfer.OpScratch, Machine: name}, request())
	require.Equal(t, wantArgv, argv())

	// keep: the save's result and its error class cross the process
	// boundary, and so does the drop's outcome after it.
	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=keep")
	kept := adminCacheDisk(a).Keep(ctx, name, project, []string{"lve/p/k 1-protected/cache.zip"})
	require.ErrorContains(t, kept.DropErr, "volume busy")
	require.ErrorIs(t, kept.Err, hostcache.ErrProjectLimit)
	require.ErrorContains(t, kept.Err, "too big")
	require.Equal(t, hostcache.SaveResult{Files: 2, Bytes: 10, Unchanged: 1}, kept.Result)
	require.False(t, kept.FromFile)
	require.Equal(t, cachexfer.AdminRequest{Op: cachexfer.OpKeep, Machine: name, Project: project, Files: []string{"lve/p/k 1-protected/cache.zip"}}, request())
	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=kept")
	kept = adminCacheDisk(a).Keep(ctx, name, project, nil)
	require.NoError(t, kept.Err)
	require.NoError(t, kept.DropErr)
	require.Equal(t, hostcache.SaveResult{Files: 1, Bytes: 3}, kept.Result)
	require.True(t, kept.FromFile, "read from the volume's file")
	// An answer that does not say the volumes were deleted: the stage
	// deletes them itself.
	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=kept-old")
	kept = adminCacheDisk(a).Keep(ctx, name, project, nil)
	require.NoError(t, kept.Err)
	require.ErrorContains(t, kept.DropErr, "did not say")

	// Bad answers are refused, saying why.
	for mode, want := range map[string]string{
		"garbage":  "not the JSON wanted",
		"two":      "more than one JSON value",
		"negative": "want numbers of 0 or more",
		"wrong":    "want attached only",
		"huge":     "over 65536 bytes",
		"done":     "want attached only",
	} {
		a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE="+mode)
		_, err = adminCacheDisk(a).Attach(ctx, name, project, nil)
		require.ErrorContains(t, err, want, mode)
	}
	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=attach")
	kept = adminCacheDisk(a).Keep(ctx, name, project, nil)
	require.ErrorContains(t, kept.Err, "want kept only")
	require.Error(t, kept.DropErr, "not known to be deleted")

	a, _ = testExplainer(t, dir, cfgPath, "FAKE_MODE=fail")
	_, err = adminCacheDisk(a).Attach(ctx, name, project, nil)
	require.ErrorContains(t, err, "libvirt said no", "the tool's own words reach the job log")

	a, _ = testExplainer(t, t.TempDir(), cfgPath) // no tool there, none on PATH
	_, err = adminCacheDisk(a).Attach(ctx, name, project, nil)
	require.ErrorContains(t, err, "was not found")
}
