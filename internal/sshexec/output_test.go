package sshexec

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/testkit/sshtest"
)

// heapPeak samples the heap until stop is closed and returns the largest
// HeapInuse seen over the one before it began.
func heapPeak(stop <-chan struct{}) <-chan uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	peak := make(chan uint64, 1)
	go func() {
		var most uint64
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			runtime.ReadMemStats(&ms)
			if ms.HeapInuse > base && ms.HeapInuse-base > most {
				most = ms.HeapInuse - base
			}
			select {
			case <-stop:
				peak <- most
				return
			case <-tick.C:
			}
		}
	}()
	return peak
}

// A hostile guest (its login shell replaced, or a ForceCommand) answers the
// group kill's command with endless output and never exits. Output keeps a
// bounded part of it and returns when its context ends, at once: before, it
// kept everything (about 1 GiB per call) and returned seconds late.
func TestOutputFromAGuestThatNeverStopsTalking(t *testing.T) {
	ts := sshtest.Start(t)
	ts.SetLogin("sh", "-c", "exec cat /dev/zero") // runs instead of any command
	c := dial(t, target(ts))
	const wait = 2 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	stop := make(chan struct{})
	peak := heapPeak(stop)
	start := time.Now()
	out, err := c.Output(ctx, "kill -TERM -1234")
	took := time.Since(start)
	close(stop)
	grew := <-peak
	t.Logf("Output returned after %s; the heap grew by at most %d KiB", took.Round(time.Millisecond), grew>>10)
	require.Less(t, took, wait+5*time.Second, "Output returns when its context ends (the heap bound below is what catches keeping it all)")
	require.Less(t, grew, uint64(64<<20), "the heap grew by %d MiB while the guest talked", grew>>20)
	require.LessOrEqual(t, len(out), OutputLimit)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NoError(t, c.Dead(), "the connection itself stays usable")
}

// A guest that answers with a lot of output and exits: Output returns the
// first OutputLimit bytes of it, not all of it.
func TestOutputKeepsABoundedPart(t *testing.T) {
	ts := sshtest.Start(t)
	ts.SetLogin("sh", "-c", "head -c 1000000 /dev/zero; echo lots-of-noise >&2; head -c 1000000 /dev/zero >&2")
	c := dial(t, target(ts))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := c.Output(ctx, "true")
	require.NoError(t, err)
	require.Equal(t, OutputLimit, len(out), "the first OutputLimit bytes of 1 MB")

	ts.SetLogin("sh", "-c", "echo nope >&2; head -c 1000000 /dev/zero >&2; exit 3")
	_, err = c.Output(ctx, "true")
	require.ErrorContains(t, err, `exit status 3: "nope\n`)
	require.Less(t, len(err.Error()), 2*stderrLimit, "the error keeps a bounded part of stderr")
}

// A guest's stderr in the error (which reaches the host's logs) is quoted
// and cut: no forged log line after a newline, no terminal escape, at
// most about obs.MaxLogText bytes of it.
func TestOutputErrorQuotesGuestText(t *testing.T) {
	ts := sshtest.Start(t)
	ts.SetLogin("sh", "-c", `printf 'no\nlevel=ERROR msg=forged\033[2J' >&2; head -c 4000 /dev/zero | tr '\0' A >&2; exit 3`)
	c := dial(t, target(ts))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := c.Output(ctx, "true")
	require.Error(t, err)
	msg := err.Error()
	require.True(t, strings.HasPrefix(msg, `exit status 3: "no\nlevel=ERROR msg=forged\x1b[2J`), msg)
	require.NotContains(t, msg, "\n")
	require.NotContains(t, msg, "\x1b")
	require.Less(t, len(msg), 2*obs.MaxLogText)
	require.Contains(t, msg, "bytes cut)")
}

// A guest that answers a little, slowly, and never exits: Output returns when
// its context ends while the command's output is still being copied in.
// Before, Output read the kept bytes while the copy still appended to them (a
// data race: go test -race -count=200 -run TestOutputWhenItsContextEnds);
// now what Output returns is no longer written to, and nothing that comes
// after is kept.
func TestOutputWhenItsContextEnds(t *testing.T) {
	ts := sshtest.Start(t)
	ts.SetLogin("sh", "-c", "while :; do echo tick; sleep 0.001; done")
	c := dial(t, target(ts))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	out, err := c.Output(ctx, "true")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	kept := string(out)
	require.True(t, strings.HasPrefix(strings.Repeat("tick\n", len(kept)/5+1), kept), "only the guest's ticks: %q", kept)
	for i := range out {
		out[i] = 'x' // the caller owns what Output returned
	}
	require.NoError(t, c.Dead(), "the connection itself stays usable")
}
