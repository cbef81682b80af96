#!/usr/bin/env bash
# Builds the Debian package: deploy/package/build.sh [--binaries DIR] [--version V] OUTDIR
# (make package). Prints the .deb's path on stdout, nothing else.
#
# It packages make build's six executables (position-independent) and the guest agent
# (static) from bin/, stamped with deploy/package/version.sh's identity, stripped; --binaries DIR packages those
# found in DIR instead (the e2e upgrade test packages an earlier commit's build this
# way, with --version naming it). Needs binutils' strip and dpkg-deb; not root: the
# files are root's in the archive.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
die() { printf 'package: %s\n' "$*" >&2; exit 1; }

bins='' version='' from_flag=''
while [ $# -gt 1 ]; do
	case $1 in
	--binaries) bins=$2; from_flag=1; shift 2 ;;
	--version) version=$2; shift 2 ;;
	*) die "unknown option $1 (allowed: --binaries DIR, --version V)" ;;
	esac
done
[ $# -eq 1 ] || die "usage: build.sh [--binaries DIR] [--version V] OUTDIR"
out=$1
command -v dpkg-deb >/dev/null || die "dpkg-deb is missing (apt-get install dpkg)"

mapfile -t id < <("$here/version.sh")
version=${version:-${id[0]}}
[[ $version =~ ^[0-9][A-Za-z0-9.+~]*$ ]] || die "version '$version': must start with a digit and hold only letters, digits and . + ~"

pkg=libvirt-executor
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/root
exes=(libvirt-executor libvirt-executor-config libvirt-executor-prepare libvirt-executor-run libvirt-executor-cleanup libvirt-executor-garm)

install -d -m 0755 "$root/usr/bin"
bins=${bins:-$top/bin}
for e in "${exes[@]}"; do
	[ -x "$bins/$e" ] || die "no executable $e in $bins (make build first, or --binaries DIR)"
	# What dh_strip does: the package ships no symbols.
	strip --remove-section=.comment --remove-section=.note --strip-unneeded -o "$root/usr/bin/$e" "$bins/$e"
	chmod 0755 "$root/usr/bin/$e"
done

# The guest agent (static; it goes onto the guests' tools disk, never runs on the host):
# where guest_tools.agent = "auto" finds it, ../lib/libvirt-executor from /usr/bin.
# A build from before the agent (--binaries of an earlier commit) has none.
if [ -x "$bins/lve-agent" ]; then
	install -d -m 0755 "$root/usr/lib/libvirt-executor"
	strip --remove-section=.comment --remove-section=.note --strip-unneeded -o "$root/usr/lib/libvirt-executor/lve-agent" "$bins/lve-agent"
	chmod 0755 "$root/usr/lib/libvirt-executor/lve-agent"
elif [ -z "$from_flag" ]; then
	die "no lve-agent in $bins (make build first)"
fi

# systemd units, pointed at /usr/bin.
install -d -m 0755 "$root/lib/systemd/system"
for u in libvirt-executor.service libvirt-executor-gc.service libvirt-executor-gc.timer; do
	sed 's|/usr/local/bin/|/usr/bin/|g; s|make install (or cp it to /etc/systemd/system/)|the libvirt-executor package|' \
		"$top/deploy/systemd/$u" >"$root/lib/systemd/system/$u"
	chmod 0644 "$root/lib/systemd/system/$u"
done

# Configuration (conffiles). The guard hook guards no network until one is listed in
# its configuration, so installing the package changes no network.
install -d -m 0755 "$root/etc/libvirt-executor" "$root/etc/libvirt/hooks/network.d"
install -m 0640 "$top/deploy/config.example.toml" "$root/etc/libvirt-executor/config.toml"
install -m 0755 "$top/deploy/network/libvirt-executor-guard" "$root/etc/libvirt/hooks/network.d/50-libvirt-executor-guard"
sed 's/^\([a-z]\)/# \1/' "$top/deploy/network/libvirt-executor-guard.conf" >"$root/etc/libvirt/hooks/libvirt-executor-guard.conf"
chmod 0644 "$root/etc/libvirt/hooks/libvirt-executor-guard.conf"
# polkit rules for libvirt's access driver, for the example configuration (they do
# nothing until access_drivers = [ "polkit" ]; /etc/polkit-1/rules.d/ of the same name wins).
install -d -m 0755 "$root/usr/share/polkit-1/rules.d"
install -m 0644 "$top/deploy/polkit/50-libvirt-executor.rules" "$root/usr/share/polkit-1/rules.d/50-libvirt-executor.rules"

# Documentation and examples.
doc=$root/usr/share/doc/$pkg
install -d -m 0755 "$doc/examples"
install -m 0644 "$top"/docs/*.md "$doc/"
install -m 0644 "$top/README.md" "$doc/README.md"
install -m 0644 "$top/deploy/config.example.toml" "$top/deploy/garm.example.toml" "$doc/examples/"
install -m 0644 "$top/deploy/prometheus/alerts.yml" "$top/deploy/grafana/libvirt-executor.json" "$doc/examples/"
install -m 0644 "$here/debian/copyright" "$doc/copyright"
{
	printf '%s (%s) unstable; urgency=medium\n\n' "$pkg" "$version"
	if [ -n "$from_flag" ]; then
		printf '  * Packaged from the prebuilt executables given (--binaries).\n\n'
	else
		printf '  * Built from commit %s.\n\n' "${id[1]}"
	fi
	printf ' -- libvirt-executor developers <libvirt-executor@localhost>  %s\n' "$(date -u -R -d "${id[2]}")"
} | gzip -9n >"$doc/changelog.gz"
chmod 0644 "$doc/changelog.gz"
install -d -m 0755 "$root/usr/share/lintian/overrides"
install -m 0644 "$here/debian/lintian-overrides" "$root/usr/share/lintian/overrides/$pkg"

# Control area.
install -d -m 0755 "$root/DEBIAN"
for f in postinst prerm postrm; do install -m 0755 "$here/debian/$f" "$root/DEBIAN/$f"; done
(cd "$root" && find etc -type f | sed 's|^|/|' | LC_ALL=C sort) >"$root/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@SIZE@/$size/" "$here/debian/control" >"$root/DEBIAN/control"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/conffiles" "$root/DEBIAN/md5sums"

mkdir -p "$out"
deb=$out/${pkg}_${version}_amd64.deb
# Reproducible: the files' times are the build date.
find "$root" -exec touch -h -d "${id[2]}" {} +
# xz as Debian's own; LVE_DEB_FAST=1 (the e2e test) trades size for time: gzip -1.
comp=(-Zxz)
if [ "${LVE_DEB_FAST:-}" = 1 ]; then comp=(-Zgzip -z1); fi
dpkg-deb --root-owner-group "${comp[@]}" --build "$root" "$deb" >/dev/null
printf '%s\n' "$deb"
