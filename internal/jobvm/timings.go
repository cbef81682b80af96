package jobvm

import (
	"gitlab.com/libvirt-executor/libvirt-executor/internal/obs"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// NewClaimRecord is the record of a claimed standby machine whose front end
// began preparing at began; ReadyMs runs until now, Claimed is when the
// claim was complete.
func NewClaimRecord(mach *state.Machine, c *Claimed, began time.Time) lifecycle.TimingRecord {
	return lifecycle.TimingRecord{
		Machine: mach.Name, Image: mach.Image, Began: began, Warm: true,
		ClaimMs: ms(c.Took), ReadyMs: ms(time.Since(began)), Claimed: c.At,
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Timings is the timing record of a's machine for a front end that began
// preparing at began: the claim's (NewClaimRecord) for a warm machine,
// else the provisioning's (lifecycle.NewTimingRecord).
func (a *Acquired) Timings(began time.Time) lifecycle.TimingRecord {
	if a.Warm {
		return NewClaimRecord(a.record(), a.Claimed, began)
	}
	return lifecycle.NewTimingRecord(a.Ready, began)
}

// record is the machine's record as the acquisition read or wrote it.
func (a *Acquired) record() *state.Machine {
	if a.Warm {
		return a.Claimed.Machine
	}
	return a.Ready.Machine
}

// Start is how the job's machine started: obs.PathWarm (a claimed standby
// machine), obs.PathSnapshot (restored from its image's memory snapshot)
// or obs.PathCold (booted).
func (a *Acquired) Start() string {
	switch {
	case a.Warm:
		return obs.PathWarm
	case a.Ready != nil && a.Ready.Timings.Start == lifecycle.StartSnapshot:
		return obs.PathSnapshot
	}
	return obs.PathCold
}

// WriteTimings appends rec to the file that LIBVIRT_EXECUTOR_TIMINGS
// (lifecycle.TimingsEnv) names in getenv, if it is set: a variable of the
// runner host, never a job's.
func WriteTimings(getenv func(string) string, rec lifecycle.TimingRecord) error {
	path := getenv(lifecycle.TimingsEnv)
	if path == "" {
		return nil
	}
	return lifecycle.AppendTimings(path, rec)
}
