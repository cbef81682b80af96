package main

import (
	"io"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/urfave/cli/v2"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/bench"
)

// parse runs the real flags through options() without benchmarking.
func parse(t *testing.T, args ...string) (bench.Options, error) {
	t.Helper()
	var o bench.Options
	var oerr error
	a := &cli.App{Name: "lve-bench", Flags: flags(), Writer: io.Discard, ErrWriter: io.Discard,
		Action: func(c *cli.Context) error {
			o, oerr = options(c)
			return nil
		}}
	require.NoError(t, a.Run(append([]string{"lve-bench"}, args...)))
	return o, oerr
}

func TestDefaults(t *testing.T) {
	t.Setenv("LIBVIRT_EXECUTOR_CONFIG", "")
	o, err := parse(t, "--config", "rig.toml", "--bin", "bin")
	require.NoError(t, err)
	abs, _ := filepath.Abs("rig.toml")
	require.Equal(t, abs, o.ConfigPath, "stages run elsewhere: the path is made absolute")
	require.True(t, filepath.IsAbs(o.BinDir))
	require.Equal(t, 5, o.Runs)
	require.Equal(t, 2, o.Concurrency)
	require.Equal(t, 50*time.Millisecond, o.Poll)
	require.Empty(t, o.Images, "default: the configuration's default image")
	require.Nil(t, o.JobLog)
	require.False(t, o.SkipWarm, "the warm round runs by default")
	require.Zero(t, o.DirectRuns, "the direct round's default: as many jobs as --runs")
}

func TestDirectRunsFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want int
	}{
		{nil, 0},                             // bench's default: --runs
		{[]string{"--direct-runs", "0"}, -1}, // skip
		{[]string{"--direct-runs", "3"}, 3},
		{[]string{"--direct-runs=1", "--runs", "7"}, 1},
	} {
		o, err := parse(t, append([]string{"--config", "/c.toml", "--bin", "/b"}, tc.args...)...)
		require.NoError(t, err, "%v", tc.args)
		require.Equal(t, tc.want, o.DirectRuns, "%v", tc.args)
	}
}

func TestFlags(t *testing.T) {
	o, err := parse(t, "--config", "/c.toml", "--bin", "/b", "--image", "tiny", "--image", "debian",
		"--runs", "3", "--concurrency", "0", "--poll", "20ms", "--job-logs")
	require.NoError(t, err)
	require.Equal(t, []string{"tiny", "debian"}, o.Images)
	require.Equal(t, 3, o.Runs)
	require.Negative(t, o.Concurrency, "0 on the command line skips the concurrent round")
	require.Equal(t, 20*time.Millisecond, o.Poll)
	require.NotNil(t, o.JobLog)
	require.False(t, o.SkipWarm)
}

func TestWarmFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		skip bool
	}{
		{nil, false},
		{[]string{"--warm"}, false},
		{[]string{"--warm=true"}, false},
		{[]string{"--warm=false"}, true},
	} {
		o, err := parse(t, append([]string{"--config", "/c.toml", "--bin", "/b"}, tc.args...)...)
		require.NoError(t, err, "%v", tc.args)
		require.Equal(t, tc.skip, o.SkipWarm, "%v", tc.args)
	}
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--runs", "0"},
		{"--concurrency", "-1"},
		{"--concurrency", "9"},
		{"--poll", "0s"},
		{"--direct-runs", "-1"},
		{"--direct-runs", "51"},
	} {
		_, err := parse(t, append([]string{"--config", "/c.toml", "--bin", "/b"}, args...)...)
		require.Error(t, err, "%v", args)
	}
}
