#!/bin/sh
# Pinned copies through phos against memcpy, on emu (CI can run it: no GPU): builds perf/bench_pinned.c
# against phos's libcuda.so.1, runs it through the native stub against an emu server over ipc, and
# prints one table. The pinned buffer is memory the worker maps (schema/phos.capnp, "Pinned host
# memory"): a copy is one memcpy in the worker, against the same memcpy in the application.
#   perf/bench_pinned_emu.sh [--server ADDR] [bench_pinned options: --mib N (256) --repeats N (7)]
# Target: each pinned copy at least 80% of memcpy's rate between the same buffers in the same
# direction (host->device against memcpy out of the pinned buffer, device->host into it).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CC=${CC:-cc}
PYTHON=${PYTHON:-python3}
server=""
if [ "${1:-}" = "--server" ]; then server=$2; shift 2; fi

. "$root/tests/apps/stub_session.sh"
$CC -O2 -I"$CUDA_HOME/include" -o "$work/bench_pinned" "$here/bench_pinned.c" \
    -L"$root/phos/stub" -l:libcuda.so.1 -Wl,-rpath,"$root/phos/stub"

[ -n "$server" ] || start_server emu
PHOS_SERVER=$server PHOS_VERBOSE=1 "$work/bench_pinned" "$@" > "$work/pinned.txt" 2> "$work/stub.txt"
grep -q "the worker mapped pinned host memory" "$work/stub.txt" ||
    { echo "the worker did not map the pinned buffer: these are not pinned copies in place"; cat "$work/stub.txt"; exit 1; }

$PYTHON - "$work/pinned.txt" <<'PY'
import sys
with open(sys.argv[1]) as f:
    figures = dict((k, float(v)) for k, v in (line.split() for line in f if line.strip()))
# host->device reads the pinned buffer as memcpy to the pageable one does; device->host writes it
memcpy = {"h2d": figures["memcpy_to_pageable_GBps"], "d2h": figures["memcpy_from_pageable_GBps"]}
print(f"{'figure':28} {'GB/s':>8} {'of memcpy':>10}  target (>= 0.80)")
for name, value in figures.items():
    if name.startswith("memcpy"):
        print(f"{name:28} {value:>8.2f}")
    else:
        ratio = value / memcpy[name.split("_")[1]]
        print(f"{name:28} {value:>8.2f} {ratio:>10.2f}  {'met' if ratio >= 0.8 else 'MISSED'}")
PY
