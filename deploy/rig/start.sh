#!/bin/bash
# Start the private libvirt rig (idempotent; a second run is a quick no-op):
#   - installs qemu/libvirt/dnsmasq/iptables with apt-get if missing,
#   - /dev/kvm -> group kvm, 0660 (else libvirt re-probes QEMU on every domain start),
#   - removes the autostart link of libvirt's "default" network (never started here),
#   - network namespace $LVE_RIG_NS with virtlogd + libvirtd started inside it
#     (pidfiles in $LVE_RIG_DIR/run/); URI qemu:///system works from any namespace;
#     with LVE_RIG_ACCESS=polkit (the default) libvirtd asks polkit for every API call,
#     on a D-Bus and polkitd of the rig's own (rules in $LVE_RIG_DIR/run/polkit-rules.d),
#   - NAT network $LVE_RIG_NET (bridge virbr-lve, 10.213.7.0/24, DHCP: static host entries and a small range,
#     dnsmasq no-ping) and dir pool $LVE_RIG_POOL at $LVE_RIG_DIR/pool,
#   - builds the test images ($LVE_RIG_IMAGES, default "tiny"; add "debian" for the
#     systemd one, "cloud" for the cloud-init one, "podman" for services) and writes the executor config
#     $LVE_RIG_DIR/config.toml (name_prefix $LVE_RIG_PREFIX, default "lve").
# Guests are reachable only from inside the namespace: ip netns exec $LVE_RIG_NS ssh ...
#
# If a libvirtd is already running that this rig did not start, start.sh fails unless
# LVE_RIG_REUSE=1: then it uses that libvirtd (its other guests are left alone) and the
# rig network lives in THAT libvirtd's network namespace. A libvirtd in the root network
# namespace is never reused (guest traffic must stay in a private namespace).
# Needs root on Debian 12.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
. "$here/../images/lib.sh"
[ "$(id -u)" = 0 ] || rig_die "must run as root"
rig_valid_prefix "$LVE_RIG_PREFIX" ||
	rig_die "LVE_RIG_PREFIX='$LVE_RIG_PREFIX': 1-16 lower-case letters, digits or '-', starting with a letter"

# --- packages ---------------------------------------------------------------------
lve_apt_install qemu-system-x86 qemu-utils libvirt-daemon-system libvirt-daemon-driver-qemu \
	libvirt-clients libvirt-daemon-config-nwfilter ebtables dnsmasq-base iptables iproute2 util-linux conntrack

# --- host fixes --------------------------------------------------------------------
if [ -e /dev/kvm ]; then
	getent group kvm >/dev/null && chgrp kvm /dev/kvm
	chmod 0660 /dev/kvm
fi
if [ -e /etc/libvirt/qemu/networks/autostart/default.xml ] ||
	[ -L /etc/libvirt/qemu/networks/autostart/default.xml ]; then
	rm -f /etc/libvirt/qemu/networks/autostart/default.xml
	rig_log "removed the autostart link of libvirt's default network"
fi

mkdir -p "$LVE_RIG_RUN" "$LVE_RIG_DIR/pool" "$LVE_RIG_DIR/state"
chmod 0755 "$LVE_RIG_DIR" "$LVE_RIG_DIR/pool" "$LVE_RIG_DIR/state"
chmod 0700 "$LVE_RIG_RUN"

