package bench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParseNoop(t *testing.T) {
	for _, tc := range []struct {
		name, log string
		want      time.Duration
	}{
		{"EPOCHREALTIME", "LVB_NOOP 1795276344.123456 1795276344.123499\n", 43 * time.Microsecond},
		{"across a second", "LVB_NOOP 1795276344.999990 1795276345.000010\n", 20 * time.Microsecond},
		{"date +%s.%N", "LVB_NOOP 1795276344.100000000 1795276344.104000001\r\n", 4*time.Millisecond + 1},
		{"comma locale", "LVB_NOOP 1795276344,5 1795276344,75\n", 250 * time.Millisecond},
		{"whole seconds", "LVB_NOOP 10 12\n", 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The harness echoes the command first; that line must not match.
			log := "\x1b[32;1m$ " + NoopCommand + "\x1b[0;m\n" + tc.log + "--- stage build_script (901ms, exit 0)\n"
			got, err := ParseNoop(log)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestParseNoopErrors(t *testing.T) {
	for _, log := range []string{
		"\x1b[32;1m$ " + NoopCommand + "\x1b[0;m\n", // command echoed, never ran
		"LVB_NOOP 1795276344%N 1795276344%N\n",      // busybox date without %N
		"LVB_NOOP 5.2 5.1\n",                        // clock went backwards
		"LVB_NOOP 5.+2 5.3\n",
		"LVB_NOOP -5 5\n",
	} {
		_, err := ParseNoop(log)
		require.Error(t, err, "%q", log)
	}
}

func TestNoopCommandShape(t *testing.T) {
	// One command, so the harness runs it as one step and echoes it once.
	require.NotContains(t, NoopCommand, "\n")
	require.Contains(t, NoopCommand, "${EPOCHREALTIME")
	require.Contains(t, NoopCommand, `echo "`+NoopMarker+" ")
}
