#!/usr/bin/env bash
# Installs what building, linting and testing libvirt-executor needs on Debian 12
# (run as root; `make deps`). Idempotent: what is present is not fetched again.
#
# Go: Debian 12's golang (1.19) is too old for this module. Without a Go of
# the version go.mod names (on PATH or in /usr/local/go), the official Go
# toolchain is fetched as the Go module golang.org/toolchain from the Go
# module proxy (the same module `go` itself downloads for GOTOOLCHAIN),
# verified against the Go checksum database, and unpacked into
# ${LVE_GO_ROOT:-/usr/local/go}. Verification:
#   - with any Go >= 1.16 already installed (too old to build, good enough to
#     fetch): `go mod download` does it, with the checksum database's signed
#     tree and inclusion proofs (GOENV=off: no go env file can switch it off);
#   - with no Go at all: the zip and the module's record in the checksum
#     database come from the proxy (its /sumdb/sum.golang.org/lookup endpoint,
#     as `go` asks it); the record's signature and tree inclusion are not
#     checked here, so the proxy's TLS is trusted for it.
# Either way the unpacked tree's Go module hash (dirhash "h1:") is computed
# here and must equal the checksum database's before anything is installed.
#
# Sourcing this file (for tests) defines the functions without running main.
set -euo pipefail

# busybox-static and dash: the unit tests run the guest-side wrapper under the
# login shells guests have (bash, dash, busybox ash). shellcheck: make lint. xz-utils:
# unpacks the gitlab-runner release binary of the real-runner tests (deploy/rig/test-runner.sh).
# prometheus: the observability e2e tests scrape the service with a real Prometheus server
# (started by the test in the rig's namespace; the package's own service is not started)
# and check the endpoint and the shipped rules with promtool.
# python3: the unit tests run the garm bootstrap's HTTP code (internal/garm/bootstrap.py).
# lintian: the e2e package test checks the built .deb (make package) with it.
# docker-registry: the registry the image tests push to and pull from (started by the
# tests on 127.0.0.1 or in the rig's namespace; the package's own service is not started).
# qemu-utils: the unit tests make hostile images with qemu-img (internal/imagecheck).
# rpm: the unit test of the package description (internal/packaging) reads the .rpm
# with rpm's own query tools (files, modes, config files, scripts, dependencies),
# and has shellcheck check the scriptlets as the .rpm carries them.
# uidmap: the GitHub hook e2e tests run virtiofsd in a user namespace of the share
# user's subordinate ids (newuidmap, newgidmap).
pkgs=(gcc make git pkg-config libvirt-dev ca-certificates curl unzip busybox-static dash shellcheck xz-utils prometheus python3 lintian docker-registry qemu-utils rpm uidmap conntrack)

die() { printf 'install-deps: %s\n' "$*" >&2; exit 1; }
# The package manager's and go install's output go here, not to the terminal; a
# failing step shows the log's end and names it.
LVE_APT_LOG=${LVE_APT_LOG:-/var/log/libvirt-executor-setup.log}
# logged CMD...: run CMD with its output appended to $LVE_APT_LOG.
logged() {
	printf '\n=== %s: %s\n' "$(date -u +%FT%TZ)" "$*" 2>/dev/null >>"$LVE_APT_LOG" ||
		{ LVE_APT_LOG=${TMPDIR:-/tmp}/libvirt-executor-setup.$(id -u).log && printf '\n=== %s: %s\n' "$(date -u +%FT%TZ)" "$*" >>"$LVE_APT_LOG"; }
	"$@" >>"$LVE_APT_LOG" 2>&1 && return 0
	local rc=$?
	tail -n 20 "$LVE_APT_LOG" >&2
	log "'$*' failed (exit $rc; its output: $LVE_APT_LOG)"
	return "$rc"
}
log() { printf 'install-deps: %s\n' "$*" >&2; }

