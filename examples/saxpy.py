"""A cuda-python program; switching it to phos took one import line.

    PHOS_SERVER=ipc:///tmp/phos/phos.sock python examples/saxpy.py
"""
import ctypes
import os
import subprocess
import tempfile

import numpy as np

from phos.client_stub import driver as cuda   # was: from cuda.bindings import driver as cuda


def check(result):
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{result[0].name}: {cuda.last_error}")
    return result[1] if len(result) == 2 else result[1:]


def main():
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "saxpy.cu")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["nvcc", "-ptx", "-arch=compute_75", src, "-o", f"{tmp}/saxpy.ptx"], check=True)
        ptx = open(f"{tmp}/saxpy.ptx", "rb").read()
    check(cuda.cuInit(0))
    dev = check(cuda.cuDeviceGet(0))
    print("device:", check(cuda.cuDeviceGetName(128, dev)).decode())
    ctx = check(cuda.cuCtxCreate(None, 0, dev))
    n = 1 << 20
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    y = np.ones(n, np.float32)
    dx, dy = check(cuda.cuMemAlloc(x.nbytes)), check(cuda.cuMemAlloc(y.nbytes))
    check(cuda.cuMemcpyHtoD(dx, x, x.nbytes))
    check(cuda.cuMemcpyHtoD(dy, y, y.nbytes))
    module = check(cuda.cuModuleLoadData(ptx))
    kernel = check(cuda.cuModuleGetFunction(module, b"saxpy"))
    args = ((2.0, dx, dy, n), (ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int))
    check(cuda.cuLaunchKernel(kernel, n // 256, 1, 1, 256, 1, 1, 0, 0, args, 0))
    out = np.empty_like(y)
    check(cuda.cuMemcpyDtoH(out, dy, out.nbytes))
    assert np.allclose(out, 2.0 * x + 1.0)
    print(f"saxpy over {n} floats: correct (y[:3] = {out[:3]})")
    check(cuda.cuCtxDestroy(ctx))


if __name__ == "__main__":
    main()
