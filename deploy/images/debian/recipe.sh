#!/bin/bash
# Recipe of the "debian" test image: Debian 12 (bookworm) minbase with systemd 252,
# systemd-networkd (DHCP), OpenSSH server, git, bash, Debian's cloud kernel; booted
# directly (vmlinuz + initrd.img taken from the root filesystem), root=/dev/vda.
# The steps and config files it shares with ../cloud are in ../common.
# Per-job keys: systemd imports the SMBIOS credentials; its tmpfiles provision.conf writes
# root's authorized_keys, libvirt-executor-hostkey.service installs the host key.
# Snapshot template mode (kernel option lve.snapshot=template, docs/pool.md):
# libvirt-executor-snapshot.service holds networkd, the keys, the tools disk and sshd back
# until a restored clone's credentials disk is plugged in.
# Called by ../build.sh as: recipe.sh OUTDIR  (writes disk.qcow2 vmlinuz initrd.img there)
# shellcheck disable=SC2119 # (the shared steps' optional extra packages and units: none here)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
. "$here/../common/debian.sh"
name=debian
out=$1
work=$out/work
root=$work/root
DISK_SIZE=4G

lve_deb_enter_mount_ns "$0" "$@"
lve_deb_bootstrap
lve_deb_install_kernel

lve_log "debian: configuring"
lve_deb_configure_base
lve_deb_guest_tools
lve_deb_ssh_hostkey "$here"
# snapshot template mode (lve.snapshot=template on the kernel command line; docs/pool.md)
install -D -m 0755 "$here/snapshot-wait" "$root/usr/libexec/libvirt-executor/snapshot-wait"
install -m 0644 "$here/libvirt-executor-snapshot.service" "$root/etc/systemd/system/"
lve_in_root systemctl enable libvirt-executor-snapshot.service >/dev/null 2>&1
lve_deb_mask
lve_deb_identity
mkdir -p "$root/builds" "$root/cache"
chmod 0755 "$root/builds" "$root/cache"

lve_deb_finish "$DISK_SIZE"
