package lifecycle

import (
	"encoding/json"
	"fmt"
	"os"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// Timings are the durations Provision measures, unrounded (the job log
// prints them rounded), and when it reached each stage of the boot.
type Timings struct {
	// Start is how the machine started: StartCold (booted) or
	// StartSnapshot (restored from its image's memory snapshot).
	Start string
	// Create is each step of vm.Engine.Create, in order: "clone disk",
	// "create seed volume" and "upload seed" (for an image with a seed),
	// "define", "start".
	Create []vm.StepTime
	// Created is the whole create step ("Created ... in").
	Created time.Duration
	// Address is the wait for the address after the start ("Booted,
	// address ... in").
	Address time.Duration
	// SSH is the wait for SSH after the address, SSHAttempts the dials it
	// took ("SSH ready ... in ... (N attempts)").
	SSH         time.Duration
	SSHAttempts int
	// Check is the front end's check of the connected machine (0 without
	// one).
	Check time.Duration
	// Ready is the whole Provision, leftovers removal included ("Machine
	// ready in").
	Ready time.Duration
	// Started, Addressed and Connected are when (wall clock) the domain's
	// start call returned, its address was known, and SSH was ready.
	Started, Addressed, Connected time.Time
}

// How a provisioned machine started (Timings.Start).
const (
	StartCold     = "cold"
	StartSnapshot = "snapshot"
)

// TimingsEnv is the environment variable of the runner host (set by its
// administrator or the benchmark) that names the file a front end appends
// one TimingRecord to for each machine it provisions. It is never read from
// a job's variables: GitLab passes those as CUSTOM_ENV_*.
const TimingsEnv = "LIBVIRT_EXECUTOR_TIMINGS"

// TimingRecord is one line of the timings file: a provisioned machine's
// Timings for programs (the benchmark), durations in milliseconds,
// unrounded.
type TimingRecord struct {
	Machine string `json:"machine"`
	Image   string `json:"image"`
	// Began is when the front end began preparing the machine (GitLab's
	// prepare stage: when it printed its first job-log line).
	Began time.Time `json:"began"`
	// CreateMs is each step of the create step by its name in Timings.Create.
	CreateMs    map[string]float64 `json:"create_steps_ms"`
	CreatedMs   float64            `json:"created_ms"`
	AddressMs   float64            `json:"address_ms"`
	SSHMs       float64            `json:"ssh_ms"`
	SSHAttempts int                `json:"ssh_attempts"`
	CheckMs     float64            `json:"check_ms"`
	ReadyMs     float64            `json:"ready_ms"`
	// Start is how a provisioned machine started: "cold" or "snapshot"
	// (Timings.Start); empty for a claimed standby machine (Warm).
	Start string `json:"start,omitempty"`
	// Warm says the machine was a claimed standby machine; ClaimMs is the
	// claim, Claimed when it completed. The boot fields are then empty.
	Warm      bool      `json:"warm,omitempty"`
	ClaimMs   float64   `json:"claim_ms,omitempty"`
	Claimed   time.Time `json:"claimed,omitzero"`
	Started   time.Time `json:"started"`
	Addressed time.Time `json:"addressed"`
	Connected time.Time `json:"connected"`
}

// NewTimingRecord is the record of a provisioned machine whose front end
// began preparing it at began.
func NewTimingRecord(r *Ready, began time.Time) TimingRecord {
	t := r.Timings
	steps := make(map[string]float64, len(t.Create))
	for _, s := range t.Create {
		steps[s.Name] = ms(s.Took)
	}
	return TimingRecord{
		Machine: r.Machine.Name, Image: r.Machine.Image, Began: began,
		CreateMs: steps, CreatedMs: ms(t.Created), AddressMs: ms(t.Address),
		SSHMs: ms(t.SSH), SSHAttempts: t.SSHAttempts, CheckMs: ms(t.Check), ReadyMs: ms(t.Ready), Start: t.Start,
		Started: t.Started, Addressed: t.Addressed, Connected: t.Connected,
	}
}

// AppendTimings appends rec as one JSON line to the file at path, creating
// it (mode 0600) if needed. The line is one write to a file opened with
// O_APPEND, so stages that share the file do not mix their lines.
func AppendTimings(path string, rec TimingRecord) error {
	line, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("timings file (%s): %w", TimingsEnv, err)
	}
	_, err = f.Write(append(line, '\n'))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("timings file (%s): %w", TimingsEnv, err)
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
