package jobvm

// AdminExecutable is the admin tool's executable (cmd/admin), installed
// next to the stage executables.
const AdminExecutable = "libvirt-executor"

// ExplainCommand is the admin tool's hidden command that prints
// lifecycle.Manager.Explain's sentence for a machine of this installation,
// or nothing: `libvirt-executor --config=PATH explain-machine -- NAME`. The
// run stage, built without libvirt, asks it when a guest stops answering.
const ExplainCommand = "explain-machine"

// CacheDiskCommand is the admin tool's hidden command that moves a
// project's host cache to and from a job's machine on hot-plugged disks;
// the run stage, built without libvirt, asks it:
//
//	libvirt-executor --config=PATH cache-disk attach -- NAME PROJECT [FILE...]   # prints "FILES BYTES" (0 0: nothing cached, no disk)
//	libvirt-executor --config=PATH cache-disk scratch -- NAME          # an empty disk for the guest to write
//	libvirt-executor --config=PATH cache-disk keep -- NAME PROJECT     # prints the save's KeepAnswer (JSON)
//	libvirt-executor --config=PATH cache-disk drop -- NAME             # deletes both disks' volumes
const (
	CacheDiskCommand = "cache-disk"
	CacheDiskAttach  = "attach"
	CacheDiskScratch = "scratch"
	CacheDiskKeep    = "keep"
	CacheDiskDrop    = "drop"
)
