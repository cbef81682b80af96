package gitlab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachelayout"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/config"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/detachctx"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/jobvm"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/sshexec"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// The host cache (docs/caching.md): the runner keeps a job's cache archives
// under cache_dir in the guest (no distributed cache configured). Before the
// runner's restore_cache sub-stage extracts them, the project's archives go
// from the host into the guest's cache_dir; after archive_cache (or
// archive_cache_on_failure) made them, the guest's cache_dir comes back to
// the host. Both over a connection of their own to the job's machine; the
// stream the guest sends is checked and bounded by hostcache.Store. A cache
// that cannot be restored or kept never fails the job: the job log says why.

// guestCacheDir is cache_dir in the guest (the config stage says so).
const guestCacheDir = "/cache"

// The guest's side of the copies: fixed commands, nothing of the job in
// them. tar in the guest: busybox, GNU and BSD tar all take these.
const (
	restoreCommand = "mkdir -p " + guestCacheDir + " && tar -xf - -C " + guestCacheDir
	saveCommand    = "mkdir -p " + guestCacheDir + " && cd " + guestCacheDir + " && tar -cf - ."
	// What the disk commands say on their last line.
	diskOK         = "lve-cache-restored"
	diskWritten    = cachelayout.Written // and the guest tar's exit status
	diskMissing    = "lve-cache-no-disk"
	diskUnreadable = "lve-cache-disk-unreadable"
	diskUnwritable = "lve-cache-disk-unwritable"
	diskNotAsked   = cachelayout.NotAsked  // the armed save's stdin ended without go
	diskNotDirect  = cachelayout.NotDirect // the guest agent's save could not write the direct layout
	diskGo         = cachelayout.Go        // the armed save's signal on its stdin
)

// directFirst is where the direct layout's first file starts: after the
// manifest's room.
var directFirst = strconv.Itoa(hostcache.DirectManifestMax)

// findDisk is the start of the disk commands: it waits up to 10 s for the
// disk with serial to appear, and sets d to its device (or says
// diskMissing and ends). The serials are read by the shell itself (no
// process per disk: each costs a TCG guest tens of milliseconds).
func findDisk(serial string) string {
	return `d=; i=0
while [ $i -lt 100 ]; do
  for s in /sys/block/*/serial; do
    v=; read -r v 2>/dev/null < "$s"
    if [ "$v" = ` + serial + ` ]; then d=${s%/serial}; d=/dev/${d##*/}; fi
  done
  if [ -n "$d" ] && [ -b "$d" ]; then break; fi
  d=; i=$((i+1)); sleep 0.1
done
if [ -z "$d" ]; then echo ` + diskMissing + `; exit 0; fi
`
}

// The guest's side of the disk copies: fixed commands, nothing of the job
// in them. The disks are read and written as the job's user, or through
// sudo where only root may; the files are written as the job's user.
var (
	// diskRestoreCommand extracts the cache from the restore disk (serial
	// vm.DataDiskSerial) and says diskOK, or why the disk could not be
	// used, which sends the cache over SSH instead.
	diskRestoreCommand = findDisk(vm.DataDiskSerial) + `if [ -r "$d" ]; then
  mkdir -p ` + guestCacheDir + ` && tar -xf "$d" -C ` + guestCacheDir + ` && echo ` + diskOK + `
elif sudo -n true 2>/dev/null; then
  mkdir -p ` + guestCacheDir + ` && sudo -n cat "$d" | tar -xf - -C ` + guestCacheDir + ` && echo ` + diskOK + `
else
  echo ` + diskUnreadable + `
fi`
	// diskSaveCommand writes cache_dir on the scratch disk (serial
	// vm.ScratchDiskSerial): through the guest agent where the tools disk
	// carries it (agentSave), else see diskSaveBody.
	diskSaveCommand = findDisk(vm.ScratchDiskSerial) + agentSave("") + diskSaveBody
	// diskSaveShell is diskSaveCommand without the agent: after the
	// agent said diskNotDirect.
	diskSaveShell = findDisk(vm.ScratchDiskSerial) + diskSaveBody
	// diskSaveArmed is diskSaveCommand started while the runner's script
	// still makes the archive (earlyScratch): it finds the disk, sees
	// whether it needs sudo and starts the agent's save, or defines its
	// functions, then waits for a line "go" on its stdin before it touches
	// cache_dir; at the end of its stdin without it, it says diskNotAsked
	// and ends.
	diskSaveArmed = findDisk(vm.ScratchDiskSerial) + agentSave("--armed ") + diskSavePrep + `IFS= read -r g || g=
if [ "$g" != ` + diskGo + ` ]; then echo ` + diskNotAsked + `; exit 0; fi
` + diskSaveAct
)

// guestAgent is the guest agent's path on the tools disk (a variable: the
// tests point it at a built one).
var guestAgent = guestinit.GuestAgentPath

