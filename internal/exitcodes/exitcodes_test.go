package exitcodes

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestResolve(t *testing.T) {
	codes := Codes{Build: 41, System: 42}
	tests := []struct {
		name string
		err  error
		want int
	}{
		{"nil", nil, 0},
		{"script error", &ScriptError{Code: 3}, 41},
		{"wrapped script error", fmt.Errorf("stage build_script: %w", &ScriptError{Code: 3}), 41},
		{"user error", Userf("image %q is not allowed", "x"), 41},
		{"wrapped user error", fmt.Errorf("prepare: %w", Userf("bad")), 41},
		{"unknown error", errors.New("boom"), 42},
		{"io.EOF (lost connection)", io.EOF, 42},
		{"context canceled", context.Canceled, 42},
		{"system wrapping script error", System(&ScriptError{Code: 1}), 42},
		{"system wrapping user error", fmt.Errorf("x: %w", System(Userf("y"))), 42},
		{"joined with system", errors.Join(&ScriptError{Code: 1}, System(errors.New("vm gone"))), 42},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, codes.Resolve(tc.err))
		})
	}
}

func TestFromEnv(t *testing.T) {
	env := map[string]string{"BUILD_FAILURE_EXIT_CODE": "7", "SYSTEM_FAILURE_EXIT_CODE": "9"}
	require.Equal(t, Codes{Build: 7, System: 9}, FromEnv(func(k string) string { return env[k] }))
	for _, bad := range []string{"", "x", "0", "-1", "256"} {
		env := map[string]string{"BUILD_FAILURE_EXIT_CODE": bad, "SYSTEM_FAILURE_EXIT_CODE": bad}
		require.Equal(t, Codes{Build: 1, System: 2}, FromEnv(func(k string) string { return env[k] }), "value %q", bad)
	}
}

func TestScriptCode(t *testing.T) {
	code, ok := ScriptCode(fmt.Errorf("w: %w", &ScriptError{Code: 3}))
	require.True(t, ok)
	require.Equal(t, 3, code)
	_, ok = ScriptCode(System(&ScriptError{Code: 3}))
	require.False(t, ok, "a script code inside a system failure is not the script's verdict")
	_, ok = ScriptCode(errors.New("x"))
	require.False(t, ok)
}
