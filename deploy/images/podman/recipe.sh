#!/bin/bash
# Recipe of the "podman" image: the "debian" image (Debian 12 minbase, systemd 252,
# systemd-networkd DHCP, OpenSSH server, git, Debian's cloud kernel, direct kernel boot,
# per-job keys from the SMBIOS credentials; its files in ../debian, named in ./base so that
# they are part of this image's hash) plus a container runtime for a job's `services:`
# (docs/services.md): Debian 12's podman with crun, conmon, netavark and aardvark-dns
# (a per-job network with DNS), iptables (netavark's firewall driver), catatonit (--init).
# Containers run rootful: the login user is root. Nothing is pulled into the image.
# Called by ../build.sh as: recipe.sh OUTDIR  (writes disk.qcow2 vmlinuz initrd.img there)
# shellcheck disable=SC2119 # (the shared bootstrap step's optional extra packages: none here)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
deb=$here/../debian
. "$here/../lib.sh"
. "$here/../common/debian.sh"
name=podman
out=$1
work=$out/work
root=$work/root
# room for a few service images beside the system (the overlay grows only as written)
DISK_SIZE=8G
runtime=(podman crun conmon netavark aardvark-dns iptables catatonit)

lve_deb_enter_mount_ns "$0" "$@"
lve_deb_bootstrap
lve_deb_install_kernel "${runtime[@]}"

lve_log "podman: configuring"
lve_deb_configure_base
lve_deb_guest_tools
lve_deb_ssh_hostkey "$deb"
# podman: netavark (not CNI) for per-job networks with DNS (aardvark-dns); the overlay
# storage driver on the guest's ext4; the driver writes registries.conf.d at job time.
install -D -m 0644 "$here/containers.conf" "$root/etc/containers/containers.conf"
install -D -m 0644 "$here/storage.conf" "$root/etc/containers/storage.conf"
install -d -m 0755 "$root/etc/containers/registries.conf.d"
# the kernel modules a container network needs, loaded at boot rather than on demand
install -D -m 0644 "$here/modules-load.conf" "$root/etc/modules-load.d/libvirt-executor-podman.conf"
lve_deb_mask podman-auto-update.timer podman-restart.service podman.socket
lve_deb_identity
mkdir -p "$root/builds" "$root/cache"
chmod 0755 "$root/builds" "$root/cache"

lve_deb_finish "$DISK_SIZE" podman crun netavark aardvark-dns