// agentSave is the disk save commands' part that hands the save to the
// guest agent (agent.CacheSave: one process writes the direct layout,
// where the shell's way starts five, each tens of milliseconds in a TCG
// guest), through one sudo where the job's user cannot write the disk.
// Where the tools disk does not carry the agent (guest_tools.agent =
// "none", an image that does not mount the disk), or the agent does not
// know cache-save (exit status 2: guest_tools.agent naming an older one)
// or sudo refuses it, the shell's way follows. An agent that cannot write
// the layout says diskNotDirect: the host runs diskSaveShell then.
func agentSave(flags string) string {
	run := `"$A" cache-save ` + flags + `"$d" ` + guestCacheDir + ` && exit 0`
	return `A='` + guestAgent + `'
if [ -x "$A" ]; then
  if [ -w "$d" ]; then ` + run + `
  elif sudo -n true 2>/dev/null; then sudo -n ` + run + `
  fi
fi
`
}

// diskSaveBody writes the files of cache_dir on the disk $d in hostcache's
// direct layout: each file copied by one dd with O_DIRECT (the guest's
// page cache is not in the way: 100 MiB take 0.25 s in a TCG guest against
// 2 s for tar; conv=sync pads its last partial MiB, which the next file,
// written after it, or the disk's spare MiB takes), and the manifest last.
// Names and sizes come from one find and one stat for all files, the
// manifest is built by the shell: each process costs a TCG guest tens of
// milliseconds, and a save with one archive as root starts five (find,
// stat, dd, stat, sync; where the job's user cannot write the disk, also
// the sudo check, sudo and its sh).
// Where that cannot be done (more than 100 files, a name with a newline
// (one made to read as two lines of existing files is left out instead),
// a stat without -c, a dd without oflag=direct or seek_bytes, a file whose
// size changes meanwhile, no room left on the disk) it writes a tar
// stream instead. The writes and the flush of that disk alone (`sync
// FILE`, an fsync of the device, in coreutils 8.24+ and busybox with its
// fancy sync; elsewhere a global sync) are diskWriter, run through one
// `sudo -n` where the job's user cannot write the disk (each sudo costs a
// TCG guest a third of a second or more), else in a function of this
// shell. It says diskWritten with the write's exit status and how (direct
// or tar), or why the disk could not be used. Nothing is left in the
// guest's filesystem. The manifest stays below DirectManifestMax bytes:
// at most 100 lines, each a path stat can open (PATH_MAX, 4096 bytes) and
// two numbers.
var diskSaveBody = diskSavePrep + diskSaveAct

// diskSavePrep is diskSaveBody's part that does not look at cache_dir.
var diskSavePrep = `if [ -w "$d" ]; then W=
elif sudo -n true 2>/dev/null; then W="sudo -n"
else echo ` + diskUnwritable + `; exit 0
fi
# shellcheck disable=SC2016 # the writer's own shell expands it
w='` + diskWriter + `'
eval "writer() {
$w
}"
# write runs the writer with the manifest or tar stream on its stdin.
write() { if [ -n "$W" ]; then sudo -n sh -c "$w" sh "$@"; else (writer "$@"); fi; }
# direct sets M to the manifest of the direct layout, or fails.
direct() {
  c=; read -r c < "/sys/block/${d##*/}/size" || return 1
  case $c in '' | *[!0-9]*) return 1 ;; esac
  L=$(find . -type f -exec stat -c '%s %n' {} +) || return 1
  M='` + hostcache.DirectMagic + `
'
  o=` + directFirst + `; e=$o; n=0; r=0
  set -f; oi=$IFS; IFS='
'
  for x in $L; do
    s=${x%% *}; f=${x#* }
    case $s in '' | *[!0-9]*) r=1; break ;; esac
    n=$((n + 1)); [ $n -le ` + strconv.Itoa(cachelayout.MaxDirectFiles) + ` ] || { r=1; break; }
    M="$M$o $s $f
"
    t=$((o + (s + 1048575) / 1048576 * 1048576)); [ $t -le $e ] || e=$t
    o=$((o + (s + 4095) / 4096 * 4096))
  done
  IFS=$oi; set +f
  [ $r = 0 ] || return 1
  M="${M}` + hostcache.DirectEnd + `
"
  [ "$e" -le $((c * 512)) ] && [ ${#M} -le ` + directFirst + ` ]
}
`

// diskSaveAct is diskSaveBody's part that writes cache_dir on the disk.
var diskSaveAct = `cd ` + guestCacheDir + ` 2>/dev/null || { mkdir -p ` + guestCacheDir + ` && cd ` + guestCacheDir + `; } || exit 1
if direct && printf '%s' "$M" | write "$d" direct; then st=0; how=direct
elif [ -z "$W" ]; then tar -cf "$d" .; st=$?; how=tar; sync "$d" 2>/dev/null || sync
else tar -cf - . | write "$d"; st=$?; how=tar
fi
echo ` + diskWritten + ` $st $how`

