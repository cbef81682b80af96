// Package vm is the VM engine: it turns a Spec into a running libvirt domain
// backed by a linked-clone disk, finds its address, and removes everything it
// made. It knows nothing of GitLab; front ends pass a Spec and an Owner.
package vm

import (
	"fmt"
	"regexp"
)

// nameRE is the shape of every name the engine creates. It is safe as a
// libvirt object name, a file name and inside XML without escaping.
var nameRE = regexp.MustCompile(`^[a-z][a-z0-9-]{0,62}$`)

// CheckName refuses any name that is not of the engine's safe shape. It runs
// before any XML or libvirt object exists.
func CheckName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("machine name %q refused: want 1-63 characters of a-z, 0-9 and '-', starting with a letter", name)
	}
	return nil
}

// DiskVolume is the name of the machine's overlay disk volume.
func DiskVolume(name string) string { return name + ".qcow2" }

// SeedVolume is the name of the machine's seed volume (cloud-init NoCloud
// image or credentials disk).
func SeedVolume(name string) string { return name + "-seed.img" }

// DataVolume is the name of the machine's data volume: a read-only disk
// hot-plugged into the running guest to hand it data (AttachData).
func DataVolume(name string) string { return name + "-data.img" }

// ScratchVolume is the name of the machine's scratch volume: an empty
// disk hot-plugged into the running guest for it to hand data back
// (AttachScratch).
func ScratchVolume(name string) string { return name + "-scratch.img" }

// SaveVolume is the name of a snapshot template's save volume: its memory
// and device state (Engine.SaveMachine), which clones restore from.
func SaveVolume(name string) string { return name + ".save" }

// Volumes are the names of every volume the engine may make for machine
// name; teardown and sweep look for all of them.
func Volumes(name string) []string {
	return []string{DiskVolume(name), SeedVolume(name), DataVolume(name), ScratchVolume(name), SaveVolume(name)}
}
