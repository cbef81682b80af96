# shellcheck shell=bash disable=SC2034 # (variables used by the scripts that source this file)
# Shared names of the private libvirt rig (sourced by start.sh, stop.sh and tests).
# Every value can be overridden from the environment.
LVE_RIG_NS=${LVE_RIG_NS:-lve-rig}                          # network namespace
LVE_RIG_DIR=${LVE_RIG_DIR:-/var/lib/libvirt-executor-rig}  # rig state: run/, pool/, state/, config.toml
LVE_RIG_NET=${LVE_RIG_NET:-lve-rig}                        # libvirt NAT network
LVE_RIG_POOL=${LVE_RIG_POOL:-lve-rig}                      # libvirt dir storage pool ($LVE_RIG_DIR/pool)
LVE_RIG_IMAGES=${LVE_RIG_IMAGES:-tiny}                     # images to build: "tiny", "tiny,debian,cloud"
LVE_RIG_URI=${LVE_RIG_URI:-qemu:///system}
# How the rig's own libvirtd authorises API calls: "polkit" (libvirt's polkit access
# driver, with a private D-Bus and polkitd; the tests confine their runner user with
# the rules of `libvirt-executor polkit-rules`) or "none" (socket permissions only).
LVE_RIG_ACCESS=${LVE_RIG_ACCESS:-polkit}
LVE_RIG_PREFIX=${LVE_RIG_PREFIX:-lve}                      # name_prefix of the rig's config: job VMs and volumes are <prefix>-*
LVE_RIG_BRIDGE=virbr-lve
LVE_RIG_GATEWAY=10.213.7.1                                 # host side of the guest network
LVE_RIG_NETMASK=255.255.255.0
# Every VM gets a static host entry of its own (static_addresses), outside the dynamic
# range (kept for what makes its VMs without one: an earlier release in the
# package upgrade test), so a guest asking with new client identifiers gets its own
# address again, and a new VM its address even with the range used up. The one entry the
# network starts with keeps dnsmasq's static DHCP on.
# Not too small: libvirt sets dnsmasq's dhcp-lease-max to the ranges' size, and every
# VM's lease counts against it, a static entry's too, until it expires (an 11-address
# range starved the fault tests of leases).
LVE_RIG_DHCP_START=10.213.7.100
LVE_RIG_DHCP_END=10.213.7.250
LVE_RIG_DHCP_RESERVED=10.213.7.254
# The host name of the tests' GitLab over HTTPS (the fake job API behind TLS, at the
# gateway): the network's DNS answers it for the guests (<dns><host>), the namespace's
# /etc/hosts (/etc/netns/$LVE_RIG_NS/hosts) for the runner on the host side.
LVE_RIG_GITLAB_HOST=gitlab.lve-rig.test
LVE_RIG_SERVICE_PORTS=${LVE_RIG_SERVICE_PORTS:-20000:20999} # host-side TCP ports guests may reach (test git servers)
LVE_RIG_RUN=$LVE_RIG_DIR/run                               # pidfiles, logs, markers
LVE_RIG_CONFIG=$LVE_RIG_DIR/config.toml                    # executor config written by start.sh
export LVE_RIG_ACCESS LVE_RIG_GITLAB_HOST LVE_RIG_NS LVE_RIG_DIR LVE_RIG_NET LVE_RIG_POOL LVE_RIG_IMAGES LVE_RIG_URI LVE_RIG_PREFIX \
	LVE_RIG_BRIDGE LVE_RIG_GATEWAY LVE_RIG_RUN LVE_RIG_CONFIG LVE_RIG_SERVICE_PORTS

rig_log() { printf '[rig] %s\n' "$*" >&2; }
rig_die() { printf '[rig] ERROR: %s\n' "$*" >&2; exit 1; }

# rig_virsh ARGS...: virsh against the rig's URI, never hanging for long.
rig_virsh() { timeout 120 virsh -q -c "$LVE_RIG_URI" "$@"; }

# rig_libvirt_up: does a libvirtd answer on the URI?
rig_libvirt_up() { timeout 10 virsh -c "$LVE_RIG_URI" version >/dev/null 2>&1; }

# rig_pid_is PIDFILE NAME: print the PID from PIDFILE if that process is alive and is NAME.
rig_pid_is() {
	local pid
	[ -r "$1" ] || return 1
	pid=$(tr -dc 0-9 <"$1")
	[ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
	echo "$pid"
}

# rig_pids_named NAME: PIDs of all processes whose comm is NAME (reads /proc, no procps).
rig_pids_named() {
	local d
	for d in /proc/[0-9]*; do
		[ "$(cat "$d/comm" 2>/dev/null)" = "$1" ] && echo "${d#/proc/}"
	done
	return 0
}

# rig_valid_prefix PREFIX: is PREFIX a name_prefix the executor accepts (1-16 lower-case
# letters, digits or '-', starting with a letter; safe in a pattern)?
rig_valid_prefix() { [[ $1 =~ ^[a-z][a-z0-9-]{0,15}$ ]]; }

# rig_stale_bindings PREFIX: the tap devices of network filter bindings of the project's
# filters (lve-vm-*) whose owner, a domain named PREFIX-*, does not run. libvirt leaves
# them when it cannot release a stopped domain's interface (under its polkit access
# driver: the client whose call stopped the domain exited first), and refuses to start
# the next domain that gets that tap name. The executor removes them itself (at start
# and in its sweep); the rig checks for them at stop and clears earlier runs' at start.
rig_stale_bindings() {
	local dev x owner
	for dev in $(rig_virsh nwfilter-binding-list 2>/dev/null | awk '$2 ~ /^lve-vm-/ {print $1}'); do
		x=$(rig_virsh nwfilter-binding-dumpxml "$dev" 2>/dev/null) || continue
		owner=$(sed -nE '/<owner>/,/<\/owner>/ s|.*<name>([^<]*)</name>.*|\1|p' <<<"$x" | head -n1)
		case $owner in "$1"-*) ;; *) continue ;; esac
		[ "$(rig_virsh domstate "$owner" 2>/dev/null | head -n1)" = running ] && continue
		printf '%s %s\n' "$dev" "$owner"
	done
}

# rig_netns_exists: is the rig's network namespace there?
rig_netns_exists() { [ -e "/run/netns/$LVE_RIG_NS" ]; }