// diskWriter writes on the disk $1: with $2 = direct, the files of the
// manifest on its stdin, each at its offset, then the manifest at the
// start; else the tar stream on its stdin. It then flushes the disk. It
// fails (and the guest writes a tar stream instead) when a file's size is
// not the manifest's any more, or the manifest does not reach its end: a
// manifest on the disk always describes bytes that were written. No single
// quote in it: diskSaveBody quotes it so.
const diskWriter = `d=$1
if [ "$2" = direct ]; then
  IFS= read -r x || exit 1
  M="$x
"; S=; set --
  while IFS= read -r x && [ "$x" != ` + hostcache.DirectEnd + ` ]; do
    M="$M$x
"
    o=${x%% *}; x=${x#* }; s=${x%% *}; f=${x#* }
    if [ "$s" -gt 0 ]; then
      dd if="$f" of="$d" bs=1M count=$(((s + 1048575) / 1048576)) seek="$o" oflag=seek_bytes,direct conv=notrunc,sync 2>/dev/null || exit 1
    fi
    set -- "$@" "$f"; S="$S${S:+
}$s"
  done
  [ "$x" = ` + hostcache.DirectEnd + ` ] || exit 1
  if [ $# -gt 0 ]; then
    n=$(stat -c %s "$@" 2>/dev/null) || exit 1
    [ "$n" = "$S" ] || exit 1
  fi
  printf "%s` + hostcache.DirectEnd + `\n" "$M" 1<> "$d" || exit 1
else
  dd of="$d" bs=1M 2>/dev/null || exit 1
fi
sync "$d" 2>/dev/null || sync`

// cacheTimeout bounds one copy (restore or save) of a project's cache.
const cacheTimeout = 10 * time.Minute

// cacheOp is what a run stage does for the host cache: nothing, restore
// before the stage's script, or save after it.
type cacheOp int

const (
	cacheNone cacheOp = iota
	cacheRestore
	cacheSave
)

// cacheOpOf is the host cache's part in stage with script: only the
// runner's cache sub-stages, and only when their script calls the runner's
// cache helper (a job without cache:, or with policy pull for a save, has
// none): such jobs pay nothing.
func cacheOpOf(stage string, script []byte) cacheOp {
	switch {
	case stage == "restore_cache" && bytes.Contains(script, []byte("cache-extractor")):
		return cacheRestore
	case (stage == "archive_cache" || stage == "archive_cache_on_failure") && bytes.Contains(script, []byte("cache-archiver")):
		return cacheSave
	}
	return cacheNone
}

// hostCache is the store of j's project, or nil (with the reason for the
// job log, "" when the host cache is simply off for the image). The
// project's cache is that of its protected refs or of its other refs, as
// the job's: a job of an unprotected branch never sees nor replaces what
// a protected one extracts.
func hostCache(j *job, img *config.Image) (*hostcache.Store, string, string) {
	c := j.cfg.Cache
	if !c.For(img) {
		return nil, "", ""
	}
	if !j.job.FromPayload || j.job.ProjectID <= 0 || j.job.ServerURL == "" {
		return nil, "", "Host cache: not used: the job's project is not known from the runner's payload (JOB_RESPONSE_FILE)"
	}
	project, err := hostcache.ProjectID(j.job.ServerURL, j.job.ProjectID, j.job.Protected)
	if err != nil {
		return nil, "", "Host cache: not used: " + err.Error()
	}
	return hostcache.ForConfig(c), project, ""
}

// runCache does op for the job's machine name on image img, saying in the
// job log what happened and how long it took.
// script is the stage's script (the runner's).
func runCache(ctx context.Context, e Env, j *job, name string, img *config.Image, op cacheOp, script []byte, early *earlyScratch) {
	store, project, why := hostCache(j, img)
	if store == nil {
		if why != "" {
			e.say("%s", why)
		}
		return
	}
	named := namedArchives(script)
	if len(named) == 0 {
		// Nothing named, nothing copied: never the project's whole cache.
		if op == cacheRestore {
			e.Report.Cache("restore", cacheResult(false, nil), 0, 0)
			e.say("Host cache: nothing restored: the runner's restore_cache script names no cache archive under %s", guestCacheDir)
		} else {
			e.say("Host cache: nothing kept: the runner's archive_cache script names no cache archive under %s", guestCacheDir)
		}
		return
	}
	ctx, cancel := context.WithTimeout(ctx, cacheTimeout)
	defer cancel()
	t0 := time.Now()
	client := early.connection()
	var err error
	if client == nil {
		_, client, err = j.vm.Session().Take(ctx)
	}
	if err != nil {
		e.say("Host cache: no connection to the VM for the cache: %v", err)
		return
	}
	defer client.Close()
	switch op {
	case cacheRestore:
		restoreCache(ctx, e, j, name, img, store, project, client, named, t0)
	case cacheSave:
		saveCache(ctx, e, j, name, img, store, project, client, named, t0, early)
	}
}

