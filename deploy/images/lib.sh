# shellcheck shell=bash
# Helpers shared by the image recipes (sourced, not executed).

lve_log() { printf '[images] %s\n' "$*" >&2; }
lve_die() { printf '[images] ERROR: %s\n' "$*" >&2; exit 1; }

# lve_image_hash DIR NAME: the cache key of image NAME, the first 16 hex digits of the
# sha256 over the names and sha256s of build.sh, lib.sh and every file of common/ and
# NAME/ under DIR (deploy/images), and of the recipe directory named in NAME/base when
# there is one (a recipe built on another's files, e.g. podman on debian): a change in
# any of them builds a new image.
lve_image_hash() {
	local dirs=("$2") base
	if [ -f "$1/$2/base" ]; then
		base=$(tr -d '[:space:]' <"$1/$2/base")
		case $base in '' | *[!a-z0-9]*) lve_die "$2/base: not a recipe name: '$base'" ;; esac
		dirs+=("$base")
	fi
	(cd "$1" && find build.sh lib.sh common "${dirs[@]}" -type f -print0 | LC_ALL=C sort -z |
		xargs -0 sha256sum | sha256sum | cut -c1-16)
}

# The log of the package manager's output (make deps, demo, test print one line per
# step; the log is named when a step fails).
LVE_APT_LOG=${LVE_APT_LOG:-/var/log/libvirt-executor-setup.log}

# lve_apt_install PKG...: install the packages that are not installed yet, quietly: one
# line, the package manager's output in $LVE_APT_LOG (its end shown if it fails).
# Never starts services (policy-rc.d), runs apt-get update at most once per process.
lve_apt_install() {
	local missing=() p st
	for p in "$@"; do
		st=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
		[ "$st" = installed ] || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	local t0=$SECONDS
	export DEBIAN_FRONTEND=noninteractive
	if [ -z "${LVE_APT_UPDATED:-}" ]; then
		# A failing third-party source must not stop us: Debian's mirror is what we need.
		apt-get update -qq >>"$LVE_APT_LOG" 2>&1 || true
		LVE_APT_UPDATED=1
	fi
	local prc=/usr/sbin/policy-rc.d made_prc=
	if [ ! -e "$prc" ]; then
		# Without systemd, package scripts would start daemons (libvirtd in the root
		# network namespace, with its default network): forbid that while installing.
		printf '#!/bin/sh\nexit 101\n' >"$prc"; chmod 0755 "$prc"; made_prc=1
	fi
	local rc=0
	printf '\n=== %s: apt-get install %s\n' "$(date -u +%FT%TZ)" "${missing[*]}" >>"$LVE_APT_LOG"
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$LVE_APT_LOG" 2>&1 </dev/null || rc=$?
	[ -n "$made_prc" ] && rm -f "$prc"
	if [ $rc -ne 0 ]; then
		tail -n 20 "$LVE_APT_LOG" >&2
		lve_die "apt-get install ${missing[*]} failed (its output: $LVE_APT_LOG)"
	fi
	lve_log "installed ${missing[*]} in $((SECONDS - t0)) s (log: $LVE_APT_LOG)"
}

# lve_host_path PATH: PATH with its directory resolved (merged-/usr aware), file name kept.
lve_host_path() {
	local d
	d=$(realpath -- "$(dirname -- "$1")")
	printf '%s/%s\n' "${d%/}" "$(basename -- "$1")"
}

# lve_copy_file ROOT PATH: copy a host file (dereferenced) to the same place under ROOT.
lve_copy_file() {
	local root=$1 src=$2 dst
	dst=$root$(lve_host_path "$src")
	[ -e "$dst" ] && return 0
	mkdir -p -- "$(dirname -- "$dst")"
	cp -L --preserve=mode -- "$src" "$dst"
}

# lve_copy_elf ROOT PATH...: copy ELF executables and every shared library they load (ldd).
lve_copy_elf() {
	local root=$1 f lib
	shift
	for f in "$@"; do
		lve_copy_file "$root" "$f"
		while read -r lib; do
			lve_copy_file "$root" "$lib"
		done < <(ldd "$f" 2>/dev/null | grep -o '/[^ ]*' | grep -v '^/.*:$' || true)
	done
}

# lve_fetch_deb PKG DIR: apt-get download PKG (latest candidate) into DIR, print the .deb path.
lve_fetch_deb() {
	local pkg=$1 dir=$2 deb
	( cd "$dir" && apt-get download -q "$pkg" >/dev/null 2>&1 ) \
		|| ( cd "$dir" && apt-get download -q "$pkg" >&2 ) \
		|| lve_die "apt-get download $pkg failed"
	local debs=("$dir"/"${pkg}"_*.deb)
	deb=${debs[0]}
	[ -f "$deb" ] || lve_die "no .deb for $pkg"
	printf '%s\n' "$deb"
}

# lve_cloud_kernel DIR: download + unpack Debian's current cloud kernel into DIR/x,
# print its version (e.g. 6.1.0-56-cloud-amd64).
lve_cloud_kernel() {
	local dir=$1 meta dep ver
	mkdir -p "$dir/x"
	meta=$(lve_fetch_deb linux-image-cloud-amd64 "$dir")
	dep=$(dpkg-deb -f "$meta" Depends | grep -o 'linux-image-[0-9][^ ,]*-cloud-amd64' | head -n1)
	[ -n "$dep" ] || lve_die "cannot find the kernel package behind linux-image-cloud-amd64"
	dpkg-deb -x "$(lve_fetch_deb "$dep" "$dir")" "$dir/x"
	ver=${dep#linux-image-}
	[ -f "$dir/x/boot/vmlinuz-$ver" ] || lve_die "vmlinuz-$ver missing in $dep"
	depmod -b "$dir/x" "$ver"
	printf '%s\n' "$ver"
}

# lve_mkfs_qcow2 SRC_DIR OUT.qcow2 SIZE LABEL: ext4 filled from SRC_DIR without mounting, as qcow2.
lve_mkfs_qcow2() {
	local src=$1 out=$2 size=$3 label=$4 raw
	raw=$out.raw
	rm -f -- "$raw"
	truncate -s "$size" "$raw"
	mkfs.ext4 -q -F -L "$label" -E root_owner=0:0 -d "$src" "$raw" "$size" >&2
	qemu-img convert -q -f raw -O qcow2 "$raw" "$out"
	rm -f -- "$raw"
}
