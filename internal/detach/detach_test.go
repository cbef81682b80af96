package detach

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestStartDetachesWithOnlyPathAndStdin(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	script := filepath.Join(dir, "child")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\n{ cat; echo; env | sort; ps -o sid= -p $$; echo $$; } > "+out+".tmp\nmv "+out+".tmp "+out+"\necho to-the-log >&2\n"), 0o700))
	t.Setenv("CUSTOM_ENV_CI_JOB_TOKEN", "glcbt-must-not-pass")
	log := filepath.Join(dir, "child.log")
	pid, err := Start(Spec{Exe: script, Stdin: []byte("configuration text"), Log: log})
	require.NoError(t, err)
	var got string
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(out)
		got = string(b)
		return err == nil
	}, 5*time.Second, 10*time.Millisecond)
	lines := strings.Split(strings.TrimSpace(got), "\n")
	require.Equal(t, "configuration text", lines[0])
	require.NotContains(t, got, "glcbt-must-not-pass", "the starter's environment is not passed on")
	require.Contains(t, got, "PATH=/usr/local/sbin:")
	require.Equal(t, strconv.Itoa(pid), strings.TrimSpace(lines[len(lines)-2]), "a session of its own (sid = its pid)")
	require.Eventually(t, func() bool {
		b, _ := os.ReadFile(log)
		return strings.Contains(string(b), "to-the-log")
	}, 5*time.Second, 10*time.Millisecond)
	fi, err := os.Stat(log)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
}

func TestStartFailsForMissingExecutable(t *testing.T) {
	_, err := Start(Spec{Exe: filepath.Join(t.TempDir(), "nope"), Log: filepath.Join(t.TempDir(), "log")})
	require.Error(t, err)
}
