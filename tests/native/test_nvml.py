"""phos/stub/libnvidia-ml.so.1: the NVML calls PyTorch makes, answered from the server's
devices through phos's driver, the way torch.cuda asks them (ctypes, before CUDA starts)."""
import os
import subprocess
import sys

import pytest

from test_stub import STUB, stub_env

pytestmark = pytest.mark.gpu

NVML = r"""
import ctypes, sys
nvml = ctypes.CDLL(sys.argv[1])
cuda = ctypes.CDLL(sys.argv[2])
handle = ctypes.c_void_p()
print("before init:", nvml.nvmlDeviceGetCount_v2(ctypes.byref(ctypes.c_uint())))
assert nvml.nvmlInit_v2() == 0
count = ctypes.c_uint()
assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
print("count:", count.value, "bad index:", nvml.nvmlDeviceGetHandleByIndex_v2(count.value, ctypes.byref(ctypes.c_void_p())))

# what the driver says, to compare
assert cuda.cuInit(0) == 0
cu_name, cu_uuid, cu_total = ctypes.create_string_buffer(256), ctypes.create_string_buffer(16), ctypes.c_size_t()
assert cuda.cuDeviceGetName(cu_name, 255, 0) == 0 and cuda.cuDeviceGetUuid_v2(cu_uuid, 0) == 0
assert cuda.cuDeviceTotalMem_v2(ctypes.byref(cu_total), 0) == 0

name, uuid = ctypes.create_string_buffer(96), ctypes.create_string_buffer(96)
assert nvml.nvmlDeviceGetName(handle, name, 96) == 0 and nvml.nvmlDeviceGetUUID(handle, uuid, 96) == 0
h = cu_uuid.raw.hex()
print("name:", name.value == cu_name.value)
print("uuid:", uuid.value.decode() == f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
print("short buffer:", nvml.nvmlDeviceGetUUID(handle, uuid, 8))
memory = (ctypes.c_ulonglong * 3)()
assert nvml.nvmlDeviceGetMemoryInfo(handle, memory) == 0
print("memory:", memory[0] == cu_total.value, memory[1] == memory[0], memory[2])
major, minor = ctypes.c_int(), ctypes.c_int()
assert nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0
print("cc:", major.value, minor.value)
pci = ctypes.create_string_buffer(80)             # nvmlPciInfo_v3: 16 + 5 * 4 + 32 bytes
assert nvml.nvmlDeviceGetPciInfo_v3(handle, pci) == 0
bus_id = pci.raw[36:68].split(b"\0")[0]
again = ctypes.c_void_p()
print("by pci:", nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(again)), again.value == handle.value)
print("by uuid:", nvml.nvmlDeviceGetHandleByUUID(uuid.value, ctypes.byref(again)), again.value == handle.value)
procs = ctypes.c_uint(7)
print("processes:", nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(procs), None), procs.value)
print("utilisation:", nvml.nvmlDeviceGetUtilizationRates(handle, ctypes.create_string_buffer(8)))
nvml.nvmlErrorString.restype = ctypes.c_char_p
print("error string:", nvml.nvmlErrorString(3).decode())
assert nvml.nvmlShutdown() == 0
print("after shutdown:", nvml.nvmlDeviceGetName(handle, name, 96), nvml.nvmlShutdown())
"""


def test_nvml_answers_what_the_driver_knows_and_names_what_it_cannot(stub, server):
    r = subprocess.run([sys.executable, "-c", NVML, os.path.join(STUB, "libnvidia-ml.so.1"), os.path.join(STUB, "libcuda.so.1")],
                       capture_output=True, text=True, timeout=120, env=stub_env(server.address))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "before init: 1",                     # NVML_ERROR_UNINITIALIZED
        "count: 1 bad index: 2",              # NVML_ERROR_INVALID_ARGUMENT
        "name: True",
        "uuid: True",
        "short buffer: 7",                    # NVML_ERROR_INSUFFICIENT_SIZE
        "memory: True True 0",                # the device's memory; its use is the server host's
        "cc: 9 0",
        "by pci: 0 True",
        "by uuid: 0 True",
        "processes: 0 0",
        "utilisation: 3",                     # NVML_ERROR_NOT_SUPPORTED, named on stderr
        "error string: Not Supported",
        "after shutdown: 1 1",
    ], r.stderr
    assert "nvmlDeviceGetUtilizationRates: not supported on a phos client" in r.stderr
