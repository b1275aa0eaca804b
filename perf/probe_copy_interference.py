"""Why does the application run slower during a concurrent checkpoint? (issue 5)

On the H200 the benchmark's application managed 13-30% of its kernels per second while a
checkpoint copied its memory at 25-28 GB/s. This probe asks whether the device and driver
alone do that, in one process and one context as a worker holds them: an application thread
launches a small kernel (64 blocks writing 8 MiB, the benchmark's) and synchronizes its stream,
in a loop, while a copy thread runs each of:

    none        nothing: the application alone
    d2h         16 MiB device-to-host copies into pinned memory, an event per 128 MiB
    d2d         16 MiB device-to-device copies, an event per 128 MiB
    engine      phos's own CudaSnapshotOps.read: per batch, D2D into our buffer, D2H, pfp1 hash
    engine-hi   the same, with the application on a stream of the highest priority
    python      a thread spinning in pure Python (the GIL alone)
    engine-steps  the engine's copies as steps on the application's own thread, taken while
                its kernel runs (polling cuStreamQuery), as a worker takes them

and then what each driver call of a checkpoint's step costs the calling thread.

    python perf/probe_copy_interference.py [--gib 8]     # on the H200 (perf/device/run.sh interference)
"""
import argparse
import json
import os
import sys
import threading
import time
import types

import numpy as np
from cuda.bindings import driver as cu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_snapshot import FILL_PTX, MiB  # noqa: E402
from probe_driver_stalls import ok  # noqa: E402

CHUNK, BATCH = 16 * MiB, 128 * MiB


def app_loop(ctx, fn, buf, stream, stop, ends, step=None):
    """step: the copies' next step, taken on this thread while the kernel runs (as the worker
    does): the sync polls cuStreamQuery instead of blocking in cuStreamSynchronize."""
    ok(cu.cuCtxSetCurrent(ctx))
    words = np.array([buf, MiB, 0], np.uint64)       # 8 MiB of u64
    ptrs = np.array([words.ctypes.data + 8 * i for i in range(3)], np.uint64)
    while not stop.is_set():
        ok(cu.cuLaunchKernel(fn, 64, 1, 1, 256, 1, 1, 0, stream, ptrs.ctypes.data, 0))
        if step is None:
            ok(cu.cuStreamSynchronize(stream))
        else:
            while int(cu.cuStreamQuery(stream)[0]) != 0:
                step()
            step()
        ends.append(time.perf_counter())
        words[2] += 1


def stepper(ops, src, nbytes, moved):
    """The engine's copies as steps: next() of its read generator, over and over."""
    spans = [(src + o, CHUNK) for o in range(0, nbytes, CHUNK)]
    per = BATCH // CHUNK

    def forever():
        while True:
            yield from ops.read((spans[i:i + per], None, i) for i in range(0, len(spans), per))
    steps = forever()

    def step():
        """Returns whether a batch came back (else the device is still copying)."""
        got = next(steps)
        if got is not None:
            moved[0] += sum(len(data) for data, _ in got[1])
        return got is not None
    return step


def wait(event):
    while int(cu.cuEventQuery(event)[0]) != 0:
        time.sleep(0.00005)


def plain_copies(kind, src, nbytes, dst, stream, stop):
    """16 MiB copies of the whole source, over and over; an event per batch. Returns bytes moved."""
    moved, event = 0, ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    while not stop.is_set():
        for off in range(0, nbytes, BATCH):
            for o in range(off, min(off + BATCH, nbytes), CHUNK):
                if kind == "d2h":
                    ok(cu.cuMemcpyDtoHAsync(dst + (o - off), src + o, CHUNK, stream))
                else:
                    ok(cu.cuMemcpyDtoDAsync(dst + (o - off), src + o, CHUNK, stream))
            ok(cu.cuEventRecord(event, stream))
            wait(event)
            moved += min(BATCH, nbytes - off)
            if stop.is_set():
                break
    return moved


def engine_copies(ops, src, nbytes, stop):
    """The engine's copies in a thread of their own: its steps, a short sleep while the device copies."""
    moved = [0]
    step = stepper(ops, src, nbytes, moved)
    while not stop.is_set():
        if not step():
            time.sleep(0.00005)
    return moved[0]


def spin(stop):
    n = 0
    while not stop.is_set():
        n += 1
    return 0


def measure(name, copier, app, seconds, step=None, moved=None):
    stop, ends, moved = threading.Event(), [], moved or []
    t = threading.Thread(target=lambda: moved.append(copier(stop))) if copier else None
    if t:
        t.start()
        time.sleep(0.1)                 # copies under way
    start = time.perf_counter()
    a = threading.Thread(target=app_loop, args=(*app, stop, ends, step))
    a.start()
    time.sleep(seconds)
    stop.set()
    a.join()
    if t:
        t.join()
    elapsed = time.perf_counter() - start
    gaps = np.diff([start] + ends) * 1e3
    row = {"copier": name, "kernels_per_s": round(len(ends) / elapsed), "p50_ms": round(float(np.median(gaps)), 3),
           "p99_ms": round(float(np.percentile(gaps, 99)), 3), "max_ms": round(float(gaps.max()), 2),
           "copy_GBps": round(moved[0] / (elapsed + 0.1) / 1e9, 1) if moved and moved[0] else None}
    print(json.dumps(row), flush=True)
    return row


