"""The pfp1 fingerprint pass on the GPU: every chunk of a context hashed, as a checkpoint's cut
and a handoff's frozen round do it (gpu_server/backends/cuda_snapshot.py, CudaSnapshotOps.fingerprints).

    python perf/bench_fingerprint.py --sizes 1,8        # on the H200 (perf/device/run.sh handoff)

"fingerprints" is the whole call the engine makes (chunk table up, kernel, sums down, the
host's final mix of every chunk); "device copy" is cuMemcpyDtoD of the same bytes, for the
memory bandwidth the kernel competes with (it reads each byte once, the copy reads and writes).
"""
import argparse
import time

from cuda.bindings import driver as cu

GiB, MiB = 1 << 30, 1 << 20


def best_of(n, fn):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    from phos.gpu_server.backends.cuda import CudaBackend
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8", help="GiB")
    ap.add_argument("--chunks", default="2,16", help="chunk sizes, MiB")
    args = ap.parse_args()
    backend = CudaBackend(0)
    rows = []
    for size in (int(s) * GiB for s in args.sizes.split(",")):
        ptr = backend.alloc(size)
        backend.memset(ptr, 0x5A, 1, size, None)
        other = backend.alloc(size)
        backend.synchronize()

        def copy():
            cu.cuMemcpyDtoD(other, ptr, size)
            cu.cuCtxSynchronize()
        copy_s = best_of(3, copy)
        for chunk in (int(c) * MiB for c in args.chunks.split(",")):
            spans = [(ptr + off, min(chunk, size - off)) for off in range(0, size, chunk)]
            fp_s = best_of(5, lambda: backend.snap.fingerprints(spans, fence=False)())
            rows.append((size, chunk, len(spans), fp_s, copy_s))
        backend.free(other)
        backend.free(ptr)
    print("| size | chunk | chunks | fingerprints (ms) | GB/s | device copy (ms) | copy GB/s (read + write) |")
    print("|---|---|---|---|---|---|---|")
    for size, chunk, n, fp_s, copy_s in rows:
        print(f"| {size // GiB} GiB | {chunk // MiB} MiB | {n} | {fp_s * 1e3:.2f} | {size / fp_s / 1e9:.0f} | "
              f"{copy_s * 1e3:.2f} | {2 * size / copy_s / 1e9:.0f} |")
    backend.close()


if __name__ == "__main__":
    main()
