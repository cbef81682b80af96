#!/usr/bin/env bash
# Prints the build's identity for the Makefile: VERSION COMMIT DATE, one per line.
#   VERSION: the package version, valid for Debian: a tag vX.Y.Z gives X.Y.Z (with
#            +N.gCOMMIT when N commits follow it); without a tag, 0.0.N+gCOMMIT where N
#            is the number of commits (it grows with every commit, so upgrades order;
#            a shallow clone counts only what it has); "~dirty" is appended when the
#            tree has uncommitted changes (it sorts below the clean build of the same
#            commit); a tag's "-" becomes "~" (v1.0.0-rc1: 1.0.0~rc1, below 1.0.0).
#   COMMIT:  the full commit hash ("-dirty" appended likewise), "unknown" outside git.
#   DATE:    the build date for --version: SOURCE_DATE_EPOCH if set, else the commit's
#            date (reproducible: the same commit gives the same binaries).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! git rev-parse --verify -q HEAD >/dev/null 2>&1; then
	printf '0.0.0+unknown\nunknown\n%s\n' "$(date -u -d "@${SOURCE_DATE_EPOCH:-$(date +%s)}" +%Y-%m-%dT%H:%M:%SZ)"
	exit 0
fi
commit=$(git rev-parse HEAD)
short=$(git rev-parse --short=7 HEAD)
dirty=
if ! git diff --quiet HEAD -- 2>/dev/null; then dirty=1; fi
if tag=$(git describe --tags --abbrev=0 --match 'v[0-9]*' 2>/dev/null); then
	n=$(git rev-list --count "$tag..HEAD")
	version=${tag#v}
	version=${version//-/\~}
	if [ "$n" != 0 ]; then version+="+$n.g$short"; fi
else
	version="0.0.$(git rev-list --count HEAD)+g$short"
fi
if [ -n "$dirty" ]; then
	version+="~dirty"
	commit+=-dirty
fi
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct HEAD)}
printf '%s\n%s\n%s\n' "$version" "$commit" "$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)"
