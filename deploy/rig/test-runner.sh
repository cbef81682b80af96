#!/usr/bin/env bash
# Prints the path of the gitlab-runner binary the tests use, or nothing when there is none:
#   1. $LVE_E2E_GITLAB_RUNNER, if set (must be executable);
#   2. the release binary provided beside the checkout on the project's CI machines,
#      ../shared/tools/gitlab-runner-17.9.3.xz, unpacked once into BIN_DIR (argument 1)
#      and checked against its published sha256 (see ../shared/tools/README.md);
#   3. gitlab-runner on PATH.
# Fails (exit 1) when a binary is named or provided but unusable: a test tier that should
# run must not be skipped silently.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin_dir=${1:?usage: test-runner.sh BIN_DIR}
die() { printf 'test-runner: %s\n' "$*" >&2; exit 1; }

if [ -n "${LVE_E2E_GITLAB_RUNNER:-}" ]; then
	[ -x "$LVE_E2E_GITLAB_RUNNER" ] || die "LVE_E2E_GITLAB_RUNNER=$LVE_E2E_GITLAB_RUNNER is not an executable file"
	echo "$LVE_E2E_GITLAB_RUNNER"
	exit 0
fi
xz_file=$here/../../../shared/tools/gitlab-runner-17.9.3.xz
want=45939aab73a83fe2b9ccaaddf2a47c39605b20ffaa2235a2ffbee9d5d67f78f0
if [ -f "$xz_file" ]; then
	out=$(cd "$bin_dir" && pwd)/gitlab-runner
	if [ ! -x "$out" ] || [ "$(sha256sum <"$out" | cut -d' ' -f1)" != "$want" ]; then
		command -v xz >/dev/null || die "xz is needed to unpack $xz_file (make deps)"
		xz -dc "$xz_file" >"$out.tmp" || die "cannot unpack $xz_file"
		got=$(sha256sum <"$out.tmp" | cut -d' ' -f1)
		[ "$got" = "$want" ] || { rm -f "$out.tmp"; die "$xz_file: sha256 $got, want $want"; }
		chmod 0755 "$out.tmp"
		mv -f "$out.tmp" "$out"
	fi
	echo "$out"
	exit 0
fi
command -v gitlab-runner || true
