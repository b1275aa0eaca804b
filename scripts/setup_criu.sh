#!/usr/bin/env bash
# CRIU 4 or newer, for whole-process checkpoints (phos/process.py), into $PHOS_PREFIX/criu (default
# /opt/phos): Debian 12's criu 3.17 fails on current kernels, and Debian 13's binary needs a newer
# glibc, so it is built from Debian 13's source tarball (fetched with apt through a configuration
# of our own: the system's sources stay as they are). Sourced by scripts/setup.sh; safe to run again.
set -euo pipefail
prefix=${PHOS_PREFIX:-/opt/phos}
have() {   # a criu of version 4 or newer at $1
    [ -x "$1" ] && "$1" --version 2>/dev/null | grep -Eq 'Version: ([4-9]|[1-9][0-9])\.'
}
for c in "${PHOS_CRIU:-}" "$prefix/criu/sbin/criu" "$(command -v criu || true)"; do
    [ -n "$c" ] && have "$c" && exit 0
done

echo "phos setup: building CRIU 4 into $prefix/criu"
deps=(build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler
      python3-protobuf libcap-dev libnl-3-dev libnet1-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev
      xz-utils ca-certificates)
missing=()
for pkg in "${deps[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The archive the system already uses, for Debian 13's sources.
uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$uri" ] || uri=$(awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$uri" ] || { echo "phos setup: no Debian archive in the apt sources to fetch CRIU's source from" >&2; exit 1; }
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri trixie main" > "$work/sources.list"
opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=/dev/null
      -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache")
apt-get "${opts[@]}" -o APT::Sandbox::User=root update -qq
# apt checks the tarball against the archive's signed index; the .dsc it may not find is not needed
(cd "$work" && apt-get "${opts[@]}" -o APT::Sandbox::User=root source --download-only criu >/dev/null 2>&1 || true)
tarball=$(ls "$work"/criu_*.orig.tar.* 2>/dev/null | head -1)
[ -n "$tarball" ] || { echo "phos setup: CRIU's source tarball could not be fetched" >&2; exit 1; }
tar -C "$work" -xf "$tarball"
src=$(find "$work" -maxdepth 1 -type d -name 'criu-*' | head -1)
make -s -C "$src" -j"$(nproc)" criu >/dev/null
install -D -m 0755 "$src/criu/criu" "$prefix/criu/sbin/criu"
"$prefix/criu/sbin/criu" --version | head -1
