package harness

import (
	"bytes"
	"context"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// helperAllocEnv makes the test binary, run as a stage executable, touch that
// many MiB of memory, hold it for a moment and exit (see
// TestHelperProcessAlloc).
const helperAllocEnv = "LVE_HARNESS_HELPER_ALLOC_MIB"

// TestHelperProcessAlloc is not a test: it is the body of the child process
// started by the RSS tests.
func TestHelperProcessAlloc(t *testing.T) {
	mib, err := strconv.Atoi(os.Getenv(helperAllocEnv))
	if err != nil {
		t.Skip("helper process only")
	}
	b := make([]byte, mib<<20)
	for i := 0; i < len(b); i += 4096 {
		b[i] = 1 // touch every page so it is resident
	}
	time.Sleep(time.Second) // long enough to be sampled on a loaded host
	_, _ = os.Stdout.WriteString("allocated " + strconv.Itoa(len(b)>>20) + " MiB\n")
	runtime.KeepAlive(b)
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
	res := runProc(context.Background(), spec,
		procTimes{graceful: 5 * time.Second, force: 2 * time.Second, sampleRSS: 10 * time.Millisecond}, nil)
	require.Equal(t, 0, res.ExitCode, out.String())
	require.Contains(t, out.String(), "allocated "+strconv.Itoa(mib)+" MiB")
	return res
}

func TestRSSIsRecorded(t *testing.T) {
	small := runAllocHelper(t, 1)
	big := runAllocHelper(t, 96)
	for _, r := range []StageResult{small, big} {
		require.Positive(t, r.MaxRSSKiB)
		require.Positive(t, r.PeakRSSKiB)
	}
	require.GreaterOrEqual(t, big.MaxRSSKiB, int64(96<<10), "touched 96 MiB must be resident at the peak")
	require.GreaterOrEqual(t, big.PeakRSSKiB, int64(96<<10), "the sampled peak sees the touched 96 MiB")
	require.Greater(t, big.PeakRSSKiB-small.PeakRSSKiB, int64(80<<10), "the peak follows what the process used")
}

// ru_maxrss of a child started with vfork includes the parent's peak RSS;
// the sampled VmHWM is the child's own.
func TestPeakRSSExcludesTheHarnessMemory(t *testing.T) {
	ballast := make([]byte, 160<<20)
	for i := 0; i < len(ballast); i += 4096 {
		ballast[i] = 1
	}
	r := runAllocHelper(t, 8)
	runtime.KeepAlive(ballast)
	require.GreaterOrEqual(t, r.MaxRSSKiB, int64(160<<10), "ru_maxrss carries the harness's own peak (exec after vfork)")
	require.GreaterOrEqual(t, r.PeakRSSKiB, int64(8<<10))
	require.Less(t, r.PeakRSSKiB, int64(100<<10), "VmHWM is the child's own peak")
}

func TestNoRSSSamplingByDefault(t *testing.T) {
	var out bytes.Buffer
	res := runProc(context.Background(), procSpec{argv: []string{"true"}, stdout: &out},
		procTimes{graceful: time.Second, force: time.Second}, nil)
	require.Equal(t, 0, res.ExitCode)
	require.Zero(t, res.PeakRSSKiB)
}

func TestRSSZeroWhenNotStarted(t *testing.T) {
	var out bytes.Buffer
	res := runProc(context.Background(), procSpec{argv: []string{"/nonexistent/lve-harness-test"}, stdout: &out},
		procTimes{graceful: time.Second, force: time.Second, sampleRSS: time.Millisecond}, nil)
	require.NotEmpty(t, res.StartError)
	require.Zero(t, res.MaxRSSKiB)
	require.Zero(t, res.PeakRSSKiB)
}

func TestParseHWM(t *testing.T) {
	status := "Name:\tbash\nVmPeak:\t  8000 kB\nVmHWM:\t    4242 kB\nVmRSS:\t    4000 kB\n"
	kib, ok := parseHWM(status)
	require.True(t, ok)
	require.Equal(t, int64(4242), kib)
	for _, bad := range []string{"", "Name:\tzombie\nState:\tZ (zombie)\n", "VmHWM:\t12 MB\n", "VmHWM:\tx kB\n"} {
		_, ok := parseHWM(bad)
		require.False(t, ok, "%q", bad)
	}
}
