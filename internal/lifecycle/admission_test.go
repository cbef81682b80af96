package lifecycle

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

func TestAdmissionWaitsForRoom(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	m.Cfg.Capacity.MaxVMs = 1
	first := testRequest(img)
	ready, err := m.Provision(context.Background(), first)
	require.NoError(t, err)
	_ = ready.Client.Close()

	s := lifecycletest.NewSayings(t)
	m2 := *m
	m2.Say = s.Say
	second := testRequest(img)
	second.Name = "lve-0123abcd-8"
	done := make(chan error, 1)
	go func() {
		r, err := m2.Provision(context.Background(), second)
		if err == nil {
			_ = r.Client.Close()
		}
		done <- err
	}()
	require.Eventually(t, func() bool { return s.Has("Waiting for room on the host") }, 5*time.Second, 20*time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("second machine admitted while the host was full: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	hv.Lock()
	_, created := hv.Domains[second.Name]
	hv.Unlock()
	require.False(t, created, "nothing created while waiting")

	require.NoError(t, m.Machine(first.Name).Teardown(context.Background()))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("second machine not admitted after the first left")
	}
	require.True(t, s.Has("Room on the host after"))
	require.NoError(t, m.Machine(second.Name).Teardown(context.Background()))
	requireNothingLeft(t, hv, m)
}

func TestAdmissionMemoryBudgetAndTimeout(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	m.Cfg.Capacity.MemoryBudgetMiB = 300
	m.Cfg.Capacity.Wait = config.Duration(700 * time.Millisecond)
	// Another job holds 200 MiB and is alive (its lock is held).
	_, err := m.Store.Reserve("lve-0123abcd-99", state.Reservation{VCPUs: 1, MemoryMiB: 200})
	require.NoError(t, err)
	unlock, err := m.Store.TryLock("lve-0123abcd-99")
	require.NoError(t, err)
	defer unlock()

	start := time.Now()
	_, err = m.Provision(context.Background(), testRequest(img)) // wants 256 MiB
	require.Error(t, err)
	require.ErrorContains(t, err, "200 MiB of 300 MiB in use, this job needs 256 MiB (capacity.memory_budget_mib)")
	require.ErrorContains(t, err, "capacity.wait")
	require.Less(t, time.Since(start), 5*time.Second)
	hv.Lock()
	require.Empty(t, hv.Domains)
	hv.Unlock()
	require.NoDirExists(t, m.Store.MachineDir("lve-0123abcd-7"), "no reservation left behind")
}

func TestAdmissionSweepsStaleReservations(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	m.Cfg.Capacity.MaxVMs = 1
	// A prepare was SIGKILLed after reserving: its directory remains, no
	// domain, nobody holds its lock.
	_, err := m.Store.Reserve("lve-0123abcd-50", state.Reservation{VCPUs: 1, MemoryMiB: 256})
	require.NoError(t, err)
	s := lifecycletest.NewSayings(t)
	m.Say = s.Say
	ready, err := m.Provision(context.Background(), testRequest(img))
	require.NoError(t, err)
	_ = ready.Client.Close()
	require.True(t, s.Has("leftover machine(s) to make room"))
	require.NoDirExists(t, m.Store.MachineDir("lve-0123abcd-50"))
	require.NoError(t, m.Machine("lve-0123abcd-7").Teardown(context.Background()))
}
