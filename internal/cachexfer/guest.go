package cachexfer

import (
	"strconv"

	"gitlab.com/libvirt-executor/libvirt-executor/internal/cachelayout"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/guestinit"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/hostcache"
	"gitlab.com/libvirt-executor/libvirt-executor/internal/vm"
)

// The guest's side of the host cache, the only place it is written as
// shell: what a guest without the agent (guest_tools.agent = "none", an
// image that does not mount the tools disk, an agent too old to know
// cache-save) runs. Where the agent is there, the save's direct layout is
// its cache-save (internal/agent.CacheSave); the shell below only hands
// over to it (agentSave) and is the fallback.

// GuestCacheDir is cache_dir in the guest (the config stage says so).
const GuestCacheDir = "/cache"

// The guest's side of the copies: fixed commands, nothing of the job in
// them. tar in the guest: busybox, GNU and BSD tar all take these.
const (
	restoreCommand = "mkdir -p " + GuestCacheDir + " && tar -xf - -C " + GuestCacheDir
	saveCommand    = "mkdir -p " + GuestCacheDir + " && cd " + GuestCacheDir + " && tar -cf - ."
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
  mkdir -p ` + GuestCacheDir + ` && tar -xf "$d" -C ` + GuestCacheDir + ` && echo ` + diskOK + `
elif sudo -n true 2>/dev/null; then
  mkdir -p ` + GuestCacheDir + ` && sudo -n cat "$d" | tar -xf - -C ` + GuestCacheDir + ` && echo ` + diskOK + `
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
	run := `"$A" cache-save ` + flags + `"$d" ` + GuestCacheDir + ` && exit 0`
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
var diskSaveAct = `cd ` + GuestCacheDir + ` 2>/dev/null || { mkdir -p ` + GuestCacheDir + ` && cd ` + GuestCacheDir + `; } || exit 1
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