install_packages() {
	local p missing=()
	for p in "${pkgs[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
	done
	((${#missing[@]})) || return 0
	[ "$(id -u)" = 0 ] || die "missing Debian packages ${missing[*]}: run 'make deps' as root"
	local t0=$SECONDS
	export DEBIAN_FRONTEND=noninteractive
	logged apt-get update -qq || log "apt-get update reported errors (unreachable extra repositories?); continuing"
	# No package may start its service here (prometheus would listen on
	# :9090 in the root namespace): a policy-rc.d that refuses every start,
	# unless the host has one of its own; removed again whatever happens.
	local policy=/usr/sbin/policy-rc.d ours=
	if [ ! -e "$policy" ]; then
		trap 'rm -f /usr/sbin/policy-rc.d' EXIT INT TERM
		printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 0755 "$policy" && ours=1
	fi
	local rc=0
	logged apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null || rc=$?
	[ "$rc" -ne 0 ] || log "installed ${missing[*]} in $((SECONDS - t0)) s (log: $LVE_APT_LOG)"
	if [ -n "$ours" ]; then
		rm -f "$policy"
		trap - EXIT INT TERM
	fi
	# The tests start their own Prometheus and registry: the packages' services are not
	# left enabled for the next boot either (only when installed here).
	local svc
	for svc in prometheus docker-registry; do
		[[ " ${missing[*]} " == *" $svc "* ]] || continue
		if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
			systemctl disable "$svc.service" >/dev/null 2>&1 || true
		fi
		update-rc.d "$svc" disable >/dev/null 2>&1 || true
	done
	return "$rc"
}

# go_version GO: print GO's version without the "go" prefix (fails for Go < 1.16).
go_version() {
	local v
	# (from /: a go.mod around the caller's directory must not switch toolchains)
	v=$(cd / && GOTOOLCHAIN=local "$1" env GOVERSION 2>/dev/null) || return 1
	[ -n "$v" ] || return 1
	printf '%s\n' "${v#go}"
}

# have_go GO WANT: is GO at least version WANT?
have_go() {
	local v
	v=$(go_version "$1") || return 1
	[ "$(printf '%s\n%s\n' "$2" "$v" | sort -V | head -n1)" = "$2" ]
}

# go_proxy: the first proxy URL of $GOPROXY (default proxy.golang.org), no trailing slash.
go_proxy() {
	local p=${GOPROXY:-https://proxy.golang.org}
	p=${p%%[,|]*}
	case $p in
	https://* | http://*) printf '%s\n' "${p%/}" ;;
	*) die "GOPROXY starts with '$p': the Go toolchain is fetched from a proxy URL only" ;;
	esac
}

# tree_h1 DIR NAMES: the Go module hash (golang.org/x/mod/sumdb/dirhash Hash1) of the
# files under DIR whose names (relative to DIR) are the lines of file NAMES: sha256 over
# the lines "<sha256 hex of the file>  <name>\n" in byte order of the names, base64.
tree_h1() {
	local hex
	hex=$(LC_ALL=C sort "$2" | tr '\n' '\0' | (cd "$1" && xargs -0 -r sha256sum --zero --) |
		tr '\0' '\n' | sha256sum | cut -d' ' -f1) || return 1
	[ ${#hex} = 64 ] || return 1
	printf 'h1:%s\n' "$(printf '%b' "$(printf '%s' "$hex" | sed 's/../\\x&/g')" | base64 -w0)"
}

# unpack_verified ZIP H1 DIR: unzip the module zip ZIP into the new directory DIR and
# check that what was unpacked is exactly the module whose hash is H1: its regular files
# are the zip's entries (same names, once each, nothing else but directories) and their
# dirhash is H1. Returns non-zero (leaving DIR for the caller to remove) otherwise.
unpack_verified() {
	local zip=$1 want=$2 dir=$3 got
	case $want in h1:?*) ;; *) log "no h1: hash to verify against ('$want')"; return 1 ;; esac
	mkdir "$dir" "$dir/x" || return 1
	unzip -Z1 "$zip" >"$dir/names" || { log "$zip: not a readable zip"; return 1; }
	unzip -qq "$zip" -d "$dir/x" </dev/null || { log "$zip: unzip failed"; return 1; }
	(cd "$dir/x" && find . -type f) | sed 's|^\./||' | LC_ALL=C sort >"$dir/files"
	if ! LC_ALL=C sort "$dir/names" | cmp -s - "$dir/files" ||
		[ -n "$(find "$dir/x" ! -type f ! -type d -print -quit)" ]; then
		log "$zip: the unpacked files are not the zip's entries (duplicate, unsafe or special names)"
		return 1
	fi
	got=$(tree_h1 "$dir/x" "$dir/files") || { log "cannot hash the unpacked $zip"; return 1; }
	if [ "$got" != "$want" ]; then
		log "CHECKSUM MISMATCH for $zip: unpacked $got, checksum database $want"
		return 1
	fi
	log "verified $(wc -l <"$dir/files") files against the checksum database: $got"
}

# fetch_toolchain VERSION TMP [VERIFIER_GO]: download module golang.org/toolchain@VERSION
# into TMP and print two lines: the zip's path and its h1: hash from the checksum
# database. With VERIFIER_GO, `go mod download` fetches and verifies it.
fetch_toolchain() {
	local ver=$1 tmp=$2 gobin=${3:-} proxy out zip sum
	proxy=$(go_proxy) || return 1
	if [ -n "$gobin" ]; then
		log "fetching golang.org/toolchain@$ver from $proxy with $gobin ($(go_version "$gobin")), verified by it against sum.golang.org"
		out=$(cd "$tmp" && env GOENV=off GOTOOLCHAIN=local GOFLAGS=-modcacherw GOPROXY="$proxy" \
			GOSUMDB=sum.golang.org GONOSUMDB= GOPRIVATE= GONOPROXY= GOINSECURE= \
			GOPATH="$tmp/gopath" GOMODCACHE="$tmp/gopath/pkg/mod" \
			"$gobin" mod download -json "golang.org/toolchain@$ver") ||
			{ printf '%s\n' "$out" >&2; log "go mod download failed"; return 1; }
		zip=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Zip": "\(.*\)",\{0,1\}$/\1/p')
		sum=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Sum": "\(h1:[^"]*\)",\{0,1\}$/\1/p')
	else
		log "fetching golang.org/toolchain@$ver and its checksum database record from $proxy"
		zip=$tmp/toolchain.zip
		curl -fsSL --retry 3 -o "$zip" "$proxy/golang.org/toolchain/@v/$ver.zip" || return 1
		sum=$(curl -fsSL --retry 3 "$proxy/sumdb/sum.golang.org/lookup/golang.org/toolchain@$ver" |
			awk -v v="$ver" '$1 == "golang.org/toolchain" && $2 == v && NF == 3 {print $3}') || return 1
	fi
	[ -f "$zip" ] || { log "no zip for golang.org/toolchain@$ver"; return 1; }
	[ "$(printf '%s\n' "$sum" | grep -c '^h1:')" = 1 ] ||
		{ log "no checksum database record for golang.org/toolchain@$ver"; return 1; }
	printf '%s\n%s\n' "$zip" "$sum"
}

# golangci-lint, for make lint: pinned, built from the Go module proxy by go
# itself (which checks every module against the checksum database).
GOLANGCI_LINT_VERSION=v2.15.0

# install_lint GO: golangci-lint $GOLANGCI_LINT_VERSION in $LVE_TOOLS_BIN
# (default /usr/local/bin), unless that version is there already.
install_lint() {
	local gobin=$1 dest=${LVE_TOOLS_BIN:-/usr/local/bin}
	if "$dest/golangci-lint" version 2>/dev/null | grep -q "has version ${GOLANGCI_LINT_VERSION#v} "; then
		return 0
	fi
	local t0=$SECONDS
	logged env GOBIN="$dest" GOFLAGS='' GOENV=off "$gobin" install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$GOLANGCI_LINT_VERSION" || return 1
	log "built golangci-lint $GOLANGCI_LINT_VERSION into $dest in $((SECONDS - t0)) s"
}

main() {
	local here want goroot g verifier="" tmp fetched zip sum ver src
	here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
	install_packages

	want=$(sed -n 's/^go //p' "$here/../go.mod")
	goroot=${LVE_GO_ROOT:-/usr/local/go}
	if have_go "$goroot/bin/go" "$want"; then
		install_lint "$goroot/bin/go"
		return 0
	fi
	if command -v go >/dev/null && have_go "$(command -v go)" "$want"; then
		install_lint "$(command -v go)"
		return 0
	fi
	mkdir -p "$(dirname "$goroot")" 2>/dev/null || true
	[ -w "$(dirname "$goroot")" ] || die "Go $want is missing and $(dirname "$goroot") is not writable: run 'make deps' as root"
	# An installed (too old) Go fetches and verifies with the checksum database's proofs.
	for g in "$goroot/bin/go" "$(command -v go || true)"; do
		if [ -n "$g" ] && go_version "$g" >/dev/null; then verifier=$g; break; fi
	done
	ver=v0.0.1-go${want}.linux-amd64
	# beside $goroot: the unpacked tree is renamed into place, not copied
	tmp=$(mktemp -d "$(dirname "$goroot")/.lve-go-install.XXXXXX")
	# shellcheck disable=SC2064 # $tmp is fixed now
	trap "chmod -R u+w '$tmp' 2>/dev/null; rm -rf '$tmp'" EXIT
	fetched=$(fetch_toolchain "$ver" "$tmp" "$verifier") || die "cannot fetch the Go toolchain $ver"
	zip=$(sed -n 1p <<<"$fetched")
	sum=$(sed -n 2p <<<"$fetched")
	unpack_verified "$zip" "$sum" "$tmp/unpacked" || die "refusing to install the Go toolchain $ver"
	src=$tmp/unpacked/x/golang.org/toolchain@$ver
	[ -f "$src/bin/go" ] || die "the toolchain zip has no bin/go"
	# Module zips carry no file modes.
	chmod -R a+rX "$src"
	chmod a+x "$src"/bin/* "$src"/pkg/tool/linux_amd64/*
	rm -rf "$goroot.new"
	mv "$src" "$goroot.new"
	[ ! -e "$goroot" ] || mv "$goroot" "$goroot.old.$$"
	mv "$goroot.new" "$goroot"
	rm -rf "$goroot.old.$$"
	"$goroot/bin/go" version
	install_lint "$goroot/bin/go"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
	main "$@"
fi
