package harness

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// helperAllocEnv makes the test binary, run as a stage executable, touch that
// many MiB of memory and exit (see TestHelperProcessAlloc).
const helperAllocEnv = "LVE_HARNESS_HELPER_ALLOC_MIB"

// TestHelperProcessAlloc is not a test: it is the body of the child process
// started by TestMaxRSSIsRecorded.
func TestHelperProcessAlloc(t *testing.T) {
	mib, err := strconv.Atoi(os.Getenv(helperAllocEnv))
	if err != nil {
		t.Skip("helper process only")
	}
	b := make([]byte, mib<<20)
	for i := 0; i < len(b); i += 4096 {
		b[i] = 1 // touch every page so it is resident
	}
	os.Stdout.WriteString("allocated " + strconv.Itoa(len(b)>>20) + " MiB\n")
	os.Exit(0)
}

func runAllocHelper(t *testing.T, mib int) StageResult {
	t.Helper()
	var out bytes.Buffer
	spec := procSpec{
		argv:   []string{os.Args[0], "-test.run=^TestHelperProcessAlloc$"},
		env:    append(os.Environ(), helperAllocEnv+"="+strconv.Itoa(mib)),
		stdout: &out,
	}
	res := runProc(context.Background(), spec, procTimes{graceful: 5 * time.Second, force: 2 * time.Second}, nil)
	require.Equal(t, 0, res.ExitCode, out.String())
	require.Contains(t, out.String(), "allocated "+strconv.Itoa(mib)+" MiB")
	return res
}

func TestMaxRSSIsRecorded(t *testing.T) {
	small := runAllocHelper(t, 1)
	big := runAllocHelper(t, 96)
	require.Positive(t, small.MaxRSSKiB)
	require.GreaterOrEqual(t, big.MaxRSSKiB, int64(96<<10), "touched 96 MiB must be resident at the peak")
	require.Greater(t, big.MaxRSSKiB-small.MaxRSSKiB, int64(80<<10), "the peak follows what the process used")
}

func TestMaxRSSZeroWhenNotStarted(t *testing.T) {
	var out bytes.Buffer
	res := runProc(context.Background(), procSpec{argv: []string{"/nonexistent/lve-harness-test"}, stdout: &out},
		procTimes{graceful: time.Second, force: time.Second}, nil)
	require.NotEmpty(t, res.StartError)
	require.Zero(t, res.MaxRSSKiB)
}