# --- polkit (LVE_RIG_ACCESS=polkit) ------------------------------------------------------
# start_polkit: a D-Bus system bus of the rig's own ($LVE_RIG_DIR/dbus: polkitd, which runs
# as its own user, must reach the socket), polkitd on it with the rig's rules directory,
# and access_drivers = [ "polkit" ] for libvirtd (appended to its configuration file, which
# must be written before). Sets rig_bus to the bus address for libvirtd.
rig_bus=
start_polkit() {
	local bus=$LVE_RIG_DIR/dbus pid
	lve_apt_install dbus dbus-bin polkitd
	rig_bus=unix:path=$bus/system_bus_socket
	mkdir -p "$bus" "$LVE_RIG_RUN/polkit-rules.d"
	chmod 0755 "$bus"
	chown polkitd:root "$LVE_RIG_RUN/polkit-rules.d"
	chmod 0700 "$LVE_RIG_RUN/polkit-rules.d"
	if pid=$(rig_pid_is "$LVE_RIG_RUN/dbus.pid" dbus-daemon); then
		rig_log "the rig's D-Bus already running (pid $pid)"
	else
		rm -f "$bus/system_bus_socket"
		# The system bus's default policy (deny owning names and method calls
		# unless a policy of /usr/share/dbus-1/system.d allows them), on the
		# rig's socket, without activation.
		cat >"$LVE_RIG_RUN/dbus.conf" <<-EOF
			<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
			 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
			<!-- written by deploy/rig/start.sh -->
			<busconfig>
			  <type>system</type>
			  <listen>$rig_bus</listen>
			  <auth>EXTERNAL</auth>
			  <policy context="default">
			    <allow user="*"/>
			    <deny own="*"/>
			    <deny send_type="method_call"/>
			    <allow send_type="signal"/>
			    <allow send_requested_reply="true" send_type="method_return"/>
			    <allow send_requested_reply="true" send_type="error"/>
			    <allow receive_type="method_call"/>
			    <allow receive_type="method_return"/>
			    <allow receive_type="error"/>
			    <allow receive_type="signal"/>
			    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
			    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
			    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
			  </policy>
			  <includedir>/usr/share/dbus-1/system.d</includedir>
			</busconfig>
		EOF
		dbus-daemon --config-file="$LVE_RIG_RUN/dbus.conf" --fork --print-pid >"$LVE_RIG_RUN/dbus.pid"
		pid=$(rig_pid_is "$LVE_RIG_RUN/dbus.pid" dbus-daemon) || rig_die "the rig's dbus-daemon did not start"
		rig_log "started the rig's D-Bus system bus (pid $pid) at $bus"
	fi
	if pid=$(rig_pid_is "$LVE_RIG_RUN/polkitd.pid" polkitd); then
		rig_log "polkitd already running (pid $pid)"
	else
		# setsid (no fork: not a group leader here), unshare (no fork) and sh's
		# exec keep one PID: the pidfile's is polkitd's.
		# shellcheck disable=SC2016 # "$1" is the inner sh's
		DBUS_SYSTEM_BUS_ADDRESS=$rig_bus setsid unshare -m --propagation private \
			sh -c 'mount --bind "$1" /etc/polkit-1/rules.d && exec /usr/lib/polkit-1/polkitd --no-debug' sh "$LVE_RIG_RUN/polkit-rules.d" \
			</dev/null >>"$LVE_RIG_RUN/polkitd.log" 2>&1 &
		echo $! >"$LVE_RIG_RUN/polkitd.pid"
		local deadline=$((SECONDS + 30))
		until DBUS_SYSTEM_BUS_ADDRESS=$rig_bus dbus-send --system --print-reply --dest=org.freedesktop.DBus / \
			org.freedesktop.DBus.NameHasOwner string:org.freedesktop.PolicyKit1 2>/dev/null | grep -q 'boolean true'; do
			[ -e "/proc/$!" ] || rig_die "polkitd exited during startup (log: $LVE_RIG_RUN/polkitd.log)"
			[ $SECONDS -lt $deadline ] || rig_die "polkitd did not take its bus name in 30 s (log: $LVE_RIG_RUN/polkitd.log)"
			sleep 0.1
		done
		rig_log "started polkitd (pid $!) with the rules in $LVE_RIG_RUN/polkit-rules.d"
	fi
	printf 'access_drivers = [ "polkit" ]\n' >>"$LVE_RIG_RUN/libvirtd.conf"
}

