#!/bin/bash
# Stop the private libvirt rig started by start.sh (safe to run twice):
#   - destroys + undefines leftover domains named <prefix>-* and deletes <prefix>-* volumes
#     of the rig pool, reporting each as a LEAK (the executor should have removed them);
#     <prefix> is the name_prefix of the config start.sh wrote ($LVE_RIG_PREFIX without one),
#   - stops + undefines the rig network and pool (the pool directory stays),
#   - stops the libvirtd and virtlogd the rig started, and the polkitd and D-Bus of its
#     access driver (by pidfile PID, nothing else),
#   - deletes the network namespace if the rig created it.
# The image cache is left alone. Exit status 0 even when leaks were found (they are
# reported on stderr and counted in the last line: "leaks=N").
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
[ "$(id -u)" = 0 ] || rig_die "must run as root"

leaks=0
# The name_prefix (a top-level key) of the rig's config: the one its job VMs were named with.
prefix=$(sed -nE '/^[[:space:]]*\[/q; s/^[[:space:]]*name_prefix[[:space:]]*=[[:space:]]*"([^"]*)".*/\1/p' \
	"$LVE_RIG_CONFIG" 2>/dev/null | head -n1)
prefix=${prefix:-$LVE_RIG_PREFIX}
if ! rig_valid_prefix "$prefix"; then
	rig_log "name prefix '$prefix' (from $LVE_RIG_CONFIG or LVE_RIG_PREFIX) is not valid: sweeping lve-* instead"
	prefix=lve
fi
own_pid=$(rig_pid_is "$LVE_RIG_RUN/libvirtd.pid" libvirtd || true)
reused=
[ -e "$LVE_RIG_RUN/reused" ] && reused=1

# wait_gone PID SECONDS: poll (0.1 s) until the process is gone.
wait_gone() {
	local i
	for ((i = 0; i < $2 * 10; i++)); do
		[ -e "/proc/$1" ] || return 0
		sleep 0.1
	done
	return 1
}
# stop_pid PID NAME: TERM, wait, KILL a process this rig started (comm checked again).
stop_pid() {
	[ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 0
	kill -TERM "$1" 2>/dev/null || true
	wait_gone "$1" 15 && return 0
	rig_log "$2 (pid $1) ignores SIGTERM: SIGKILL"
	kill -KILL "$1" 2>/dev/null || true
	wait_gone "$1" 5
}

# reapers: pids of cleanup's reapers (libvirt-executor-cleanup reap-machines) still
# removing machines of this prefix.
reapers() {
	local f args a
	for f in /proc/[0-9]*/cmdline; do
		mapfile -d '' a <"$f" 2>/dev/null || continue
		args=" ${a[*]} "
		case $args in
		*" reap-machines "*" $prefix-"*) f=${f#/proc/}; echo "${f%/cmdline}" ;;
		esac
	done
}
# A job's cleanup returns before its VM is gone; its reaper finishes the removal. Let
# the reapers of this rig finish (30 s at most) before anything left counts as a leak.
for ((i = 0; i < 300; i++)); do
	[ -z "$(reapers)" ] && break
	[ "$i" = 0 ] && rig_log "waiting for cleanup's reapers to finish"
	sleep 0.1
done

if { [ -n "$own_pid" ] || [ -n "$reused" ]; } && rig_libvirt_up; then
	for dom in $(rig_virsh list --all --name | grep -- "^$prefix-" || true); do
		rig_log "LEAK: domain $dom: destroying and undefining it"
		leaks=$((leaks + 1))
		rig_virsh destroy "$dom" >/dev/null 2>&1 || true
		rig_virsh undefine "$dom" --nvram >/dev/null 2>&1 ||
			rig_virsh undefine "$dom" >/dev/null 2>&1 || rig_log "cannot undefine $dom"
	done
	while read -r dev owner; do
		[ -n "$dev" ] || continue
		rig_log "LEAK: network filter binding $dev of $owner, which does not run: deleting it"
		leaks=$((leaks + 1))
		rig_virsh nwfilter-binding-delete "$dev" >/dev/null 2>&1 || rig_log "cannot delete the binding $dev"
	done < <(rig_stale_bindings "$prefix")
	if rig_virsh pool-info "$LVE_RIG_POOL" >/dev/null 2>&1; then
		rig_virsh pool-refresh "$LVE_RIG_POOL" >/dev/null 2>&1 || true
		# The guest tools disk (<prefix>-<controller>-tools-<hash>.iso) is shared by all jobs
		# and lives as long as the rig: not a leak. It goes with its records (state_dir/tools),
		# so the next rig start (maybe of another checkout) builds its own.
		for vol in $(rig_virsh vol-list "$LVE_RIG_POOL" 2>/dev/null | awk '{print $1}'); do
			case $vol in
			"$prefix"-*-tools-*.iso)
				rig_virsh vol-delete --pool "$LVE_RIG_POOL" "$vol" >/dev/null || rig_log "cannot delete volume $vol"
				;;
			"$prefix"-*)
				rig_log "LEAK: volume $LVE_RIG_POOL/$vol: deleting it"
				leaks=$((leaks + 1))
				rig_virsh vol-delete --pool "$LVE_RIG_POOL" "$vol" >/dev/null || rig_log "cannot delete volume $vol"
				;;
			esac
		done
		rm -rf "$LVE_RIG_DIR/state/tools"
		rig_virsh pool-destroy "$LVE_RIG_POOL" >/dev/null 2>&1 || true
		rig_virsh pool-undefine "$LVE_RIG_POOL" >/dev/null 2>&1 || true
		rig_log "removed storage pool $LVE_RIG_POOL (its directory is kept)"
	fi
	if rig_virsh net-info "$LVE_RIG_NET" >/dev/null 2>&1; then
		rig_virsh net-destroy "$LVE_RIG_NET" >/dev/null 2>&1 || true
		rig_virsh net-undefine "$LVE_RIG_NET" >/dev/null 2>&1 || true
		rig_log "removed network $LVE_RIG_NET"
	fi
