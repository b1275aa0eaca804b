"""The cuda backend: a real GPU through cuda-python's driver API.

Allocations are VMM mappings inside one range reserved at the context's base (DESIGN
decision 3: its device's, address_space.device_base, or its image's once restored), so a
restored or handed-off context keeps its addresses, on whichever device.
"""
import collections
import ctypes
import itertools
from concurrent.futures import Future
import logging
import os
import threading
import time

import numpy as np
from cuda.bindings import driver as cu

from phos.base import settings
from phos.gpu_server.backends import native_launch
from phos.gpu_server.address_space import DEVICE_SPAN, AddressSpace, device_base
from phos.gpu_server.backends.backend import FUNCTION_ATTRIBUTES, DeviceInfo, Function
from phos.gpu_server.backends.fatbin import module_variables
from phos.gpu_server.backends.staging_layout import FrozenLayout, copy_runs, join_runs, pieces, stage_offsets
from phos.schema.cuda_types import CudaError, CUresult
from phos.schema.wire import LAUNCH_COOPERATIVE, STREAM_ALIASES, launch_cluster
from phos.snapshot.ops import BATCH_BYTES, URGENT_BATCH_BYTES, WorkThreads, ahead_memory

log = logging.getLogger("phos.cuda")
GiB = 1 << 30
PIN_PIECE = 2 << 20      # staging areas are pinned in pieces this big (see register_host) ...
PIN_AFTER = 0.02         # ... beginning this long after the client attached
STORE_PIN_PIECE = 16 << 20   # a HostStore is pinned in pieces of whole slots about this big (see CudaSnapshotOps.pin) ...
PIN_PAUSE = 0.001        # ... and pinned and unpinned a piece at a time, this long apart
# Batches of a read from freeze()'s copy into a store's slots under way at once (others: two, in
# buffers that take turns): the link idles once those are copied (512 MiB, ~10 ms each), and the
# worker's steps can come that far apart (a batch's bookkeeping took 8-10 ms beside the module
# images being stored, on the H200). Not more: enqueueing a batch's copies can wait for room in
# the driver's queue, the application's calls held meanwhile (16 and 29 ms with four under way).
FROZEN_IN_FLIGHT = 3
DEVICEMAP = 0x02         # CU_MEMHOSTREGISTER_DEVICEMAP
HASH_PART = 1 << 20      # a chunk bigger than this is hashed in parts of this size ...
SPLIT_BELOW = 1024       # ... when fewer chunks than this are hashed at once (a cut's thousands fill the GPU as they are)
FREEZE_HEADROOM = 2 << 30   # a checkpoint's device copy leaves this much free at least (or 5% of the device)
CUT_TABLE = 1 << 16      # chunks a cut hashes without growing its table (128 GiB in 2 MiB chunks): 1 MiB, pinned
FREEZE_PIECE = 4 << 20   # the cut's device copy gives each block of its kernel this much at most ...
FREEZE_TABLE = 1 << 15   # ... and copies this many pieces without growing its table (GPT-2's 9.65 GiB: ~4,400): 768 KiB, pinned


def ok(result, what):
    """Unpack a cuda-python result tuple, raising CudaError on failure."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise _failure(err, what)
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


def _failure(err, what):
    """The CudaError of the driver's error err in `what`."""
    return CudaError(int(err), f"{what} failed: {_error_string(err)}")


def _limit(number):
    """A CUlimit by number; one this cuda-python does not know is unsupported, as the driver says."""
    try:
        return cu.CUlimit(number)
    except ValueError:
        raise CudaError(CUresult.CUDA_ERROR_UNSUPPORTED_LIMIT, f"no CUlimit {number}") from None


def _error_string(err):
    """The driver's words for an error: a ctypes call gives a bare int, cuda-python wants its enum."""
    try:
        return cu.cuGetErrorString(cu.CUresult(int(err)))[1].decode(errors="replace")
    except (ValueError, TypeError, AttributeError):
        return f"error {int(err)}"


def _driver_call(name, *argtypes):
    f = getattr(_libcuda, name)
    f.argtypes, f.restype = argtypes, ctypes.c_int
    return f


