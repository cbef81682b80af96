#!/bin/bash
# Build (or reuse) a libvirt-executor test guest image.
#
#   deploy/images/build.sh tiny|debian|cloud|podman
#
# Prints the image directory as the last line of stdout (progress goes to stderr):
#   ${LVE_IMAGE_CACHE:-/var/cache/libvirt-executor/images}/<name>-<hash>/
#     disk.qcow2  vmlinuz  initrd.img  image.toml  versions.txt
# <hash> is the first 16 hex digits of the sha256 over this script, lib.sh, every file of
# common/ (what the recipes share), of the recipe directory <name>/ and of the recipe
# directory named in <name>/base if there is one (lve_image_hash):
# an unchanged recipe is a cache hit (instant), a changed one builds a new directory. A recipe directory may hold image.env, shell assignments of
# IMAGE_USER (login user, default root) and IMAGE_KEY_INJECTION (smbios or cloud-init,
# default smbios) for image.toml. Builds run in a temporary directory beside the cache entry
# and are renamed into place when complete, so an interrupted build leaves no half image.
# Needs root on Debian 12 (installs what it needs with apt-get).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"

name=${1:-}
case $name in
tiny | debian | cloud | podman) ;;
*) echo "usage: $0 tiny|debian|cloud|podman" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || lve_die "must run as root"

cache=${LVE_IMAGE_CACHE:-/var/cache/libvirt-executor/images}
hash=$(lve_image_hash "$here" "$name")
final=$cache/$name-$hash

if [ -f "$final/image.toml" ]; then
	lve_log "$name: cached"
	echo "$final"
	exit 0
fi

mkdir -p "$cache"
chmod 0755 "$cache"
exec 9>"$cache/.$name.lock"
flock 9 # one build per image name at a time
if [ -f "$final/image.toml" ]; then
	lve_log "$name: built meanwhile by another run"
	echo "$final"
	exit 0
fi
# Leftovers of interrupted builds of this image (we hold its lock, so none is running).
rm -rf "$cache/.tmp-$name-"*

tmp=$(mktemp -d "$cache/.tmp-$name-$hash.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
lve_log "$name: building into $tmp"
start=$(date +%s)
bash "$here/$name/recipe.sh" "$tmp" >&2

for f in disk.qcow2 vmlinuz initrd.img; do
	[ -s "$tmp/$f" ] || lve_die "$name: recipe made no $f"
done
IMAGE_USER=root
IMAGE_KEY_INJECTION=smbios
# shellcheck source=cloud/image.env
if [ -f "$here/$name/image.env" ]; then . "$here/$name/image.env"; fi
# root=/dev/vda: the overlay must be the domain's first virtio disk (a credentials or
# cloud-init seed disk comes after it).
cmdline="console=ttyS0 root=/dev/vda rw quiet"
cat >"$tmp/image.toml" <<T
[images.$name]
base = "$final/disk.qcow2"
format = "qcow2"
user = "$IMAGE_USER"
shell = "bash"
builds_dir = "/builds"
cache_dir = "/cache"
key_injection = "$IMAGE_KEY_INJECTION"
boot = "kernel"
kernel = "$final/vmlinuz"
initrd = "$final/initrd.img"
cmdline = "$cmdline"
T
# libvirt's QEMU runs as an unprivileged user: everything must be world-readable.
chmod 0755 "$tmp"
chmod 0644 "$tmp"/*
sync -f "$tmp/disk.qcow2" 2>/dev/null || true
mv -T "$tmp" "$final"
trap - EXIT
lve_log "$name: built in $(($(date +%s) - start)) s: $final"
echo "$final"
