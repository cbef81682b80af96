// Package cachexfer owns the host cache's way into and out of a job's
// machine (docs/caching.md): copying a project's cached archives from the
// host's store (internal/hostcache) into the guest's cache_dir before the
// runner extracts them, and the guest's cache_dir back into the store
// after the runner made them. Both go over a connection to the machine
// (a tar stream), or on hot-plugged disks (a restore disk the guest
// extracts, a scratch disk the guest writes in cachelayout's direct layout
// or as a tar stream), attached during the script where that pays.
//
// It owns:
//   - the guest's side of the copies, written once (guest.go): the shell a
//     guest without the agent runs; where the tools disk carries the agent,
//     the save's direct layout is the agent's cache-save (internal/agent)
//     and the shell only hands over to it;
//   - the disks' host side (Disk): in the stage's process over jobvm
//     (LocalDisk), or through the admin tool (its hidden cache-disk
//     command, internal/admin), which the run stage, built without
//     libvirt, asks with one typed AdminRequest as JSON on its stdin and
//     reads one typed AdminAnswer from its stdout (admin.go: AdminDisk,
//     ServeAdmin);
//   - what each copy did (Restored, Saved), which the front end turns into
//     its job log's lines and its metrics.
//
// It does not know a runner: which stage is a cache stage, which archives
// the runner's script names and what the job log says are the front end's
// (internal/gitlab). The stream the guest sends is checked and bounded by
// hostcache.Store. A cache that cannot be restored or kept never fails the
// job.
package cachexfer
