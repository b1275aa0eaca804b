"""How close does the cut's fingerprint pass come to reading the memory? pfp1 beside a plain read.

The cut's pass over all of a context's memory is the fence the application waits behind. This
times, over 2 MiB chunks as the cut hashes them:

- `shipped`: snapshot/kernels/pfp1.ptx, as the server loads it (PTX for compute 7.5, which the
  driver compiles for the device);
- `sm_90`: the same source, snapshot/kernels/pfp1.cu, compiled here for the H200 by nvcc;
- `read`: XOR of every word (what reading the memory alone costs);

and checks that both pfp1 builds give the same sums. (perf/RESULTS.md also times the kernel
with 512 threads a block, which gains under 2%.)

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

# The shipped kernel's source (its warp_sum with it), and a plain read over the same table.
VARIANTS = r"""
#include "pfp1.cu"

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


def time_kernel(fn, table, sums, n, repeat=5):
    params = np.array([table, sums, n], np.uint64)
    args = np.array([params.ctypes.data + 8 * i for i in range(3)], np.uint64)
    start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
    best = float("inf")
    for _ in range(repeat):
        ok(cu.cuMemsetD8(sums, 0, 16 * n))
        ok(cu.cuEventRecord(start, 0))
        ok(cu.cuLaunchKernel(fn, n, 1, 1, 256, 1, 1, 0, 0, args.ctypes.data, 0))     # pfp1 assumes 256 threads
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
    kernels_dir = os.path.join(os.path.dirname(snapshot.__file__), "kernels")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "v.cu"), "w") as f:
            f.write(VARIANTS)
        subprocess.run(["nvcc", "-ptx", "-arch=sm_90", "-I", kernels_dir, "-o", os.path.join(d, "v.ptx"),
                        os.path.join(d, "v.cu")], check=True)
        with open(os.path.join(d, "v.ptx"), "rb") as f:
            variants_ptx = f.read()
    with open(os.path.join(kernels_dir, "pfp1.ptx"), "rb") as f:
        shipped_ptx = f.read()
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    shipped, variants = load(shipped_ptx), load(variants_ptx)
    kernels = [("shipped", ok(cu.cuModuleGetFunction(shipped, b"pfp1_lane_sums"))),
               ("sm_90", ok(cu.cuModuleGetFunction(variants, b"pfp1_lane_sums"))),
               ("read", ok(cu.cuModuleGetFunction(variants, b"read256")))]
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
        for name, fn in kernels:
            ms, out = time_kernel(fn, table, sums, n)
            if reference is None:
                reference = out
            same = "-" if name == "read" else ("yes" if np.array_equal(out, reference) else "NO")
            print(f"| {gib} GiB | {name} | {ms:.2f} | {size / ms / 1e9:.2f} | {same} |")
        for p in (mem, table, sums):
            ok(cu.cuMemFree(p))


if __name__ == "__main__":
    main()
