"""Remoting cost: native cuda-python against phos over ipc:// and tcp://127.0.0.1.

    python perf/bench_rpc.py --backend cuda      # on the H200 (perf/device/run.sh)
    python perf/bench_rpc.py --backend emu --launches 200 --sizes 4K,1M,64M   # anywhere

Prints one table: synchronous round trip (idle cuCtxSynchronize), asynchronous launch
cost (N empty launches then one sync, per launch), and host<->device bandwidth; each figure's
least / median / most over --repeat runs (3), the paths taking turns run by run.
"""
import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spread import REPEAT, spread_text  # noqa: E402

EMPTY_PTX = b""".version 8.0
.target sm_75
.address_size 64
.visible .entry empty()
{
\tret;
}
"""
SIZES = {"4K": 4 << 10, "1M": 1 << 20, "64M": 64 << 20, "256M": 256 << 20}


def ok(res):
    if int(res[0]) != 0:
        raise RuntimeError(f"CUDA call failed: {res[0]!r}")
    return res[1] if len(res) == 2 else res[1:]


def measure(cu, launches, sizes, rounds):
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuCtxCreate(None, 0, dev))
    row = {}
    for _ in range(200):
        cu.cuCtxSynchronize()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(1000):
            cu.cuCtxSynchronize()
        samples.append((time.perf_counter() - t) / 1000 * 1e6)
    row["sync_us"] = statistics.median(samples)

    mod = ok(cu.cuModuleLoadData(EMPTY_PTX))
    fn = ok(cu.cuModuleGetFunction(mod, b"empty"))
    for _ in range(100):
        cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)
    cu.cuCtxSynchronize()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(launches):
            cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)
        ok(cu.cuCtxSynchronize())
        samples.append((time.perf_counter() - t) / launches * 1e6)
    row["launch_us"] = statistics.median(samples)

    for label in sizes:
        n = SIZES[label]
        host = np.ones(n, np.uint8)
        ptr = ok(cu.cuMemAlloc(n))
        reps = max(3, min(200, (256 << 20) // n // 4))
        for direction in ("h2d", "d2h"):
            best = 0.0
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(reps):
                    if direction == "h2d":
                        ok((cu.cuMemcpyHtoD(ptr, host, n)[0], None))
                    else:
                        ok((cu.cuMemcpyDtoH(host, ptr, n)[0], None))
                ok((cu.cuCtxSynchronize()[0], None))
                best = max(best, n * reps / (time.perf_counter() - t) / 1e9)
            row[f"{direction}_{label}_GBs"] = best
        cu.cuMemFree(ptr)
    cu.cuCtxDestroy(ctx)
    return row


def start_server(backend, listen):
    # --insecure: a keyless loopback listener, for the transport's cost alone
    insecure = ["--insecure"] if listen.startswith("tcp://") else []
    proc = subprocess.Popen([sys.executable, "-m", "phos.cli", "server", "--backend", backend, "--listen", listen, *insecure],
                            stdout=subprocess.PIPE, text=True)
    if "listening" not in proc.stdout.readline():
        raise RuntimeError("server did not start")
    return proc


def run_child(kind, args, env=None):
    """Measure in a fresh process, so each client's global state starts clean."""
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--launches", str(args.launches),
                          "--sizes", args.sizes, "--rounds", str(args.rounds)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{kind} measurement failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_phos(backend, listen, args):
    server = start_server(backend, listen)
    try:
        return run_child("phos", args, dict(os.environ, PHOS_SERVER=listen))
    finally:
        server.terminate()
        server.wait()


def table(rows, sizes):
    """rows: path -> its runs' rows; a cell is a figure's least / median / most over them."""
    cols = ["sync_us", "launch_us"] + [f"{d}_{s}_GBs" for s in sizes for d in ("h2d", "d2h")]
    head = "| path | runs | sync round trip (µs) | async launch (µs) | " + " | ".join(
        f"{d.upper()} {s} (GB/s)" for s in sizes for d in ("h2d", "d2h")) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for name, runs in rows.items():
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(
            spread_text((r[c] for r in runs), ".2f" if c.endswith("GBs") else ".1f") for c in cols) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="emu", choices=["emu", "cuda"])
    ap.add_argument("--launches", type=int, default=10000)
    ap.add_argument("--sizes", default="4K,1M,256M")
    ap.add_argument("--rounds", type=int, default=5, help="rounds within a run, of which each figure takes the median (bandwidth: the best)")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="runs of each path, each in a fresh process and server")
    ap.add_argument("--json", help="also write every run's row here, by path")
    ap.add_argument("--child", choices=["phos", "native"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    if args.child:
        cu = importlib.import_module("phos.client_stub.driver" if args.child == "phos" else "cuda.bindings.driver")
        print(json.dumps(measure(cu, args.launches, sizes, args.rounds)))
        return
    rows = {}
    for _ in range(max(1, args.repeat)):     # the paths take turns: a machine slower for a while slows each alike
        if args.backend == "cuda":
            rows.setdefault("native cuda-python", []).append(run_child("native", args))
        with tempfile.TemporaryDirectory() as tmp:
            rows.setdefault("phos ipc://", []).append(run_phos(args.backend, f"ipc://{tmp}/bench.sock", args))
            rows.setdefault("phos tcp://127.0.0.1", []).append(run_phos(args.backend, "tcp://127.0.0.1:45871", args))
    print(table(rows, sizes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
