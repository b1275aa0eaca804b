"""The project's CUDA C kernels, compiled to PTX, run through a real server with the Python client.

Same PTX, same checks on both backends: CI runs emu; perf/device/run.sh runs --backend cuda.
"""
import ctypes

import numpy as np
import pytest

from ptx_helpers import compile_ptx

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

OK = 0
i32, f32, f64, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_double, ctypes.c_void_p


class Params(ctypes.Structure):
    _fields_ = [("scale", ctypes.c_float), ("offset", ctypes.c_double), ("idx", ctypes.c_int * 3)]


class Dev:
    """Allocate, upload, download and launch through the phos client, checking every status."""

    def __init__(self, cu):
        self.cu = cu

    def check(self, res):
        assert int(res[0]) == OK, (res, self.cu.last_error)
        return res[1] if len(res) == 2 else res[1:]

    def put(self, a):
        a = np.ascontiguousarray(a)
        p = self.check(self.cu.cuMemAlloc(max(a.nbytes, 1)))
        self.check(self.cu.cuMemcpyHtoD(p, a, a.nbytes))
        return p

    def get(self, p, n, dtype):
        out = np.zeros(n, dtype)
        self.check(self.cu.cuMemcpyDtoH(out, p, out.nbytes))
        return out

    def kernel(self, source, name, arch="compute_90"):
        mod = self.check(self.cu.cuModuleLoadData(compile_ptx(source, arch).encode()))
        return mod, self.check(self.cu.cuModuleGetFunction(mod, name.encode()))

    def launch(self, fn, grid, block, args, shared=0):
        values, types = zip(*args)
        self.check(self.cu.cuLaunchKernel(fn, *grid, *block, shared, 0, (values, types), 0))