// earlyScratch is a scratch disk attached while the archive_cache stage's
// script (the runner making its archive) runs, so that the hot plug and
// the guest's finding the disk are done when the archive is: the copy
// after the script is then only the guest writing the disk and the host
// reading it.
//
// The save's SSH connection is made then too: its handshake costs a TCG
// guest 0.3 s (tiny) to 1.3 s (Debian), which the guest's other vCPU and
// the host's other core do while the runner zips.
type earlyScratch struct {
	done   chan struct{}
	cancel context.CancelFunc // stops an attach not needed any more
	err    error
	took   time.Duration

	connected   chan struct{}
	stopConnect context.CancelFunc
	client      *sshexec.Client // nil once taken; else closed by drop
	armed       *armedSave      // set before connected is closed; nil if none

	dropped bool // the save's Keep deleted the disk's volume
}

// armedSave is the save's guest command (diskSaveArmed), started on the
// early connection once the disk is attached, waiting for go: the SSH
// session, the guest's shell, its finding the disk and its sudo check
// (a third of a second for Debian) are paid while the runner zips.
type armedSave struct {
	stdin *io.PipeWriter
	out   *headBuffer
	done  chan struct{} // closed when the command has ended; err says how
	err   error
}

// arm starts diskSaveArmed on client; it ends with ctx at the latest.
func arm(ctx context.Context, client *sshexec.Client) *armedSave {
	pr, pw := io.Pipe()
	a := &armedSave{stdin: pw, out: &headBuffer{limit: 4096}, done: make(chan struct{})}
	go func() {
		defer close(a.done)
		a.err = client.Stream(ctx, diskSaveArmed, pr, a.out)
		_ = pr.CloseWithError(errors.New("the save's guest command ended"))
	}()
	return a
}

// fire tells the armed command to write the disk, and reports whether it
// will: false when it ended before (its connection lost, the guest's
// shell killed by the job, or it did not see the disk within its 10 s,
// which ran while the runner zipped), when the guest did not take the
// go before ctx ended (a guest that never answered the session's
// start): the caller starts diskSaveCommand itself. An armed command
// that ended on its own with another answer (not writable) is used as it
// is.
func (a *armedSave) fire(ctx context.Context) bool {
	select {
	case <-a.done:
		last := lastLine(a.out.String())
		return a.err == nil && last != "" && last != diskMissing
	default:
	}
	sent := make(chan error, 1)
	go func() { // the pipe's reader is the session's, once it started
		_, err := io.WriteString(a.stdin, diskGo+"\n")
		sent <- err
	}()
	var err error
	select {
	case err = <-sent:
	case <-ctx.Done():
		err = context.Cause(ctx)
	}
	_ = a.stdin.Close()
	return err == nil
}

// predictWait bounds startScratch's look at what the host keeps (a shared
// lock on the project, which a save being installed holds for a moment):
// the runner's script does not wait for it longer.
const predictWait = 2 * time.Second

// startScratch attaches the scratch disk for a save in the background,
// when the save will go through a disk: the image's cache_via = "disk", the
// script names an archive, and the cache it names (or, for a key not
// cached yet, the project's whole cache) is at least cache.disk_min_mib,
// or that is 0. Else nil.
func startScratch(ctx context.Context, e Env, j *job, name string, img *config.Image, script []byte) *earlyScratch {
	store, project, _ := hostCache(j, img)
	named := namedArchives(script)
	if store == nil || img.CacheVia != config.CacheViaDisk || len(named) == 0 {
		return nil
	}
	if min := j.cfg.Cache.DiskMin(); min > 0 {
		pctx, cancel := context.WithTimeout(ctx, predictWait)
		want, size, all, err := wantedFiles(pctx, store, project, named)
		cancel()
		if len(want) == 0 {
			size = all
		}
		if err != nil || size < min {
			return nil
		}
	}
	actx, cancel := context.WithCancel(ctx)
	es := &earlyScratch{done: make(chan struct{}), cancel: cancel}
	disk := e.cacheDisk(j)
	go func() {
		defer close(es.done)
		t0 := time.Now()
		es.err = disk.AttachScratch(actx, name)
		es.took = time.Since(t0)
	}()
	cctx, stop := context.WithCancel(ctx)
	es.connected, es.stopConnect = make(chan struct{}), stop
	go func() {
		defer close(es.connected)
		if j.vm == nil { // the caller dials itself when there is none
			return
		}
		if _, es.client, _ = j.vm.Session().Take(cctx); es.client == nil {
			return
		}
		select {
		case <-es.done:
			if es.err == nil {
				es.armed = arm(cctx, es.client)
			}
		case <-cctx.Done():
		}
	}()
	return es
}

// armedCommand is the save's guest command started during the script, or
// nil (none, or no early disk).
func (es *earlyScratch) armedCommand() *armedSave {
	if es == nil {
		return nil
	}
	<-es.connected
	return es.armed
}

// wait is the attach's result, once it has ended.
func (es *earlyScratch) wait() error {
	<-es.done
	es.cancel()
	return es.err
}

// connection hands over the connection made during the script, once its
// dial has ended; the caller closes it. nil when there is none (no early
// disk, the dial failed, or the connection's keepalive gave up while the
// script ran): the caller dials itself, and says why if that fails too.
func (es *earlyScratch) connection() *sshexec.Client {
	if es == nil {
		return nil
	}
	<-es.connected
	c := es.client
	es.client = nil
	if c != nil && c.Dead() != nil {
		es.armed = nil // its session went with the connection
		_ = c.Close()
		return nil
	}
	return c
}

