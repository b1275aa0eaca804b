"""Does one driver call a batch (cuMemcpyBatchAsync) shorten a checkpoint's copy steps?

Issue 5: a 32 GiB checkpoint takes 740-760 steps of ~120 us on the worker's thread, and a call
that arrives during one waits for it. A third of them enqueue a batch's 64 chunk copies to
the store's slots, one driver call each (perf/RESULTS.md, bench_snapshot). This probe copies --gib
of device memory in 2 MiB chunks to a pinned HostStore through CudaSnapshotOps.read, as a
checkpoint does, with the batch call and with a call a copy, and back through write, as a
restore does. Per way:

    issue us      the step that enqueues a batch's copies (_copy_out): median, p90
    fps us        the step that hands a batch's fingerprints over: median, p90
    D2H GB/s      the whole copy to the store
    H2D GB/s      the whole copy back from the store, into a second allocation
    same          whether every slot holds what the device held, and the copy back the
                  fingerprints the copy out had

    python perf/probe_batch_copies.py [--gib 2]      # on the H200 (perf/device/run.sh batch)
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from phos.gpu_server import cuda
from phos.snapshot.host_store import HostStore

MiB = 1 << 20
CHUNK = 2 * MiB
BATCH = 64                        # chunks a checkpoint's batch holds (BATCH_BYTES / CHUNK)


def fill(backend, ptr, n, pattern):
    """Chunk i: the pattern with i in its first 8 bytes, so that no two chunks are alike."""
    for i in range(n):
        pattern[:8] = np.frombuffer(np.uint64(i).tobytes(), np.uint8)
        backend.htod(ptr + i * CHUNK, pattern, None)


def copy_out(snap, chunks, store, slots):
    """Copy chunks into slots as a checkpoint does; returns (issue us, fps us, s, fps)."""
    issue, steps, fps = [], [], []
    copy_out = snap._copy_out

    def timed(*a):
        t = time.perf_counter()
        try:
            return copy_out(*a)
        finally:
            issue.append(time.perf_counter() - t)
    snap._copy_out = timed
    batches = ((chunks[k:k + BATCH], [store.payload(s, CHUNK) for s in slots[k:k + BATCH]], k)
               for k in range(0, len(chunks), BATCH))
    t0 = time.perf_counter()
    try:
        copies = snap.read(batches)
        while True:
            t = time.perf_counter()
            got = next(copies, StopIteration)
            if got is StopIteration:
                break
            if got is not None:
                steps.append(time.perf_counter() - t)
                fps += [fp for _, fp in got[1]]
    finally:
        del snap._copy_out
    return issue, steps, time.perf_counter() - t0, fps


def same_bytes(store, slots, pattern):
    for i, slot in enumerate(slots):
        want = pattern.copy()
        want[:8] = np.frombuffer(np.uint64(i).tobytes(), np.uint8)
        if not np.array_equal(store.payload(slot, CHUNK), want):
            return False
    return True


def us(xs):
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e6:.0f} / {xs[int(0.9 * (len(xs) - 1))] * 1e6:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // CHUNK
    backend = cuda.CudaBackend(0)
    snap = backend.snap
    src, dst = backend.alloc(n * CHUNK), backend.alloc(n * CHUNK)
    pattern = np.random.default_rng(5).integers(0, 256, CHUNK, np.uint8)
    fill(backend, src, n, pattern)
    where = tempfile.mkdtemp(dir="/dev/shm")
    pool = ThreadPoolExecutor(4)
    try:
        store = HostStore.create(os.path.join(where, "store"), n * (CHUNK + 4096) + 64 * MiB, capacity=CHUNK)
        assert snap.pin(store.memory, store.slot_bytes * max(1, cuda.STORE_PIN_PIECE // store.slot_bytes))
        chunks = [(src + i * CHUNK, CHUNK) for i in range(n)]
        back = [(dst + i * CHUNK, CHUNK) for i in range(n)]
        has_batch = cuda._batch_call()
        default = cuda._cuMemcpyBatchAsync
        print(f"{n} chunks of 2 MiB, batches of {BATCH}; the driver has cuMemcpyBatchAsync: {has_batch is not None}")
        print("| way | issue us (median / p90) | fps us (median / p90) | D2H GB/s | H2D GB/s | same |")
        print("|---|---|---|---|---|---|")
        for way in ("one call a batch", "a call a copy") if has_batch else ("a call a copy",):
            cuda._cuMemcpyBatchAsync = has_batch if way == "one call a batch" else None
            slots = store.reserve(n)
            copy_out(snap, chunks[:BATCH * 2], store, slots)       # warm: buffers, tables, launches
            issue, steps, took, fps = copy_out(snap, chunks, store, slots)
            t = time.perf_counter()
            landed = []
            for k in range(0, n, 4 * BATCH):     # a restore's batch: 512 MiB straight from the slots
                landed += snap.write(back[k:k + 4 * BATCH], None, pool, sources=[store.payload(s, CHUNK) for s in slots[k:k + 4 * BATCH]])
            back_s = time.perf_counter() - t
            same = same_bytes(store, slots, pattern) and landed == fps
            print(f"| {way} | {us(issue)} | {us(steps)} | {n * CHUNK / took / 1e9:.1f} | {n * CHUNK / back_s / 1e9:.1f} | {same} |")
            store.release(slots)
            if not same:
                sys.exit(f"{way}: the copies are not what the device held")
        cuda._cuMemcpyBatchAsync = default
    finally:
        pool.shutdown()
        shutil.rmtree(where, ignore_errors=True)
        backend.close()


if __name__ == "__main__":
    main()
