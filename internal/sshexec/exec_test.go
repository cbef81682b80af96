package sshexec

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// Exec passes every byte of its arguments and environment as words, under
// each login shell: quotes, $(...), backticks, newlines and globs reach the
// program untouched, and the program's stdin is what the caller gave.
func TestExecArgvAndEnvAreNeverParsed(t *testing.T) {
	eachLoginShell(t, func(t *testing.T, ts *sshtest.Server) {
		c := dial(t, target(ts))
		nasty := []string{`it's "quoted"`, "$(touch /tmp/lve-exec-pwned)", "`id`", "two\nlines", "*", "", "-n", `back\slash`}
		var out, errb bytes.Buffer
		code, err := c.Exec(context.Background(), append([]string{"printf", "[%s]\n"}, nasty...), nil, nil, &out, &errb)
		require.NoError(t, err)
		require.Equal(t, 0, code, errb.String())
		var want strings.Builder
		for _, a := range nasty {
			want.WriteString("[" + a + "]\n")
		}
		require.Equal(t, want.String(), out.String())
		require.NoFileExists(t, "/tmp/lve-exec-pwned")

		out.Reset()
		code, err = c.Exec(context.Background(), []string{"bash", "-c", `printf '%s|%s' "$LVE_A" "$LVE_B"; cat`},
			[]string{"LVE_A=multi\nline $(x) 'q'", "LVE_B="}, strings.NewReader("stdin-bytes"), &out, nil)
		require.NoError(t, err)
		require.Equal(t, 0, code)
		require.Equal(t, "multi\nline $(x) 'q'|stdin-bytes", out.String())
	})
}

func TestExecExitStatusAndSignal(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	code, err := c.Exec(context.Background(), []string{"sh", "-c", "exit 7"}, nil, nil, nil, nil)
	require.NoError(t, err)
	require.Equal(t, 7, code)
	var errb bytes.Buffer
	code, err = c.Exec(context.Background(), []string{"lve-no-such-program"}, nil, nil, nil, &errb)
	require.NoError(t, err)
	require.Equal(t, 127, code, "a missing program is exec's 127")
	require.Contains(t, errb.String(), "lve-no-such-program")
	code, err = c.Exec(context.Background(), []string{"sh", "-c", "kill -TERM $$"}, nil, nil, nil, nil)
	require.NoError(t, err)
	require.Equal(t, 128+15, code)
}

func TestExecRefusesBadRequests(t *testing.T) {
	for name, tc := range map[string]struct {
		argv, env []string
		want      string
	}{
		"empty":     {nil, nil, "no program"},
		"nul":       {[]string{"echo", "a\x00b"}, nil, "NUL"},
		"env form":  {[]string{"true"}, []string{"NOEQUALS"}, "NAME=VALUE"},
		"env name":  {[]string{"true"}, []string{"A-B=1"}, "NAME=VALUE"},
		"env digit": {[]string{"true"}, []string{"1A=1"}, "NAME=VALUE"},
		"too many":  {make([]string, MaxExecArgs+1), nil, "at most"},
		"too big":   {[]string{"echo", strings.Repeat("x", MaxExecBytes)}, nil, "exceeds"},
	} {
		t.Run(name, func(t *testing.T) {
			if name == "too many" {
				tc.argv[0] = "echo"
			}
			_, err := ExecRequest(tc.argv, tc.env)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// A cancelled Exec returns at once with an error (never a status).
func TestExecCancelled(t *testing.T) {
	ts := sshtest.Start(t)
	c := dial(t, target(ts))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	began := time.Now()
	code, err := c.Exec(ctx, []string{"sleep", "30"}, nil, nil, nil, nil)
	require.Error(t, err)
	require.Equal(t, -1, code)
	require.Less(t, time.Since(began), 10*time.Second)
}
