#!/bin/bash
# Recipe of the "cloud" test image: the "debian" image's approach (Debian 12 minbase,
# systemd 252, systemd-networkd DHCP, OpenSSH server, git, Debian's cloud kernel, direct
# kernel boot with root=/dev/vda) with cloud-init in place of the SMBIOS credentials:
# key_injection = "cloud-init", user "debian" (see image.env).
# Per-job keys: cloud-init (datasource NoCloud only) reads the executor's seed disk
# (label "cidata", vdb), creates the user "debian" with the client key and passwordless
# sudo, and installs the per-job host key (ssh_keys) before ssh.service starts.
# The small config files shared with ../debian/ are copies (the image hash covers only
# this directory): keep them in step.
# Called by ../build.sh as: recipe.sh OUTDIR  (writes disk.qcow2 vmlinuz initrd.img there)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
out=$1
DISK_SIZE=4G
SUITE=bookworm
MIRROR=${LVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${LVE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if [ -z "${LVE_IN_MOUNT_NS:-}" ]; then
	lve_apt_install debootstrap debian-archive-keyring e2fsprogs qemu-utils util-linux
	# debootstrap and the kernel's postinst mount /proc, /sys, ... inside the target: do it
	# in a private mount namespace, so that a killed build cannot leave mounts behind.
	LVE_IN_MOUNT_NS=1 exec unshare --mount --propagation private bash "$0" "$@"
fi

work=$out/work
root=$work/root
mkdir -p "$work"

lve_log "cloud: debootstrap $SUITE (minbase) from $MIRROR"
debootstrap --variant=minbase --merged-usr \
	--include=systemd-sysv,udev,kmod,openssh-server,git,ca-certificates,iproute2,procps,sudo \
	"$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 ||
	{ tail -n 30 "$work/debootstrap.log" >&2; lve_die "debootstrap failed"; }

in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
	DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 "$@"; }
# (no bind mount of /dev: debootstrap made the device nodes the chroot needs, and a final
# rm -rf of the work tree must never reach the host's /dev)
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
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
S

# Small initramfs: only what a libvirt guest with virtio disk + NIC needs.
mkdir -p "$root/etc/initramfs-tools/conf.d"
echo 'MODULES=list' >"$root/etc/initramfs-tools/conf.d/libvirt-executor.conf"
printf '%s\n' virtio_pci virtio_blk virtio_net virtio_rng >>"$root/etc/initramfs-tools/modules"

lve_log "cloud: updating, installing the cloud kernel and cloud-init"
{ in_root apt-get update -qq && in_root apt-get -y -qq upgrade &&
	in_root apt-get install -y -qq --no-install-recommends linux-image-cloud-amd64 cloud-init; } >"$work/kernel.log" 2>&1 ||
	{ tail -n 30 "$work/kernel.log" >&2; lve_die "kernel/cloud-init install failed"; }
kver=$(basename "$(ls -1 "$root"/boot/vmlinuz-* | tail -n1)")
kver=${kver#vmlinuz-}
cp "$root/boot/vmlinuz-$kver" "$out/vmlinuz"
cp "$root/boot/initrd.img-$kver" "$out/initrd.img"

lve_log "cloud: configuring"
# network: systemd-networkd, DHCP on the NICs
install -m 0644 "$here/20-dhcp.network" "$root/etc/systemd/network/20-dhcp.network"
in_root systemctl enable systemd-networkd.service >/dev/null 2>&1
# cloud-init: NoCloud seed only, no network config, only the "init" stage's modules
install -m 0644 "$here/cloud.cfg.d-libvirt-executor.cfg" "$root/etc/cloud/cloud.cfg.d/99-libvirt-executor.cfg"
# per-job SSH host key from cloud-init; no image host keys; ssh only after cloud-init and
# only with that key
install -D -m 0644 "$here/ssh.service.d-libvirt-executor.conf" \
	"$root/etc/systemd/system/ssh.service.d/libvirt-executor.conf"
install -D -m 0644 "$here/sshd_config.d-libvirt-executor.conf" \
	"$root/etc/ssh/sshd_config.d/libvirt-executor.conf"
in_root systemctl enable ssh.service >/dev/null 2>&1
rm -f "$root"/etc/ssh/ssh_host_*
# cloud-init state of the build (there should be none): every clone is a first boot
rm -rf "$root"/var/lib/cloud/* "$root"/var/log/cloud-init*
# nothing that waits for or runs in the background of a short-lived CI guest
# (getty-static would start gettys on tty2..6; the serial console keeps its getty).
# Of cloud-init's four stages only cloud-init.service ("init": finds the NoCloud seed,
# runs the user, hostname and ssh modules, Before=sysinit.target and ssh.service) runs:
# each stage is a Python start costing 5-20 s under TCG. cloud-init-local only finds the
# seed early to write network configuration (disabled here) and holds back networkd
# (Before=network-pre.target); cloud-config and cloud-final would run beside the job.
for u in systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer \
	e2scrub_all.timer e2scrub_reap.service fstrim.timer systemd-firstboot.service \
	getty-static.service getty@tty1.service systemd-pstore.service modprobe@drm.service \
	modprobe@efi_pstore.service sys-kernel-debug.mount sys-kernel-tracing.mount \
	cloud-init-local.service cloud-config.service cloud-final.service cloud-init-hotplugd.socket; do
	in_root systemctl mask "$u" >/dev/null 2>&1 || true
done

# fewer generators (each one is a process start, slow under TCG), fewer drivers, and a
# journal in memory
mkdir -p "$root/etc/systemd/system-generators"
for g in systemd-cryptsetup-generator systemd-integritysetup-generator \
	systemd-veritysetup-generator systemd-gpt-auto-generator systemd-hibernate-resume-generator \
	systemd-system-update-generator systemd-rc-local-generator systemd-sysv-generator \
	systemd-run-generator; do
	ln -sf /dev/null "$root/etc/systemd/system-generators/$g"
done
install -m 0644 "$here/modprobe-blacklist.conf" "$root/etc/modprobe.d/libvirt-executor.conf"
install -D -m 0644 "$here/journald-libvirt-executor.conf" \
	"$root/etc/systemd/journald.conf.d/libvirt-executor.conf"

echo lve-cloud >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tlve-cloud\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
echo '/dev/vda / ext4 rw,errors=remount-ro 0 1' >"$root/etc/fstab"
# debootstrap copied the build host's resolv.conf. No resolver here: networkd does not
# write resolv.conf (systemd-resolved would; it is left out to keep the boot short).
: >"$root/etc/resolv.conf"
# the job user "debian" exists only from the first boot on (cloud-init makes it): sticky
# world-writable like /tmp
mkdir -p "$root/builds" "$root/cache"
chmod 1777 "$root/builds" "$root/cache"
# every clone gets its own machine-id at boot
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"

rm -f "$root/usr/sbin/policy-rc.d"
in_root apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log \
	"$root"/var/log/apt/* "$root"/tmp/* "$root"/var/tmp/*
umount "$root/sys" "$root/proc"

lve_log "cloud: making disk.qcow2 (ext4, $DISK_SIZE virtual)"
lve_mkfs_qcow2 "$root" "$out/disk.qcow2" "$DISK_SIZE" lve-root
{
	echo "kernel $kver"
	echo "systemd $(chroot "$root" dpkg-query -W -f='${Version}' systemd)"
	echo "openssh-server $(chroot "$root" dpkg-query -W -f='${Version}' openssh-server)"
	echo "git $(chroot "$root" dpkg-query -W -f='${Version}' git)"
	echo "cloud-init $(chroot "$root" dpkg-query -W -f='${Version}' cloud-init)"
} >"$out/versions.txt"
if grep -q " $work" /proc/mounts; then lve_die "still mounted under $work"; fi
rm -rf "$work"
