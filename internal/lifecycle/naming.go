package lifecycle

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
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
