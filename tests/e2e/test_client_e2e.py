"""End to end through a real server process: the cuda-python-shaped client, on the chosen backend.

CI runs these on emu; perf/device/run.sh runs the same file with --backend cuda on the H200.
"""
import ctypes
import os

import numpy as np
import pytest

from phos.gpu_server.address_space import BASE

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

OK = 0


def test_device_queries(cu):
    assert cu.cuDeviceGetCount() == (OK, 1)
    err, dev = cu.cuDeviceGet(0)
    assert err == OK
    err, name = cu.cuDeviceGetName(256, dev)
    assert err == OK and len(name) > 3
    err, total = cu.cuDeviceTotalMem(dev)
    assert err == OK and total > 1 << 30
    err, major, minor = cu.cuDeviceComputeCapability(dev)
    assert err == OK and major >= 7
    attr = cu.CUdevice_attribute
    assert cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE, dev) == (OK, 32)
    assert cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) == (OK, major)
    err, uuid = cu.cuDeviceGetUuid(dev)
    assert err == OK and len(uuid.bytes) == 16
    assert cu.cuDeviceGet(5)[0] == cu.CUresult.CUDA_ERROR_INVALID_DEVICE
    err, version = cu.cuDriverGetVersion()
    assert err == OK and version >= 12000


def test_alloc_copy_memset_roundtrip(cu):
    n = 1 << 20
    err, ptr = cu.cuMemAlloc(n * 4)
    assert err == OK and int(ptr) >= BASE               # the fixed base of DESIGN decision 3
    src = np.random.default_rng(1).random(n, dtype=np.float32)
    assert cu.cuMemcpyHtoD(ptr, src, src.nbytes) == (OK,)
    assert cu.cuMemsetD32(ptr, 0x3F800000, 16) == (OK,)          # 1.0f
    assert cu.cuMemsetD16(int(ptr) + 64, 0xFFFF, 2) == (OK,)
    assert cu.cuMemsetD8(int(ptr) + 68, 0xAB, 4) == (OK,)
    out = np.zeros_like(src)
    assert cu.cuMemcpyDtoH(out, ptr, out.nbytes) == (OK,)
    want = src.copy()
    want[:16] = 1.0
    want.view(np.uint8)[64:68] = 0xFF
    want.view(np.uint8)[68:72] = 0xAB
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    err, ptr2 = cu.cuMemAlloc(n * 4)
    assert cu.cuMemcpyDtoD(ptr2, ptr, n * 4) == (OK,)
    out2 = np.zeros_like(src)
    assert cu.cuMemcpyDtoH(out2, ptr2, out2.nbytes) == (OK,)
    assert np.array_equal(out2.view(np.uint32), want.view(np.uint32))
    assert cu.cuMemFree(ptr) == (OK,) and cu.cuMemFree(ptr2) == (OK,)
    assert cu.cuCtxSynchronize() == (OK,)


def test_int_addresses_and_ctypes_buffers(cu):
    err, ptr = cu.cuMemAlloc(64)
    src = (ctypes.c_uint32 * 16)(*range(16))
    assert cu.cuMemcpyHtoD(ptr, ctypes.addressof(src), 64) == (OK,)
    dst = (ctypes.c_uint32 * 16)()
    assert cu.cuMemcpyDtoH(ctypes.addressof(dst), ptr, 64) == (OK,)
    assert list(dst) == list(range(16))


def test_mem_info_and_address_range(cu):
    err, free0, total = cu.cuMemGetInfo()
    assert err == OK and 0 < free0 <= total
    err, ptr = cu.cuMemAlloc(3 << 20)
    err, base, size = cu.cuMemGetAddressRange(int(ptr) + 12345)
    assert err == OK and base == ptr and size == 3 << 20
    err, free1, _ = cu.cuMemGetInfo()
    assert free1 < free0
    assert cu.cuMemGetAddressRange(int(ptr) + (64 << 20))[0] == cu.CUresult.CUDA_ERROR_NOT_FOUND
    cu.cuMemFree(ptr)