@pytest.fixture
def dev(cu):
    return Dev(cu)


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_vector_add(dev, arch):
    n = 1 << 16
    a, b = np.random.default_rng(0).random((2, n), dtype=np.float32)
    pa, pb, pc = dev.put(a), dev.put(b), dev.put(np.zeros(n, np.float32))
    _, fn = dev.kernel("vecadd.cu", "vec_add", arch)
    dev.launch(fn, ((n + 255) // 256, 1, 1), (256, 1, 1), [(pa, ptr), (pb, ptr), (pc, ptr), (n, i32)])
    assert np.array_equal(dev.get(pc, n, np.float32), a + b)


def test_saxpy(dev):
    n = 10000
    x, y = np.random.default_rng(1).random((2, n), dtype=np.float32)
    px, py = dev.put(x), dev.put(y)
    _, fn = dev.kernel("vecadd.cu", "saxpy")
    dev.launch(fn, ((n + 127) // 128, 1, 1), (128, 1, 1), [(2.5, f32), (px, ptr), (py, ptr), (n, i32)])
    assert np.allclose(dev.get(py, n, np.float32), np.float32(2.5) * x + y, rtol=1e-6)


def test_tiled_matmul(dev):
    m, n, k = 64, 48, 80
    rng = np.random.default_rng(2)
    a, b = rng.random((m, k), dtype=np.float32), rng.random((k, n), dtype=np.float32)
    pa, pb, pc = dev.put(a), dev.put(b), dev.put(np.zeros(m * n, np.float32))
    _, fn = dev.kernel("matmul.cu", "matmul")
    dev.launch(fn, ((n + 15) // 16, (m + 15) // 16, 1), (16, 16, 1),
               [(pa, ptr), (pb, ptr), (pc, ptr), (m, i32), (n, i32), (k, i32)])
    assert np.allclose(dev.get(pc, m * n, np.float32).reshape(m, n), a @ b, rtol=1e-4)


def test_reduction_with_shuffles(dev):
    n = 1 << 16
    x = np.random.default_rng(3).integers(0, 8, n).astype(np.float32)      # exact in float32
    px, pout = dev.put(x), dev.put(np.zeros(1, np.float32))
    _, fn = dev.kernel("reduce.cu", "reduce_sum")
    dev.launch(fn, (32, 1, 1), (256, 1, 1), [(px, ptr), (pout, ptr), (n, i32)], shared=256 * 4)
    assert dev.get(pout, 1, np.float32)[0] == x.sum()


def test_histogram_with_atomics(dev):
    n = 50000
    data = np.random.default_rng(4).integers(0, 256, n).astype(np.uint8)
    pd, pb = dev.put(data), dev.put(np.zeros(256, np.uint32))
    _, fn = dev.kernel("histogram.cu", "histogram")
    dev.launch(fn, (16, 1, 1), (128, 1, 1), [(pd, ptr), (pb, ptr), (n, i32)])
    assert np.array_equal(dev.get(pb, 256, np.uint32), np.bincount(data, minlength=256))


def test_struct_by_value_and_param_layout(dev):
    n = 96
    x = np.random.default_rng(5).random(n, dtype=np.float32)
    px, py = dev.put(x), dev.put(np.zeros(n, np.float32))
    _, fn = dev.kernel("structs.cu", "by_value")
    layout = [dev.check(dev.cu.cuFuncGetParamInfo(fn, i)) for i in range(6)]
    assert layout == [(0, 8), (8, 8), (16, 4), (24, 32), (56, 1), (64, 8)]
    assert dev.cu.cuFuncGetParamInfo(fn, 6)[0] != OK
    p = Params(1.5, 0.25, (1, 2, 3))
    dev.launch(fn, (1, 1, 1), (128, 1, 1), [(px, ptr), (py, ptr), (n, i32), (p, None), (3, ctypes.c_char), (0.5, f64)])
    want = x * np.float32(1.5) + np.float32(0.25) + np.array([1, 2, 3], np.float32)[np.arange(n) % 3] + 3 + np.float32(0.5)
    assert np.allclose(dev.get(py, n, np.float32), want, rtol=1e-6)


def test_double_precision(dev):
    n = 256
    rng = np.random.default_rng(6)
    x, y = rng.random(n) + 0.5, rng.random(n) + 0.5
    px, py, po, pi = dev.put(x), dev.put(y), dev.put(np.zeros(4 * n)), dev.put(np.zeros(2 * n, np.int64))
    _, fn = dev.kernel("double.cu", "dbl")
    dev.launch(fn, (2, 1, 1), (128, 1, 1), [(px, ptr), (py, ptr), (po, ptr), (pi, ptr), (n, i32)])
    out = dev.get(po, 4 * n, np.float64).reshape(n, 4)
    assert np.allclose(out[:, 0], x * y + x / y - np.sqrt(np.abs(x)), rtol=1e-12)
    assert np.allclose(out[:, 1], (x * y + 1.0) / (1.0 + y * y), rtol=1e-12)
    assert np.array_equal(dev.get(pi, 2 * n, np.int64)[0::2], (x * 1000.0).astype(np.int64))


def test_module_globals(dev):
    n = 64
    mod, fn = dev.kernel("globals.cu", "use_globals")
    counter, size = dev.check(dev.cu.cuModuleGetGlobal(mod, b"counter"))
    assert size == 4 and dev.get(counter, 1, np.int32)[0] == 7
    coeffs, _ = dev.check(dev.cu.cuModuleGetGlobal(mod, b"coeffs"))
    dev.check(dev.cu.cuMemcpyHtoD(coeffs, np.array([2, 2, 2, 2], np.float32), 16))   # like cudaMemcpyToSymbol
    po = dev.put(np.zeros(n, np.float32))
    dev.launch(fn, (1, 1, 1), (n, 1, 1), [(po, ptr), (n, i32)])
    i = np.arange(n)
    assert np.allclose(dev.get(po, n, np.float32), 2.0 * i * 0.5 + np.array([10, 20, 30])[i % 3])
    assert dev.get(counter, 1, np.int32)[0] == 8
    assert dev.cu.cuModuleGetGlobal(mod, b"nope")[0] == dev.cu.CUresult.CUDA_ERROR_NOT_FOUND


def test_illegal_address_is_sticky(cu, dev):
    po = dev.put(np.zeros(64, np.float32))
    _, fn = dev.kernel("faults.cu", "oob_write")
    dev.launch(fn, (4, 1, 1), (64, 1, 1), [(po, ptr), (64, i32), (1 << 22, i32)])
    assert cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    assert cu.cuMemAlloc(16)[0] == cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS      # the context is dead, as on a GPU
    assert cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS


def test_trap(cu, dev):
    po = dev.put(np.zeros(32, np.int32))
    _, fn = dev.kernel("faults.cu", "trap_kernel")
    dev.launch(fn, (1, 1, 1), (32, 1, 1), [(po, ptr), (5, i32)])
    err = cu.cuCtxSynchronize()[0]
    from phos.gpu_server.backends.ptx import TRAP_STATUS
    assert err == TRAP_STATUS, f"trap gave {err!r}; emu reports {TRAP_STATUS!r}"


def test_launch_errors(cu, dev):
    _, fn = dev.kernel("vecadd.cu", "vec_add")
    p = dev.put(np.zeros(4, np.float32))
    args = ((p, p, p, 4), (ptr, ptr, ptr, i32))
    assert cu.cuLaunchKernel(fn, 1, 1, 1, 2048, 1, 1, 0, 0, args, 0) == (OK,)      # asynchronous...
    assert cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE        # ...reported at the sync
    assert cu.cuLaunchKernel(fn, 1, 1, 1, 4, 1, 1, 0, 0, ((p,), (ptr,)), 0)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
    assert cu.cuCtxSynchronize() == (OK,)