// drop stops the early disk's attach if it still runs and deletes its
// volume: at the end of the stage, whether the save used the disk, went
// over SSH or was not made (the script failed). Also after a failed or
// stopped attach: one stopped midway (the admin tool is killed) may have
// left its volume; deleting none is success. Not again after the save's
// Keep deleted it.
func (es *earlyScratch) drop(ctx context.Context, e Env, j *job, name string) {
	if es == nil {
		return
	}
	es.cancel()
	es.stopConnect()
	<-es.done
	<-es.connected
	if es.armed != nil {
		_ = es.armed.stdin.Close() // not asked: the guest's command ends
	}
	if es.client != nil {
		_ = es.client.Close()
	}
	if !es.dropped {
		dropDisks(ctx, j, e.cacheDisk(j), name)
	}
}

// saveCache keeps the archives named in keep (those the runner's
// archive_cache script names) of the guest's cache_dir in the project's
// cache: written by the guest on a scratch disk (the image's cache_via =
// "disk"), else, or when the guest cannot use the disk, over the client's
// connection. Any other file in cache_dir is left out. The job log says
// what was kept, left out and evicted, and how long it took.
func saveCache(ctx context.Context, e Env, j *job, name string, img *config.Image, store *hostcache.Store, project string, client *sshexec.Client, keep []string, t0 time.Time, early *earlyScratch) {
	var res hostcache.SaveResult
	var serr, gerr error
	how, done := "", false
	if img.CacheVia == config.CacheViaDisk {
		var steps string
		res, done, steps, gerr, serr = saveByDisk(ctx, e, j, name, project, keep, client, early)
		how = " from a scratch disk (" + steps + ")"
	}
	if !done && serr == nil {
		how = " over SSH"
		res, gerr, serr = saveBySSH(ctx, store, project, keep, client)
	}
	e.Report.Cache("save", cacheResult(true, serr), res.Bytes, res.Evicted.Bytes)
	took := vm.Round(time.Since(t0))
	switch {
	case errors.Is(serr, hostcache.ErrProjectLimit):
		e.say("Host cache: not kept (%s): %v. The project's earlier cache stays; raise cache.project_limit_mib or cache less", took, serr)
		return
	case serr != nil:
		e.say("Host cache: not kept (%s): %v", took, serr)
		return
	}
	e.say("Host cache: kept %d file(s), %s (%d unchanged)%s in %s", res.Files, mib(res.Bytes), res.Unchanged, how, took)
	if gerr != nil {
		e.say("Host cache: (the guest's tar ended with: %v)", gerr)
	}
	if res.SkipCount > 0 {
		e.say("Host cache: left out %d entr(ies) that are not archives the runner's script names, not plain files, or have names not allowed (first: %s)", res.SkipCount, strings.Join(res.Skipped, "; "))
	}
	if res.Evicted.Files > 0 {
		e.say("Host cache: made room: %d older file(s), %s, removed", res.Evicted.Files, mib(res.Evicted.Bytes))
	}
}

// saveBySSH reads the guest's tar stream of its cache_dir over the
// client's connection into the store, keeping the files named in keep.
// gerr is how the guest's side ended.
func saveBySSH(ctx context.Context, store *hostcache.Store, project string, keep []string, client *sshexec.Client) (res hostcache.SaveResult, gerr, serr error) {
	pr, pw := io.Pipe()
	done := make(chan struct{})
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		defer close(done)
		res, serr = store.Save(sctx, project, pr, hostcache.Only(keep))
		// The guest's tar is not waited for once the host has what it
		// keeps, or refused it: what it still sends is dropped.
		_ = pr.CloseWithError(errors.New("the host stopped reading the guest's cache"))
		if serr != nil {
			stop()
		}
	}()
	gerr = client.Stream(sctx, saveCommand, bytes.NewReader(nil), pw)
	_ = pw.CloseWithError(gerr)
	<-done
	return res, gerr, serr
}

