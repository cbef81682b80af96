package vm_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	. "gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// slowLeases is a hypervisor whose lease query takes a while.
type slowLeases struct {
	Hypervisor
	took  time.Duration
	polls atomic.Int32
}

func (s *slowLeases) Addresses(ctx context.Context, name string, source AddressSource) ([]Lease, error) {
	s.polls.Add(1)
	time.Sleep(s.took)
	return s.Hypervisor.Addresses(ctx, name, source)
}

// WaitAddress asks at a fixed rate, 50 ms by default (the benchmark floor's
// rate): a poll that takes 30 ms is followed by the next 20 ms later, not
// 50 ms later (which would be 0.625 of the rate). Two seconds of polls
// average out a loaded machine's late wake-ups.
func TestWaitAddressPollsAtAFixedRate(t *testing.T) {
	for _, tc := range []struct {
		name     string
		interval time.Duration
		want     time.Duration
	}{
		{"default", 0, 50 * time.Millisecond},
		{"set", 160 * time.Millisecond, 160 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := vmtest.New()
			f.Domains["lve-x-1"] = &vmtest.Domain{Active: true}
			hv := &slowLeases{Hypervisor: f, took: tc.want * 3 / 5}
			e := &Engine{HV: hv, PollInterval: tc.interval}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			start := time.Now()
			_, err := e.WaitAddress(ctx, "lve-x-1", "52:54:00:aa:bb:cc", SourceLease)
			elapsed := time.Since(start)
			require.ErrorContains(t, err, "no address for lve-x-1")
			polls := float64(hv.polls.Load())
			want := float64(elapsed) / float64(tc.want)
			require.GreaterOrEqual(t, polls, 0.75*want, "%v polls in %s: one per %s expected", polls, elapsed, tc.want)
			require.LessOrEqual(t, polls, want+2, "%v polls in %s: not more than one per %s", polls, elapsed, tc.want)
		})
	}
}