def call_costs(ops, src, host, dev_dst, stream, rounds=50):
    """Microseconds of this thread's time per call of a checkpoint step (enqueueing only; the
    device work is waited for outside the timing): on the H200 a worker's step took ~700 µs a
    128 MiB batch, against ~60 µs of Python measured with a stand-in driver elsewhere."""
    import mmap
    import tempfile
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(BATCH)
        shared = np.frombuffer(mmap.mmap(f.fileno(), BATCH), np.uint8)
        shared[::4096] = 1                                   # the pages exist, as a HostStore's do
        ok(cu.cuMemHostRegister(shared.ctypes.data, BATCH, 0x02))
        registered = shared.ctypes.data
        per = BATCH // CHUNK
        spans = [(src + i * CHUNK, CHUNK) for i in range(per)]
        event = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        calls = {
            "cuMemcpyDtoDAsync 16 MiB": lambda i: cu.cuMemcpyDtoDAsync(dev_dst + i % per * CHUNK, src + i % per * CHUNK, CHUNK, stream),
            "cuMemcpyDtoDAsync 128 MiB": lambda i: cu.cuMemcpyDtoDAsync(dev_dst, src, BATCH, stream),
            "cuMemcpyDtoHAsync 16 MiB, cuMemHostAlloc": lambda i: cu.cuMemcpyDtoHAsync(host + i % per * CHUNK, src, CHUNK, stream),
            "cuMemcpyDtoHAsync 16 MiB, registered": lambda i: cu.cuMemcpyDtoHAsync(registered + i % per * CHUNK, src, CHUNK, stream),
            "cuEventCreate+Record+Destroy": lambda i: (cu.cuEventRecord(e := ok(cu.cuEventCreate(2)), stream), cu.cuEventDestroy(e)),
            "cuEventQuery (done)": lambda i: cu.cuEventQuery(event),
            "cuStreamQuery(0)": lambda i: cu.cuStreamQuery(0),
            "pfp1 hash of a batch, enqueued (ops._hash)": lambda i: ops._hash(spans, "bulk0", int(stream)),
        }
        out = {}
        for name, call in calls.items():
            took = 0.0
            for r in range(rounds):
                ok(cu.cuStreamSynchronize(stream))
                ok(cu.cuEventRecord(event, stream))
                t = time.perf_counter()
                for i in range(per):
                    call(r * per + i)
                took += time.perf_counter() - t
            ok(cu.cuStreamSynchronize(stream))
            out[name] = round(took / (rounds * per) * 1e6, 1)
        ok(cu.cuMemHostUnregister(registered))
        del shared
    print(json.dumps(out), flush=True)
    print("\n| call | µs each |\n|---|---|")
    for name, us in out.items():
        print(f"| {name} | {us} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=1.5)
    args = ap.parse_args()
    nbytes = args.gib << 30
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    fn = ok(cu.cuModuleGetFunction(ok(cu.cuModuleLoadData(FILL_PTX.encode() + b"\0")), b"fill_u64"))
    src = int(ok(cu.cuMemAlloc(nbytes)))
    ok(cu.cuMemsetD8(src, 7, nbytes))
    scratch = int(ok(cu.cuMemAlloc(8 * MiB)))
    host = int(ok(cu.cuMemHostAlloc(BATCH, 0)))
    dev_dst = int(ok(cu.cuMemAlloc(BATCH)))
    flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    copy_stream = ok(cu.cuStreamCreateWithPriority(flags, 0))
    _, greatest = ok(cu.cuCtxGetStreamPriorityRange())
    high = ok(cu.cuStreamCreateWithPriority(flags, greatest))
    ok(cu.cuCtxSynchronize())

    from phos.gpu_server.backends.cuda_snapshot import CudaSnapshotOps
    ops = CudaSnapshotOps(types.SimpleNamespace(ctx=ctx, streams=[]))

    def in_ctx(f):                     # contexts are current per thread
        def run(stop):
            ok(cu.cuCtxSetCurrent(ctx))
            return f(stop)
        return run
    legacy = (ctx, fn, scratch, 0)
    rows = [measure("none", None, legacy, args.seconds),
            measure("d2h", in_ctx(lambda s: plain_copies("d2h", src, nbytes, host, copy_stream, s)), legacy, args.seconds),
            measure("d2d", in_ctx(lambda s: plain_copies("d2d", src, nbytes, dev_dst, copy_stream, s)), legacy, args.seconds),
            measure("engine", in_ctx(lambda s: engine_copies(ops, src, nbytes, s)), legacy, args.seconds),
            measure("engine-hi", in_ctx(lambda s: engine_copies(ops, src, nbytes, s)), (ctx, fn, scratch, high), args.seconds),
            measure("python", spin, legacy, args.seconds)]
    moved = [0]
    rows.append(measure("engine-steps", None, legacy, args.seconds, step=stepper(ops, src, nbytes, moved), moved=moved))
    call_costs(ops, src, host, dev_dst, copy_stream)
    base = rows[0]["kernels_per_s"]
    print("\n| copier | kernels/s | of alone | p50 (ms) | p99 (ms) | max (ms) | copy GB/s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['copier']} | {r['kernels_per_s']} | {100 * r['kernels_per_s'] / base:.0f}% | {r['p50_ms']} | "
              f"{r['p99_ms']} | {r['max_ms']} | {r['copy_GBps'] or '-'} |")


if __name__ == "__main__":
    main()
