"""How fast can the cut's fingerprint pass go? pfp1 written several ways, beside a plain read.

The cut's pass over all of a context's memory is the fence the application waits behind (12 ms
at 32 GiB in session 11: 2.9 TB/s, where the H200 reads ~4.5 TB/s). This times, over 2 MiB
chunks as the cut hashes them:

- `shipped`: snapshot/kernels/pfp1.ptx, as the server loads it;
- `pairs`: the same sums from 16-byte loads of two words, a 32-bit loop and warp shuffles;
- `pairs512`: the same with 512 threads a block;
- `read`: XOR of every word (what reading the memory alone costs);

and checks that every pfp1 variant gives the shipped kernel's sums.

    python perf/probe_fingerprint_kernels.py --sizes 8,32      # on the H200; needs nvcc
"""
import argparse
import os
import subprocess
import tempfile

import numpy as np
from cuda.bindings import driver as cu

GiB, MiB = 1 << 30, 1 << 20
CHUNK = 2 * MiB

VARIANTS = r"""
typedef unsigned long long u64;
#define S0 0x243F6A8885A308D3ull
#define P0 0x9E3779B97F4A7C15ull
#define A0 0xBF58476D1CE4E5B9ull
#define B0 0x94D049BB133111EBull
#define S1 0x13198A2E03707344ull
#define P1 0xC2B2AE3D27D4EB4Full
#define A1 0xFF51AFD7ED558CCDull
#define B1 0xC4CEB9FE1A85EC53ull

__device__ __forceinline__ u64 term(u64 w, u64 k, u64 a, u64 b) {
    u64 x = (w ^ k) * a;
    x ^= x >> 32;
    x *= b;
    return x ^ (x >> 29);
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// Whole chunks only, 16-byte aligned, an even number of words (the probe's table).
template <int THREADS>
__device__ void pairs(const u64* chunks, u64* sums) {
    __shared__ u64 s0[THREADS / 32], s1[THREADS / 32];
    unsigned c = blockIdx.x, t = threadIdx.x;
    const ulonglong2* p = (const ulonglong2*)chunks[2 * c];
    u64 first = chunks[2 * c + 1] >> 32;
    unsigned n = (unsigned)((chunks[2 * c + 1] & 0xFFFFFFFFull) / 16);
    u64 k0 = S0 + (first + 2 * t) * P0, k1 = S1 + (first + 2 * t) * P1, h0 = 0, h1 = 0;
    const u64 d0 = 2 * THREADS * P0, d1 = 2 * THREADS * P1;
#pragma unroll 4
    for (unsigned j = t; j < n; j += THREADS) {
        ulonglong2 w = p[j];
        h0 += term(w.x, k0, A0, B0) + term(w.y, k0 + P0, A0, B0);
        h1 += term(w.x, k1, A1, B1) + term(w.y, k1 + P1, A1, B1);
        k0 += d0;
        k1 += d1;
    }
    h0 = warp_sum(h0);
    h1 = warp_sum(h1);
    if (t % 32 == 0) { s0[t / 32] = h0; s1[t / 32] = h1; }
    __syncthreads();
    if (t < 32) {
        h0 = t < THREADS / 32 ? s0[t] : 0;
        h1 = t < THREADS / 32 ? s1[t] : 0;
        h0 = warp_sum(h0);
        h1 = warp_sum(h1);
        if (t == 0) { sums[2 * c] = h0; sums[2 * c + 1] = h1; }
    }
}

extern "C" __global__ void __launch_bounds__(256) pairs256(const u64* chunks, u64* sums, unsigned n) { pairs<256>(chunks, sums); }
extern "C" __global__ void __launch_bounds__(512) pairs512(const u64* chunks, u64* sums, unsigned n) { pairs<512>(chunks, sums); }

extern "C" __global__ void read256(const u64* chunks, u64* sums, unsigned n) {
    unsigned c = blockIdx.x, t = threadIdx.x;
    const ulonglong2* p = (const ulonglong2*)chunks[2 * c];
    unsigned m = (unsigned)((chunks[2 * c + 1] & 0xFFFFFFFFull) / 16);
    u64 h = 0;
#pragma unroll 4
    for (unsigned j = t; j < m; j += 256) { ulonglong2 w = p[j]; h ^= w.x ^ w.y; }
    h = warp_sum(h);
    if (t % 32 == 0) atomicAdd(&sums[2 * c], h);
}
"""


