//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"
)

// figures are the fault suite's numbers, printed when the suite ends.
var figures = &suiteFigures{}

type suiteFigures struct {
	mu           sync.Mutex
	faulted      int
	leaks        int
	classRight   int
	classChecked int
	detection    []time.Duration
}

func (f *suiteFigures) addLeaks(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leaks += n
}

// faulted records one faulted job.
func (f *suiteFigures) fault() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faulted++
}

// class records whether a stage exited with the expected class.
func (f *suiteFigures) class(got, want int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.classChecked++
	if got == want {
		f.classRight++
	}
}

// detected records how long a dead guest took to notice.
func (f *suiteFigures) detected(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.detection = append(f.detection, d)
}

func (f *suiteFigures) print() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.faulted == 0 && f.classChecked == 0 {
		return
	}
	pct := 100.0
	if f.classChecked > 0 {
		pct = 100 * float64(f.classRight) / float64(f.classChecked)
	}
	fmt.Printf("\nfault suite figures:\n")
	fmt.Printf("  faulted jobs run:        %d\n", f.faulted)
	fmt.Printf("  leaks found:             %d (must be 0)\n", f.leaks)
	fmt.Printf("  exit class correct:      %d/%d = %.1f%% (must be 100%%)\n", f.classRight, f.classChecked, pct)
	if len(f.detection) > 0 {
		d := slices.Clone(f.detection)
		slices.Sort(d)
		fmt.Printf("  dead-guest detection:    median %s, max %s over %d (target < 15s with the default keepalive 3s x 3)\n",
			d[len(d)/2].Round(100*time.Millisecond), d[len(d)-1].Round(100*time.Millisecond), len(d))
	}
}

func TestMain(m *testing.M) {
	if addr := os.Getenv(helperListenEnv); addr != "" {
		helperListen(addr) // the test binary as a tiny TCP service, see metadataStandIn
		return
	}
	code := m.Run()
	figures.print()
	os.Exit(code)
}
