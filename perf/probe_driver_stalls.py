"""What the driver makes an application wait for right after a handoff (issue 6), measured alone:

1. lazy function loading: the first launch of a function fetched with cuModuleGetFunction,
   against one whose load was forced beforehand with cuFuncLoad;
2. pinning a staging area (cuMemHostRegister, 64 MiB) in another thread while the
   application launches and synchronizes, or runs Python: does the driver hold its launches,
   or the binding the GIL, meanwhile? For a client's staging file fresh from ftruncate, and
   one its maker populated.
3. another process (a retiring worker, gpu_server/backends/cuda.py's CudaBackend) freeing its
   memory and its context: how long does the application's launch+sync stall?
4. the same, one operation at a time, 30 ms apart, for memory that was written and a pinned
   host store (as a retiring handoff source has): which of them stalls the application?

    python perf/probe_driver_stalls.py                  # on the H200 (perf/device/run.sh probe)
    python perf/probe_driver_stalls.py --only teardown  # the last part alone
"""
import argparse
import json
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
from cuda.bindings import driver as cu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_snapshot import FILL_PTX, MiB  # noqa: E402


def ok(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    assert int(err) == 0, res
    return rest[0] if len(rest) == 1 else rest


def launch_sync(fn, buf, words=4096, seed=0):
    t = time.perf_counter()
    args = [np.array([buf], np.uint64), np.array([words], np.uint64), np.array([seed], np.uint64)]
    ptrs = np.array([a.ctypes.data for a in args], np.uint64)
    ok(cu.cuLaunchKernel(fn, 16, 1, 1, 256, 1, 1, 0, 0, ptrs.ctypes.data, 0))
    ok(cu.cuCtxSynchronize())
    return (time.perf_counter() - t) * 1e3


def first_launches(buf):
    rows = []
    for preload in (False, True):
        module = ok(cu.cuModuleLoadData(FILL_PTX.encode() + b"\0"))
        fn = ok(cu.cuModuleGetFunction(module, b"fill_u64"))
        t = time.perf_counter()
        if preload:
            ok(cu.cuFuncLoad(fn))
        load = (time.perf_counter() - t) * 1e3
        rows.append(("cuFuncLoad first" if preload else "lazy", load, launch_sync(fn, buf), launch_sync(fn, buf)))
        ok(cu.cuModuleUnload(module))
    return rows


def staging_area(kind):
    """64 MiB as a worker maps a client's staging file: the file fresh from ftruncate (no page
    exists yet), or populated by its maker (MAP_POPULATE); or anonymous memory, touched."""
    if kind == "anonymous, touched":
        area = mmap.mmap(-1, 64 * MiB)
        np.frombuffer(area, np.uint8)[::4096] = 1
        return area, 0.0
    path = f"/dev/shm/phos-probe-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, 64 * MiB)
    t = time.perf_counter()
    if kind == "shm file, populated":
        mmap.mmap(fd, 64 * MiB, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE).close()
    made = (time.perf_counter() - t) * 1e3
    area = mmap.mmap(fd, 64 * MiB)
    os.close(fd)
    os.unlink(path)
    return area, made


def pin_stall(fn, buf, kind, driver_loop=True):
    """Longest gap of a loop over 400 ms (launch+sync, or pure Python), with a 64 MiB
    cuMemHostRegister from another thread at 100 ms."""
    ctx = ok(cu.cuCtxGetCurrent())
    area, made = staging_area(kind)
    host = np.frombuffer(area, np.uint8)
    took = []

    def pinner():
        ok(cu.cuCtxSetCurrent(ctx))
        time.sleep(0.1)
        t = time.perf_counter()
        ok(cu.cuMemHostRegister(host.ctypes.data, host.nbytes, 0))
        took.append((time.perf_counter() - t) * 1e3)
    thread = threading.Thread(target=pinner)
    thread.start()
    ends, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < 0.4:
        if driver_loop:
            launch_sync(fn, buf)
        else:
            sum(range(200))
        ends.append(time.perf_counter())
    thread.join()
    ok(cu.cuMemHostUnregister(host.ctypes.data))
    del host
    area.close()
    return float(np.diff(ends).max()) * 1e3, took[0], made


RETIRING = """
import json, sys, time
from phos.gpu_server.backends.cuda import CudaBackend, GiB
b = CudaBackend()
ptrs = [b.alloc(GiB) for _ in range(int(sys.argv[1]))]
print("ready", flush=True)
sys.stdin.readline()
marks = {"start": time.perf_counter()}
for p in ptrs:
    b.free(p)
marks["freed"] = time.perf_counter()
b.close()
marks["closed"] = time.perf_counter()
print(json.dumps(marks), flush=True)
"""


def beside_child(fn, buf, script, args=(), before=0.1, after=0.0):
    """Launch and sync here while a child process runs script: for `before` seconds, then from
    telling it "go" (once it said "ready") until it exits, then `after` seconds more. Returns
    (each launch+sync's end, when it was told to go, when it exited, its last line as JSON)."""
    child = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    ends = []

    def loop(done):
        while not done():
            launch_sync(fn, buf)
            ends.append(time.perf_counter())
    t0 = time.perf_counter()
    loop(lambda: time.perf_counter() - t0 >= before)
    child.stdin.write("go\n")
    child.stdin.flush()
    go = time.perf_counter()
    loop(lambda: child.poll() is not None)
    exited = time.perf_counter()
    loop(lambda: time.perf_counter() - exited >= after)
    return np.array(ends), go, exited, json.loads(child.stdout.readline())


def teardown_stall(fn, buf, gib):
    """Longest launch+sync gap while another process frees gib GiB, closes its context and exits."""
    ends, _, exited, marks = beside_child(fn, buf, RETIRING, [str(gib)], after=0.1)

    def worst(a, b):
        inside = ends[(ends > a) & (ends <= b + 0.05)]
        return float(np.diff(inside).max()) * 1e3 if len(inside) > 1 else float("nan")
    return (worst(marks["start"], marks["freed"]), worst(marks["freed"], marks["closed"]), worst(marks["closed"], exited),
            (marks["freed"] - marks["start"]) * 1e3, (marks["closed"] - marks["freed"]) * 1e3, (exited - marks["closed"]) * 1e3,
            float(np.diff(ends[ends < marks["start"]]).max()) * 1e3)


TEARDOWN_OPS = """
import json, mmap, os, sys, time
import numpy as np
from cuda.bindings import driver as cu
from phos.gpu_server.backends.cuda import CudaBackend, GiB
from phos.gpu_server.backends.cuda_driver import DEVICEMAP
MiB = 1 << 20
b = CudaBackend()
big = [b.alloc(GiB) for _ in range(4)]
pieces = []                        # 1 GiB made of 64 MiB handles, each mapped alone
for _ in range(16):
    pieces.append(b.alloc(64 * MiB))
for p in big + pieces:             # written, as a context's memory is
    b.memset(p, 0x5A, 1, GiB if p in big else 64 * MiB, None)
b.synchronize()
path = f"/dev/shm/phos-probe-store-{os.getpid()}"
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
os.ftruncate(fd, 4 * GiB)
area = mmap.mmap(fd, 4 * GiB, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
os.close(fd)
os.unlink(path)
host = np.frombuffer(area, np.uint8).ctypes.data
pinned = [(host + i * GiB, GiB) for i in range(3)] + [(host + 3 * GiB + i * 64 * MiB, 64 * MiB) for i in range(16)]
for at, n in pinned:
    assert int(cu.cuMemHostRegister(at, n, DEVICEMAP)[0]) == 0
print("ready", flush=True)
sys.stdin.readline()
ops = []
def op(name, fn, *args):
    t = time.perf_counter()
    fn(*args)
    ops.append((name, t, time.perf_counter()))
    time.sleep(0.03)
for p in big:
    op("unmap+release 1 GiB", b.free, p)
for p in pieces[:8]:
    op("unmap+release 64 MiB", b.free, p)
for at, n in pinned:
    op(f"unpin {n >> 20} MiB", cu.cuMemHostUnregister, at)
op("close (8 x 64 MiB left)", b.close)
print(json.dumps(ops), flush=True)
"""


def keep_pinning(ctx, stop):
    """What a worker does for a client that re-attached: pin its fresh 64 MiB staging file in
    2 MiB pieces, 1 ms apart (gpu_server/backends/cuda.py, register_host); again and again until stop."""
    ok(cu.cuCtxSetCurrent(ctx))
    while not stop.is_set():
        area, _ = staging_area("shm file, fresh")
        host = np.frombuffer(area, np.uint8).ctypes.data
        for off in range(0, 64 * MiB, 2 * MiB):
            ok(cu.cuMemHostRegister(host + off, 2 * MiB, 0))
            time.sleep(0.001)
        for off in range(0, 64 * MiB, 2 * MiB):
            ok(cu.cuMemHostUnregister(host + off))
        area.close()


def teardown_ops(fn, buf, pinning=False):
    """Per operation of a retiring worker (TEARDOWN_OPS): its time, and the application's
    longest launch+sync gap that overlaps it; then every gap over 2 ms on the timeline.
    pinning: meanwhile a thread here pins staging memory, as a handoff's target does."""
    stop = threading.Event()
    pinner = threading.Thread(target=keep_pinning, args=(ok(cu.cuCtxGetCurrent()), stop))
    if pinning:
        pinner.start()
    ends, go, _, ops = beside_child(fn, buf, TEARDOWN_OPS, before=0.2)
    stop.set()
    if pinning:
        pinner.join()
    gaps = np.diff(ends)
    print(f"\n| operation (another process){', while this one pins' if pinning else ''} | its time (ms) "
          "| longest gap overlapping it here (ms) |\n|---|---|---|")
    for name, a, b in ops:
        hit = gaps[(ends[1:] > a) & (ends[:-1] < b + 0.002)]
        print(f"| {name} | {(b - a) * 1e3:.2f} | {hit.max() * 1e3 if len(hit) else 0:.2f} |")
    print("before it began, the longest gap: %.2f ms" % (gaps[ends[1:] < go].max() * 1e3))
    print("gaps over 2 ms (began, length; ms after go):",
          [(round((ends[i] - go) * 1e3, 1), round(g * 1e3, 1)) for i, g in enumerate(gaps) if g > 0.002 and ends[i] > go])
    print("operations (began, took; ms after go):", [(n, round((a - go) * 1e3, 1), round((b - a) * 1e3, 1)) for n, a, b in ops])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["teardown"], help="run only the per-operation teardown probe")
    only = ap.parse_args().only
    ok(cu.cuInit(0))
    print("CUDA_MODULE_LOADING =", os.environ.get("CUDA_MODULE_LOADING", "(unset: LAZY is the default)"))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    buf = int(ok(cu.cuMemAlloc(8 * MiB)))
    print("\n| function | cuFuncLoad (ms) | first launch+sync (ms) | second (ms) |\n|---|---|---|---|")
    for name, load, first, second in first_launches(buf):
        print(f"| {name} | {load:.2f} | {first:.2f} | {second:.3f} |")
    module = ok(cu.cuModuleLoadData(FILL_PTX.encode() + b"\0"))
    fn = ok(cu.cuModuleGetFunction(module, b"fill_u64"))
    launch_sync(fn, buf)
    if only == "teardown":
        teardown_ops(fn, buf)
        teardown_ops(fn, buf, pinning=True)
        return
    print("\n| staging memory | made (ms) | cuMemHostRegister 64 MiB in a thread (ms) | longest launch+sync gap meanwhile (ms) "
          "| longest pure-Python loop gap meanwhile (ms) |\n|---|---|---|---|---|")
    for kind in ("anonymous, touched", "shm file, fresh", "shm file, populated") * 2:
        gap, took, made = pin_stall(fn, buf, kind)
        py_gap, took2, _ = pin_stall(fn, buf, kind, driver_loop=False)
        print(f"| {kind} | {made:.1f} | {took:.1f} / {took2:.1f} | {gap:.2f} | {py_gap:.2f} |")
    print("\n| another process's memory | longest gap before (ms) | while it frees (ms, gap) | closes its context | exits |"
          "\n|---|---|---|---|---|")
    for gib in (1, 8, 1, 8):
        g_free, g_close, g_exit, t_free, t_close, t_exit, before = teardown_stall(fn, buf, gib)
        print(f"| {gib} GiB | {before:.2f} | {t_free:.1f}, {g_free:.2f} | {t_close:.1f}, {g_close:.2f} | {t_exit:.1f}, {g_exit:.2f} |")
    teardown_ops(fn, buf)
    teardown_ops(fn, buf, pinning=True)


if __name__ == "__main__":
    main()
