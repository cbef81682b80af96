package bench

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Lines as gitlab-runner 17.9.3 writes them with FF_TIMESTAMPS (from a
// bench run on the rig, 4 MiB).
const s3SaveLog = "2026-11-27T05:15:12.227651Z 00O+\x1b[0Ksection_start:1795756512:archive_cache\r\n" +
	"2026-11-27T05:15:12.233302Z 00O+\x1b[0K\x1b[0K\x1b[36;1mSaving cache for successful job\x1b[0;m\x1b[0;m\n" +
	"2026-11-27T05:15:16.616580Z 01O \x1b[32;1mCreating cache bench-0...\x1b[0;m\n" +
	"2026-11-27T05:15:17.000000Z 01O vendor/: found 2 matching artifact files and directories\x1b[0;m\n" +
	"2026-11-27T05:15:18.445262Z 01O Uploading cache.zip to http://10.213.7.1:20999/lve-bench/project/1/bench-0\x1b[0;m \n" +
	"2026-11-27T05:15:18.630928Z 01O \x1b[32;1mCreated cache\x1b[0;m\n" +
	"2026-11-27T05:15:18.665058Z 00O section_end:1795756518:archive_cache\r\x1b[0K\n"

const hostSaveLog = "2026-11-27T05:15:52.716652Z 00O+\x1b[0Ksection_start:1795756552:archive_cache\r\n" +
	"2026-11-27T05:15:55.618242Z 01O \x1b[32;1mCreating cache bench-0...\x1b[0;m\n" +
	"2026-11-27T05:15:57.647401Z 01O No URL provided, cache will not be uploaded to shared cache server. Cache will be stored only locally.\x1b[0;m \n" +
	"2026-11-27T05:15:57.686530Z 01O \x1b[32;1mCreated cache\x1b[0;m\n" +
	"2026-11-27T05:15:58.343679Z 01O Host cache: kept 1 file(s), 4.0 MiB (0 unchanged) over SSH in 625ms\n" +
	"2026-11-27T05:15:58.348148Z 00O section_end:1795756558:archive_cache\r\x1b[0K\n"

func TestSaveSplit(t *testing.T) {
	zip, after, cp, err := saveSplit(s3SaveLog)
	require.NoError(t, err)
	require.Equal(t, 1828682*time.Microsecond, zip, "Creating cache to Uploading")
	require.Equal(t, 219796*time.Microsecond, after, "the upload and the stage's end")
	require.Equal(t, 185666*time.Microsecond, cp, "Uploading to Created cache: the upload")

	zip, after, cp, err = saveSplit(hostSaveLog)
	require.NoError(t, err)
	require.Equal(t, 2029159*time.Microsecond, zip, "Creating cache to No URL provided")
	require.Equal(t, 700747*time.Microsecond, after, "the host cache's copy and the stage's end")
	require.Equal(t, 39129*time.Microsecond, cp, "No URL provided to Created cache: the runner's script ends (the host cache's copy is added from its own line)")
}

func TestSaveSplitNeedsTimestamps(t *testing.T) {
	for name, log := range map[string]string{
		"no timestamps":    "Creating cache bench-0...\nUploading cache.zip to http://x\nsection_end:1:archive_cache\n",
		"no archive":       "2026-11-27T05:15:55.618242Z 01O Creating cache bench-0...\n2026-11-27T05:15:58.348148Z 00O section_end:1795756558:archive_cache\r\x1b[0K\n",
		"empty":            "",
		"no Created cache": strings.Replace(hostSaveLog, "Created cache", "Something else", 1),
	} {
		_, _, _, err := saveSplit(log)
		require.Error(t, err, name)
	}
}

// The host cache's copy time is read in Go's duration format, a minute
// or more included, from the last " in " of the driver's line.
func TestHostCopy(t *testing.T) {
	for line, want := range map[string]time.Duration{
		"2026-11-27T05:15:58.343679Z 01O Host cache: kept 1 file(s), 4.0 MiB (0 unchanged) over SSH in 625ms\n":                                                 625 * time.Millisecond,
		"Host cache: restored 1 file(s), 100.0 MiB, into /cache from a restore disk (written and attached in 287ms, read by the guest in 3.4s) in 3.9s\r\n":     3900 * time.Millisecond,
		"x\nHost cache: kept 1 file(s), 900.0 MiB (0 unchanged) from a scratch disk (made in 1s, written by the guest in 1m2s, read in 3s) in 1m5.5s\x1b[0;m\n": 65500 * time.Millisecond,
	} {
		kind, took, _, ok := hostCopy(line)
		require.True(t, ok, line)
		require.Contains(t, []string{"kept", "restored"}, kind)
		require.Equal(t, want, took, line)
	}
	_, _, _, ok := hostCopy("Host cache: nothing cached for this project yet (12ms)\n")
	require.False(t, ok)
}
