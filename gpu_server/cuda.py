"""The cuda backend: a real GPU through cuda-python's driver API.

Allocations are VMM mappings inside one range reserved at the fixed base
(DESIGN decision 3), so a restored or handed-off context keeps its addresses.
"""
import ctypes

import numpy as np
from cuda.bindings import driver as cu

from phos.gpu_server.address_space import BASE, AddressSpace
from phos.gpu_server.backend import DeviceInfo, Function
from phos.schema.cuda_types import CudaError, CUresult

GiB = 1 << 30


def ok(result, what):
    """Unpack a cuda-python result tuple, raising CudaError on failure."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(int(err), f"{what} failed: {cu.cuGetErrorString(err)[1].decode(errors='replace')}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


# Launches are the hot path: calling the driver through ctypes costs a third of cuda-python's wrapper.
_cuLaunchKernel = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
_cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
_cuLaunchKernel.restype = ctypes.c_int


def _init():
    ok(cu.cuInit(0), "cuInit")


class CudaBackend:
    name = "cuda"

    @staticmethod
    def devices():
        _init()
        out = []
        for ordinal in range(ok(cu.cuDeviceGetCount(), "cuDeviceGetCount")):
            dev = ok(cu.cuDeviceGet(ordinal), "cuDeviceGet")
            attrs = {}
            for attr in cu.CUdevice_attribute:
                err, value = cu.cuDeviceGetAttribute(attr, dev)
                if int(err) == 0:
                    attrs[int(attr)] = int(value)
            name = ok(cu.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0")[0].decode()
            uuid = bytes(ok(cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes)
            out.append(DeviceInfo(name, uuid, ok(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem"), attrs))
        return out

    @staticmethod
    def driver_version():
        return ok(cu.cuDriverGetVersion(), "cuDriverGetVersion")

    def __init__(self, device=0):
        _init()
        self.device = ok(cu.cuDeviceGet(device), "cuDeviceGet")
        self.ctx = ok(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        ok(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        granularity = ok(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                         "cuMemGetAllocationGranularity")
        self.reserved = self._reserve(ok(cu.cuDeviceTotalMem(self.device), "cuDeviceTotalMem"))
        self.space = AddressSpace(self.reserved, granularity)
        self.handles = {}            # base -> (mapped length, physical handle)
        self.registered = []         # pinned host ranges (the staging area)

    @staticmethod
    def _reserve(total):
        """Reserve the context's virtual range at BASE: as large as the driver allows, at least the device's memory."""
        for size in (4 * total, 2 * total, total):
            size = -(-size // GiB) * GiB
            err, base = cu.cuMemAddressReserve(size, 0, BASE, 0)
            if int(err) == 0 and int(base) == BASE:
                return size
            if int(err) == 0:
                cu.cuMemAddressFree(base, size)
        raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"could not reserve the context's address range at {BASE:#x}")

    # memory
    def alloc(self, nbytes, at=None):
        ptr = self.space.alloc(nbytes, at)
        length = -(-nbytes // self.space.align) * self.space.align
        try:
            handle = ok(cu.cuMemCreate(length, self.prop, 0), "cuMemCreate")
        except CudaError:
            self.space.release(ptr)
            raise
        ok(cu.cuMemMap(ptr, length, 0, handle, 0), "cuMemMap")
        ok(cu.cuMemSetAccess(ptr, length, [self.access], 1), "cuMemSetAccess")
        self.handles[ptr] = (length, handle)
        return ptr

    def free(self, ptr):
        self.space.release(ptr)
        ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")     # cuMemFree waits for work using the memory too
        length, handle = self.handles.pop(ptr)
        ok(cu.cuMemUnmap(ptr, length), "cuMemUnmap")
        ok(cu.cuMemRelease(handle), "cuMemRelease")

    def mem_info(self):
        return ok(cu.cuMemGetInfo(), "cuMemGetInfo")

    def htod(self, dst, data, stream):
        src = np.frombuffer(data, np.uint8)
        if stream is None:
            ok(cu.cuMemcpyHtoD(dst, src.ctypes.data, src.nbytes), "cuMemcpyHtoD")
        else:
            ok(cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, stream), "cuMemcpyHtoDAsync")

    def dtoh(self, src, out, stream):
        if stream is None:
            ok(cu.cuMemcpyDtoH(out.ctypes.data, src, out.nbytes), "cuMemcpyDtoH")
        else:
            ok(cu.cuMemcpyDtoHAsync(out.ctypes.data, src, out.nbytes, stream), "cuMemcpyDtoHAsync")
            ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def register_host(self, buf):
        """Pin the shared staging area, so copies through it run at full link speed."""
        err = cu.cuMemHostRegister(buf.ctypes.data, buf.nbytes, 0)[0]
        if int(err) == 0:
            self.registered.append(buf.ctypes.data)

    def dtod(self, dst, src, nbytes, stream):
        ok(cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream or 0), "cuMemcpyDtoDAsync")

    def memset(self, dst, value, elem_size, count, stream):
        fn = {1: cu.cuMemsetD8Async, 2: cu.cuMemsetD16Async, 4: cu.cuMemsetD32Async}[elem_size]
        ok(fn(dst, value, count, stream or 0), "cuMemsetAsync")

    # modules
    def load_module(self, image):
        data = bytes(image)
        if not data.startswith((b"\x50\xed\x55\xba", b"\x7fELF", b"\xb1\x43\x62\x46")) and not data.endswith(b"\0"):
            data += b"\0"        # PTX text must be NUL-terminated for the driver
        module = ok(cu.cuModuleLoadData(data), "cuModuleLoadData")
        return [module, []]      # the module and the globals adopted into the address space

    def unload_module(self, module):
        for ptr in module[1]:
            self.space.forget(ptr)
        ok(cu.cuModuleUnload(module[0]), "cuModuleUnload")

    def get_function(self, module, name):
        fn = ok(cu.cuModuleGetFunction(module[0], name.encode()), f"cuModuleGetFunction({name})")
        params = []
        while True:
            err, offset, size = cu.cuFuncGetParamInfo(fn, len(params))
            if int(err) != 0:
                break
            params.append((int(offset), int(size)))
        return Function(fn, name, params)

    def get_global(self, module, name):
        ptr, size = ok(cu.cuModuleGetGlobal(module[0], name.encode()), f"cuModuleGetGlobal({name})")
        ptr = int(ptr)
        if ptr not in self.space.sizes:
            self.space.adopt(ptr, size)
            module[1].append(ptr)
        return ptr, size

    def launch(self, function, grid, block, shared_bytes, stream, params):
        args = getattr(function, "args", None)
        if args is None:     # one argument buffer per function, reused: the driver copies it at launch
            buf = np.zeros(max(function.param_bytes, 8), np.uint8)
            ptrs = np.array([buf.ctypes.data + off for off, _ in function.params] or [0], np.uint64)
            args = function.args = (buf, ptrs, ptrs.ctypes.data if function.params else 0, buf.ctypes.data,
                                    int(function.handle))
        ctypes.memmove(args[3], params, len(params))
        err = _cuLaunchKernel(args[4], *grid, *block, shared_bytes, int(stream) if stream else 0, args[2], None)
        if err:
            ok((err,), f"launch of {function.name}")

    def take_output(self):
        return ""      # device printf goes to the worker's stdout on a real GPU

    # streams and events
    def stream_create(self, flags, priority):
        return ok(cu.cuStreamCreateWithPriority(flags, priority), "cuStreamCreate")

    def stream_destroy(self, stream):
        ok(cu.cuStreamDestroy(stream), "cuStreamDestroy")

    def stream_sync(self, stream):
        ok(cu.cuStreamSynchronize(stream or 0), "cuStreamSynchronize")

    def stream_query(self, stream):
        err = cu.cuStreamQuery(stream or 0)[0]
        if int(err) == CUresult.CUDA_ERROR_NOT_READY:
            return False
        ok((err,), "cuStreamQuery")
        return True

    def stream_wait_event(self, stream, event):
        ok(cu.cuStreamWaitEvent(stream or 0, event, 0), "cuStreamWaitEvent")

    def event_create(self, flags):
        return ok(cu.cuEventCreate(flags), "cuEventCreate")

    def event_record(self, event, stream):
        ok(cu.cuEventRecord(event, stream or 0), "cuEventRecord")

    def event_sync(self, event):
        ok(cu.cuEventSynchronize(event), "cuEventSynchronize")

    def event_query(self, event):
        err = cu.cuEventQuery(event)[0]
        if int(err) == CUresult.CUDA_ERROR_NOT_READY:
            return False
        ok((err,), "cuEventQuery")
        return True

    def event_elapsed(self, start, end):
        elapsed = getattr(cu, "cuEventElapsedTime_v2", None) or cu.cuEventElapsedTime
        return ok(elapsed(start, end), "cuEventElapsedTime")

    def event_destroy(self, event):
        ok(cu.cuEventDestroy(event), "cuEventDestroy")

    def synchronize(self):
        ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def close(self):
        cu.cuCtxSynchronize()
        for addr in self.registered:
            cu.cuMemHostUnregister(addr)
        for ptr, (length, handle) in self.handles.items():
            cu.cuMemUnmap(ptr, length)
            cu.cuMemRelease(handle)
        cu.cuMemAddressFree(BASE, self.reserved)
        cu.cuDevicePrimaryCtxRelease(self.device)