def ok(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    assert int(err) == 0, res
    return rest[0] if len(rest) == 1 else rest


def load(ptx):
    return ok(cu.cuModuleLoadData(ptx + b"\0"))


def time_kernel(fn, table, sums, n, threads, repeat=5):
    params = np.array([table, sums, n], np.uint64)
    args = np.array([params.ctypes.data + 8 * i for i in range(3)], np.uint64)
    start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
    best = float("inf")
    for _ in range(repeat):
        ok(cu.cuMemsetD8(sums, 0, 16 * n))
        ok(cu.cuEventRecord(start, 0))
        ok(cu.cuLaunchKernel(fn, n, 1, 1, threads, 1, 1, 0, 0, args.ctypes.data, 0))
        ok(cu.cuEventRecord(end, 0))
        ok(cu.cuEventSynchronize(end))
        best = min(best, ok(cu.cuEventElapsedTime(start, end)))
    out = np.empty(2 * n, np.uint64)
    ok(cu.cuMemcpyDtoH(out.ctypes.data, sums, out.nbytes))
    return best, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,32", help="GiB")
    args = ap.parse_args()
    from phos import snapshot
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "v.cu"), "w") as f:
            f.write(VARIANTS)
        subprocess.run(["nvcc", "-ptx", "-arch=sm_90", "-o", os.path.join(d, "v.ptx"), os.path.join(d, "v.cu")], check=True)
        with open(os.path.join(d, "v.ptx"), "rb") as f:
            variants_ptx = f.read()
    with open(os.path.join(os.path.dirname(snapshot.__file__), "kernels", "pfp1.ptx"), "rb") as f:
        shipped_ptx = f.read()
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    shipped, variants = load(shipped_ptx), load(variants_ptx)
    kernels = [("shipped", ok(cu.cuModuleGetFunction(shipped, b"pfp1_lane_sums")), 256),
               ("pairs", ok(cu.cuModuleGetFunction(variants, b"pairs256")), 256),
               ("pairs512", ok(cu.cuModuleGetFunction(variants, b"pairs512")), 512),
               ("read", ok(cu.cuModuleGetFunction(variants, b"read256")), 256)]
    print("| size | kernel | ms | TB/s | sums equal the shipped kernel's |\n|---|---|---|---|---|")
    for gib in (int(s) for s in args.sizes.split(",")):
        size = gib * GiB
        mem = int(ok(cu.cuMemAlloc(size)))
        rng = np.random.default_rng(gib)
        block = rng.integers(0, 2**63, 16 * MiB // 8, dtype=np.uint64)
        for off in range(0, size, block.nbytes):       # distinct data: each 16 MiB differs
            block[0] = off
            ok(cu.cuMemcpyHtoD(mem + off, block.ctypes.data, block.nbytes))
        n = size // CHUNK
        table_host = np.empty(2 * n, np.uint64)
        table_host[0::2] = mem + CHUNK * np.arange(n, dtype=np.uint64)
        table_host[1::2] = CHUNK
        table, sums = int(ok(cu.cuMemAlloc(16 * n))), int(ok(cu.cuMemAlloc(16 * n)))
        ok(cu.cuMemcpyHtoD(table, table_host.ctypes.data, table_host.nbytes))
        reference = None
        for name, fn, threads in kernels:
            ms, out = time_kernel(fn, table, sums, n, threads)
            if reference is None:
                reference = out
            same = "-" if name == "read" else ("yes" if np.array_equal(out, reference) else "NO")
            print(f"| {gib} GiB | {name} | {ms:.2f} | {size / ms / 1e9:.2f} | {same} |")
        for p in (mem, table, sums):
            ok(cu.cuMemFree(p))


if __name__ == "__main__":
    main()