// saveByDisk has the guest write its cache_dir as a tar stream on an empty
// disk hot-plugged into its VM, and keeps the files named in keep of what
// is on the disk (checked as any guest's stream is). done is false (with nil errors) when the guest
// could not use the disk: the job log says why, and the caller copies over
// SSH instead. The disk's volume is deleted once read. steps says how
// long the disk took to make, the guest to write it and the host to keep
// it.
func saveByDisk(ctx context.Context, e Env, j *job, name, project string, keep []string, client *sshexec.Client, early *earlyScratch) (res hostcache.SaveResult, done bool, steps string, gerr, serr error) {
	// A disk attached during the script is used whatever the size: its
	// hot plug is paid, and writing a small cache on it costs less than
	// asking the guest how small it is.
	if early == nil && smallSave(ctx, j, client) {
		return res, false, "", nil, nil
	}
	disk := e.cacheDisk(j)
	t0 := time.Now()
	var err error
	made := "made in "
	if early != nil {
		err = early.wait()
		made = fmt.Sprintf("made during the script in %s, waited for ", vm.Round(early.took))
	} else {
		err = disk.AttachScratch(ctx, name)
	}
	if err != nil {
		if ctx.Err() != nil {
			return res, false, "", nil, err
		}
		e.say("Host cache: no scratch disk (%v); copying over SSH instead", err)
		return res, false, "", nil, nil
	}
	// The volumes are deleted by Keep; where that was not reached or
	// failed, here (or by earlyScratch.drop, when the stage ends).
	dropped := false
	if early == nil {
		defer func() {
			if !dropped {
				dropDisks(ctx, j, disk, name)
			}
		}()
	}
	attached := time.Since(t0)
	t1 := time.Now()
	way := "" // the direct layout, or said
	last, err := guestWrite(ctx, client, early.armedCommand())
	if err != nil {
		return res, false, "", nil, fmt.Errorf("writing the cache to the scratch disk: %w", err)
	}
	switch {
	case strings.HasPrefix(last, diskWritten+" "):
		status, how, _ := strings.Cut(strings.TrimPrefix(last, diskWritten+" "), " ")
		if status != "0" {
			gerr = fmt.Errorf("exit status %.8s", status)
		}
		switch how {
		case "tar":
			way = "as a tar stream, "
		case "direct agent":
			way = "agent " // "written by the guest agent in"
		}
	case last == diskMissing:
		e.say("Host cache: the guest did not see the scratch disk within 10 s (does its kernel do PCI hot plug? cache_via = \"ssh\" avoids the wait); copying over SSH instead")
		return res, false, "", nil, nil
	case last == diskUnwritable:
		e.say("Host cache: the guest's user cannot write the scratch disk (not root, no passwordless sudo; cache_via = \"ssh\" avoids the attempt); copying over SSH instead")
		return res, false, "", nil, nil
	default:
		return res, false, "", nil, errors.New("writing the cache to the scratch disk: the guest's tar did not finish")
	}
	written := time.Since(t1)
	t2 := time.Now()
	k := disk.Keep(ctx, name, project, keep)
	res, serr = k.Result, k.Err
	if dropped = k.DropErr == nil; dropped && early != nil {
		early.dropped = true
	}
	read := "read"
	if k.FromFile {
		read = "read from the volume's file"
	}
	return res, true, fmt.Sprintf("%s%s, written by the guest %sin %s, %s and deleted in %s", made, vm.Round(attached), way, vm.Round(written), read, vm.Round(time.Since(t2))), gerr, serr
}

// guestWrite has the guest write its cache_dir on the scratch disk: by the
// armed command a where it takes the go, else by a command of its own
// (diskSaveCommand); after the agent's diskNotDirect, the shell's way
// (diskSaveShell). last is the guest's last line.
func guestWrite(ctx context.Context, client *sshexec.Client, a *armedSave) (last string, err error) {
	out := &headBuffer{limit: 4096}
	fired := a != nil && a.fire(ctx)
	if fired {
		select {
		case <-a.done:
		case <-ctx.Done():
			return "", context.Cause(ctx)
		}
		if a.err != nil {
			return "", a.err
		}
		out = a.out
	} else if err := client.Stream(ctx, diskSaveCommand, bytes.NewReader(nil), out); err != nil {
		return "", err
	}
	last = lastLine(out.String())
	if last != diskNotDirect && (!fired || last != diskNotAsked) {
		return last, nil
	}
	// The agent's layout cannot carry this cache (the shell's way writes a
	// tar stream), or the armed agent took the go and died (its shell
	// found its stdin ended: not asked).
	out = &headBuffer{limit: 4096}
	if err := client.Stream(ctx, diskSaveShell, bytes.NewReader(nil), out); err != nil {
		return "", err
	}
	return lastLine(out.String()), nil
}

// duCommand says how many KiB the guest's cache_dir holds.
const duCommand = "du -sk " + guestCacheDir + " 2>/dev/null"

// smallSave reports whether the guest says its cache_dir holds less than
// cache.disk_min_mib: cheaper over SSH than on a disk. A guest that does
// not say (or lies) only chooses the way its cache comes; both check what
// comes the same.
func smallSave(ctx context.Context, j *job, client *sshexec.Client) bool {
	min := j.cfg.Cache.DiskMin()
	if min == 0 {
		return false
	}
	out := &headBuffer{limit: 256}
	if err := client.Stream(ctx, duCommand, bytes.NewReader(nil), out); err != nil {
		return false
	}
	f := strings.Fields(out.String())
	if len(f) == 0 {
		return false
	}
	kib, err := strconv.ParseInt(f[0], 10, 64)
	return err == nil && kib >= 0 && kib<<10 < min
}

// dropDisks deletes the volumes of the machine's hot-plugged disks, on a
// deadline of its own.
func dropDisks(ctx context.Context, j *job, disk CacheDisk, name string) {
	dctx, cancel := detachctx.WithTimeout(ctx, dropWait)
	defer cancel()
	if err := disk.Drop(dctx, name); err != nil {
		j.log.Warn("a host cache disk's volume was not deleted; the VM's teardown deletes it", "vm", name, "err", err)
	}
}

