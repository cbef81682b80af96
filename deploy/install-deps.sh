#!/usr/bin/env bash
# Installs what building and testing libvirt-executor needs on Debian 12
# (run as root). Idempotent: what is present is not fetched again.
#
# Go: Debian 12's golang (1.19) is too old for this module. Without a Go of
# the version go.mod names (on PATH or in /usr/local/go), the official Go
# toolchain is fetched as the Go module golang.org/toolchain from the Go
# module proxy (the same module `go` itself downloads for GOTOOLCHAIN) and
# unpacked into ${LVE_GO_ROOT:-/usr/local/go}.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# busybox-static and dash: the unit tests run the guest-side wrapper under the
# login shells guests have (bash, dash, busybox ash).
pkgs=(gcc make git pkg-config libvirt-dev ca-certificates curl unzip busybox-static dash)
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
	echo "install-deps: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq || echo "install-deps: apt-get update reported errors (unreachable extra repositories?); continuing"
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

want=$(sed -n 's/^go //p' "$here/../go.mod")
goroot=${LVE_GO_ROOT:-/usr/local/go}
have_go() { # have_go GO: is GO at least the version go.mod names?
	local v
	v=$("$1" env GOVERSION 2>/dev/null) || return 1
	v=${v#go}
	[ "$(printf '%s\n%s\n' "$want" "$v" | sort -V | head -n1)" = "$want" ]
}
if have_go "$goroot/bin/go" || { command -v go >/dev/null && have_go "$(command -v go)"; }; then
	exit 0
fi
proxy=$(printf '%s' "${GOPROXY:-https://proxy.golang.org}" | cut -d, -f1)
mod="golang.org/toolchain/@v/v0.0.1-go${want}.linux-amd64.zip"
echo "install-deps: fetching Go ${want} (module golang.org/toolchain) from ${proxy}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -fsSL --retry 3 -o "$tmp/go.zip" "$proxy/$mod"
unzip -q "$tmp/go.zip" -d "$tmp/x"
src=$(echo "$tmp"/x/golang.org/toolchain@*)
# Module zips carry no file modes.
chmod -R a+rX "$src"
chmod a+x "$src"/bin/* "$src"/pkg/tool/linux_amd64/*
rm -rf "$goroot.new"
mv "$src" "$goroot.new"
[ ! -e "$goroot" ] || mv "$goroot" "$goroot.old.$$"
mv "$goroot.new" "$goroot"
rm -rf "$goroot.old.$$"
"$goroot/bin/go" version
