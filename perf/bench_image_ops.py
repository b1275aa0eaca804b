"""The per-chunk bookkeeping of images, without a device: what a handoff's frozen round and an
on-demand restore spend in Python for every chunk of a large context (no byte is copied here).

    python perf/bench_image_ops.py --chunks 2048,4096,16384

A 32 GiB context is 2,048 chunks of 16 MiB (bench_snapshot) or 16,384 of 2 MiB; 8 GiB in 2 MiB
chunks (a handoff) is 4,096. Each chunk here is a tiny file with a distinct key, in a DirStore
on /dev/shm, so the times are the manifest's and the store's, not the bytes'.

    commit            ImageWriter.commit of the manifest (the chunks are in the store)
    read (checked)    read_image with every chunk's presence checked (a restore)
    read              read_image without (an advance: its new chunks are checked alone)
    latest of 2       latest_image in a store of two images (the recovery front end)
    frozen round      a handoff's paused last round on emu, 1% of the chunks changed, the
                      emulator's fingerprints taken beforehand (describe, copy, commit)
    ... to its delta  the same, until its delta is ready (a handoff's target gets it then)
    advance           the target's warm restore moving on to that round's image (manifest
                      and load of what changed)
    advance by delta  the same, given the round's delta (its ImageDelta message) instead of its manifest
"""
import argparse
import os
import secrets
import shutil
import tempfile
import time

from phos.snapshot import DirStore, ImageWriter, latest_image, read_image

CHUNK = 16 << 20


def best_ms(fn, n=5):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def fields(keys, chunk=CHUNK):
    return {"backend": "emu", "cut_seq": 7,
            "device": {"name": "bench", "uuid": "00" * 16, "cc": [9, 0], "total_mem": 1 << 40},
            "allocations": [{"address": 1 << 40, "size": len(keys) * chunk, "chunk_size": chunk, "chunks": keys}],
            "session": {"ctx": 1, "token": "ab" * 32, "next_id": 9}}


def one_size(root, n):
    store = DirStore(os.path.join(root, f"s{n}"), fsync=False)
    w = ImageWriter(store, "base")
    keys = [w.add_chunk(secrets.token_bytes(64)) for _ in range(n)]
    w.commit(fields(keys, 64))     # chunks of 64 bytes: what the header check expects
    names = iter(f"img{i}" for i in range(1000))

    def commit():
        w = ImageWriter(store, next(names), parent="base", known=keys)
        w.commit(fields(keys, 64))
    row = {"chunks": n, "commit": best_ms(commit)}
    row["read (checked)"] = best_ms(lambda: read_image(store, "base"))
    row["read"] = best_ms(lambda: read_image(store, "base", check_chunks=False))
    for name in store.list_images():
        if name not in ("base", "img0"):
            store.delete_image(name)
    row["latest of 2"] = best_ms(lambda: latest_image(store, 1))
    return row


def rounds(root, n, chunk=4096):
    """A context of n small chunks on emu: (frozen round, advance) in ms, bookkeeping only."""
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.session import Session
    from phos.snapshot.engine import Checkpoint, Restore
    s = Session(EmuBackend(), 1, b"t" * 16)
    ptr = s.backend.alloc(n * chunk)
    s.backend.htod(ptr, secrets.token_bytes(n * chunk), None)
    store = DirStore(os.path.join(root, f"r{n}"), fsync=False)
    base = Checkpoint(s, store, "base", paused=True, chunk_size=chunk)
    base.cut(1, paused=True)
    base.finish(1)
    s.backend.htod(ptr, secrets.token_bytes(max(1, n // 100) * chunk), None)
    now = s.backend.snap.fingerprints(base.chunks.table, False)()
    s.backend.snap.fingerprints = lambda chunks, fence, frozen=None: lambda: now    # the emulator hashes on the CPU: not timed
    times = {"frozen round": [], "... to its delta": [], "advance": [], "advance by delta": []}
    for i in range(5):
        cp = Checkpoint(s, store, f"round{i}", parent="base", paused=True, chunk_size=chunk, known=base.chunk_keys(),
                        prior=(base.chunks.regions, base.keys))       # as the worker that committed base gives them
        deltas = []
        t = time.perf_counter()
        cp.cut(2, paused=True)
        cp.finish(2, lambda d: deltas.append((d, time.perf_counter())))
        times["frozen round"].append(time.perf_counter() - t)
        times["... to its delta"].append(deltas[0][1] - t)
        for how in ("advance", "advance by delta"):
            target = Session(EmuBackend(), 0, b"t" * 16)
            r = Restore(target, store, "base")
            r.recreate()
            r.start(full=True)
            t = time.perf_counter()
            r.advance(f"round{i}", full=True, delta=deltas[0][0] if how == "advance by delta" else None)
            times[how].append(time.perf_counter() - t)
    return {k: min(v) * 1e3 for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="2048,4096,16384", help="chunk counts")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="phos-bench-image-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        rows = [{**one_size(root, int(n)), **rounds(root, int(n))} for n in args.chunks.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cols = list(rows[0])
    print("| " + " | ".join(c if c == "chunks" else f"{c} (ms)" for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) if c == "chunks" else f"{r[c]:.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