# --- libvirtd -------------------------------------------------------------------------
wait_libvirt() { # bounded short-interval poll until the socket answers
	local pid=${1:-} deadline=$((SECONDS + 90))
	until rig_libvirt_up; do
		if [ -n "$pid" ] && [ ! -e "/proc/$pid" ]; then
			tail -n 20 "$LVE_RIG_RUN/libvirtd.log" >&2 2>/dev/null || true
			rig_die "libvirtd exited during startup (log: $LVE_RIG_RUN/libvirtd.log)"
		fi
		[ $SECONDS -lt $deadline ] || rig_die "libvirtd does not answer on $LVE_RIG_URI after 90 s"
		sleep 0.1
	done
}
if pid=$(rig_pid_is "$LVE_RIG_RUN/libvirtd.pid" libvirtd); then
	rig_log "libvirtd already running (pid $pid, namespace $LVE_RIG_NS)"
	wait_libvirt "$pid"
elif [ -e "$LVE_RIG_RUN/reused" ] && [ -n "$(rig_pids_named libvirtd)" ]; then
	rig_log "reusing the libvirtd that was running before the rig (LVE_RIG_REUSE)"
	wait_libvirt
else
	rm -f "$LVE_RIG_RUN/reused" "$LVE_RIG_RUN/libvirtd.pid"
	others=$(rig_pids_named libvirtd | tr '\n' ' ')
	others=${others% }
	if [ -n "$others" ]; then
		[ "${LVE_RIG_REUSE:-}" = 1 ] || rig_die "a libvirtd not started by this rig is running (pid $others).
  Stop it, or set LVE_RIG_REUSE=1 to use it: its other guests are left alone and the rig
  network $LVE_RIG_NET then lives in that libvirtd's network namespace."
		for p in $others; do
			[ "$(readlink "/proc/$p/ns/net")" != "$(readlink /proc/1/ns/net)" ] ||
				rig_die "the running libvirtd (pid $p) is in the root network namespace: refusing to
  put the rig's guest network there. Start it inside a namespace, or stop it."
		done
		ns=$(ip netns identify "${others%% *}" 2>/dev/null || true)
		echo "${ns:-unnamed}" >"$LVE_RIG_RUN/reused"
		rig_log "LVE_RIG_REUSE=1: using the running libvirtd (pid $others); guest network in its namespace (${ns:-unnamed})"
		wait_libvirt
	else
		if ! rig_netns_exists; then
			ip netns add "$LVE_RIG_NS"
			touch "$LVE_RIG_RUN/netns-owned"
			# the tests' GitLab by name on the host side (ip netns exec binds this over
			# /etc/hosts); the guests ask the network's DNS
			mkdir -p "/etc/netns/$LVE_RIG_NS"
			{ cat /etc/hosts; printf '%s\t%s\n' "$LVE_RIG_GATEWAY" "$LVE_RIG_GITLAB_HOST"; } >"/etc/netns/$LVE_RIG_NS/hosts"
			rig_log "created network namespace $LVE_RIG_NS"
		fi
		ip -n "$LVE_RIG_NS" link set lo up
		export LIBVIRT_LOG_OUTPUTS="3:file:$LVE_RIG_RUN/libvirtd.log"
		if pid=$(rig_pid_is "$LVE_RIG_RUN/virtlogd.pid" virtlogd); then
			rig_log "virtlogd already running (pid $pid)"
		elif [ -n "$(rig_pids_named virtlogd)" ]; then
			rig_log "using the virtlogd already running (pid $(rig_pids_named virtlogd | tr '\n' ' '))"
		else
			LIBVIRT_LOG_OUTPUTS="3:file:$LVE_RIG_RUN/virtlogd.log" \
				ip netns exec "$LVE_RIG_NS" virtlogd -d -p "$LVE_RIG_RUN/virtlogd.pid"
			rig_log "started virtlogd (pid $(cat "$LVE_RIG_RUN/virtlogd.pid")) in $LVE_RIG_NS"
		fi
		# Members of the libvirt group may use the read-write socket, by its
		# permissions: what Debian's polkit rule (60-libvirt.rules) grants on a
		# host with polkitd running, without needing D-Bus and polkitd here.
		# Tests run the stages as such an unprivileged user.
		getent group libvirt >/dev/null || groupadd --system libvirt
		cat >"$LVE_RIG_RUN/libvirtd.conf" <<-'EOF'
			# written by deploy/rig/start.sh
			unix_sock_group = "libvirt"
			unix_sock_ro_perms = "0777"
			unix_sock_rw_perms = "0770"
			auth_unix_ro = "none"
			auth_unix_rw = "none"
		EOF
		# libvirt's polkit access driver (LVE_RIG_ACCESS=polkit, the default): every API
		# call is asked of polkitd, on a D-Bus system bus of the rig's own (no host
		# bus or polkitd is touched or needed), with polkit's rules directory
		# /etc/polkit-1/rules.d replaced, in polkitd's mount namespace only, by
		# $LVE_RIG_RUN/polkit-rules.d, where the tests put the rules of
		# `libvirt-executor polkit-rules`. polkit always authorises root.
		case $LVE_RIG_ACCESS in
		polkit) start_polkit ;;
		none) ;;
		*) rig_die "LVE_RIG_ACCESS='$LVE_RIG_ACCESS': \"polkit\" or \"none\"" ;;
		esac
		echo "$LVE_RIG_ACCESS" >"$LVE_RIG_RUN/access"
		# The network guard is installed the way an admin installs it: as a
		# libvirt network hook (deploy/network). This libvirtd sees the rig's
		# hooks directory in place of /etc/libvirt/hooks, in its own mount
		# namespace only.
		mkdir -p "$LVE_RIG_RUN/hooks/network.d" /etc/libvirt/hooks
		install -m 0755 "$here/../network/libvirt-executor-guard" "$LVE_RIG_RUN/hooks/network.d/50-libvirt-executor-guard"
		printf '%s %s\n' "$LVE_RIG_NET" "$LVE_RIG_SERVICE_PORTS" >"$LVE_RIG_RUN/hooks/libvirt-executor-guard.conf"
		# And the QEMU hook that forgets a released VM's tracked connections.
		mkdir -p "$LVE_RIG_RUN/hooks/qemu.d"
		install -m 0755 "$here/../network/libvirt-executor-conntrack" "$LVE_RIG_RUN/hooks/qemu.d/50-libvirt-executor-conntrack"
		# shellcheck disable=SC2016 # "$1" and "$@" are the inner sh's
		ip netns exec "$LVE_RIG_NS" env ${rig_bus:+DBUS_SYSTEM_BUS_ADDRESS="$rig_bus"} sh -c 'mount --bind "$1" /etc/libvirt/hooks && shift && exec "$@"' sh "$LVE_RIG_RUN/hooks" \
			libvirtd -d -f "$LVE_RIG_RUN/libvirtd.conf" -p "$LVE_RIG_RUN/libvirtd.pid"
		for _ in $(seq 50); do [ -s "$LVE_RIG_RUN/libvirtd.pid" ] && break; sleep 0.1; done
		pid=$(tr -dc 0-9 <"$LVE_RIG_RUN/libvirtd.pid" 2>/dev/null || true)
		t0=$SECONDS
		wait_libvirt "$pid"
		rig_log "started libvirtd (pid $pid) in $LVE_RIG_NS; answering after $((SECONDS - t0)) s"
	fi
