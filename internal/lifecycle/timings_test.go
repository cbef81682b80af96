package lifecycle

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle/lifecycletest"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm/vmtest"
)

// Provision returns the durations it printed, unrounded, in the order the
// boot went through them.
func TestProvisionReturnsTimings(t *testing.T) {
	hv := vmtest.New()
	g := newGuest(t, hv)
	m, img := manager(t, hv, g)
	req := testRequest(img)
	req.Check = func(context.Context, *sshexec.Client, *state.Tools) error {
		time.Sleep(20 * time.Millisecond)
		return nil
	}
	began := time.Now()
	ready, err := m.Provision(context.Background(), req)
	require.NoError(t, err)
	defer ready.Client.Close()
	tm := ready.Timings

	var names []string
	var sum time.Duration
	for _, s := range tm.Create {
		names = append(names, s.Name)
		sum += s.Took
	}
	require.Equal(t, []string{"clone disk", "reserve address", "create seed volume", "upload seed", "define", "start"}, names)
	require.GreaterOrEqual(t, tm.Created, sum, "the create step holds Create's steps")
	require.GreaterOrEqual(t, tm.Address, lifecycletest.LeaseDelay, "the fake lease comes LeaseDelay after the start")
	require.Positive(t, tm.SSH)
	require.Equal(t, 1, tm.SSHAttempts)
	require.GreaterOrEqual(t, tm.Check, 20*time.Millisecond)
	require.GreaterOrEqual(t, tm.Ready, tm.Created+tm.Address+tm.SSH+tm.Check)
	require.LessOrEqual(t, tm.Ready, time.Since(began))

	// The waits begin after the milestone before them and end at their own.
	require.True(t, began.Before(tm.Started))
	require.GreaterOrEqual(t, tm.Addressed.Sub(tm.Started), tm.Address)
	require.GreaterOrEqual(t, tm.Connected.Sub(tm.Addressed), tm.SSH)
}

// The record is one JSON line per machine, appended to a 0600 file, with
// the durations in milliseconds, unrounded.
func TestAppendTimings(t *testing.T) {
	path := filepath.Join(t.TempDir(), "timings.jsonl")
	began := time.Date(2026, 11, 21, 15, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return began.Add(time.Duration(ms) * time.Millisecond) }
	ready := &Ready{
		Machine: &state.Machine{Name: "lve-0123abcd-7", Image: "tiny"},
		Timings: Timings{
			Create: []vm.StepTime{
				{Name: "clone disk", Took: 12345678 * time.Nanosecond},
				{Name: "define", Took: 20 * time.Millisecond},
				{Name: "start", Took: 398*time.Millisecond + 1},
			},
			Created: 434 * time.Millisecond, Address: 6234567 * time.Microsecond,
			SSH: 1400 * time.Millisecond, SSHAttempts: 3, Check: 300 * time.Millisecond, Ready: 68 * time.Second,
			Started: at(500), Addressed: at(6734), Connected: at(8134),
		},
	}
	rec := NewTimingRecord(ready, began)
	require.NoError(t, AppendTimings(path, rec))
	second := rec
	second.Machine = "lve-0123abcd-8"
	require.NoError(t, AppendTimings(path, second))

	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var lines []TimingRecord
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r TimingRecord
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), "one JSON value a line: %s", sc.Text())
		lines = append(lines, r)
	}
	require.Len(t, lines, 2)
	require.Equal(t, TimingRecord{
		Machine: "lve-0123abcd-7", Image: "tiny", Began: began,
		CreateMs:  map[string]float64{"clone disk": 12.345678, "define": 20, "start": 398.000001},
		CreatedMs: 434, AddressMs: 6234.567, SSHMs: 1400, SSHAttempts: 3, CheckMs: 300, ReadyMs: 68000,
		Started: at(500), Addressed: at(6734), Connected: at(8134),
	}, lines[0])
	require.Equal(t, "lve-0123abcd-8", lines[1].Machine)
}

func TestAppendTimingsNamesTheVariableOnError(t *testing.T) {
	err := AppendTimings(filepath.Join(t.TempDir(), "missing", "t.jsonl"), TimingRecord{})
	require.ErrorContains(t, err, TimingsEnv)
}
