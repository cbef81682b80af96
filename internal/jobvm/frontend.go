package jobvm

import (
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/lifecycle"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/state"
)

// What a front end names of the engine through the job layer: the types
// and sentinels jobvm's own API takes and returns (OpenJobs, Acquire,
// Session.Client), named here so that a front end imports jobvm and not
// lifecycle or holder. They are aliases: the types are still the engine's,
// and a front end is coupled to them through jobvm's signatures as before.
type (
	// Options opens the engine (OpenJobs).
	Options = lifecycle.Options
	// Connector opens the hypervisor (Options.Connect).
	Connector = lifecycle.Connector
	// Request is what a job asks of its machine (AcquireRequest).
	Request = lifecycle.Request
	// MachineRecord is the job's machine as recorded (Job.Record,
	// Session.Client); Tools its guest tools disk (JobRequest.Check);
	// KeptMachine a machine kept for debugging (Job.Keep).
	MachineRecord = state.Machine
	Tools         = state.Tools
	KeptMachine   = state.Kept
	// Client is a direct connection into the job's machine
	// (Session.Client).
	Client = sshexec.Client
)

// ErrNoMachine: the job has no prepared machine (Job.Record,
// Session.Client).
var ErrNoMachine = state.ErrNoMachine

// ShellQuote quotes a word for the guest's shell.
var ShellQuote = sshexec.ShellQuote

// Where the guest tools disk puts things in the guest (front ends name
// them in what they tell the job's log).
const (
	ToolsDiskSerial     = guestinit.ToolsDiskSerial
	ToolsMountPoint     = guestinit.ToolsMountPoint
	GuestStepRunnerPath = guestinit.GuestStepRunnerPath
)

// InstanceTag is the short tag of a front end's instance (its server URL
// and runner, say) that the machine names carry (lifecycle.InstanceTag).
func InstanceTag(parts ...string) string { return lifecycle.InstanceTag(parts...) }