def test_async_copies_on_streams_and_events(cu):
    n = 1 << 16
    err, s1 = cu.cuStreamCreate(0)
    err, s2 = cu.cuStreamCreate(1)
    err, ev = cu.cuEventCreate(0)
    err, start = cu.cuEventCreate(0)
    err, ptr = cu.cuMemAlloc(n * 4)
    src = np.arange(n, dtype=np.uint32)
    assert cu.cuEventRecord(start, s1) == (OK,)
    assert cu.cuMemcpyHtoDAsync(ptr, src, src.nbytes, s1) == (OK,)
    assert cu.cuMemsetD32Async(ptr, 9, 8, s1) == (OK,)
    assert cu.cuEventRecord(ev, s1) == (OK,)
    assert cu.cuStreamWaitEvent(s2, ev, 0) == (OK,)
    out = np.zeros_like(src)
    assert cu.cuMemcpyDtoHAsync(out, ptr, out.nbytes, s2) == (OK,)
    assert cu.cuStreamSynchronize(s2) == (OK,)         # the bytes land by the sync, as in CUDA
    assert out[:8].tolist() == [9] * 8 and np.array_equal(out[8:], src[8:])
    assert cu.cuEventSynchronize(ev) == (OK,)
    assert cu.cuEventQuery(ev) == (OK,)
    assert cu.cuStreamQuery(s1) == (OK,)
    err, ms = cu.cuEventElapsedTime(start, ev)
    assert err == OK and ms >= 0
    for h in (ev, start):
        assert cu.cuEventDestroy(h) == (OK,)
    for s in (s1, s2):
        assert cu.cuStreamDestroy(s) == (OK,)
    assert cu.cuCtxSynchronize() == (OK,)


def test_bad_pointer_fails_its_own_call_and_is_not_sticky(cu):
    err, ptr = cu.cuMemAlloc(1024)
    assert cu.cuMemsetD8(int(ptr) + 1000, 1, 100)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE   # at once, as CUDA's driver
    assert "past the end" in cu.last_error
    assert cu.cuCtxSynchronize() == (OK,)                             # not sticky, as in CUDA
    buf = np.zeros(16, np.uint8)
    assert cu.cuMemcpyDtoH(buf, 0x1234, 16)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
    assert cu.cuMemcpyDtoH(buf, ptr, 16) == (OK,)


def test_unknown_handles_are_refused(cu):
    assert cu.cuStreamSynchronize(cu.CUstream(0xDEAD))[0] == cu.CUresult.CUDA_ERROR_INVALID_HANDLE
    assert cu.cuEventQuery(cu.CUevent(0x1234))[0] == cu.CUresult.CUDA_ERROR_INVALID_HANDLE
    assert cu.cuModuleGetFunction(cu.CUmodule(0x999), b"k")[0] == cu.CUresult.CUDA_ERROR_INVALID_HANDLE
    err, s = cu.cuStreamCreate(0)
    assert cu.cuEventRecord(cu.CUevent(int(s)), 0) == (OK,)         # a stream id used as an event...
    assert cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_ERROR_INVALID_HANDLE   # ...is refused
    assert cu.cuMemFree(BASE + 7)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE    # at once
    assert cu.cuCtxSynchronize() == (OK,)


def test_module_load_errors_are_clear(cu):
    err, _ = cu.cuModuleLoadData(b"this is not a module image")
    assert err in (cu.CUresult.CUDA_ERROR_INVALID_IMAGE, cu.CUresult.CUDA_ERROR_INVALID_PTX)
    assert cu.last_error


