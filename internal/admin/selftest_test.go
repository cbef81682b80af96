package admin

import (
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/urfave/cli/v2"
)

// selftest's --services flags are checked against the configuration before
// any VM is made, with the allowed values in the message.
func TestSelftestServicesFlags(t *testing.T) {
	var cmd *cli.Command
	for _, c := range App().Commands {
		if c.Name == "selftest" {
			cmd = c
		}
	}
	require.NotNil(t, cmd, "the selftest command")
	check := func(extra string, args ...string) error {
		cfg := testConfig(t, extra)
		app := &cli.App{Name: "selftest", Flags: cmd.Flags, Action: func(c *cli.Context) error { return selftestServicesFlags(c, cfg) }}
		return app.Run(append([]string{"selftest"}, args...))
	}
	enabled := "[services]\nenabled = true\nallowed_images = [\"postgres:*\"]\n"
	require.NoError(t, check(""), "no --services: nothing to check")
	require.NoError(t, check(enabled, "--services", "postgres:15", "--services-image", "ok", "--service-port", "5432"))
	require.NoError(t, check(enabled, "--sample-jobs=false", "--services", "postgres:15"))
	require.NoError(t, check("", "--sample-jobs=false", "--steps"))
	for _, tc := range []struct {
		extra string
		args  []string
		want  string
	}{
		{"", []string{"--services", "postgres:15"}, "[services] enabled = false"},
		{enabled, []string{"--services", "postgres:15", "--services-image", "nope"}, `--services-image "nope": not an image of the configuration (evil, missing, ok)`},
		{enabled, []string{"--services", "postgres:15", "--service-port", "70000"}, "--service-port 70000: must be a TCP port, 1 to 65535"},
		{enabled, []string{"--services", "postgres:15", "--service-port", "0"}, "--service-port 0: must be a TCP port"},
		{enabled, []string{"--service-port", "5432"}, "--service-port needs --services IMAGE"},
		{enabled, []string{"--services", "redis:7"}, `--services "redis:7": not among the images this configuration allows for services ([services] allowed_images: postgres:*)`},
		{enabled, []string{"--services", "-x"}, `--services "-x": `},
		{enabled, []string{"--services-image", "ok"}, "--services-image needs --services IMAGE"},
		{enabled, []string{"--sample-jobs=false"}, "--sample-jobs=false leaves nothing to run: add --steps or --services IMAGE"},
		{enabled, []string{"--sample-jobs=false", "--services", "postgres:15", "--url", "https://gitlab.example.com"}, "the GitLab probe runs in the first sample job"},
	} {
		err := check(tc.extra, tc.args...)
		require.Error(t, err, "%v", tc.args)
		require.Contains(t, err.Error(), tc.want)
	}
}
