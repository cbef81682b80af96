package lifecycle

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// instanceTagLen is how many hex digits of the instance identity's hash a
// machine name carries.
const instanceTagLen = 8

// InstanceTag is a short, stable tag of the identity of the front end's
// instance: for GitLab, the server URL and the runner id. Jobs of different
// instances sharing one host and one driver configuration may have the same
// job id; the tag keeps their machine names apart. It is the first 8 hex
// digits of a SHA-256 over the parts (length-prefixed, so parts cannot run
// into each other), safe in any name whatever the parts contain. Never pass
// secrets: the tag is a short hash, not a secret-preserving one.
func InstanceTag(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(strconv.Itoa(len(p)) + ":" + p))
	}
	return hex.EncodeToString(h.Sum(nil))[:instanceTagLen]
}

// MachineName is the one place that names a job's machine:
// <prefix>-<first 8 of controller>-<instance>-<job id>, built on
// MachinePrefix so every name starts the way the sweep recognises this
// installation's machines. instance is an InstanceTag (cut to its 8
// digits if longer). With the longest name_prefix the configuration allows
// (16) and the largest job id (19 digits) a name has 54 characters, within
// vm.CheckName's 63.
func MachineName(prefix, controller, instance string, jobID int64) string {
	if len(instance) > instanceTagLen {
		instance = instance[:instanceTagLen]
	}
	return MachinePrefix(prefix, controller) + instance + "-" + strconv.FormatInt(jobID, 10)
}

// MachinePrefix is how every machine name of this installation starts.
func MachinePrefix(prefix, controller string) string {
	short := controller
	if len(short) > 8 {
		short = short[:8]
	}
	return prefix + "-" + short + "-"
}

// Every machine name of this installation is MachinePrefix followed by one
// of these shapes, made here and nowhere else:
//   - a job's machine: <instance tag>-<job id> (MachineName);
//   - a standby machine: sb-<8 random hex digits> (StandbyName); "sb-" is
//     not hex, so it never looks like an instance tag;
//   - a front end's instance: <kind>-<12 hex digits of a hash of its
//     identity> (InstanceName; garm's runners: "garm-");
//   - the KVM probe's guest: kvm-<8 random hex digits> (KVMProbeName).
const standbyTag = "sb-"

// KVMProbeName is a fresh name for the KVM probe's guest (ProbeKVM):
// <prefix>-<first 8 of controller>-kvm-<8 random hex digits>.
func KVMProbeName(prefix, controller string) (string, error) {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return MachinePrefix(prefix, controller) + "kvm-" + hex.EncodeToString(b), nil
}

// StandbyName is a fresh name for a standby machine:
// <prefix>-<first 8 of controller>-sb-<8 random hex digits>.
func StandbyName(prefix, controller string) (string, error) {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return MachinePrefix(prefix, controller) + standbyTag + hex.EncodeToString(b), nil
}

// IsStandby reports whether name is a standby machine's name of this
// installation.
func (mc Machine) IsStandby() bool {
	m, name := mc.m, mc.name
	return strings.HasPrefix(name, m.namePrefix()+standbyTag)
}

// InstanceName names the machine of a front end's instance whose
// identity is parts (garm: its controller id and the instance's name):
// MachinePrefix, kind (lower case letters, then "-"), and 12 hex digits of
// a SHA-256 over the parts, separated by NUL bytes. Stable for the same
// identity; safe whatever the parts hold (garm's names have capitals,
// machine names do not).
func InstanceName(prefix, controller, kind string, parts ...string) string {
	h := sha256.New()
	for i, p := range parts {
		if i > 0 {
			h.Write([]byte{0})
		}
		h.Write([]byte(p))
	}
	return MachinePrefix(prefix, controller) + kind + "-" + hex.EncodeToString(h.Sum(nil)[:6])
}

// JobKey is the key of a job's name record (state.JobName): the front
// end's kind, the job's instance tag and its id. Unlike machine names it
// is frozen: every version computes the same key for the same job, so a
// job prepared by one version is found by the later stages of the next
// one even if that one names machines differently. Do not change it.
func JobKey(kind, instance string, jobID int64) string {
	return kind + "-" + instance + "-" + strconv.FormatInt(jobID, 10)
}
