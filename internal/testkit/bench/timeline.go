package bench

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
)

// readTimings returns the last timing record for machine in the file at
// path: the file the prepare stage appends one record to when the benchmark
// names it in its environment (lifecycle.TimingsEnv). A prepare attempt
// writes one only when it succeeds; the last one is the attempt that counts.
func readTimings(path, machine string) (lifecycle.TimingRecord, error) {
	var rec lifecycle.TimingRecord
	recs, err := timingRecords(path)
	if errors.Is(err, os.ErrNotExist) {
		return rec, fmt.Errorf("no timings record of %s: prepare wrote none (%s)", machine, lifecycle.TimingsEnv)
	}
	if err != nil {
		return rec, err
	}
	found := false
	for _, r := range recs {
		if r.Machine == machine {
			rec, found = r, true
		}
	}
	if !found {
		return rec, fmt.Errorf("no timings record of %s in %s", machine, path)
	}
	return rec, nil
}

// timingRecords reads every record of a timings file, in order; a missing
// file is os.ErrNotExist.
func timingRecords(path string) ([]lifecycle.TimingRecord, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var recs []lifecycle.TimingRecord
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		var r lifecycle.TimingRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("timings record %s:%d: %w", path, n, err)
		}
		recs = append(recs, r)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("timings record %s: %w", path, err)
	}
	return recs, nil
}

// requiredSteps are the create steps every machine has (seed steps only an
// image with a seed).
var requiredSteps = []string{"clone disk", "define", "start"}

// prepareMs is the driver's own breakdown of prepare, from its record. A
// missing create step is an error naming it, so a renamed step shows up
// instead of a silent zero.
func prepareMs(rec lifecycle.TimingRecord) (*PrepareMs, error) {
	var missing []string
	for _, s := range requiredSteps {
		if _, ok := rec.CreateMs[s]; !ok {
			missing = append(missing, fmt.Sprintf("%q", s))
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("timings record of %s: no create step %s", rec.Machine, strings.Join(missing, ", "))
	}
	c := rec.CreateMs
	return &PrepareMs{
		Clone: c["clone disk"], Seed: c["create seed volume"] + c["upload seed"], Entry: c["reserve address"], Define: c["define"], Start: c["start"],
		Created: rec.CreatedMs, Address: rec.AddressMs, SSH: rec.SSHMs, SSHAttempts: rec.SSHAttempts,
		Check: rec.CheckMs, Ready: rec.ReadyMs,
	}, nil
}

// Timeline is the prepare stage cut at the moments its record gives.
type Timeline struct {
	Launch   time.Duration // process started .. its first job-log line (exec, configuration, job)
	ToStart  time.Duration // first line .. domain started (leftovers, admission, keys, clone, define, start)
	ToAddr   time.Duration // domain started .. address known
	ToSSH    time.Duration // address known .. SSH login succeeded
	AfterSSH time.Duration // SSH login .. prepare exited (guest tool check, record, exit)
	// StartCall is the start call's own duration; StartToSSH is then from
	// the start call's beginning to the SSH login, the span the floor
	// measures.
	StartCall  time.Duration
	StartToSSH time.Duration
}

// prepareTimeline cuts the prepare stage that the harness launched at launch
// and saw exit at exit, at the moments of its timing record (wall clock, the
// same host's).
func prepareTimeline(rec lifecycle.TimingRecord, launch, exit time.Time) (Timeline, error) {
	startMs, ok := rec.CreateMs["start"]
	if !ok {
		return Timeline{}, fmt.Errorf("prepare timeline: no start step in the timings record of %s", rec.Machine)
	}
	marks := []time.Time{launch, rec.Began, rec.Started, rec.Addressed, rec.Connected, exit}
	for i := 1; i < len(marks); i++ {
		if marks[i].Before(marks[i-1]) {
			return Timeline{}, fmt.Errorf("prepare timeline: the moments of %s are out of order (not this stage's record?)", rec.Machine)
		}
	}
	startCall := time.Duration(startMs * float64(time.Millisecond))
	return Timeline{
		Launch: rec.Began.Sub(launch), ToStart: rec.Started.Sub(rec.Began), ToAddr: rec.Addressed.Sub(rec.Started),
		ToSSH: rec.Connected.Sub(rec.Addressed), AfterSSH: exit.Sub(rec.Connected),
		StartCall: startCall, StartToSSH: rec.Connected.Sub(rec.Started) + startCall,
	}, nil
}
