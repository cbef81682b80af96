package jobvm

import (
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
