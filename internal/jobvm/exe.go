package jobvm

// AdminExecutable is the admin tool's executable (cmd/admin), installed
// next to the stage executables.
const AdminExecutable = "libvirt-executor"

// ExplainCommand is the admin tool's hidden command that prints
// lifecycle.Manager.Explain's sentence for a machine of this installation,
// or nothing: `libvirt-executor --config=PATH explain-machine -- NAME`. The
// run stage, built without libvirt, asks it when a guest stops answering.
const ExplainCommand = "explain-machine"

// CacheDiskCommand is the admin tool's hidden command that hands a
// project's host cache to a job's machine on a restore disk, or takes the
// disk's volume away again (CacheDiskAttach, CacheDiskDrop):
// `libvirt-executor --config=PATH cache-disk attach -- NAME PROJECT`
// prints "FILES BYTES" (0 0: nothing cached, no disk); `... cache-disk
// drop -- NAME`. The run stage, built without libvirt, asks it.
const (
	CacheDiskCommand = "cache-disk"
	CacheDiskAttach  = "attach"
	CacheDiskDrop    = "drop"
)