// restoreCache copies the project's archives that the runner's
// restore_cache script names (named) into the guest's cache_dir: on a
// restore disk (the image's cache_via = "disk"), else, or when the guest
// cannot have the disk, over the client's connection. Nothing else of the
// project's cache reaches the guest.
func restoreCache(ctx context.Context, e Env, j *job, name string, img *config.Image, store *hostcache.Store, project string, client *sshexec.Client, named []string, t0 time.Time) {
	want, size, all, err := wantedFiles(ctx, store, project, named)
	var res hostcache.RestoreResult
	how, done := "", false
	if err == nil && len(want) == 0 {
		e.Report.Cache("restore", cacheResult(false, nil), 0, 0)
		if all == 0 {
			e.say("Host cache: nothing cached for this project yet (%s)", vm.Round(time.Since(t0)))
		} else {
			e.say("Host cache: nothing cached yet for the archive(s) the runner's script names (%s)", vm.Round(time.Since(t0)))
		}
		return
	}
	// Below cache.disk_min_mib the hot plug costs more than SSH's copy.
	if err == nil && img.CacheVia == config.CacheViaDisk && size >= j.cfg.Cache.DiskMin() {
		var steps string
		res, done, steps, err = restoreByDisk(ctx, e, j, name, project, want, client)
		how = "from a restore disk (" + steps + ")"
	}
	if !done && err == nil {
		how = "over SSH"
		res, err = restoreBySSH(ctx, store, project, want, client)
	}
	e.Report.Cache("restore", cacheResult(res.Files > 0, err), res.Bytes, 0)
	switch {
	case err != nil:
		e.say("Host cache: restore failed after %s, the job goes on without it: %v", vm.Round(time.Since(t0)), err)
	case res.Files == 0:
		e.say("Host cache: nothing cached for this project yet (%s)", vm.Round(time.Since(t0)))
	default:
		e.say("Host cache: restored %d file(s), %s, into %s %s in %s", res.Files, mib(res.Bytes), guestCacheDir, how, vm.Round(time.Since(t0)))
	}
}

// wantedFiles are the project's cached files among named (the archives
// the runner's script names: namedArchives), and their bytes (size), and
// the bytes of all the project's cached files (all).
func wantedFiles(ctx context.Context, store *hostcache.Store, project string, named []string) (want []string, size, all int64, err error) {
	sn, err := store.Open(ctx, project)
	if err != nil {
		return nil, 0, 0, err
	}
	defer func() { _ = sn.Close() }()
	for _, n := range sn.Names() {
		if slices.Contains(named, n) {
			want = append(want, n)
		}
	}
	return want, sn.Bytes(hostcache.Only(want)), sn.Bytes(nil), nil
}

// archiveFile is the file the runner keeps a cache key's archive in
// (cache_dir/<project path>/<key>/cache.zip).
const archiveFile = "cache.zip"

// maxNamed bounds the archives taken from one script (the runner names
// one per cache: entry and fallback key).
const maxNamed = 64