# Launches are the hot path: calling the driver through ctypes costs a third of cuda-python's
# wrapper, and cuLaunchKernelEx with a prepared CUlaunchConfig less again than cuLaunchKernel:
# four arguments to convert instead of eleven (an application repeats a handful of launch shapes).
# A checkpoint's copies are the other: a dozen calls a batch, taken between the application's.
_libcuda = ctypes.CDLL("libcuda.so.1")
_P, _U64, _N = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
_cuLaunchKernelEx = _driver_call("cuLaunchKernelEx", _P, _P, _P, _P)
_cuMemcpyDtoDAsync = _driver_call("cuMemcpyDtoDAsync_v2", _U64, _U64, _N, _P)
_cuMemcpyDtoHAsync = _driver_call("cuMemcpyDtoHAsync_v2", _P, _U64, _N, _P)
_cuMemcpyHtoDAsync = _driver_call("cuMemcpyHtoDAsync_v2", _U64, _P, _N, _P)
_cuEventRecord = _driver_call("cuEventRecord", _P, _P)
# A restore maps every allocation before the context is usable: through ctypes, with the
# properties cuda-python built passed by address (getPtr).
_cuMemCreate = _driver_call("cuMemCreate", ctypes.POINTER(_U64), _N, _P, ctypes.c_ulonglong)
_cuMemMap = _driver_call("cuMemMap", _U64, _N, _N, _U64, ctypes.c_ulonglong)
_cuMemSetAccess = _driver_call("cuMemSetAccess", _U64, _N, _P, _N)
_cuMemUnmap = _driver_call("cuMemUnmap", _U64, _N)
_cuMemRelease = _driver_call("cuMemRelease", _U64)
_cuEventQuery = _driver_call("cuEventQuery", _P)
_cuStreamQuery = _driver_call("cuStreamQuery", _P)
_cuCtxSynchronize = _driver_call("cuCtxSynchronize")     # the sync round trip's call: ctypes is ~1 µs quicker
_CTX_SYNCHRONIZE_ADDRESS = ctypes.cast(_cuCtxSynchronize, ctypes.c_void_p).value     # ... and native_box's
_cuOccupancyMaxActiveClusters = _driver_call("cuOccupancyMaxActiveClusters", _P, _P, _P)
# The tensor maps a client's libraries encode for the device (the format is the driver's own).
_I, _UI = ctypes.c_int, ctypes.c_uint
_cuTensorMapEncodeTiled = _driver_call("cuTensorMapEncodeTiled", _P, _I, _UI, _U64, _P, _P, _P, _P, _I, _I, _I, _I)
_cuTensorMapEncodeIm2col = _driver_call("cuTensorMapEncodeIm2col", _P, _I, _UI, _U64, _P, _P, _P, _P, _UI, _UI, _P,
                                        _I, _I, _I, _I)     # a synchronize polls it while a checkpoint runs


def _check(err, what):
    """Raise CudaError for a failed ctypes driver call."""
    if err:
        ok((err,), what)


def _ready(err, what):
    """A query's answer: False while the device is still at it, True once done; an error raises."""
    if int(err) == CUresult.CUDA_ERROR_NOT_READY:
        return False
    _check(int(err), what)
    return True


class _LaunchConfig(ctypes.Structure):      # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _LaunchAttribute(ctypes.Structure):   # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


def _launch_attributes(options):
    """The CUlaunchAttribute array a launch's options (schema/wire.py) stand for, or None."""
    attrs = []
    cluster = launch_cluster(options)
    if cluster:
        a = _LaunchAttribute(int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION))
        a.value[0], a.value[1], a.value[2] = (max(c, 1) for c in cluster)
        attrs.append(a)
    if options & LAUNCH_COOPERATIVE:
        a = _LaunchAttribute(int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE))
        a.value[0] = 1
        attrs.append(a)
    return (_LaunchAttribute * len(attrs))(*attrs) if attrs else None


def _native_launcher():
    """A NativeLauncher over this driver's cuLaunchKernelEx, or None where its library was not
    built (PHOS_NATIVE_LAUNCH=0: none, every launch through launch())."""
    lib = native_launch.load() if settings.native_launch() else None
    if lib is None:
        return None
    return native_launch.NativeLauncher(lib, ctypes.cast(_cuLaunchKernelEx, ctypes.c_void_p).value, _failure, STREAM_ALIASES)


def _init():
    ok(cu.cuInit(0), "cuInit")


