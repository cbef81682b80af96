package jobvm

// AdminExecutable is the admin tool's executable (cmd/admin), installed
// next to the stage executables.
const AdminExecutable = "libvirt-executor"

// ExplainCommand is the admin tool's hidden command that prints
// lifecycle.Manager.Explain's sentence for a machine of this installation,
// or nothing: `libvirt-executor --config=PATH explain-machine -- NAME`. The
// run stage, built without libvirt, asks it when a guest stops answering.
const ExplainCommand = "explain-machine"
