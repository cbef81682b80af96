package stagecli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHelperArgumentsAndConfiguration(t *testing.T) {
	cfg := "domain_type = \"qemu\"\nstate_dir = \"" + t.TempDir() + "\"\n[images.tiny]\nbase = \"/img/tiny.qcow2\"\n"
	for _, tc := range []struct {
		name  string
		run   func(stderr *bytes.Buffer) int
		code  int
		inLog string
	}{
		{"reap without names", func(e *bytes.Buffer) int {
			return Reap([]string{"--config", "/x.toml", "--config-stdin"}, strings.NewReader(cfg), e)
		}, 2, "usage: reap-machines"},
		{"reap without --config", func(e *bytes.Buffer) int {
			return Reap([]string{"--", "lve-0123abcd-1"}, strings.NewReader(cfg), e)
		}, 2, "usage: reap-machines"},
		{"reap of a hostile name", func(e *bytes.Buffer) int {
			return Reap([]string{"--config", "/x.toml", "--config-stdin", "--", "../../etc"}, strings.NewReader(cfg), e)
		}, 2, "bad machine name"},
		{"hold of two machines", func(e *bytes.Buffer) int {
			return Hold([]string{"--config", "/x.toml", "--config-stdin", "lve-a-1", "lve-a-2"}, strings.NewReader(cfg), e)
		}, 2, "usage: hold-connection"},
		{"hold with a bad --until", func(e *bytes.Buffer) int {
			return Hold([]string{"--config", "/x.toml", "--config-stdin", "--until", "soon", "lve-a-1"}, strings.NewReader(cfg), e)
		}, 2, "--until is not a Unix time"},
		{"configuration on stdin that does not parse", func(e *bytes.Buffer) int {
			return Reap([]string{"--config", "/x.toml", "--config-stdin", "--", "lve-a-1"}, strings.NewReader("domain_type = 3\n"), e)
		}, 1, "config /x.toml (from stdin)"},
		{"configuration file that is missing", func(e *bytes.Buffer) int {
			return Reap([]string{"--config", "/nonexistent/x.toml", "--", "lve-a-1"}, strings.NewReader(cfg), e)
		}, 1, "no such file"},
		{"reap refuses a name outside this installation (configuration from stdin: the file is missing)", func(e *bytes.Buffer) int {
			return Reap([]string{"--config", "/nonexistent/x.toml", "--config-stdin", "--", "lve-a-1"}, strings.NewReader(cfg), e)
		}, 1, "refusing to remove"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			require.Equal(t, tc.code, tc.run(&stderr), "%s", stderr.String())
			require.Contains(t, stderr.String(), tc.inLog)
		})
	}
}
