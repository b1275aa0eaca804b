"""Virtual memory management through phos's libcuda.so.1, as PyTorch's expandable segments use
it: reserve a range, map physical allocations into it one after another, copy across them,
unmap, and give the range back. The server keeps the range and its mappings (images too:
tests/e2e/test_driver_calls.py)."""
import subprocess
import sys

import pytest

from test_stub import LIBCUDA, stub_env

pytestmark = pytest.mark.gpu

VMM = r"""
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
MIB2 = 2 << 20
def ok(name, *args):
    r = getattr(cuda, name)(*args)
    assert r == 0, f"{name} -> {r}"

class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]
class Access(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]

ok("cuInit", 0)
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok("cuDeviceGet", ctypes.byref(dev), 0)
ok("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
ok("cuCtxSetCurrent", ctx)
prop = Prop(type=1, location=Location(type=1, id=0))        # pinned, on device 0
granularity = ctypes.c_size_t()
ok("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop), 0)
print("granularity:", granularity.value)

base = ctypes.c_uint64()
ok("cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(4 * MIB2), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0))
handles = [ctypes.c_uint64(), ctypes.c_uint64()]
for i, h in enumerate(handles):                               # the segment grows by two pieces
    ok("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(MIB2), ctypes.byref(prop), ctypes.c_ulonglong(0))
    ok("cuMemMap", ctypes.c_uint64(base.value + i * MIB2), ctypes.c_size_t(MIB2), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0))
    ok("cuMemRelease", h)                                     # mapped memory outlives its handle
access = Access(location=Location(type=1, id=0), flags=3)
ok("cuMemSetAccess", ctypes.c_uint64(base.value), ctypes.c_size_t(2 * MIB2), ctypes.byref(access), ctypes.c_size_t(1))

data = bytes(range(256)) * 64                                 # 16 KiB across the two mappings
at = base.value + MIB2 - 8192
ok("cuMemcpyHtoD_v2", ctypes.c_uint64(at), data, ctypes.c_size_t(len(data)))
ok("cuMemsetD8_v2", ctypes.c_uint64(at + len(data) - 16), ctypes.c_ubyte(7), ctypes.c_size_t(16))
out = ctypes.create_string_buffer(len(data))
ok("cuMemcpyDtoH_v2", out, ctypes.c_uint64(at), ctypes.c_size_t(len(data)))
print("data across mappings:", out.raw == data[:-16] + bytes([7]) * 16)
print("past the range:", cuda.cuMemsetD8_v2(ctypes.c_uint64(base.value + 2 * MIB2 - 16), ctypes.c_ubyte(7), ctypes.c_size_t(32)))
flags = ctypes.c_ulonglong()
ok("cuMemGetAccess", ctypes.byref(flags), ctypes.byref(Location(type=1, id=0)), ctypes.c_uint64(base.value + 100))
retained = ctypes.c_uint64()
ok("cuMemRetainAllocationHandle", ctypes.byref(retained), ctypes.c_void_p(base.value + MIB2 + 5))
print("access:", flags.value, "retained the second:", retained.value == handles[1].value)
ok("cuMemRelease", retained)
print("free a mapping:", cuda.cuMemFree_v2(ctypes.c_uint64(base.value)))
print("map outside the range:", cuda.cuMemMap(ctypes.c_uint64(base.value + 8 * MIB2), ctypes.c_size_t(MIB2), ctypes.c_size_t(0), handles[0], ctypes.c_ulonglong(0)))
print("address free while mapped:", cuda.cuMemAddressFree(ctypes.c_uint64(base.value), ctypes.c_size_t(4 * MIB2)))
ok("cuMemUnmap", ctypes.c_uint64(base.value), ctypes.c_size_t(2 * MIB2))
print("released handle:", cuda.cuMemRelease(handles[0]))
ok("cuMemAddressFree", ctypes.c_uint64(base.value), ctypes.c_size_t(4 * MIB2))
shareable = Prop(type=1, requestedHandleTypes=1, location=Location(type=1, id=0))   # a POSIX fd, as PyTorch asks
ok("cuMemCreate", ctypes.byref(handles[0]), ctypes.c_size_t(MIB2), ctypes.byref(shareable), ctypes.c_ulonglong(0))
fd = ctypes.c_int()
print("export:", cuda.cuMemExportToShareableHandle(ctypes.byref(fd), handles[0], 1, ctypes.c_ulonglong(0)))
ok("cuMemRelease", handles[0])
ok("cuCtxSynchronize")
print("done")
"""


def test_a_range_grows_by_mappings_holds_data_across_them_and_is_given_back(stub, server):
    r = subprocess.run([sys.executable, "-c", VMM, LIBCUDA], capture_output=True, text=True, timeout=120,
                       env=stub_env(server.address))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        f"granularity: {2 << 20}",
        "data across mappings: True",         # side by side, they are one range, as in CUDA
        "past the range: 1",
        "access: 3 retained the second: True",   # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        "free a mapping: 1",                  # CUDA_ERROR_INVALID_VALUE: cuMemUnmap frees it
        "map outside the range: 400",         # the handle is released: CUDA_ERROR_INVALID_HANDLE
        "address free while mapped: 1",
        "released handle: 1",                 # both handles went with their mappings
        "export: 801",                        # asked for, but sharing it is not supported
        "done",
    ], r.stderr
    assert "cuMemExportToShareableHandle" in r.stderr
