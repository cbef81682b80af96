#!/usr/bin/env bash
# test-tool.sh TOOL BIN_DIR: prints the path of the TOOL binary the tests use (gitlab-runner or
# step-runner), or nothing when there is none:
#   1. $LVE_E2E_GITLAB_RUNNER / $LVE_E2E_STEP_RUNNER, if set (must be executable);
#   2. the release binary provided beside the checkout on the project's CI machines,
#      ../shared/tools/TOOL-VERSION.xz, unpacked once into BIN_DIR and checked against its
#      published sha256 (see ../shared/tools/README.md);
#   3. TOOL on PATH.
# Fails (exit 1) when a binary is named or provided but unusable: a test tier that should
# run must not be skipped silently.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tool=${1:?usage: test-tool.sh gitlab-runner|step-runner BIN_DIR}
bin_dir=${2:?usage: test-tool.sh gitlab-runner|step-runner BIN_DIR}
die() { printf 'test-tool: %s: %s\n' "$tool" "$*" >&2; exit 1; }

case $tool in
gitlab-runner)
	var=LVE_E2E_GITLAB_RUNNER
	xz_file=$here/../../../shared/tools/gitlab-runner-17.9.3.xz
	want=45939aab73a83fe2b9ccaaddf2a47c39605b20ffaa2235a2ffbee9d5d67f78f0 ;;
step-runner)
	var=LVE_E2E_STEP_RUNNER
	xz_file=$here/../../../shared/tools/step-runner-0.11.0.xz
	want=6a32698a60c31c6123261b8dc7b52b17d7675bf0076e8bd75207025994916c11 ;;
*) printf 'test-tool: unknown tool %q (allowed: gitlab-runner, step-runner)\n' "$tool" >&2; exit 2 ;;
esac

if [ -n "${!var:-}" ]; then
	[ -x "${!var}" ] || die "$var=${!var} is not an executable file"
	echo "${!var}"
	exit 0
fi
if [ -f "$xz_file" ]; then
	out=$(cd "$bin_dir" && pwd)/$tool
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
command -v "$tool" || true
