#!/usr/bin/env bash
# Packs the set-up's CRIU (scripts/setup_criu.sh) for the GPU machine, which has none: the
# binary and the shared libraries it needs beyond glibc, into .criu/ (carry it), with .criu/criu,
# a wrapper that finds them. run.sh points PHOS_CRIU at it.
set -euo pipefail
cd "$(dirname "$0")/../.."
criu=${PHOS_CRIU:-${PHOS_PREFIX:-/opt/phos}/criu/sbin/criu}
[ -x "$criu" ] || { echo "no criu at $criu: run scripts/setup_criu.sh first" >&2; exit 1; }
rm -rf .criu && mkdir -p .criu/bin .criu/lib
cp "$criu" .criu/bin/criu
ldd "$criu" | awk '$3 ~ /^\// {print $3}' | grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' |
    xargs -r -I{} cp -L {} .criu/lib/
cat > .criu/criu <<'WRAP'
#!/bin/sh
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/criu" "$@"
WRAP
chmod +x .criu/criu
du -sh .criu