class CudaBackend:
    """The Backend (gpu_server/backends/backend.py) of a real GPU."""
    name = "cuda"
    pins_host_memory = True      # unpinned host memory copies slowly, and pinning takes ~280 ms per GiB

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
            _check(_cuMemCreate(ctypes.byref(handle), length, self.prop_ptr, 0), "cuMemCreate")
            _check(_cuMemMap(ptr, length, 0, handle.value, 0), "cuMemMap")
            mapped = True
            _check(_cuMemSetAccess(ptr, length, self.access_ptr, 1), "cuMemSetAccess")
        except CudaError:          # nothing half made stays behind
            if mapped:
                _cuMemUnmap(ptr, length)
            if handle.value:
                _cuMemRelease(handle.value)
            self.space.release(ptr)
            raise
        self.handles[ptr] = (length, handle.value)
        return ptr

    def free(self, ptr):
        self.space.release(ptr)
        self.synchronize()         # cuMemFree waits for work using the memory too
        length, handle = self.handles.pop(ptr)
        _check(_cuMemUnmap(ptr, length), "cuMemUnmap")
        _check(_cuMemRelease(handle), "cuMemRelease")

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

        Pinning holds a driver lock that stalls this process's launches and copies meanwhile:
        36-43 ms for a client's fresh 64 MiB (perf/probe_driver_stalls.py), which a client
        re-attaching after a handoff would wait for. So a thread pins it in 2 MiB pieces a
        moment apart (a stall of ~1 ms each), and copies through it split where pieces meet
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
                log.warning("a pinned host range of %d bytes stays unpinned: %s", buf.nbytes, _error_string(err))
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
            return f"the driver would not map {buf.nbytes} bytes of host memory for the device: {_error_string(err)}"
        err, device = cu.cuMemHostGetDevicePointer(address, 0)
        if int(err) != 0 or int(device) != address:
            cu.cuMemHostUnregister(address)
            return (f"the device maps host memory at {address:#x} at {int(device):#x}, not at the application's "
                    f"address (cuMemHostGetDevicePointer: {_error_string(int(err))})")
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
            c = _LaunchConfig(grid, block, shared_bytes, key[3] or None, ctypes.addressof(attrs) if attrs else None,
                              len(attrs) if attrs else 0)
            config = self.launch_configs[key] = (c, ctypes.addressof(c), attrs)
        ctypes.memmove(args[3], params, len(params))
        err = _cuLaunchKernelEx(config[1], args[4], args[2], None)
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
            config = _LaunchConfig(dims(grid), dims(a), b, None, ctypes.addressof(attrs) if attrs else None,
                                   len(attrs) if attrs else 0)
            count = ctypes.c_int()
            _check(_cuOccupancyMaxActiveClusters(ctypes.byref(count), int(fn), ctypes.byref(config)), "cuOccupancyMaxActiveClusters")
            return (count.value,)
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"no occupancy query {query!r}")

    def tensor_map_encode(self, im2col, values):
        out = (ctypes.c_uint64 * 16)()
        dtype, rank, address, *rest = values
        if im2col:
            dims, strides, lower, upper = rest[0:5], rest[5:9], rest[9:12], rest[12:15]
            channels, pixels, elem, (interleave, swizzle, l2, oob) = rest[15], rest[16], rest[17:22], rest[22:26]
            err = _cuTensorMapEncodeIm2col(out, dtype, rank, address, (_U64 * 5)(*dims), (_U64 * 4)(*strides),
                                           (ctypes.c_int * 3)(*lower), (ctypes.c_int * 3)(*upper), channels, pixels,
                                           (ctypes.c_uint * 5)(*elem), interleave, swizzle, l2, oob)
        else:
            dims, strides, box, elem, (interleave, swizzle, l2, oob) = rest[0:5], rest[5:9], rest[9:14], rest[14:19], rest[19:23]
            err = _cuTensorMapEncodeTiled(out, dtype, rank, address, (_U64 * 5)(*dims), (_U64 * 4)(*strides),
                                          (ctypes.c_uint * 5)(*box), (ctypes.c_uint * 5)(*elem), interleave, swizzle, l2, oob)
        _check(err, "cuTensorMapEncodeIm2col" if im2col else "cuTensorMapEncodeTiled")
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
        return _ready(_cuStreamQuery(int(stream) if stream else None), "cuStreamQuery")

    def stream_wait_event(self, stream, event):
        ok(cu.cuStreamWaitEvent(stream or 0, event, 0), "cuStreamWaitEvent")

    def event_create(self, flags):
        return ok(cu.cuEventCreate(flags), "cuEventCreate")

    def event_record(self, event, stream):
        ok(cu.cuEventRecord(event, stream or 0), "cuEventRecord")

    def event_sync(self, event):
        ok(cu.cuEventSynchronize(event), "cuEventSynchronize")

    def event_query(self, event):
        return _ready(cu.cuEventQuery(event)[0], "cuEventQuery")

    def event_elapsed(self, start, end):
        elapsed = getattr(cu, "cuEventElapsedTime_v2", None) or cu.cuEventElapsedTime
        return ok(elapsed(start, end), "cuEventElapsedTime")

    def event_destroy(self, event):
        ok(cu.cuEventDestroy(event), "cuEventDestroy")

    def synchronize(self):
        """Wait for the application's work. Not cuCtxSynchronize once a snapshot made its own
        streams: the application must not wait for the background copy."""
        if self._snap is None:
            _check(_cuCtxSynchronize(), "cuCtxSynchronize")
            return
        for stream in (0, *self.streams):
            ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def native_synchronize(self):
        # cuCtxSynchronize also waits for a snapshot's streams: idle while none runs (the worker asks then)
        return _CTX_SYNCHRONIZE_ADDRESS

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
        # handoff's target pins its client's staging area just as the retiring source lets go:
        # each 1 GiB piece the source unpinned held that application 14-21 ms on the H200.
        for addr in self.registered + list(self.pinned_ranges) + (self._snap.pieces if self._snap is not None else []):
            cu.cuMemHostUnregister(addr)
            time.sleep(PIN_PAUSE)
        for ptr, (length, handle) in self.handles.items():
            _cuMemUnmap(ptr, length)
            _cuMemRelease(handle)
        cu.cuMemAddressFree(self.space.base, self.reserved)
        cu.cuDevicePrimaryCtxRelease(self.device)
        if self.launcher is not None:
            self.launcher.close()


def _wait_event(event):
    """Wait for an event, polling: the worker's loop serving the application must not stall
    behind our copies. (cuda.bindings releases the GIL in every driver call, NVIDIA/cuda-python
    #1065, so cuEventSynchronize on a blocking-sync event would do too: on the H200 it gives
    the same application throughput during a checkpoint and the same copy rate.)"""
    while not _event_done(event):
        time.sleep(0.00005)


def _event_done(event):
    return _ready(_cuEventQuery(int(event)), "cuEventQuery")


