#!/usr/bin/env bash
# make release: from a clean tree, the .deb and the .rpm (one description:
# internal/packaging), SHA256SUMS and the version's CHANGELOG.md entry, into
# bin/release/VERSION/. Not root; needs what make build and make package need.
#
# The version is deploy/package/version.sh's. A tagged commit (vX.Y.Z: version
# X.Y.Z, or X.Y.Z~rc1 for v X.Y.Z-rc1) needs a CHANGELOG.md entry "## X.Y.Z" (or
# "## [X.Y.Z]", "## X.Y.Z-rc1", optionally followed by " - DATE"); any other commit
# (0.0.N+gCOMMIT, X.Y.Z+N.gCOMMIT) releases what "## Unreleased" says. The entry is
# written beside the packages as RELEASE-NOTES.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
die() { printf 'release: %s\n' "$*" >&2; exit 1; }
cd "$top"

# A clean tree: no change, staged or not, and no untracked file (docs/*.md are
# packaged by glob); ignored build outputs do not count.
if [ -n "$(git status --porcelain --untracked-files=normal)" ]; then
	git status --short >&2
	die "the tree is not clean: commit or stash the changes above first"
fi
mapfile -t id < <("$here/version.sh")
version=${id[0]}
case $version in
*~dirty) die "version $version: the tree is not clean" ;;
*+*) heading=Unreleased ;;
*) heading=$version ;;
esac

# The entry: from its "## " heading to the next one.
entry=$(awk -v a="$heading" -v b="${heading//\~/-}" '
	/^## / {
		h = substr($0, 4); sub(/ +-.*$/, "", h); gsub(/[][]/, "", h)
		if (on) exit
		on = (h == a || h == b); next
	}
	on' CHANGELOG.md)
[ -n "$(printf '%s' "$entry" | tr -d '[:space:]')" ] ||
	die "CHANGELOG.md has no entry \"## $heading\" for version $version: write what changed for an admin and what to do when upgrading, commit, then make release"

make --no-print-directory build
out=bin/release/$version
rm -rf "$out"
mkdir -p "$out"
go=${GO:-go}
command -v "$go" >/dev/null || go=/usr/local/go/bin/go
"$go" run ./cmd/lve-package --top "$top" --binaries "$top/bin" --version "$version" \
	--commit "${id[1]}" --date "${id[2]}" --format deb,rpm "$out" >/dev/null
{
	printf '# libvirt-executor %s\n\n' "$version"
	printf '%s\n' "$entry" | sed '/./,$!d'
} >"$out/RELEASE-NOTES.md"
(cd "$out" && sha256sum -- *.deb *.rpm RELEASE-NOTES.md >SHA256SUMS)
echo "release: libvirt-executor $version (commit ${id[1]}) in $out:"
(cd "$out" && ls -l -- *)
