# shellcheck shell=bash disable=SC2154 # (name, out, work and root are set by the recipe)
# Steps shared by the Debian-based recipes (../debian, ../cloud): Debian 12 (bookworm)
# minbase with systemd 252, systemd-networkd (DHCP), OpenSSH server, git, bash, Debian's
# cloud kernel, booted directly (vmlinuz + initrd.img taken from the root filesystem),
# root=/dev/vda. Sourced after ../lib.sh; the config files beside this file are installed
# into both images. The steps work on variables the recipe sets first:
#   name  the image name (log prefix, host name lve-<name>)
#   out   the output directory (disk.qcow2 vmlinuz initrd.img versions.txt)
#   work  a scratch directory under $out, removed at the end; root=$work/root
# A change here changes the hash, so the cache entry, of every image (../build.sh).

lve_deb_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LVE_DEB_SUITE=bookworm
LVE_DEB_MIRROR=${LVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
LVE_DEB_SECURITY_MIRROR=${LVE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

# lve_deb_enter_mount_ns SCRIPT ARGS...: install the build tools, then run SCRIPT ARGS
# again (exec) in a private mount namespace: debootstrap and the kernel's postinst mount
# /proc, /sys, ... inside the target, and a killed build must not leave mounts behind.
# Returns at once when already inside it.
lve_deb_enter_mount_ns() {
	[ -z "${LVE_IN_MOUNT_NS:-}" ] || return 0
	lve_apt_install debootstrap debian-archive-keyring e2fsprogs qemu-utils util-linux
	LVE_IN_MOUNT_NS=1 exec unshare --mount --propagation private bash "$@"
}

# lve_in_root CMD...: run CMD inside $root (chroot) with a clean environment.
lve_in_root() {
	chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 "$@"
}

# lve_deb_bootstrap [EXTRA_PACKAGES]: debootstrap minbase into $root (plus the comma-
# separated EXTRA_PACKAGES), mount /proc and /sys there, forbid service starts, drop
# documentation, add the updates and security suites, and set up a small initramfs.
lve_deb_bootstrap() {
	local include=systemd-sysv,udev,kmod,openssh-server,git,ca-certificates,iproute2,procps
	include+=${1:+,$1}
	mkdir -p "$work"
	lve_log "$name: debootstrap $LVE_DEB_SUITE (minbase) from $LVE_DEB_MIRROR"
	debootstrap --variant=minbase --merged-usr --include="$include" \
		"$LVE_DEB_SUITE" "$root" "$LVE_DEB_MIRROR" >"$work/debootstrap.log" 2>&1 ||
		{ tail -n 30 "$work/debootstrap.log" >&2; lve_die "debootstrap failed"; }

	# (no bind mount of /dev: debootstrap made the device nodes the chroot needs, and a
	# final rm -rf of the work tree must never reach the host's /dev)
	mount -t proc proc "$root/proc"
	mount -t sysfs sysfs "$root/sys"
	printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
	chmod 0755 "$root/usr/sbin/policy-rc.d"

	# no documentation, manual pages or translations in a CI guest
	cat >"$root/etc/dpkg/dpkg.cfg.d/01-libvirt-executor-nodoc" <<'D'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
D
	find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
	rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/*
	find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +

	# security and point-release updates
	cat >"$root/etc/apt/sources.list" <<S
deb $LVE_DEB_MIRROR $LVE_DEB_SUITE main
deb $LVE_DEB_MIRROR $LVE_DEB_SUITE-updates main
deb $LVE_DEB_SECURITY_MIRROR $LVE_DEB_SUITE-security main
S

	# Small initramfs: only what a libvirt guest with virtio disk + NIC needs.
	mkdir -p "$root/etc/initramfs-tools/conf.d"
	echo 'MODULES=list' >"$root/etc/initramfs-tools/conf.d/libvirt-executor.conf"
	printf '%s\n' virtio_pci virtio_blk virtio_net virtio_rng >>"$root/etc/initramfs-tools/modules"
}

# lve_deb_install_kernel [PACKAGE...]: upgrade $root, install Debian's cloud kernel (and
# PACKAGEs), copy its vmlinuz and initrd.img to $out; sets kver to the kernel version.
lve_deb_install_kernel() {
	local what="the cloud kernel" vmlinuz
	[ $# -eq 0 ] || what+=" and $*"
	lve_log "$name: updating, installing $what"
	{ lve_in_root apt-get update -qq && lve_in_root apt-get -y -qq upgrade &&
		lve_in_root apt-get install -y -qq --no-install-recommends linux-image-cloud-amd64 "$@"; } \
		>"$work/kernel.log" 2>&1 ||
		{ tail -n 30 "$work/kernel.log" >&2; lve_die "installing $what failed"; }
	vmlinuz=("$root"/boot/vmlinuz-*)
	kver=$(basename "${vmlinuz[-1]}")
	kver=${kver#vmlinuz-}
	cp "$root/boot/vmlinuz-$kver" "$out/vmlinuz"
	cp "$root/boot/initrd.img-$kver" "$out/initrd.img"
}

# lve_deb_configure_base: systemd-networkd with DHCP on the NICs, fewer generators (each
# one is a process start, slow under TCG), fewer drivers, and a journal in memory.
lve_deb_configure_base() {
	local g
	install -m 0644 "$lve_deb_dir/20-dhcp.network" "$root/etc/systemd/network/20-dhcp.network"
	lve_in_root systemctl enable systemd-networkd.service >/dev/null 2>&1
	# resolv.conf from the DHCP lease's DNS servers (networkd writes none; systemd-resolved
	# would, as a daemon more to start at every boot)
	install -D -m 0755 "$lve_deb_dir/dhcp-resolv" "$root/usr/libexec/libvirt-executor/dhcp-resolv"
	install -m 0644 "$lve_deb_dir/libvirt-executor-resolv.path" "$lve_deb_dir/libvirt-executor-resolv.service" \
		"$root/etc/systemd/system/"
	lve_in_root systemctl enable libvirt-executor-resolv.path libvirt-executor-resolv.service >/dev/null 2>&1
	mkdir -p "$root/etc/systemd/system-generators"
	for g in systemd-cryptsetup-generator systemd-integritysetup-generator \
		systemd-veritysetup-generator systemd-gpt-auto-generator systemd-hibernate-resume-generator \
		systemd-system-update-generator systemd-rc-local-generator systemd-sysv-generator \
		systemd-run-generator; do
		ln -sf /dev/null "$root/etc/systemd/system-generators/$g"
	done
	install -m 0644 "$lve_deb_dir/modprobe-blacklist.conf" "$root/etc/modprobe.d/libvirt-executor.conf"
	install -D -m 0644 "$lve_deb_dir/journald-libvirt-executor.conf" \
		"$root/etc/systemd/journald.conf.d/libvirt-executor.conf"
}

# lve_deb_guest_tools: mount libvirt-executor's guest tools disk (serial lve-tools) at
# /opt/libvirt-executor before ssh.service when the VM has one, and link its gitlab-runner and
# step-runner into /usr/local/bin (dangling without the disk or that program on it: then
# "command -v" does not find it).
# lve_deb_ssh_hostkey DIR: a per-job SSH host key from the credential (the debian
# recipe's files in DIR), no image host keys, ssh only with that key.
lve_deb_ssh_hostkey() {
	install -D -m 0755 "$1/install-ssh-hostkey" "$root/usr/libexec/libvirt-executor/install-ssh-hostkey"
	install -m 0644 "$1/libvirt-executor-hostkey.service" "$root/etc/systemd/system/"
	install -D -m 0644 "$1/ssh.service.d-libvirt-executor.conf" \
		"$root/etc/systemd/system/ssh.service.d/libvirt-executor.conf"
	install -D -m 0644 "$1/sshd_config.d-libvirt-executor.conf" \
		"$root/etc/ssh/sshd_config.d/libvirt-executor.conf"
	lve_in_root systemctl enable ssh.service libvirt-executor-hostkey.service >/dev/null 2>&1
	rm -f "$root"/etc/ssh/ssh_host_*
}

lve_deb_guest_tools() {
	install -D -m 0755 "$lve_deb_dir/mount-tools" "$root/usr/libexec/libvirt-executor/mount-tools"
	install -m 0644 "$lve_deb_dir/libvirt-executor-tools.service" "$root/etc/systemd/system/"
	lve_in_root systemctl enable libvirt-executor-tools.service >/dev/null 2>&1
	install -d -m 0755 "$root/opt/libvirt-executor" "$root/usr/local/bin"
	ln -sf /opt/libvirt-executor/bin/gitlab-runner "$root/usr/local/bin/gitlab-runner"
	ln -sf /opt/libvirt-executor/bin/step-runner "$root/usr/local/bin/step-runner"
}

# lve_deb_mask [UNIT...]: mask what waits for or runs in the background of a short-lived
# CI guest, and the UNITs (getty-static would start gettys on tty2..6; the serial console
# keeps its getty).
lve_deb_mask() {
	local u
	for u in systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer \
		e2scrub_all.timer e2scrub_reap.service fstrim.timer systemd-firstboot.service \
		getty-static.service getty@tty1.service systemd-pstore.service modprobe@drm.service \
		modprobe@efi_pstore.service sys-kernel-debug.mount sys-kernel-tracing.mount "$@"; do
		lve_in_root systemctl mask "$u" >/dev/null 2>&1 || true
	done
}

# lve_deb_identity: host name lve-$name, /etc/hosts, fstab, an empty resolv.conf (filled
# at boot from DHCP) and
# machine-id.
lve_deb_identity() {
	echo "lve-$name" >"$root/etc/hostname"
	printf '127.0.0.1\tlocalhost\n127.0.1.1\tlve-%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' "$name" >"$root/etc/hosts"
	echo '/dev/vda / ext4 rw,errors=remount-ro 0 1' >"$root/etc/fstab"
	# debootstrap copied the build host's resolv.conf: emptied, libvirt-executor-resolv
	# writes the DHCP lease's servers into it at boot.
	rm -f "$root/etc/resolv.conf"
	: >"$root/etc/resolv.conf"
	# every clone gets its own machine-id at boot
	: >"$root/etc/machine-id"
	rm -f "$root/var/lib/dbus/machine-id"
}

# lve_deb_finish DISK_SIZE [PACKAGE...]: clean $root up, unmount it, make $out/disk.qcow2
# (ext4, DISK_SIZE virtual), write $out/versions.txt (kernel, systemd, openssh-server,
# git and the PACKAGEs), remove $work.
lve_deb_finish() {
	local size=$1 p
	shift
	rm -f "$root/usr/sbin/policy-rc.d"
	lve_in_root apt-get clean
	rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log \
		"$root"/var/log/apt/* "$root"/tmp/* "$root"/var/tmp/*
	umount "$root/sys" "$root/proc"

	lve_log "$name: making disk.qcow2 (ext4, $size virtual)"
	lve_mkfs_qcow2 "$root" "$out/disk.qcow2" "$size" lve-root
	{
		echo "kernel $kver"
		for p in systemd openssh-server git "$@"; do
			echo "$p $(chroot "$root" dpkg-query -W -f="\${Version}" "$p")"
		done
	} >"$out/versions.txt"
	if grep -q " $work" /proc/mounts; then lve_die "still mounted under $work"; fi
	rm -rf "$work"
}
