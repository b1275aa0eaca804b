"""The cuda-python twin of tests/apps/steps.cu, on phos's Python client: `steps.py PTX TOTAL
DELAY_MS [CONTEXTS]` runs TOTAL steps of a kernel in each of CONTEXTS contexts (default 1) over
device memory the previous steps wrote, keeps a host-side running sum, prints each step's
checksums and sleeps DELAY_MS. A whole-process checkpoint, restore or migration at any step
must leave its output exactly that of an uninterrupted run (tests/e2e/test_process.py)."""
import ctypes
import sys
import time

import numpy as np

from phos.client_stub import driver as cuda


def check(result):
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{result[0].name}: {cuda.last_error}")
    return result[1] if len(result) == 2 else result[1:]


def main():
    ptx = open(sys.argv[1], "rb").read()
    total, delay = int(sys.argv[2]), int(sys.argv[3]) / 1e3
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    n = 1 << 14
    check(cuda.cuInit(0))
    dev = check(cuda.cuDeviceGet(0))
    contexts = []
    for _ in range(count):
        ctx = check(cuda.cuCtxCreate(None, 0, dev))
        kernel = check(cuda.cuModuleGetFunction(check(cuda.cuModuleLoadData(ptx)), b"step"))
        x = check(cuda.cuMemAlloc(4 * n))
        check(cuda.cuMemcpyHtoD(x, np.ones(n, np.float32), 4 * n))
        contexts.append((ctx, kernel, x))
        check(cuda.cuCtxPopCurrent())
    running = 0.0
    host = np.empty(n, np.float32)
    for k in range(total):
        for c, (ctx, kernel, x) in enumerate(contexts):
            check(cuda.cuCtxPushCurrent(ctx))
            args = ((x, n, k + c), (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))
            check(cuda.cuLaunchKernel(kernel, (n + 255) // 256, 1, 1, 256, 1, 1, 0, 0, args, 0))
            check(cuda.cuMemcpyDtoH(host, x, 4 * n))
            check(cuda.cuCtxPopCurrent())
            total_sum = float(host.astype(np.float64).sum())
            running += total_sum
            print(f"step {k} context {c} {total_sum:.6f} {running:.6f}", flush=True)
        time.sleep(delay)
    print(f"DONE {total}", flush=True)


if __name__ == "__main__":
    main()