elif [ -n "$own_pid" ]; then
	rig_log "the rig's libvirtd (pid $own_pid) does not answer: skipping domain/network cleanup"
fi
# Machine state and locks the rig's jobs left (a failed test run): the rig's
# own state_dir, kept otherwise (controller id, caches).
for d in "$LVE_RIG_DIR/state/machines"/*/; do
	[ -d "$d" ] || continue
	rig_log "LEAK: machine state $(basename "$d"): removing it"
	leaks=$((leaks + 1))
	rm -rf "$d"
done
rm -f "$LVE_RIG_DIR/state/locks"/*.lock

if [ -n "$own_pid" ]; then
	stop_pid "$own_pid" libvirtd && rig_log "stopped libvirtd (pid $own_pid)"
fi
rm -f "$LVE_RIG_RUN/libvirtd.pid" "$LVE_RIG_RUN/reused"
if pid=$(rig_pid_is "$LVE_RIG_RUN/virtlogd.pid" virtlogd); then
	stop_pid "$pid" virtlogd && rig_log "stopped virtlogd (pid $pid)"
fi
rm -f "$LVE_RIG_RUN/virtlogd.pid"
# polkitd and the D-Bus of the access driver (LVE_RIG_ACCESS=polkit), after libvirtd.
if pid=$(rig_pid_is "$LVE_RIG_RUN/polkitd.pid" polkitd); then
	stop_pid "$pid" polkitd && rig_log "stopped polkitd (pid $pid)"
fi
if pid=$(rig_pid_is "$LVE_RIG_RUN/dbus.pid" dbus-daemon); then
	stop_pid "$pid" dbus-daemon && rig_log "stopped the rig's D-Bus (pid $pid)"
fi
rm -f "$LVE_RIG_RUN/polkitd.pid" "$LVE_RIG_RUN/dbus.pid" "$LVE_RIG_DIR/dbus/system_bus_socket"

# Children of a libvirtd that died without cleaning up (QEMU of <prefix>-* guests, the rig
# network's dnsmasq): found through libvirt's own pidfiles, checked by name.
for pf in /run/libvirt/qemu/"$prefix"-*.pid; do
	[ -e "$pf" ] || continue
	pid=$(tr -dc 0-9 <"$pf")
	if [ -n "$pid" ] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == qemu-system-* ]]; then
		rig_log "LEAK: orphaned QEMU $(basename "$pf" .pid) (pid $pid): killing it"
		leaks=$((leaks + 1))
		stop_pid "$pid" "$(cat "/proc/$pid/comm")"
	fi
done
pf=/run/libvirt/network/$LVE_RIG_NET.pid
if [ -z "$reused" ] && [ -e "$pf" ]; then
	pid=$(tr -dc 0-9 <"$pf")
	if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dnsmasq ]; then
		rig_log "stopping the orphaned dnsmasq of $LVE_RIG_NET (pid $pid)"
		stop_pid "$pid" dnsmasq
	fi
fi

if [ -e "$LVE_RIG_RUN/netns-owned" ] && rig_netns_exists; then
	left=$(ip netns pids "$LVE_RIG_NS" 2>/dev/null | tr '\n' ' ')
	[ -z "$left" ] || rig_log "processes still in namespace $LVE_RIG_NS (not started by the rig?): $left"
	ip netns del "$LVE_RIG_NS" && rig_log "deleted network namespace $LVE_RIG_NS"
	rm -rf "/etc/netns/$LVE_RIG_NS"
fi
rm -f "$LVE_RIG_RUN/netns-owned"
rig_log "stopped (image cache kept)"
echo "leaks=$leaks"