def _copies(one, dsts, srcs, sizes, stream, what):
    """Enqueue copies on stream: one(dst, src, size, stream) each (a cuMemcpy*Async)."""
    dsts, srcs, sizes = (np.ascontiguousarray(a, np.uint64) for a in (dsts, srcs, sizes))
    for dst, src, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        err = one(dst, src, n, stream)
        if err:      # which copy, and the ranges the driver knows its ends in
            ranges = [cu.cuMemGetAddressRange(p) for p in (src, src + n - 1, dst, dst + n - 1)]
            known = ", ".join(f"{int(b):#x}+{int(size)}" if not int(e) else "none" for e, b, size in ranges)
            ok((err,), f"{what}({dst:#x}, {src:#x}, {n}; driver's ranges of the ends: {known})")


_char = ctypes.c_char


def _addresses(views):
    """The addresses of host views (NumPy arrays), three times quicker than ndarray.ctypes."""
    try:
        return [ctypes.addressof(_char.from_buffer(v)) for v in views]
    except (TypeError, ValueError):     # read-only, or empty
        return [v.ctypes.data for v in views]


def _pinned(nbytes):
    """A page-locked host buffer as a uint8 array (kept for the worker's life)."""
    ptr = int(ok(cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class CudaSnapshotOps:
    """The snapshot engine's device operations (SnapshotOps, snapshot/ops.py) on a real GPU.

    Copies run on two streams of our own that never block the application's: `bulk` for
    the background copy, `urgent` (highest priority) for copy-on-write saves. The cut
    makes both wait for the application's work so far, and fingerprints every chunk with
    the pfp1 kernel; with a fence, the application's streams then wait for that kernel,
    so no later write can run before it. A read copies a batch of chunks into a device
    buffer of ours, hashes it there and sends it to the host from there, on the same stream:
    the fingerprint of what was copied.
    """
    BUFFER = {"bulk": BATCH_BYTES, "urgent": URGENT_BATCH_BYTES}     # at least: the engine's batches; two of each

    def __init__(self, backend):
        self.backend = backend
        ok(cu.cuCtxSetCurrent(backend.ctx), "cuCtxSetCurrent")   # we may be made on a restore's loader thread
        self.modules = {}
        self.kernel = self._kernel("pfp1", "pfp1_lane_sums")
        self.copy_kernel = self._kernel("copy_pieces", "copy_pieces")
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        _, greatest = ok(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        self.streams = {"bulk": ok(cu.cuStreamCreateWithPriority(flags, 0), "cuStreamCreate"),
                        "urgent": ok(cu.cuStreamCreateWithPriority(flags, greatest), "cuStreamCreate")}
        self.handles = {k: int(s) for k, s in self.streams.items()}     # for the ctypes calls
        self.host = {k: [] for k in self.streams}      # pinned buffers, made on first use
        self.pinned = []         # (start, end) of host memory pinned for direct copies (pin)
        self.pieces = []         # the start of each of its pinned pieces
        self.device = {}         # stream key -> ([two device buffers], size), made on first use
        self.tables = {}         # purpose -> chunk table and sums, on the device and pinned on the host
        self.splits = {}         # chunk table bytes -> its hash_parts
        self.uploaded = {}       # purpose -> (device table, parts) it holds: a batch's layout repeats
        self.launches = {}       # (device table, n, stream) -> pfp1's prepared arguments
        self.events = []         # events done with, for reuse: creating one costs a driver call
        self.freeze_table = None   # freeze's copies: (device table, pinned host table, capacity in pieces)
        self.mapper = WorkThreads(1, "phos-map-ahead")   # map_ahead's mappings, and unmapping freeze's copies

    def _kernel(self, name, function):
        """A kernel of snapshot/kernels/NAME.ptx (checked in: servers need no compiler)."""
        from phos import snapshot
        with open(os.path.join(os.path.dirname(snapshot.__file__), "kernels", f"{name}.ptx"), "rb") as f:
            ptx = f.read()
        self.modules[name] = ok(cu.cuModuleLoadData(ptx + b"\0"), f"cuModuleLoadData({name})")
        return ok(cu.cuModuleGetFunction(self.modules[name], function.encode()), f"cuModuleGetFunction({function})")

    def _launch(self, kernel, blocks, stream, args):
        """Launch kernel on blocks of 256 threads with these u64 arguments (a u32 parameter
        reads the low half of its u64, little-endian)."""
        params = np.array(args, np.uint64)
        pointers = np.array([params.ctypes.data + 8 * i for i in range(len(args))], np.uint64)
        config = _LaunchConfig((blocks, 1, 1), (256, 1, 1), 0, stream, None, 0)
        return params, pointers, config, ctypes.addressof(config), pointers.ctypes.data

    def _table(self, key, n):
        """(device table, device sums, host table, host sums) for n chunks; pinned, so async copies stay async."""
        t = self.tables.get(key)
        if t is None or t[4] < n:
            cap = max(n, 1024)
            t = (int(ok(cu.cuMemAlloc(16 * cap), "cuMemAlloc")), int(ok(cu.cuMemAlloc(16 * cap), "cuMemAlloc")),
                 _pinned(16 * cap).view(np.uint64), _pinned(16 * cap).view(np.uint64), cap)
            self.tables[key] = t          # the old buffers stay allocated: a pending hash may still use them
        return t

    def _hash(self, chunks, key, stream):
        """Enqueue pfp1 lane sums of chunks on stream; returns a function giving the fingerprints.
        A few chunks (a batch of copies: 8 of 16 MiB) are hashed in parts, so that many blocks
        share the work: one block per chunk held a batch's copies to 22 GB/s on the H200."""
        from phos.snapshot.fingerprint import finish_many, hash_parts
        rows = np.asarray(chunks, np.uint64).reshape(-1, 2)     # a cut's thousands come as an array already
        parts, firsts = rows, None
        if 0 < len(rows) < SPLIT_BELOW and int(rows[:, 1].max()) > HASH_PART:
            split = rows.tobytes()        # a checkpoint's batches repeat a few layouts: split once
            if split not in self.splits:
                if len(self.splits) > 64:
                    self.splits.clear()
                self.splits[split] = hash_parts(rows, HASH_PART)
            parts, firsts = self.splits[split]
        n = len(parts)
        table, sums, spec, out, _ = self._table(key, n)
        if n:
            held = self.uploaded.get(key)
            if firsts is None or held is None or held[0] != table or held[1] is not parts:
                spec[:2 * n] = parts.reshape(-1)
                _check(_cuMemcpyHtoDAsync(table, spec.ctypes.data, 16 * n, stream), "cuMemcpyHtoDAsync")
                self.uploaded[key] = (table, parts) if firsts is not None else None
            launch = self.launches.get((table, n, stream))
            if launch is None:       # pfp1(table, sums, n): its arguments and shape, kept alive with it
                if len(self.launches) > 64:
                    self.launches.clear()
                launch = self.launches[(table, n, stream)] = self._launch(self.kernel, n, stream, [table, sums, n])
            _check(_cuLaunchKernelEx(launch[3], int(self.kernel), launch[4], None), "launch of pfp1_lane_sums")
            _check(_cuMemcpyDtoHAsync(out.ctypes.data, sums, 16 * n, stream), "cuMemcpyDtoHAsync")

        def fingerprints():
            lane_sums = out[:2 * n].reshape(-1, 2)
            if firsts is not None:       # the parts' sums add up (mod 2**64) to their chunk's
                lane_sums = np.add.reduceat(lane_sums, firsts, axis=0)
            return finish_many(lane_sums, rows[:, 1])
        return self._once_done(stream, fingerprints)

    def _once_done(self, stream, result):
        """wait(block=True): result() once the stream's work so far is done (None before, when
        not blocking); the first answer is kept, as the event may be another batch's by then."""
        event = self.events.pop() if self.events else int(ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"))
        _check(_cuEventRecord(event, stream), "cuEventRecord")
        done = []

        def wait(block=True):
            if done:
                return done[0]
            if not _event_done(event):
                if not block:
                    return None
                _wait_event(event)
            self.events.append(event)
            done.append(result())
            return done[0]
        return wait

    def _app_streams(self):
        return [0, *self.backend.streams]

    def _after_application(self):
        """Our streams start after the application's work so far."""
        for app in self._app_streams():
            event = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            ok(cu.cuEventRecord(event, app), "cuEventRecord")
            for ours in self.streams.values():
                ok(cu.cuStreamWaitEvent(ours, event, 0), "cuStreamWaitEvent")
            cu.cuEventDestroy(event)

    def map_ahead(self, nbytes):
        """Map memory for the cut's copy (SnapshotOps.map_ahead) on a thread of ours: the driver
        calls release the interpreter, so the worker serves the application's calls meanwhile."""
        return self.mapper.submit(self._map_copy, nbytes)

    def freeze(self, regions, step=None, ahead=None):
        """A copy of the regions on the device (SnapshotOps.freeze), on the bulk stream, which
        the cut's fingerprint pass and its fence follow: the application's next kernels wait for
        a copy at device speed (GPT-2's 9.65 GiB: milliseconds), and the checkpoint then reads
        what it needs from the copy, with no copy-on-write. None while the device has too little
        free.

        The application is held while this runs, so both halves are made cheap. The memory is
        mapped as the application's is (cuMemCreate, cuMemMap: 0.8 ms for GPT-2's 9.65 GiB on
        the H200, where cuMemAllocAsync took 10-24 ms, perf/probe_freeze_alloc.py), and unmapping
        it later stalls no other work; mapped ahead of the cut (map_ahead), the cut only copies:
        mapping took 4.2 ms of an 8 GiB cut's 5.4 on the H200. The copy is one launch of a
        kernel that copies every region (snapshot/kernels/copy_pieces.cu): a driver copy costs
        ~8 µs to issue, and PyTorch's contexts hold thousands of regions (GPT-2's 1,951 held the
        application 14 ms)."""
        t = time.perf_counter()
        layout = FrozenLayout(regions)
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        mapped = None if ahead is None else ahead.result()
        if mapped is not None and not 0 < layout.nbytes <= mapped[1]:     # the context grew past it since
            self._unmap(mapped)
            mapped = ahead = None             # mapped below, as without it
            t = step("cut_freeze_unmap_ahead", t) if step else t
        if not layout.nbytes or ahead is not None and mapped is None:      # none could be mapped ahead (logged)
            return None
        try:
            self._after_application()
            t = step("cut_freeze_layout", t) if step else t
            if mapped is None:
                mapped = self._map_copy(layout.nbytes)
                if mapped is None:
                    return None
                t = step("cut_freeze_alloc", t) if step else t
            base = mapped[0]
            table = pieces(*layout.runs(base), FREEZE_PIECE)
            self._copy_pieces(table, self.handles["bulk"])
            self._fence(self.streams["bulk"])       # the application's later work waits for the copy alone
        except BaseException:      # a driver call failed: the memory goes with the cut, once our stream is done
            if mapped is not None:
                cu.cuStreamSynchronize(self.streams["bulk"])
                self._unmap(mapped)
            raise
        if step:
            step(f"cut_freeze_{len(table)}_pieces_of_{len(layout.sizes)}_regions", t)
        return base, layout, mapped

    def _copy_pieces(self, table, stream):
        """Enqueue the copies of a pieces() table on stream, in one launch of copy_pieces. Its
        table is uploaded from pinned memory that the next freeze overwrites: release() (which
        comes first) waits for this stream."""
        n = len(table)
        device, host = self._freeze_table(n)
        host[:3 * n] = table.reshape(-1)
        _check(_cuMemcpyHtoDAsync(device, host.ctypes.data, 24 * n, stream), "cuMemcpyHtoDAsync")
        launch = self._launch(self.copy_kernel, n, stream, [device, n])
        _check(_cuLaunchKernelEx(launch[3], int(self.copy_kernel), launch[4], None), "launch of copy_pieces")

    def _freeze_table(self, n):
        """(device table, pinned host table) for n pieces: made ahead by prepare(); a bigger
        one is made when needed (pinning it holds the application a few milliseconds, once)."""
        if self.freeze_table is None or self.freeze_table[2] < n:
            cap = max(n, FREEZE_TABLE)
            self.freeze_table = (int(ok(cu.cuMemAlloc(24 * cap), "cuMemAlloc")), _pinned(24 * cap).view(np.uint64), cap)
        return self.freeze_table[:2]

    def _map_copy(self, nbytes):
        """_map's memory for a copy of nbytes, or None (logged) where the device has too little
        free for it or mapping failed: copy-on-write then. Current first: map_ahead's thread
        has no context until it sets one."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        free, total = (int(n) for n in ok(cu.cuMemGetInfo(), "cuMemGetInfo"))
        if free < nbytes + max(FREEZE_HEADROOM, total // 20):
            log.info("checkpoint: %d MiB free on the device, too little for a copy of %d MiB: copy-on-write instead",
                     free >> 20, nbytes >> 20)
            return None
        mapped = self._map(nbytes)
        if isinstance(mapped, str):
            log.info("checkpoint: no device copy of %d MiB (%s): copy-on-write instead", nbytes >> 20, mapped)
            return None
        return mapped

    def _map(self, nbytes):
        """(address, length, handle) of nbytes of fresh device memory mapped at an address of
        its own, or why not."""
        length = -(-nbytes // self.backend.space.align) * self.backend.space.align
        handle, base = _U64(), 0
        try:
            _check(_cuMemCreate(ctypes.byref(handle), length, self.backend.prop_ptr, 0), "cuMemCreate")
            base = int(ok(cu.cuMemAddressReserve(length, 0, 0, 0), "cuMemAddressReserve"))
            _check(_cuMemMap(base, length, 0, handle.value, 0), "cuMemMap")
            _check(_cuMemSetAccess(base, length, self.backend.access_ptr, 1), "cuMemSetAccess")
            return base, length, handle.value
        except CudaError as e:
            self._unmap((base, length, handle.value))
            return e.message

    @staticmethod
    def _unmap(mapped):
        base, length, handle = mapped
        if base:
            _cuMemUnmap(base, length)          # fails harmlessly where the mapping was not made
            cu.cuMemAddressFree(base, length)
        if handle:
            _cuMemRelease(handle)

    def release(self, frozen):
        """Once the bulk stream's reads of the copy are done: unmapping does not wait for them.
        Memory mapped ahead that no freeze() took was never read: it goes once it is mapped."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        if isinstance(frozen, Future):
            mapped = ahead_memory(frozen)
        else:
            ok(cu.cuStreamSynchronize(self.streams["bulk"]), "cuStreamSynchronize")
            mapped = frozen[2]
        if mapped is not None:
            # on the mapping thread: unmapping a context's copy takes as long as mapping it (26 ms
            # for 32 GiB on the H200), which held the application's calls on this one
            self.mapper.submit(self._unmap_current, mapped)

    def _unmap_current(self, mapped):
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        self._unmap(mapped)

    def fingerprints(self, chunks, fence, frozen=None):
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        if frozen is not None:
            # The copy's bytes, after it on the same stream (freeze fenced it), and before the copy
            # to the host, which follows on it: with that copy on another stream, its queue of
            # batches held the pass's lane sums back to its end (219-233 ms into checkpoints of
            # 270-310 ms on the H200), and left its batches unchecked until then.
            rows = np.asarray(chunks, np.uint64).reshape(-1, 2)
            copied = np.column_stack([frozen[1].source(frozen[0], rows[:, 0]), rows[:, 1]])
            return self._hash(copied, "cut", self.handles["bulk"])
        self._after_application()
        wait = self._hash(chunks, "cut", self.handles["bulk"])
        if fence:                            # and the application's later work after the hash
            self._fence(self.streams["bulk"])
        return wait

    def _fence(self, stream):
        """The application's later work waits for what `stream` holds now."""
        event = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        ok(cu.cuEventRecord(event, stream), "cuEventRecord")
        for app in self._app_streams():
            ok(cu.cuStreamWaitEvent(app, event, 0), "cuStreamWaitEvent")
        cu.cuEventDestroy(event)

    def prepare(self):
        """Pin the copy buffers now (a pre-started worker, before any application uses it):
        pinning holds a driver lock that would stall the application for a quarter second."""
        for key in self.streams:
            self._buffers(key, self.BUFFER[key])
            for n in (0, 1):
                self._table(f"{key}{n}", 1024)
        self._table("cut", CUT_TABLE)       # a larger cut would pin a table of its own, the application held
        self._freeze_table(FREEZE_TABLE)

    def pin(self, memory, slot_bytes):
        """Pin a HostStore's shared memory (a NumPy view) for copies straight to and from it, in
        pieces of whole slots of slot_bytes, about STORE_PIN_PIECE each: one copy runs pinned
        only within one registration. A pre-started worker does it before any application uses
        it: pinning costs ~280 ms per GiB of a fresh store's pages (perf/RESULTS.md). Small pieces, a moment apart: pinning and unpinning
        hold a driver lock that all processes on the GPU share (see CudaBackend.close), ~18 ms
        per 64 MiB of fresh pages. Returns False (logged) if it could not."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        piece = slot_bytes * max(1, STORE_PIN_PIECE // slot_bytes)
        start, done = memory.ctypes.data, []
        for off in range(0, memory.nbytes, piece):
            n = min(piece, memory.nbytes - off)
            err = cu.cuMemHostRegister(start + off, n, DEVICEMAP)[0]
            if int(err):
                log.warning("pinning %d MiB of host store memory failed (%s): copies go through buffers", n >> 20, err)
                for at in done:
                    cu.cuMemHostUnregister(at)
                return False
            done.append(start + off)
            time.sleep(PIN_PAUSE)
        self.pinned.append((start, start + memory.nbytes))
        self.pieces = sorted(self.pieces + done)     # sorted: join_runs breaks copies at them
        return True

    def threads_at_work(self):
        return self.mapper.at_work

    def maps(self, host):
        lo = host.ctypes.data
        return any(a <= lo and lo + host.nbytes <= b for a, b in self.pinned)

    def _buffer_size(self, key, at_least):
        """A stream's copy buffers: BUFFER[key] and a MiB (room for a batch's chunks at 16-byte
        boundaries, stage_offsets), or at_least rounded up to a MiB if bigger."""
        return max(self.BUFFER[key] + (1 << 20), -(-at_least // (1 << 20)) << 20)

    def _buffers(self, key, at_least):
        """The two pinned host buffers of a stream, grown to hold a chunk of at_least bytes.
        Made when first needed, not at the cut: pinning takes milliseconds per 100 MiB."""
        buffers = self.host[key]
        if not buffers or len(buffers[0]) < at_least:
            size = self._buffer_size(key, at_least)
            buffers[:] = [_pinned(size), _pinned(size)]      # the old ones stay allocated: rare, and safe
        return buffers

    def _batches(self, chunks, capacity):
        """Split chunks into runs that fit one host buffer: [(start, end)]."""
        out, start = [], 0
        while start < len(chunks):
            end, used = start, 0
            while end < len(chunks) and (end == start or used + chunks[end][1] <= capacity):
                if chunks[end][1] > capacity:
                    raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"chunk of {chunks[end][1]} bytes exceeds the {capacity}-byte copy buffer")
                used += chunks[end][1]
                end += 1
            out.append((start, end))
            start = end
        return out

    def _device_buffers(self, key, at_least):
        """Two device buffers of a stream: a batch is copied into one on the device, hashed
        there and sent on from there. Made when first needed (a checkpoint's first batch)."""
        buffers = self.device.get(key)
        if buffers is None or buffers[1] < at_least:
            size = self._buffer_size(key, at_least)
            buffers = self.device[key] = ([int(ok(cu.cuMemAlloc(size), "cuMemAlloc")) for _ in (0, 1)], size)
        return buffers

    def read(self, batches, urgent=False, frozen=None):
        """Copy batches of chunks to the host (snapshot/ops.py, SnapshotOps.read, has the contract).
        Each batch is copied on the device into a buffer of ours first, hashed there and sent to the host
        from there: the fingerprint is that of the bytes handed on even if the application
        writes a chunk meanwhile, and the hash reads device memory, not the host copy (which
        held the copies to ~9.6 GB/s on the H200). Two batches are under way at a time, in
        buffers that take turns: the next copies while the caller stores this one (from
        freeze()'s copy into a store's slots, FROZEN_IN_FLIGHT). Without
        into, a batch lands in one of two pinned host buffers; with it (views of pinned memory,
        one per chunk), the chunks land there."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        key = "urgent" if urgent else "bulk"
        stream, batches, under_way, n = self.handles[key], iter(batches), collections.deque(), 0
        first = next(batches, None)
        depth = FROZEN_IN_FLIGHT if frozen is not None and first is not None and first[1] is not None else 2
        batches = itertools.chain([first] if first is not None else [], batches)
        try:
            while True:
                while len(under_way) < depth and (batch := next(batches, None)) is not None:
                    yield None    # a batch's bookkeeping, its copies and storing the last: steps apart,
                    under_way.append(self._copy_out(key, stream, n % 2, *batch, frozen))     # a call may come between
                    n += 1
                    yield None
                if not under_way:
                    return
                views, tag, wait = under_way[0]
                while (fps := wait(block=False)) is None:
                    yield None
                under_way.popleft()
                yield tag, list(zip(views, fps))
        finally:          # stopped early: what is under way still lands where it was sent
            for _, _, wait in under_way:
                wait()

    def _copy_out(self, key, stream, turn, chunks, into, tag, frozen=None):
        """Enqueue one batch's copies into buffer `turn`: (views, tag, wait for fingerprints)."""
        if frozen is not None:
            return self._copy_frozen(key, stream, turn, chunks, into, tag, frozen)
        offsets, used = stage_offsets(chunks)
        stage, capacity = self._device_buffers(key, used)
        stage = stage[turn]
        find = self.backend.space.find
        runs = copy_runs(chunks, offsets, [find(addr) for addr, _ in chunks])   # neighbouring chunks of one region: one copy
        _copies(_cuMemcpyDtoDAsync, [stage + off for _, off, _ in runs], [addr for addr, _, _ in runs], [n for _, _, n in runs],
                stream, "cuMemcpyDtoDAsync")
        spans = np.array([(stage + off, size) for (_, size), off in zip(chunks, offsets)], np.uint64).reshape(-1, 2)
        if into is None:
            host = self._buffers(key, capacity)[turn]
            _check(_cuMemcpyDtoHAsync(host.ctypes.data, stage, used, stream), "cuMemcpyDtoHAsync")
            views = [host[off:off + size] for (_, size), off in zip(chunks, offsets)]
        else:
            _copies(_cuMemcpyDtoHAsync, _addresses(into), spans[:, 0], spans[:, 1], stream, "cuMemcpyDtoHAsync")
            views = into
        return views, tag, self._hash(spans, f"{key}{turn}", stream)

    def _copy_frozen(self, key, stream, turn, chunks, into, tag, frozen):
        """A batch from freeze()'s copy, which nothing writes: straight to the host, neither
        staged nor hashed, as the cut's pass hashed these very bytes (its fingerprints stand:
        None for each). The device's SMs stay the application's, and only the copy engines
        work: staging and hashing each batch beside a training step held the copy to 23 GB/s."""
        sources = frozen[1].source(frozen[0], [addr for addr, _ in chunks])
        sizes = [size for _, size in chunks]
        if into is None:
            offsets, used = stage_offsets(chunks)
            host = self._buffers(key, used)[turn]
            into = [host[off:off + size] for off, size in zip(offsets, sizes)]
            destinations, breaks = host.ctypes.data + np.asarray(offsets, np.uint64), ()
        else:          # a store's slots: those side by side in one pinned piece take one copy
            destinations, breaks = _addresses(into), self.pieces
        _copies(_cuMemcpyDtoHAsync, *join_runs(destinations, sources, sizes, breaks), stream, "cuMemcpyDtoHAsync")
        return into, tag, self._once_done(stream, lambda: [None] * len(chunks))

    def write(self, chunks, load, pool, urgent=False, sources=None):
        """Copy chunks to the device through a pinned buffer: pool threads read chunk i in
        place (load(i, out)), then the link copies them at full speed; or straight from
        sources[i], views of pinned memory. Returns the fingerprints of what landed.
        urgent: a call waits for these (own stream and buffer, beside the background loading)."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        key = "urgent" if urgent else "bulk"
        stream = self.handles[key]
        if sources is not None:
            _copies(_cuMemcpyHtoDAsync, [addr for addr, _ in chunks], _addresses(sources), [size for _, size in chunks], stream, "cuMemcpyHtoDAsync")
            return self._hash(chunks, f"{key}0", stream)()
        host = self._buffers(key, max(size for _, size in chunks))[0]
        fps = []
        for start, end in self._batches(chunks, len(host)):
            offsets = np.cumsum([0] + [size for _, size in chunks[start:end]])

            list(pool.map(lambda i: load(start + i, host[offsets[i]:offsets[i + 1]]), range(end - start)))
            _copies(_cuMemcpyHtoDAsync, [addr for addr, _ in chunks[start:end]], host.ctypes.data + offsets[:-1], np.diff(offsets), stream,
                    "cuMemcpyHtoDAsync")
            fps += self._hash(chunks[start:end], f"{key}0", stream)()
        return fps
