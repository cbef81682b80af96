#!/usr/bin/env bash
# Installs what building and testing libvirt-executor needs on Debian 12
# (run as root). Idempotent: packages already present are not fetched again.
set -euo pipefail
pkgs=(gcc make git pkg-config libvirt-dev ca-certificates)
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
	echo "install-deps: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v go >/dev/null 2>&1 && [ ! -x /usr/local/go/bin/go ]; then
	echo "install-deps: Go is missing; Debian 12's golang is too old for this module." >&2
	echo "install-deps: install Go >= $(sed -n 's/^go //p' "$(dirname "$0")/../go.mod") to /usr/local/go" >&2
	exit 1
fi
