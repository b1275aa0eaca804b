"""The cuda backend: a real GPU through cuda-python's driver API.

Allocations are VMM mappings inside one range reserved at the context's base (DESIGN
decision 3: its device's, address_space.device_base, or its image's once restored), so a
restored or handed-off context keeps its addresses, on whichever device. Its snapshot operations
are in cuda_snapshot.py, and the driver calls both make through ctypes in cuda_driver.py.
"""
import ctypes
import logging
import threading
import time

import numpy as np
from cuda.bindings import driver as cu

from phos.base import settings
from phos.gpu_server.backends import native_launch
from phos.gpu_server.address_space import DEVICE_SPAN, AddressSpace, device_base
from phos.gpu_server.backends.backend import FUNCTION_ATTRIBUTES, DeviceInfo, Function
from phos.gpu_server.backends.cuda_driver import (
    CTX_SYNCHRONIZE_ADDRESS, DEVICEMAP, PIN_PAUSE, LaunchAttribute, LaunchConfig, check, cuCtxSynchronize,
    cuLaunchKernelEx, cuMemCreate, cuMemMap, cuMemRelease, cuMemSetAccess, cuMemUnmap, cuOccupancyMaxActiveClusters,
    cuStreamQuery, cuTensorMapEncodeIm2col, cuTensorMapEncodeTiled, error_string, failure, ok, ready)
from phos.gpu_server.backends.cuda_snapshot import CudaSnapshotOps
from phos.gpu_server.backends.fatbin import module_variables
from phos.schema.cuda_types import CudaError, CUresult
from phos.schema.wire import LAUNCH_COOPERATIVE, STREAM_ALIASES, launch_cluster

log = logging.getLogger("phos.cuda")
GiB = 1 << 30
_U64 = ctypes.c_uint64
PIN_PIECE = 2 << 20      # staging areas are pinned in pieces this big (see register_host) ...
PIN_AFTER = 0.02         # ... beginning this long after the client attached


def _limit(number):
    """A CUlimit by number; one this cuda-python does not know is unsupported, as the driver says."""
    try:
        return cu.CUlimit(number)
    except ValueError:
        raise CudaError(CUresult.CUDA_ERROR_UNSUPPORTED_LIMIT, f"no CUlimit {number}") from None


def _launch_attributes(options):
    """The CUlaunchAttribute array a launch's options (schema/wire.py) stand for, or None."""
    attrs = []
    cluster = launch_cluster(options)
    if cluster:
        a = LaunchAttribute(int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION))
        a.value[0], a.value[1], a.value[2] = (max(c, 1) for c in cluster)
        attrs.append(a)
    if options & LAUNCH_COOPERATIVE:
        a = LaunchAttribute(int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE))
        a.value[0] = 1
        attrs.append(a)
    return (LaunchAttribute * len(attrs))(*attrs) if attrs else None


def _native_launcher():
    """A NativeLauncher over this driver's cuLaunchKernelEx, or None where its library was not
    built (PHOS_NATIVE_LAUNCH=0: none, every launch through launch())."""
    lib = native_launch.load() if settings.native_launch() else None
    if lib is None:
        return None
    return native_launch.NativeLauncher(lib, ctypes.cast(cuLaunchKernelEx, ctypes.c_void_p).value, failure, STREAM_ALIASES)


def _init():
    ok(cu.cuInit(0), "cuInit")