fi

# --- network ----------------------------------------------------------------------------
if ! rig_virsh net-info "$LVE_RIG_NET" >/dev/null 2>&1; then
	cat >"$LVE_RIG_RUN/network.xml" <<X
<network xmlns:dnsmasq='http://libvirt.org/schemas/network/dnsmasq/1.0'>
  <name>$LVE_RIG_NET</name>
  <forward mode='nat'/>
  <bridge name='$LVE_RIG_BRIDGE' stp='off' delay='0'/>
  <ip address='$LVE_RIG_GATEWAY' netmask='$LVE_RIG_NETMASK'>
    <dhcp>
      <range start='$LVE_RIG_DHCP_START' end='$LVE_RIG_DHCP_END'>
        <lease expiry='10' unit='minutes'/>
      </range>
      <host mac='52:54:00:00:00:01' name='$LVE_RIG_NET-reserved' ip='$LVE_RIG_DHCP_RESERVED'/>
    </dhcp>
  </ip>
  <dns>
    <host ip='$LVE_RIG_GATEWAY'><hostname>$LVE_RIG_GITLAB_HOST</hostname></host>
  </dns>
  <dnsmasq:options>
    <dnsmasq:option value='no-ping'/>
  </dnsmasq:options>
</network>
X
	rig_virsh net-define "$LVE_RIG_RUN/network.xml" >/dev/null
	rig_log "defined network $LVE_RIG_NET"
