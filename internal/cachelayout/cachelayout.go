// Package cachelayout holds what the host cache's two sides agree on when
// a guest writes its cache on a scratch disk: the direct layout's
// constants (read by hostcache.FromDisk, written by the guest's shell in
// internal/gitlab or by the guest agent's cache-save) and the words the
// save's guest command says. A leaf package: the guest agent imports it.
package cachelayout

// The direct layout (hostcache.FromDisk documents it): a manifest at the
// disk's start, at most ManifestMax bytes,
//
//	lve-cache-direct 1
//	<offset> <size> <name>      one line per file, in increasing offsets
//	end
//
// and each file's bytes at its offset, a multiple of Align, at least
// ManifestMax, at or past the end of the file before rounded up to Align.
const (
	Magic       = "lve-cache-direct 1"
	End         = "end"
	ManifestMax = 1 << 20
	Align       = 4096
	// MaxDirectFiles is the most files a direct layout carries; a cache with
	// more goes as a tar stream (hostcache.MaxFiles bounds those).
	MaxDirectFiles = 100
)

// What the save's guest command says on its last line, and the word that
// starts an armed one.
const (
	// Written is followed by the write's exit status and how it was
	// written ("direct", "tar"; "direct agent" by the guest agent).
	Written = "lve-cache-written"
	// NotAsked: the armed command's stdin ended without Go.
	NotAsked = "lve-cache-not-asked"
	// NotDirect: the guest agent could not write the direct layout (too
	// many files, a name it cannot carry, a file that changed, no room):
	// the host runs the shell's save, which writes a tar stream then.
	NotDirect = "lve-cache-not-direct"
	// Go is the armed command's signal on its stdin.
	Go = "go"
)