class CudaBackend:
    """The Backend (gpu_server/backends/backend.py) of a real GPU."""
    name = "cuda"
    pins_host_memory = True      # unpinned host memory copies slowly, and pinning is slow: done ahead

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

    @staticmethod
    def p2p_attribute(attribute, device, peer):
        _init()
        try:
            attribute = cu.CUdevice_P2PAttribute(attribute)
        except ValueError:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"no peer attribute {attribute}") from None
        return ok(cu.cuDeviceGetP2PAttribute(attribute, ok(cu.cuDeviceGet(device), "cuDeviceGet"),
                                             ok(cu.cuDeviceGet(peer), "cuDeviceGet")), "cuDeviceGetP2PAttribute")

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
        self.prop_ptr, self.access_ptr = prop.getPtr(), access.getPtr()     # for the ctypes calls
        granularity = ok(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                         "cuMemGetAllocationGranularity")
        self.total_mem = ok(cu.cuDeviceTotalMem(self.device), "cuDeviceTotalMem")
        self.reserved = self._reserve(self.total_mem, device_base(device))
        self.space = AddressSpace(self.reserved, granularity, base=device_base(device))
        self.handles = {}            # base -> (mapped length, physical handle)
        self.registered = []         # pinned host ranges (the staging area's pieces)
        self.pinned_areas = []       # (start, end) of each staging area
        self.pinned_ranges = {}      # the client's pinned host ranges pinned whole: address -> bytes
        self.closing = False         # close() began: pinning stops
        self.streams = set()         # the streams we created: a checkpoint's cut fences them
        self.launch_configs = {}     # (grid, block, shared bytes, stream) -> (CUlaunchConfig, its address)
        self.launcher = _native_launcher()   # launchBatch's compiled path, where it was built
        self.pinning = []            # threads pinning staging areas
        self.ordinal = device
        self._snap = None
        self._snap_lock = threading.Lock()
        self._info = None

    def device_info(self):
        if self._info is None:       # enumerating every attribute takes a while: once per worker
            self._info = self.devices()[self.ordinal]
        return self._info

    @property
    def snap(self):
        """The snapshot engine's device operations, made on first use (they load a module)."""
        with self._snap_lock:          # a restore's loader thread and a call may both ask first
            if self._snap is None:
                self._snap = CudaSnapshotOps(self)
        return self._snap

    def rebase(self, base):
        cu.cuMemAddressFree(self.space.base, self.reserved)
        self.reserved = self._reserve(self.total_mem, base)
        self.space = AddressSpace(self.reserved, self.space.align, base=base)

    @staticmethod
    def _reserve(total, at):
        """Reserve the context's virtual range at `at`: as large as the driver allows, at least the
        device's memory, within the range's device span."""
        for size in (4 * total, 2 * total, total):
            size = min(-(-size // GiB) * GiB, DEVICE_SPAN)
            err, base = cu.cuMemAddressReserve(size, 0, at, 0)
            if int(err) == 0 and int(base) == at:
                return size
            if int(err) == 0:
                cu.cuMemAddressFree(base, size)
        raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"could not reserve the context's address range at {at:#x}")

    # memory
    def alloc(self, nbytes, at=None):
        ptr = self.space.alloc(nbytes, at)
        length = -(-nbytes // self.space.align) * self.space.align
        handle, mapped = _U64(), False
        try:
            check(cuMemCreate(ctypes.byref(handle), length, self.prop_ptr, 0), "cuMemCreate")
            check(cuMemMap(ptr, length, 0, handle.value, 0), "cuMemMap")
            mapped = True
            check(cuMemSetAccess(ptr, length, self.access_ptr, 1), "cuMemSetAccess")
        except CudaError:          # nothing half made stays behind
            if mapped:
                cuMemUnmap(ptr, length)
            if handle.value:
                cuMemRelease(handle.value)
            self.space.release(ptr)
            raise
        self.handles[ptr] = (length, handle.value)
        return ptr

    def free(self, ptr):
        self.space.release(ptr)
        self.synchronize()         # cuMemFree waits for work using the memory too
        length, handle = self.handles.pop(ptr)
        check(cuMemUnmap(ptr, length), "cuMemUnmap")
        check(cuMemRelease(handle), "cuMemRelease")

    def mem_info(self):
        return ok(cu.cuMemGetInfo(), "cuMemGetInfo")

    def htod(self, dst, data, stream):
        src = np.frombuffer(data, np.uint8)
        for off, n in self._pieces(src.ctypes.data, src.nbytes):
            if stream is None:
                ok(cu.cuMemcpyHtoD(dst + off, src.ctypes.data + off, n), "cuMemcpyHtoD")
            else:
                ok(cu.cuMemcpyHtoDAsync(dst + off, src.ctypes.data + off, n, stream), "cuMemcpyHtoDAsync")

    def dtoh(self, src, out, stream):
        for off, n in self._pieces(out.ctypes.data, out.nbytes):
            if stream is None:
                ok(cu.cuMemcpyDtoH(out.ctypes.data + off, src + off, n), "cuMemcpyDtoH")
            else:
                ok(cu.cuMemcpyDtoHAsync(out.ctypes.data + off, src + off, n, stream), "cuMemcpyDtoHAsync")
        if stream is not None:
            ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def register_host(self, buf, whole=False):
        """Pin the shared staging area, so copies through it run at full link speed.

        Pinning holds a driver lock that stalls this process's launches and copies meanwhile,
        the longer the more it pins at once (perf/probe_driver_stalls.py), and a client
        re-attaching after a handoff would wait for it. So a thread pins it in PIN_PIECE pieces a
        moment apart (each a short stall), and copies through it split where pieces meet
        (a copy runs pinned only within one registration). Until then copies run unpinned.
        It starts PIN_AFTER the attach: a client re-attaching (a handoff, a restore) replays its
        calls and syncs at once, and a piece pinned meanwhile would hold that sync up.

        A pinned host range (whole) is pinned at once, as one registration, as the application's
        cuMemHostAlloc would have: its copies go straight to the device from their first. If the
        driver refuses (locked memory is bounded), its copies run unpinned: slower, still correct."""
        if whole:
            err = int(cu.cuMemHostRegister(buf.ctypes.data, buf.nbytes, 0)[0])
            if err == 0:
                self.pinned_ranges[buf.ctypes.data] = buf.nbytes
            else:
                log.warning("a pinned host range of %d bytes stays unpinned: %s", buf.nbytes, error_string(err))
            return

        def pin():
            ok(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            time.sleep(PIN_AFTER)
            for off in range(0, buf.nbytes, PIN_PIECE):
                if self.closing or int(cu.cuMemHostRegister(buf.ctypes.data + off, min(PIN_PIECE, buf.nbytes - off), 0)[0]) != 0:
                    return
                self.registered.append(buf.ctypes.data + off)
                time.sleep(PIN_PAUSE)
        self.pinned_areas.append((buf.ctypes.data, buf.ctypes.data + buf.nbytes))
        self.pinning.append(threading.Thread(target=pin, name="phos-pin", daemon=True))
        self.pinning[-1].start()

    def unregister_host(self, buf):
        if self.pinned_ranges.pop(buf.ctypes.data, None) is not None:
            ok(cu.cuMemHostUnregister(buf.ctypes.data), "cuMemHostUnregister")

    def map_device_host(self, buf, address):
        err = int(cu.cuMemHostRegister(address, buf.nbytes, DEVICEMAP)[0])
        if err != 0:
            return f"the driver would not map {buf.nbytes} bytes of host memory for the device: {error_string(err)}"
        err, device = cu.cuMemHostGetDevicePointer(address, 0)
        if int(err) != 0 or int(device) != address:
            cu.cuMemHostUnregister(address)
            return (f"the device maps host memory at {address:#x} at {int(device):#x}, not at the application's "
                    f"address (cuMemHostGetDevicePointer: {error_string(int(err))})")
        self.pinned_ranges[address] = buf.nbytes
        return None

    def unmap_device_host(self, buf):
        self.unregister_host(buf)

    def copy_pinned(self, device, host, to_device, stream):
        if to_device:
            ok(cu.cuMemcpyHtoDAsync(device, host.ctypes.data, host.nbytes, stream or 0), "cuMemcpyHtoDAsync")
        else:
            ok(cu.cuMemcpyDtoHAsync(host.ctypes.data, device, host.nbytes, stream or 0), "cuMemcpyDtoHAsync")

    def _pieces(self, host, nbytes):
        """(offset, length) runs of a host range, split where a staging area's pinned pieces meet."""
        area = next((lo for lo, hi in self.pinned_areas if lo <= host < hi), None)
        if area is None:
            return [(0, nbytes)]
        out, off = [], 0
        while off < nbytes:
            n = min(nbytes - off, PIN_PIECE - (host + off - area) % PIN_PIECE)
            out.append((off, n))
            off += n
        return out

    def dtod(self, dst, src, nbytes, stream):
        ok(cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream or 0), "cuMemcpyDtoDAsync")

    def memset(self, dst, value, elem_size, count, stream):
        fn = {1: cu.cuMemsetD8Async, 2: cu.cuMemsetD16Async, 4: cu.cuMemsetD32Async}[elem_size]
        ok(fn(dst, value, count, stream or 0), "cuMemsetAsync")

    # modules
    def load_module(self, image):
        """The driver places the module's globals itself (see AddressSpace.alias). It cannot list
        them: we read their names from the image, so a checkpoint holds every one."""
        data = bytes(image)
        if not data.startswith((b"\x50\xed\x55\xba", b"\x7fELF", b"\xb1\x43\x62\x46")) and not data.endswith(b"\0"):
            data += b"\0"        # PTX text must be NUL-terminated for the driver
        module = [ok(cu.cuModuleLoadData(data), "cuModuleLoadData"), []]   # and its globals: (name, ptr, size)
        for name in module_variables(data):
            try:
                self.get_global(module, name)
            except CudaError:
                pass             # not a variable the driver knows by that name
        return module

    def module_host_bytes(self, image):
        """Its image, which the worker keeps for checkpoints (what the driver keeps is its own)."""
        return len(image)

    def unload_module(self, module):
        for _, ptr, _ in module[1]:
            self.space.forget(ptr)
        ok(cu.cuModuleUnload(module[0]), "cuModuleUnload")

    def get_function(self, module, name):
        fn = ok(cu.cuModuleGetFunction(module[0], name.encode()), f"cuModuleGetFunction({name})")
        # the driver loads functions lazily, at their first launch: load it now, so a context
        # restored or handed off here does not make its application wait for that
        ok(cu.cuFuncLoad(fn), f"cuFuncLoad({name})")
        params = []
        while True:
            err, offset, size = cu.cuFuncGetParamInfo(fn, len(params))
            if int(err) != 0:
                break
            params.append((int(offset), int(size)))
        attributes = tuple(ok(cu.cuFuncGetAttribute(cu.CUfunction_attribute(a), fn), f"cuFuncGetAttribute({name})")
                           for a in range(FUNCTION_ATTRIBUTES))
        return Function(fn, name, params, attributes)

    def get_global(self, module, name):
        ptr, size = ok(cu.cuModuleGetGlobal(module[0], name.encode()), f"cuModuleGetGlobal({name})")
        ptr = int(ptr)
        if ptr not in self.space.sizes:
            self.space.adopt(ptr, size)
            module[1].append((name, ptr, size))
        return ptr, size

    def module_globals(self, module):
        return list(module[1])

    def launch(self, function, grid, block, shared_bytes, stream, params, options=0):
        args = getattr(function, "args", None)
        if args is None:     # one argument buffer per function, reused: the driver copies it at launch
            buf = np.zeros(max(function.param_bytes, 8), np.uint8)
            ptrs = np.array([buf.ctypes.data + off for off, _ in function.params] or [0], np.uint64)
            args = function.args = (buf, ptrs, ptrs.ctypes.data if function.params else 0, buf.ctypes.data,
                                    int(function.handle))
        key = (grid, block, shared_bytes, int(stream) if stream else 0, options)
        config = self.launch_configs.get(key)
        if config is None:
            if len(self.launch_configs) > 1024:
                self.launch_configs.clear()
            attrs = _launch_attributes(options)
            c = LaunchConfig(grid, block, shared_bytes, key[3] or None, ctypes.addressof(attrs) if attrs else None,
                              len(attrs) if attrs else 0)
            config = self.launch_configs[key] = (c, ctypes.addressof(c), attrs)
        ctypes.memmove(args[3], params, len(params))
        err = cuLaunchKernelEx(config[1], args[4], args[2], None)
        if err:
            ok((err,), f"launch of {function.name}")

    def set_function_attribute(self, function, attribute, value):
        ok(cu.cuFuncSetAttribute(function.handle, cu.CUfunction_attribute(attribute), value), f"cuFuncSetAttribute({function.name})")

    def get_limit(self, limit):
        return ok(cu.cuCtxGetLimit(_limit(limit)), f"cuCtxGetLimit({limit})")

    def set_limit(self, limit, value):
        ok(cu.cuCtxSetLimit(_limit(limit), value), f"cuCtxSetLimit({limit}, {value})")

    def occupancy(self, function, query, a, b, flags, grid=0):
        fn = function.handle
        if query == "maxActiveBlocks":
            return (ok(cu.cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(fn, a, b, flags), "cuOccupancy"),)
        if query == "availableDynamicShared":
            return (ok(cu.cuOccupancyAvailableDynamicSMemPerBlock(fn, a, b), "cuOccupancy"),)
        if query == "maxPotentialBlockSize":
            return ok(cu.cuOccupancyMaxPotentialBlockSizeWithFlags(fn, None, a, b, flags), "cuOccupancy")
        if query == "maxActiveClusters":
            dims = lambda packed: (packed & 0x1FFFFF, (packed >> 21) & 0x1FFFFF, packed >> 42)
            attrs = _launch_attributes(flags)
            config = LaunchConfig(dims(grid), dims(a), b, None, ctypes.addressof(attrs) if attrs else None,
                                   len(attrs) if attrs else 0)
            count = ctypes.c_int()
            check(cuOccupancyMaxActiveClusters(ctypes.byref(count), int(fn), ctypes.byref(config)), "cuOccupancyMaxActiveClusters")
            return (count.value,)
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"no occupancy query {query!r}")

    def tensor_map_encode(self, im2col, values):
        out = (ctypes.c_uint64 * 16)()
        dtype, rank, address, *rest = values
        if im2col:
            dims, strides, lower, upper = rest[0:5], rest[5:9], rest[9:12], rest[12:15]
            channels, pixels, elem, (interleave, swizzle, l2, oob) = rest[15], rest[16], rest[17:22], rest[22:26]
            err = cuTensorMapEncodeIm2col(out, dtype, rank, address, (_U64 * 5)(*dims), (_U64 * 4)(*strides),
                                           (ctypes.c_int * 3)(*lower), (ctypes.c_int * 3)(*upper), channels, pixels,
                                           (ctypes.c_uint * 5)(*elem), interleave, swizzle, l2, oob)
        else:
            dims, strides, box, elem, (interleave, swizzle, l2, oob) = rest[0:5], rest[5:9], rest[9:14], rest[14:19], rest[19:23]
            err = cuTensorMapEncodeTiled(out, dtype, rank, address, (_U64 * 5)(*dims), (_U64 * 4)(*strides),
                                          (ctypes.c_uint * 5)(*box), (ctypes.c_uint * 5)(*elem), interleave, swizzle, l2, oob)
        check(err, "cuTensorMapEncodeIm2col" if im2col else "cuTensorMapEncodeTiled")
        return bytes(out)

    def take_output(self):
        return ""      # device printf goes to the worker's stdout on a real GPU

    # streams and events
    def stream_create(self, flags, priority):
        stream = ok(cu.cuStreamCreateWithPriority(flags, priority), "cuStreamCreate")
        self.streams.add(stream)
        return stream

    def stream_destroy(self, stream):
        ok(cu.cuStreamDestroy(stream), "cuStreamDestroy")
        self.streams.discard(stream)

    def stream_sync(self, stream):
        ok(cu.cuStreamSynchronize(stream or 0), "cuStreamSynchronize")

    def stream_query(self, stream):
        return ready(cuStreamQuery(int(stream) if stream else None), "cuStreamQuery")

    def stream_wait_event(self, stream, event):
        ok(cu.cuStreamWaitEvent(stream or 0, event, 0), "cuStreamWaitEvent")

    def event_create(self, flags):
        return ok(cu.cuEventCreate(flags), "cuEventCreate")

    def event_record(self, event, stream):
        ok(cu.cuEventRecord(event, stream or 0), "cuEventRecord")

    def event_sync(self, event):
        ok(cu.cuEventSynchronize(event), "cuEventSynchronize")

    def event_query(self, event):
        return ready(cu.cuEventQuery(event)[0], "cuEventQuery")

    def event_elapsed(self, start, end):
        elapsed = getattr(cu, "cuEventElapsedTime_v2", None) or cu.cuEventElapsedTime
        return ok(elapsed(start, end), "cuEventElapsedTime")

    def event_destroy(self, event):
        ok(cu.cuEventDestroy(event), "cuEventDestroy")

    def synchronize(self):
        """Wait for the application's work. Not cuCtxSynchronize once a snapshot made its own
        streams: the application must not wait for the background copy."""
        if self._snap is None:
            check(cuCtxSynchronize(), "cuCtxSynchronize")
            return
        for stream in (0, *self.streams):
            ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def native_synchronize(self):
        # cuCtxSynchronize also waits for a snapshot's streams: idle while none runs (the worker asks then)
        return CTX_SYNCHRONIZE_ADDRESS

    def idle(self):
        """Whether the application's work is done (what synchronize waits for)."""
        return all(self.stream_query(stream) for stream in (0, *self.streams))

    def close(self):
        self.closing = True
        cu.cuCtxSynchronize()
        for thread in self.pinning:
            thread.join()
        if self._snap is not None:
            self._snap.mapper.shutdown()     # its mappings made and released, before the context goes
        # Piece by piece, a moment apart: unpinning holds a driver lock that every process on
        # the GPU shares, and a process pinning meanwhile stalls its own launches behind it. A
        # handoff's target pins its client's staging area just as the retiring source lets go,
        # and a large piece unpinned at once would hold that application (perf/probe_driver_stalls.py).
        for addr in self.registered + list(self.pinned_ranges) + (self._snap.pieces if self._snap is not None else []):
            cu.cuMemHostUnregister(addr)
            time.sleep(PIN_PAUSE)
        for ptr, (length, handle) in self.handles.items():
            cuMemUnmap(ptr, length)
            cuMemRelease(handle)
        cu.cuMemAddressFree(self.space.base, self.reserved)
        cu.cuDevicePrimaryCtxRelease(self.device)
        if self.launcher is not None:
            self.launcher.close()
