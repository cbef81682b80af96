package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// --log-format and --log-level refuse a value they do not know, naming
// the allowed ones, before the command runs; before the command and after
// serve.
func TestLogFlagsRefuseBadValues(t *testing.T) {
	for _, args := range [][]string{
		{"--log-format", "xml", "serve"},
		{"serve", "--log-format=xml"},
		{"--log-level", "loud", "list"},
		{"serve", "--log-level", "loud"},
	} {
		err := App().RunContext(context.Background(), append([]string{"libvirt-executor", "--config=/nonexistent/config.toml"}, args...))
		require.Error(t, err, args)
		if args[1] == "xml" || args[1] == "--log-format=xml" {
			require.ErrorContains(t, err, `--log-format "xml": allowed values are text, json`, args)
		} else {
			require.ErrorContains(t, err, `--log-level "loud": allowed values are debug, info, warn, error`, args)
		}
	}
}

func TestNewLogger(t *testing.T) {
	var b bytes.Buffer
	l, err := newLogger(&b, "json", "warn")
	require.NoError(t, err)
	l.Info("hidden")
	l.Warn("shown", "k", "v")
	var rec map[string]any
	require.NoError(t, json.Unmarshal(b.Bytes(), &rec), b.String())
	require.Equal(t, "shown", rec["msg"])
	require.Equal(t, "WARN", rec["level"])

	b.Reset()
	l, err = newLogger(&b, "", "DEBUG")
	require.NoError(t, err)
	l.Debug("detail")
	require.Contains(t, b.String(), "level=DEBUG msg=detail")

	_, err = newLogger(&b, "yaml", "")
	require.EqualError(t, err, `--log-format "yaml": allowed values are text, json`)
}