fi
if [ "$(rig_virsh net-info "$LVE_RIG_NET" | awk '$1 == "Active:" {print $2}')" != yes ]; then
	rig_virsh net-start "$LVE_RIG_NET" >/dev/null
	rig_log "started network $LVE_RIG_NET ($LVE_RIG_BRIDGE, $LVE_RIG_GATEWAY/24)"
fi
# never autostart: a libvirtd started later in the root namespace must not bring it up there
rig_virsh net-autostart "$LVE_RIG_NET" --disable >/dev/null 2>&1 || true

# --- guard: job VMs reach only DHCP, DNS and the declared service ports of the host side --
# Installed by the network hook when the network started (see above); checked here.
if [ ! -e "$LVE_RIG_RUN/reused" ]; then
	ip netns exec "$LVE_RIG_NS" iptables -w -S "LVE-GUARD-$LVE_RIG_BRIDGE" >/dev/null 2>&1 ||
		rig_die "the network hook did not install the guard on $LVE_RIG_BRIDGE (libvirtd log: $LVE_RIG_RUN/libvirtd.log)"
	rig_log "guard: guests reach the host side only on DHCP, DNS and tcp $LVE_RIG_SERVICE_PORTS"
fi

# --- network filters: every VM's interface names lve-vm-v1 or lve-vm-egress-v1 (l2_filter) --
# libvirt-executor defines its own filters when it starts the first VM; they build on
# libvirt's clean-traffic, which the nwfilter package provides.
rig_virsh nwfilter-dumpxml clean-traffic >/dev/null 2>&1 ||
	rig_die "libvirt has no nwfilter clean-traffic: install libvirt-daemon-config-nwfilter (and ebtables)"
# Bindings an earlier run left (libvirt keeps them in /run across its restarts): not
# this run's leaks, but the next VM given that tap name would not start.
while read -r dev owner; do
	[ -n "$dev" ] || continue
	rig_virsh nwfilter-binding-delete "$dev" >/dev/null 2>&1 &&
		rig_log "removed the stale network filter binding $dev of $owner (an earlier run's)"
done < <(rig_stale_bindings "$LVE_RIG_PREFIX")

# --- storage pool -----------------------------------------------------------------------
if ! rig_virsh pool-info "$LVE_RIG_POOL" >/dev/null 2>&1; then
	rig_virsh pool-define-as "$LVE_RIG_POOL" dir --target "$LVE_RIG_DIR/pool" >/dev/null
	rig_log "defined storage pool $LVE_RIG_POOL at $LVE_RIG_DIR/pool"
fi
if [ "$(rig_virsh pool-info "$LVE_RIG_POOL" | awk '$1 == "State:" {print $2}')" != running ]; then
	rig_virsh pool-start "$LVE_RIG_POOL" >/dev/null
	rig_log "started storage pool $LVE_RIG_POOL"
fi
rig_virsh pool-autostart "$LVE_RIG_POOL" --disable >/dev/null 2>&1 || true

# --- images + executor config ---------------------------------------------------------------
# tiny always; debian, cloud and podman only when asked for
images=tiny
for img in debian cloud podman; do
	case " ${LVE_RIG_IMAGES//,/ } " in *" $img "*) images+=" $img" ;; esac
