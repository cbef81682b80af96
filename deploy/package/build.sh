#!/usr/bin/env bash
# Builds the Debian package: deploy/package/build.sh [--binaries DIR] [--version V] OUTDIR
# (make package). Prints the .deb's path on stdout, nothing else.
#
# It packages make build's seven executables (position-independent) and the guest agent
# (static) from bin/, stamped with deploy/package/version.sh's identity, stripped; --binaries DIR packages those
# found in DIR instead (the e2e upgrade test packages an earlier commit's build this
# way, with --version naming it). The package is described once, for the .deb and the
# .rpm, in internal/packaging (nfpm's packagers; cmd/lve-package writes them; make
# release writes both). Needs Go and binutils' strip; not root: the files are root's
# in the archive.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
die() { printf 'package: %s\n' "$*" >&2; exit 1; }

bins='' version='' prebuilt=()
while [ $# -gt 1 ]; do
	case $1 in
	--binaries) bins=$2; prebuilt=(--prebuilt); shift 2 ;;
	--version) version=$2; shift 2 ;;
	*) die "unknown option $1 (allowed: --binaries DIR, --version V)" ;;
	esac
done
[ $# -eq 1 ] || die "usage: build.sh [--binaries DIR] [--version V] OUTDIR"
out=$(mkdir -p "$1" && cd "$1" && pwd)
command -v strip >/dev/null || die "strip is missing (apt-get install binutils)"
go=${GO:-go}
command -v "$go" >/dev/null || go=/usr/local/go/bin/go
command -v "$go" >/dev/null || die "Go is missing (make deps)"

mapfile -t id < <("$here/version.sh")
version=${version:-${id[0]}}
[[ $version =~ ^[0-9][A-Za-z0-9.+~]*$ ]] || die "version '$version': must start with a digit and hold only letters, digits and . + ~"
bins=$(cd "${bins:-$top/bin}" && pwd) || die "no directory ${bins:-$top/bin} (make build first, or --binaries DIR)"

# xz as Debian's own; LVE_DEB_FAST=1 (the e2e test) trades size for time: gzip.
fast=()
if [ "${LVE_DEB_FAST:-}" = 1 ]; then fast=(--fast); fi
# Reproducible: the files' times are the build date.
cd "$top"
"$go" run ./cmd/lve-package --top "$top" --binaries "$bins" "${prebuilt[@]}" --version "$version" \
	--commit "${id[1]}" --date "${id[2]}" --format deb "${fast[@]}" "$out"
