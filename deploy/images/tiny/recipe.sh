#!/bin/bash
# Recipe of the "tiny" test image: busybox-static init + udhcpc, OpenSSH sshd, bash, git
# (with git-remote-http and its libcurl), Debian's cloud kernel, a small initramfs that
# loads the virtio drivers and switch_roots to the ext4 disk /dev/vda.
# Called by ../build.sh as: recipe.sh OUTDIR  (writes disk.qcow2 vmlinuz initrd.img there)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
out=$1
work=$out/work
root=$work/root
ird=$work/initramfs
DISK_SIZE=2G

lve_apt_install busybox-static openssh-server openssh-sftp-server openssh-client bash git \
	e2fsprogs qemu-utils cpio kmod gzip coreutils ca-certificates

mkdir -p "$work/kernel" "$root" "$ird"

# --- kernel + the few modules the initramfs loads ---------------------------------
lve_log "tiny: fetching the cloud kernel"
kver=$(lve_cloud_kernel "$work/kernel")
kx=$work/kernel/x
cp "$kx/boot/vmlinuz-$kver" "$out/vmlinuz"
mkdir -p "$ird/lib/modules" "$ird/bin" "$ird/proc" "$ird/sys" "$ird/dev" "$ird/newroot"
: >"$ird/lib/modules/load.list"
# isofs: the guest tools disk (an ISO 9660 image; see rcS); modprobe lists nothing for a
# built-in module
for m in virtio_pci virtio_blk virtio_net virtio_rng isofs; do
	# load order with dependencies first, each module once
	modprobe -d "$kx" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}' |
		while read -r ko; do
			b=$(basename "$ko")
			grep -qx "$b" "$ird/lib/modules/load.list" && continue
			cp "$ko" "$ird/lib/modules/$b"
			echo "$b" >>"$ird/lib/modules/load.list"
		done
done
cp /bin/busybox "$ird/bin/busybox"
for a in sh mount umount insmod mkdir sleep usleep cat switch_root poweroff echo; do
	ln -s busybox "$ird/bin/$a"
done
install -m 0755 "$here/initramfs-init" "$ird/init"
(cd "$ird" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet -R 0:0) | gzip -1 >"$out/initrd.img"

# --- root filesystem (merged /usr) ------------------------------------------------
lve_log "tiny: assembling the root filesystem"
mkdir -p "$root"/usr/bin "$root"/usr/sbin "$root"/usr/lib "$root"/usr/lib64
ln -s usr/bin "$root/bin"
ln -s usr/sbin "$root/sbin"
ln -s usr/lib "$root/lib"
ln -s usr/lib64 "$root/lib64"
mkdir -p "$root"/{dev,proc,sys,run,etc/init.d,root,builds,cache,tmp,var/tmp,var/log,mnt,home,usr/share/udhcpc} \
	"$root"/opt/libvirt-executor "$root"/usr/local/bin
# the guest tools disk's gitlab-runner and step-runner (mounted by rcS) on PATH; dangling
# without the disk or that program on it
ln -s /opt/libvirt-executor/bin/gitlab-runner "$root/usr/local/bin/gitlab-runner"
ln -s /opt/libvirt-executor/bin/step-runner "$root/usr/local/bin/step-runner"
chmod 0700 "$root/root"
chmod 1777 "$root/tmp" "$root/var/tmp"
ln -s /run "$root/var/run"

# real programs first, busybox fills in the rest
# perl: rcS's CRNG reseed of a snapshot clone (an ioctl busybox has no applet for)
lve_copy_elf "$root" /usr/bin/bash /usr/bin/git /usr/sbin/sshd /usr/bin/ssh-keygen \
	/usr/lib/openssh/sftp-server /usr/bin/perl \
	/usr/lib/git-core/git-remote-http /usr/lib/git-core/git-sh-i18n--envsubst
gc=$root/usr/lib/git-core
ln -s ../../bin/git "$gc/git"
for p in https ftp ftps; do ln -s git-remote-http "$gc/git-remote-$p"; done
for f in /usr/lib/git-core/*; do
	b=$(basename "$f")
	[ -e "$gc/$b" ] || [ -L "$gc/$b" ] && continue
	if [ -L "$f" ]; then
		# builtins: git-foo -> git
		[ "$(readlink "$f")" = git ] && ln -s git "$gc/$b"
	elif [ -f "$f" ] && head -n1 "$f" | grep -q '^#!/bin/sh\|^# '; then
		cp -p "$f" "$gc/$b" # shell helpers (git-submodule, git-sh-setup, ...); perl ones are skipped
	fi
done
mkdir -p "$root/usr/share/git-core"
cp -a /usr/share/git-core/templates "$root/usr/share/git-core/"
# the system CA store (Debian's bundle, where git's libcurl looks): a GitLab with a
# public certificate works without a CA file of the runner's
install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"

cp /bin/busybox "$root/usr/bin/busybox"
/bin/busybox --list-full | while read -r app; do
	name=$(basename "$app")
	case $app in
	sbin/* | usr/sbin/*) d=usr/sbin ;;
	*) d=usr/bin ;;
	esac
	[ -e "$root/usr/bin/$name" ] || [ -e "$root/usr/sbin/$name" ] || [ -L "$root/$d/$name" ] && continue
	ln -s /usr/bin/busybox "$root/$d/$name"
done

install -m 0755 "$here/rcS" "$root/etc/init.d/rcS"
install -m 0644 "$here/inittab" "$root/etc/inittab"
install -d -m 0755 "$root/etc/ssh"
install -m 0644 "$here/sshd_config" "$root/etc/ssh/sshd_config"
install -m 0755 "$here/udhcpc.script" "$root/usr/share/udhcpc/default.script"
cat >"$root/etc/passwd" <<'P'
root:*:0:0:root:/root:/bin/bash
sshd:x:100:65534::/run/sshd:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
P
cat >"$root/etc/group" <<'G'
root:x:0:
tty:x:5:
nogroup:x:65534:
G
printf '/bin/sh\n/bin/bash\n/usr/bin/bash\n' >"$root/etc/shells"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tlve-tiny\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
printf 'passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n' >"$root/etc/nsswitch.conf"
echo lve-tiny >"$root/etc/hostname"
: >"$root/etc/resolv.conf"
cat >"$root/etc/os-release" <<'O'
PRETTY_NAME="libvirt-executor tiny test image (busybox + dropbear + bash + git)"
NAME="lve-tiny"
ID=lve-tiny
ID_LIKE=debian
O

lve_log "tiny: making disk.qcow2 (ext4, $DISK_SIZE virtual)"
lve_mkfs_qcow2 "$root" "$out/disk.qcow2" "$DISK_SIZE" lve-root
printf 'kernel %s\n' "$kver" >"$out/versions.txt"
rm -rf "$work"
