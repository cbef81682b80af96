package bench

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A prepare stage's output as the driver prints it (job log of a real run),
// between the harness's own lines.
const prepareLog = "Running with gitlab-runner 16.11.4 (50736d6d) emulated by lve-harness\n" +
	"\x1b[36;1mPreparing the \"custom\" executor\x1b[0;m\n" +
	"Using Custom executor with driver libvirt-executor dev...\n" +
	"Preparing a fresh tiny VM lvb-2de26526-638947 for job 638947 (libvirt-executor dev)\n" +
	"  clone disk done in 12ms\n" +
	"  create seed volume done in 1ms\n" +
	"  upload seed done in 850µs\n" +
	"  define done in 20ms\n" +
	"  start done in 398ms\n" +
	"Created lvb-2de26526-638947 from image tiny (qemu, 1 vCPU, 512 MiB) in 434ms\n" +
	"Booted, address 10.213.7.55 (MAC 52:54:00:71:ae:96, from lease) in 6.2s\n" +
	"SSH ready as root@10.213.7.55, host key SHA256:k0lzdhGhapZtnQB3ukZqMSdAiJQ9k7lu5mEsX+nTr0k pinned, in 1.4s (3 attempts)\n" +
	"Machine ready in 1m8s\n" +
	"Note: git-lfs is not installed in the guest (needed only for LFS repositories)\n" +
	"--- stage prepare (8.306s, exit 0)\n"

func TestParsePrepareLog(t *testing.T) {
	p, err := ParsePrepareLog(prepareLog)
	require.NoError(t, err)
	require.Equal(t, PrepareTimes{
		Clone: 12 * time.Millisecond, SeedCreate: time.Millisecond, SeedUpload: 850 * time.Microsecond,
		Define: 20 * time.Millisecond, Start: 398 * time.Millisecond, Created: 434 * time.Millisecond,
		Address: 6200 * time.Millisecond, SSH: 1400 * time.Millisecond, SSHAttempts: 3, Ready: 68 * time.Second,
	}, p)
}

func TestParsePrepareLogCRLFAndSingleAttempt(t *testing.T) {
	log := strings.ReplaceAll(prepareLog, "(3 attempts)", "(1 attempt)")
	log = strings.ReplaceAll(log, "\n", "\r\n")
	p, err := ParsePrepareLog(log)
	require.NoError(t, err)
	require.Equal(t, 1, p.SSHAttempts)
	require.Equal(t, 68*time.Second, p.Ready)
}

func TestParsePrepareLogWithoutSeedIsFine(t *testing.T) {
	var kept []string
	for _, l := range strings.Split(prepareLog, "\n") {
		if !strings.Contains(l, "seed") {
			kept = append(kept, l)
		}
	}
	p, err := ParsePrepareLog(strings.Join(kept, "\n"))
	require.NoError(t, err)
	require.Zero(t, p.SeedCreate+p.SeedUpload)
}

func TestParsePrepareLogLastAttemptWins(t *testing.T) {
	first := strings.ReplaceAll(prepareLog, "clone disk done in 12ms", "clone disk done in 999ms")
	first = strings.ReplaceAll(first, "Machine ready in 1m8s", "Machine ready in 2m")
	p, err := ParsePrepareLog(first + "Will be retried in 1s ...\n" + prepareLog)
	require.NoError(t, err)
	require.Equal(t, 12*time.Millisecond, p.Clone)
	require.Equal(t, 68*time.Second, p.Ready)
}

func TestParsePrepareLogNamesWhatIsMissing(t *testing.T) {
	log := strings.ReplaceAll(prepareLog, "Booted, address", "Got address")
	log = strings.ReplaceAll(log, "Machine ready in 1m8s", "Machine ready in soon")
	_, err := ParsePrepareLog(log)
	require.ErrorContains(t, err, "address line missing")
	require.ErrorContains(t, err, `ready: bad duration "soon"`)
	require.ErrorContains(t, err, "ready line missing")

	_, err = ParsePrepareLog("")
	require.ErrorContains(t, err, "clone disk line missing")
}

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