done
fragments=
for img in $images; do
	dir=$("$here/../images/build.sh" "$img" | tail -n 1)
	[ -f "$dir/image.toml" ] || rig_die "image $img: no image.toml in '$dir'"
	case $img in
	debian) fragments+=$'\n# systemd guest: ~25-45 s to SSH under TCG with 1 vCPU' ;;
	cloud) fragments+=$'\n# systemd + cloud-init guest (user debian, NoCloud seed): ~35-60 s to SSH under TCG with 1 vCPU' ;;
	podman) fragments+=$'\n# the debian guest with podman for services (docs/services.md)' ;;
	esac
	fragments+=$'\n'$(cat "$dir/image.toml")$'\n'
	# systemd + sshd + git (+ cloud-init's Python) need more than the tiny guest
	case $img in debian | cloud) fragments+=$'memory_mib = 768\n' ;; podman) fragments+=$'memory_mib = 1024\n' ;; esac
	rig_log "image $img: $dir"
done
# gitlab-runner for the guests' tools disk (caches and artifacts): LVE_RIG_GITLAB_RUNNER, an
# absolute path (the Makefile passes the test binary of deploy/rig/test-runner.sh), else none
guest_runner=none
if [ -n "${LVE_RIG_GITLAB_RUNNER:-}" ]; then
	case $LVE_RIG_GITLAB_RUNNER in /*) ;; *) rig_die "LVE_RIG_GITLAB_RUNNER must be an absolute path" ;; esac
	[ -x "$LVE_RIG_GITLAB_RUNNER" ] || rig_die "LVE_RIG_GITLAB_RUNNER=$LVE_RIG_GITLAB_RUNNER is not executable"
	guest_runner=$LVE_RIG_GITLAB_RUNNER
	rig_log "guests get gitlab-runner $guest_runner on their tools disk"
fi
# step-runner for the guests' tools disk (GitLab Steps, run: jobs): LVE_RIG_STEP_RUNNER, an
# absolute path (the Makefile passes the test binary of deploy/rig/test-tool.sh), else none
guest_step_runner=none
if [ -n "${LVE_RIG_STEP_RUNNER:-}" ]; then
	case $LVE_RIG_STEP_RUNNER in /*) ;; *) rig_die "LVE_RIG_STEP_RUNNER must be an absolute path" ;; esac
	[ -x "$LVE_RIG_STEP_RUNNER" ] || rig_die "LVE_RIG_STEP_RUNNER=$LVE_RIG_STEP_RUNNER is not executable"
	guest_step_runner=$LVE_RIG_STEP_RUNNER
	rig_log "guests get step-runner $guest_step_runner on their tools disk"
fi
cat >"$LVE_RIG_CONFIG.tmp" <<T
# libvirt-executor config for the private rig (written by deploy/rig/start.sh).
# Guests live in network namespace "$LVE_RIG_NS": reach them with ip netns exec $LVE_RIG_NS ...
libvirt_uri = "$LVE_RIG_URI"
domain_type = "qemu"
storage_pool = "$LVE_RIG_POOL"
network = "$LVE_RIG_NET"
name_prefix = "$LVE_RIG_PREFIX"
state_dir = "$LVE_RIG_DIR/state"
default_image = "tiny"

[defaults]
vcpus = 1
memory_mib = 512
disk_gib = 0

[timeouts]
boot = "3m"

[ssh]
keepalive_interval = "2s"
keepalive_count = 3

[guest_tools]
gitlab_runner = "$guest_runner"
step_runner = "$guest_step_runner"
$fragments
T
mv -f "$LVE_RIG_CONFIG.tmp" "$LVE_RIG_CONFIG"

ns=$LVE_RIG_NS
[ -e "$LVE_RIG_RUN/reused" ] && ns=$(cat "$LVE_RIG_RUN/reused")
rig_log "up: libvirt $LVE_RIG_URI, network namespace $ns, network $LVE_RIG_NET ($LVE_RIG_GATEWAY/24), pool $LVE_RIG_POOL"
rig_log "config: $LVE_RIG_CONFIG"
echo "namespace=$ns"
echo "config=$LVE_RIG_CONFIG"
