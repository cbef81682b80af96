// Package buildinfo holds what the build stamps into the executables.
package buildinfo

// Version is the driver's version, set at build time with
// -ldflags "-X gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo.Version=...".
var Version = "dev"
