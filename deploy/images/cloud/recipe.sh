#!/bin/bash
# Recipe of the "cloud" test image: the "debian" image's approach (Debian 12 minbase,
# systemd 252, systemd-networkd DHCP, OpenSSH server, git, Debian's cloud kernel, direct
# kernel boot with root=/dev/vda) with cloud-init in place of the SMBIOS credentials:
# key_injection = "cloud-init", user "debian" (see image.env). The steps and config files
# it shares with ../debian are in ../common.
# Per-job keys: cloud-init (datasource NoCloud only) reads the executor's seed disk
# (label "cidata", vdb), creates the user "debian" with the client key and passwordless
# sudo, and installs the per-job host key (ssh_keys) before ssh.service starts.
# Called by ../build.sh as: recipe.sh OUTDIR  (writes disk.qcow2 vmlinuz initrd.img there)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
. "$here/../common/debian.sh"
name=cloud
out=$1
work=$out/work
root=$work/root
DISK_SIZE=4G

lve_deb_enter_mount_ns "$0" "$@"
lve_deb_bootstrap sudo
lve_deb_install_kernel cloud-init

lve_log "cloud: configuring"
lve_deb_configure_base
lve_deb_guest_tools
# cloud-init: NoCloud seed only, no network config, only the "init" stage's modules
install -m 0644 "$here/cloud.cfg.d-libvirt-executor.cfg" "$root/etc/cloud/cloud.cfg.d/99-libvirt-executor.cfg"
# per-job SSH host key from cloud-init; no image host keys; ssh only after cloud-init and
# only with that key
install -D -m 0644 "$here/ssh.service.d-libvirt-executor.conf" \
	"$root/etc/systemd/system/ssh.service.d/libvirt-executor.conf"
install -D -m 0644 "$here/sshd_config.d-libvirt-executor.conf" \
	"$root/etc/ssh/sshd_config.d/libvirt-executor.conf"
lve_in_root systemctl enable ssh.service >/dev/null 2>&1
rm -f "$root"/etc/ssh/ssh_host_*
# cloud-init state of the build (there should be none): every clone is a first boot
rm -rf "$root"/var/lib/cloud/* "$root"/var/log/cloud-init*
# Of cloud-init's four stages only cloud-init.service ("init": finds the NoCloud seed,
# runs the user, hostname and ssh modules, Before=sysinit.target and ssh.service) runs:
# each stage is a Python start costing 5-20 s under TCG. cloud-init-local only finds the
# seed early to write network configuration (disabled here) and holds back networkd
# (Before=network-pre.target); cloud-config and cloud-final would run beside the job.
lve_deb_mask cloud-init-local.service cloud-config.service cloud-final.service cloud-init-hotplugd.socket
lve_deb_identity
# the job user "debian" exists only from the first boot on (cloud-init makes it): sticky
# world-writable like /tmp
mkdir -p "$root/builds" "$root/cache"
chmod 1777 "$root/builds" "$root/cache"

lve_deb_finish "$DISK_SIZE" cloud-init
