#!/bin/sh
# Native vs phos on a GPU machine (perf/device/run.sh bench runs it on the H200): builds perf/bench_stub.cu,
# runs it natively, then through phos's native stub (NVIDIA's libcudart, as phos/stub holds
# it, over phos's libcuda.so.1) against a `cuda` server over ipc; prints one table. PHOS_BENCH_BACKEND=emu: the phos columns alone, on emu.
#   perf/bench_stub.sh [--server ADDR] [bench_stub options: --big-mib N --launches N --rtt N]
# Targets: sync_rtt_us <= 25 over ipc; launch_us <= 2x native.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")}
PYTHON=${PYTHON:-python3}
backend=${PHOS_BENCH_BACKEND:-cuda}
server=""
if [ "${1:-}" = "--server" ]; then server=$2; shift 2; fi

. "$root/tests/apps/stub_session.sh"
$NVCC -cudart shared -O2 -gencode arch=compute_90,code=compute_90 -gencode arch=compute_90,code=sm_90 \
    -o "$work/bench_stub" "$here/bench_stub.cu"

if [ "$backend" = cuda ]; then
    LD_LIBRARY_PATH="$CUDA_HOME/lib64:$CUDA_HOME/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$work/bench_stub" "$@" > "$work/native.txt"
else
    : > "$work/native.txt"   # no GPU here: phos only
fi

[ -n "$server" ] || start_server "$backend"
LD_LIBRARY_PATH="$root/phos/stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PHOS_SERVER=$server \
    "$work/bench_stub" "$@" > "$work/phos.txt"

$PYTHON - "$work/native.txt" "$work/phos.txt" <<'PY'
import sys
def read(path):
    with open(path) as f:
        return dict((k, float(v)) for k, v in (line.split() for line in f if line.strip()))
native, phos = map(read, sys.argv[1:3])
targets = {"sync_rtt_us": lambda n, p: p <= 25, "launch_us": lambda n, p: n is not None and p <= 2 * n}
print(f"{'figure':34} {'native':>10} {'phos':>10} {'phos/native':>12}  {'target':7}")
for name, p in phos.items():
    n = native.get(name)
    ratio = f"{p / n:.2f}" if n else "-"
    check = targets.get(name)
    verdict = "" if check is None else ("met" if check(n, p) else "MISSED")
    print(f"{name:34} {n if n is not None else '-':>10} {p:>10} {ratio:>12}  {verdict:7}")
PY
