// Package buildinfo holds what the build stamps into the executables.
package buildinfo

import "strings"

// Set at build time (Makefile, deploy/package/build.sh) with
// -ldflags "-X gitlab.com/libvirt-executor/libvirt-executor/internal/buildinfo.Version=...".
var (
	// Version is the driver's version: the package version (git tag, or
	// 0.0.<commits>+g<commit> without one); "dev" for a plain go build.
	Version = "dev"
	// Commit is the full git commit the build came from ("" if unknown;
	// "-dirty" appended when the tree had changes).
	Commit = ""
	// Date is when the build was made (UTC, RFC 3339; "" if unknown).
	Date = ""
)

// License is the project's licence (LICENSE at the repository's root).
const License = "MIT License"

// String is what every executable's --version prints after its name:
// the version, the commit and the build date, and the licence.
func String() string {
	var b strings.Builder
	b.WriteString(Version)
	c, d := Commit, Date
	if c == "" {
		c = "unknown"
	}
	if d == "" {
		d = "unknown"
	}
	b.WriteString(" (commit " + c + ", built " + d + "), " + License)
	return b.String()
}