// namedArchives are the cache archives the runner's script names, as
// paths relative to cache_dir: its cache-extractor's and cache-archiver's
// --file, a path through cache_dir (../../cache/<project>/<key>/cache.zip
// from the build directory, or absolute), however the runner quotes it.
// The script is searched, never run or parsed as a shell: each
// "/cache/" followed by a name up to a quote, a backslash, a blank or a
// shell operator, ending in "/cache.zip". A name quoted in a way this does
// not see is not copied: a cache miss, never someone else's archive.
func namedArchives(script []byte) []string {
	marker := []byte(guestCacheDir + "/")
	var out []string
	for rest := script; len(out) < maxNamed; {
		i := bytes.Index(rest, marker)
		if i < 0 {
			break
		}
		rest = rest[i+len(marker):]
		end := bytes.IndexAny(rest, "'\"\\ \t\r\n;&|()<>`$")
		if end < 0 {
			end = len(rest)
		}
		name := string(rest[:end])
		rest = rest[end:]
		if len(name) > len(archiveFile) && strings.HasSuffix(name, "/"+archiveFile) && len(name) <= 4096 && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}

// restoreBySSH streams the project's cache (the files in want; none:
// nothing) into the guest's tar.
func restoreBySSH(ctx context.Context, store *hostcache.Store, project string, want []string, client *sshexec.Client) (hostcache.RestoreResult, error) {
	sn, err := store.OpenOnly(ctx, project, hostcache.Only(want))
	if err != nil {
		return hostcache.RestoreResult{}, err
	}
	defer func() { _ = sn.Close() }()
	if sn.Files().Files == 0 {
		return sn.Files(), nil
	}
	pr, pw := io.Pipe()
	var serr error
	written := make(chan struct{})
	go func() {
		defer close(written)
		_, serr = sn.WriteTo(pw)
		_ = pw.CloseWithError(serr)
	}()
	gerr := client.Stream(ctx, restoreCommand, pr, io.Discard)
	_ = pr.CloseWithError(errors.New("the guest's tar ended"))
	<-written
	return sn.Files(), errors.Join(serr, gerr)
}

// CacheDisk moves a project's host cache to and from a job's machine on
// hot-plugged disks (jobvm.Jobs.AttachCache, AttachScratch, KeepCache,
// DropDisks).
type CacheDisk interface {
	// Attach attaches the cache of project (the files in want; none:
	// nothing) to machine name on a read-only disk; nothing is attached
	// when nothing is cached (Files 0).
	Attach(ctx context.Context, name, project string, want []string) (hostcache.RestoreResult, error)
	// AttachScratch attaches an empty disk for the guest to write its
	// cache on.
	AttachScratch(ctx context.Context, name string) error
	// Keep saves the files named in keep of what the guest wrote on the
	// scratch disk into the project's cache (hostcache.Store.Save), then
	// deletes the disks' volumes as Drop does (jobvm.Kept says how each
	// went).
	Keep(ctx context.Context, name, project string, keep []string) jobvm.Kept
	// Drop deletes the disks' volumes of machine name.
	Drop(ctx context.Context, name string) error
}

// cacheDisk is e's CacheDisk, or one in the stage's own process.
func (e Env) cacheDisk(j *job) CacheDisk {
	if e.CacheDisk != nil {
		return e.CacheDisk
	}
	return localCacheDisk{h: j.jobs, store: hostcache.ForConfig(j.cfg.Cache)}
}

// localCacheDisk is CacheDisk in the stage's own process.
type localCacheDisk struct {
	h     *jobvm.Jobs
	store *hostcache.Store
}

func (l localCacheDisk) Attach(ctx context.Context, name, project string, want []string) (hostcache.RestoreResult, error) {
	return l.h.AttachCache(ctx, l.store, name, project, want)
}

func (l localCacheDisk) AttachScratch(ctx context.Context, name string) error {
	return l.h.AttachScratch(ctx, name, jobvm.ScratchCapacity(l.store.ProjectLimit))
}

func (l localCacheDisk) Keep(ctx context.Context, name, project string, keep []string) jobvm.Kept {
	return l.h.KeepCache(ctx, l.store, name, project, keep)
}

func (l localCacheDisk) Drop(ctx context.Context, name string) error { return l.h.DropDisks(ctx, name) }

// dropWait bounds deleting the restore disk's volume.
const dropWait = 30 * time.Second

// restoreByDisk hands the project's cache to the guest on a read-only disk
// hot-plugged into its VM, and has the guest extract it. done is false
// (with a nil error) when the guest could not have the disk: the job log
// says why, and the caller copies over SSH instead. The disk's volume is
// deleted once the guest is done with it.
//
// steps says how long the disk took to make and the guest to read it.
func restoreByDisk(ctx context.Context, e Env, j *job, name, project string, want []string, client *sshexec.Client) (res hostcache.RestoreResult, done bool, steps string, err error) {
	disk := e.cacheDisk(j)
	t0 := time.Now()
	res, err = disk.Attach(ctx, name, project, want)
	switch {
	case err != nil && ctx.Err() == nil:
		e.say("Host cache: no restore disk (%v); copying over SSH instead", err)
		return res, false, "", nil
	case err != nil:
		return res, false, "", err
	case res.Files == 0:
		return res, true, "", nil
	}
	attached := time.Since(t0)
	t1 := time.Now()
	defer dropDisks(ctx, j, disk, name)
	out := &headBuffer{limit: 4096}
	if err := client.Stream(ctx, diskRestoreCommand, bytes.NewReader(nil), out); err != nil {
		return res, false, "", fmt.Errorf("extracting the restore disk: %w", err)
	}
	switch last := lastLine(out.String()); last {
	case diskOK:
		return res, true, fmt.Sprintf("written and attached in %s, read by the guest in %s", vm.Round(attached), vm.Round(time.Since(t1))), nil
	case diskMissing:
		e.say("Host cache: the guest did not see the restore disk within 10 s (does its kernel do PCI hot plug? cache_via = \"ssh\" avoids the wait); copying over SSH instead")
	case diskUnreadable:
		e.say("Host cache: the guest's user cannot read the restore disk (not root, no passwordless sudo; cache_via = \"ssh\" avoids the attempt); copying over SSH instead")
	default:
		return res, false, "", errors.New("extracting the restore disk: the guest's tar did not finish")
	}
	return res, false, "", nil
}

// headBuffer keeps the first limit bytes written to it and drops the rest
// (what a guest prints is bounded).
type headBuffer struct {
	b     []byte
	limit int
}

func (h *headBuffer) Write(p []byte) (int, error) {
	if room := h.limit - len(h.b); room > 0 {
		h.b = append(h.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (h *headBuffer) String() string { return string(h.b) }

// lastLine is s's last non-empty line.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

// cacheResult is the metrics' result label.
func cacheResult(hit bool, err error) string {
	switch {
	case errors.Is(err, hostcache.ErrProjectLimit):
		return "over_limit"
	case err != nil:
		return "error"
	case !hit:
		return "miss"
	}
	return "ok"
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
