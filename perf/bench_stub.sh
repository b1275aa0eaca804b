#!/bin/sh
# Native vs phos on a GPU machine (perf/device/run.sh bench runs it on the H200): builds perf/bench_stub.cu,
# runs it natively, then through phos's native stub (NVIDIA's libcudart, as phos/stub holds
# it, over phos's libcuda.so.1) against a `cuda` server over ipc, --repeat times (3) taking turns;
# prints one table of each figure's least / median / most. PHOS_BENCH_BACKEND=emu: the phos columns alone, on emu.
#   perf/bench_stub.sh [--server ADDR] [--repeat N] [--json FILE] [bench_stub options: --big-mib N --launches N --rtt N --sweep-min-kib N --settle-ms N]
# --json: every run's figures, and the copy bandwidth over sizes (64 KiB to --big-mib) that perf/plots.py draws.
# Targets: sync_rtt_us <= 25 over ipc; launch_us <= 2x native (medians).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")}
PYTHON=${PYTHON:-python3}
backend=${PHOS_BENCH_BACKEND:-cuda}
server="" repeat=3 json=""
while [ $# -gt 0 ]; do
    case $1 in
        --server) server=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --json) json=$2; shift 2 ;;
        *) break ;;
    esac
done

. "$root/tests/apps/stub_session.sh"
$NVCC -cudart shared -O2 -gencode arch=compute_90,code=compute_90 -gencode arch=compute_90,code=sm_90 \
    -o "$work/bench_stub" "$here/bench_stub.cu"

[ -n "$server" ] || start_server "$backend"
# native and phos take turns, run by run: a machine slower for a while slows both alike
for i in $(seq "$repeat"); do
    if [ "$backend" = cuda ]; then
        LD_LIBRARY_PATH="$CUDA_HOME/lib64:$CUDA_HOME/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            "$work/bench_stub" "$@" > "$work/native.$i.txt"
    else
        : > "$work/native.$i.txt"   # no GPU here: phos only
    fi
    LD_LIBRARY_PATH="$root/phos/stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PHOS_SERVER=$server \
        "$work/bench_stub" "$@" > "$work/phos.$i.txt"
done

$PYTHON - "$here" "$work" "$repeat" "$json" <<'PY'
import json
import statistics
import sys
here, work, repeat, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, here)
from spread import spread_text


def read(path):
    with open(path) as f:
        return dict((k, float(v)) for k, v in (line.split() for line in f if line.strip()))


def runs(path):     # figure: its values, one a run
    figures = {}
    for i in range(1, repeat + 1):
        for k, v in read(f"{work}/{path}.{i}.txt").items():
            figures.setdefault(k, []).append(v)
    return figures
native, phos = runs("native"), runs("phos")
# issue 23's targets: a sync round trip within 10 µs, launches within 1.5x native, pinned copies
# at 80% of native and pageable ones at 90% (256 MiB)
at_least = lambda share: lambda n, p: n is not None and p >= share * n
targets = {"sync_rtt_us": lambda n, p: p <= 10, "launch_us": lambda n, p: n is not None and p <= 1.5 * n,
           **{f"copy_pinned_{d}_256MiB_GBps": at_least(0.8) for d in ("h2d", "d2h")},
           **{f"copy_pageable_{d}_256MiB_GBps": at_least(0.9) for d in ("h2d", "d2h")}}
print(f"{repeat} runs each; least / median / most")
print(f"{'figure':34} {'native':>22} {'phos':>22} {'phos/native':>12}  {'target':7}")
for name, p in phos.items():
    if name.startswith("copy_sweep_"):      # the sweep: in the JSON, for perf/plots.py
        continue
    n = native.get(name)
    pm, nm = statistics.median(p), n and statistics.median(n)
    ratio = f"{pm / nm:.2f}" if nm else "-"
    check = targets.get(name)
    verdict = "" if check is None else ("met" if check(nm, pm) else "MISSED")
    print(f"{name:34} {spread_text(n or [], '.4g'):>22} {spread_text(p, '.4g'):>22} {ratio:>12}  {verdict:7}")
if out:
    copies = []     # copy_sweep_<memory>_<direction>_<bytes>: GB/s of each run
    for path, figures in (("native", native), ("phos", phos)):
        for name, values in figures.items():
            if name.startswith("copy_sweep_"):
                memory, direction, nbytes = name[len("copy_sweep_"):].split("_")
                copies.append({"path": path, "memory": memory, "direction": direction, "bytes": int(nbytes), "GBps": values})
    with open(out, "w") as f:
        json.dump({"runs": repeat, "figures": {"native": native, "phos": phos}, "copies": copies}, f, indent=1)
PY