def test_two_contexts_are_separate(cu):
    err, p1 = cu.cuMemAlloc(4096)
    cu.cuMemsetD8(p1, 1, 4096)
    err, ctx_a = cu.cuCtxGetCurrent()
    err, ctx_b = cu.cuCtxCreate(None, 0, 0)
    assert err == OK and ctx_b != ctx_a
    buf = np.zeros(16, np.uint8)
    # the same address means nothing in the other context: its worker owns other memory
    assert cu.cuMemcpyDtoH(buf, p1, 16)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
    err, p2 = cu.cuMemAlloc(4096)
    assert p2 == p1                                                    # both start at the fixed base
    assert cu.cuCtxDestroy(ctx_b) == (OK,)
    assert cu.cuCtxSetCurrent(ctx_a) == (OK,)
    assert cu.cuMemcpyDtoH(buf, p1, 16) == (OK,) and buf.tolist() == [1] * 16


def test_primary_context(cu):
    err, prim = cu.cuDevicePrimaryCtxRetain(0)
    assert err == OK
    err, again = cu.cuDevicePrimaryCtxRetain(0)
    assert again == prim
    assert cu.cuCtxPushCurrent(prim) == (OK,)
    err, p = cu.cuMemAlloc(256)
    assert err == OK
    assert cu.cuCtxPopCurrent() == (OK, prim)
    assert cu.cuDevicePrimaryCtxRelease(0) == (OK,)
    assert cu.cuDevicePrimaryCtxRelease(0) == (OK,)


def test_error_strings(cu):
    assert cu.cuGetErrorName(cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS) == (OK, b"CUDA_ERROR_ILLEGAL_ADDRESS")
    assert cu.cuGetErrorString(700) == (OK, b"an illegal memory access was encountered")
    assert cu.cuGetErrorName(123456)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE


@pytest.mark.parametrize("size", [1, 4096, 3 << 20])
def test_copy_sizes(cu, size):
    err, ptr = cu.cuMemAlloc(size)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert cu.cuMemcpyHtoD(ptr, data, size) == (OK,)
    out = np.zeros(size, np.uint8)
    assert cu.cuMemcpyDtoH(out, ptr, size) == (OK,)
    assert np.array_equal(out, data)


def test_large_copies_through_the_staging_area(cu):
    n = (80 << 20) + 12345                       # more than two staging slots, not slot-aligned
    conn = cu._contexts[int(cu.cuCtxGetCurrent()[1])]
    assert conn.staging is not None, "a local worker should map the staging area"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"phos-{os.getpid()}-")], "staging file left behind"
    err, ptr = cu.cuMemAlloc(n)
    data = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    assert cu.cuMemcpyHtoD(ptr, data, n) == (OK,)
    out = np.zeros(n, np.uint8)
    assert cu.cuMemcpyDtoH(out, ptr, n) == (OK,)
    assert np.array_equal(out, data)
    # a copy past the end fails at once in the client; sent anyway, the worker fails the staged
    # copy at the next synchronizing call, and nothing is lost after
    assert cu.cuMemcpyHtoD(int(ptr) + 4096, data, n)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
    conn.copy_to_device(int(ptr) + 4096, data, n, 0)
    assert cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
    assert cu.cuMemcpyDtoH(out, int(ptr) + 4096, n)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
    assert cu.cuMemcpyDtoH(out, ptr, n) == (OK,) and np.array_equal(out, data)
    cu.cuMemFree(ptr)


def test_staging_refused_for_a_forged_cookie(cu):
    conn = cu._contexts[int(cu.cuCtxGetCurrent()[1])]
    path, cookie, size = conn.offer_staging()
    with open(path, "r+b") as f:
        f.write(b"\0" * 16)                       # not what we will claim
    res = conn.call("attach", {"ctx": int(cu.cuCtxGetCurrent()[1]), "token": b"", "shmPath": path,
                               "shmCookie": cookie, "shmSize": size})
    fd, area = conn._offer                        # the offer's file, which no attach took
    os.close(fd)
    area.close()
    assert res.status == 0 and res.u64s[1] == 0   # already attached: the call succeeds, the area is refused
