"""The emu backend: emulated devices on the CPU (PHOS_EMU_DEVICES of them).

A context's memory is one arena at its device's base (emu_memory.py), whose bytes the
device's other contexts share through the server's DeviceLedger of that device; kernels run
in the PTX interpreter (ptx/), each launch for at most PHOS_EMU_LAUNCH_TIMEOUT seconds. Calls run in arrival order, which is
one valid schedule of the streams, so stream and event ordering holds; events record the time they ran.
"""
import math
import time
import uuid
from concurrent.futures import Future

import numpy as np

from phos.base import settings
from phos.base import native
from phos.gpu_server.address_space import device_base
from phos.gpu_server.backends.backend import FUNCTION_ATTRIBUTES, DeviceInfo, Function
from phos.gpu_server.backends.emu_attributes import EMU_ATTRIBUTES
from phos.gpu_server.backends import host_memory
from phos.gpu_server.backends.emu_memory import EmuMemory, emu_ledger
from phos.gpu_server.backends.staging_layout import FrozenLayout
from phos.schema.cuda_types import CudaError, CUresult
from phos.schema.wire import LAUNCH_COOPERATIVE, launch_cluster
from phos.snapshot.fingerprint import fingerprint
from phos.snapshot.ops import ahead_memory

MAX_DYNAMIC_SHARED = 8      # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
P2P_ATTRIBUTES = range(1, 5)  # CUdevice_P2PAttribute: performance rank, access, native atomics, CUDA arrays
P2P_ACCESS_SUPPORTED = 2

# CUlimit -> (a context's first value, whether the application may set it), as a
# compute-capability-9.0 device has them; a limit missing here (device-runtime sync depth,
# which such a device lacks) is unsupported.
EMU_LIMITS = {
    0: (1024, True),            # stack size
    1: (1 << 20, True),         # printf FIFO size
    2: (8 << 20, True),         # malloc heap size
    4: (2048, True),            # device-runtime pending launches
    5: (64, True),              # L2 fetch granularity
    6: (0, True),               # persisting L2 cache size (emu has no L2 to persist in)
    7: (EMU_ATTRIBUTES[97], False),   # shared memory size
    8: (0, False),              # CIG enabled: phos's contexts are no CUDA-in-graphics ones
    9: (0, False),              # CIG shared memory fallback
}
EMU_DEVICES = settings.emu_devices()
# Each device no bigger than its share of what the host can back (gpu_server/backends/host_memory.py).
EMU_MEMORY = min(settings.emu_memory(), (host_memory.backable() or 1 << 62) // max(1, EMU_DEVICES))
CONTEXT_QUOTA = settings.emu_context_quota()
LAUNCH_TIMEOUT = settings.emu_launch_timeout()
MODULE_LOAD_TIMEOUT = settings.emu_module_load_timeout()


class EmuBackend:
    """The Backend (gpu_server/backends/backend.py) of an emulated device."""
    name = "emu"
    pins_host_memory = False     # the CPU reads any host memory as it is
    launcher = None              # the interpreter's launches have no compiled path

    @staticmethod
    def devices():
        # Device 0 keeps the name and UUID it had when emu had one device.
        return [DeviceInfo("phos emu (PTX interpreter)" + (f" {i}" if i else ""),
                           uuid.uuid5(uuid.NAMESPACE_DNS, "phos.emu" + (f".{i}" if i else "")).bytes,
                           EMU_MEMORY, {**EMU_ATTRIBUTES, 33: i})      # CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: one a device
                for i in range(EMU_DEVICES)]

    @staticmethod
    def p2p_attribute(attribute, device, peer):
        """Peer access between two devices (never called for one device twice): the stubs copy
        between contexts of any two devices. Atomics and arrays across devices are not offered."""
        if attribute not in P2P_ATTRIBUTES:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"no peer attribute {attribute}")
        return int(attribute == P2P_ACCESS_SUPPORTED)

    @staticmethod
    def driver_version():
        return 13000        # the CUDA version whose PTX the interpreter follows

    def __init__(self, device=0, ledger=None):
        """ledger: the directory of the server's DeviceLedger of this device (schema/control.py
        emu_ledger_dir), which its contexts share; None: this context has the device to itself."""
        if not 0 <= device < EMU_DEVICES:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_DEVICE, f"emu has {EMU_DEVICES} device(s) (PHOS_EMU_DEVICES), "
                            f"not a device {device}")
        self.ordinal = device
        self.mem = EmuMemory(EMU_MEMORY, emu_ledger(EMU_MEMORY, ledger, CONTEXT_QUOTA), device_base(device))
        self.space = self.mem.space
        self.output = []
        self.snap = EmuSnapshotOps(self.mem)
        self.limits = {limit: value for limit, (value, _) in EMU_LIMITS.items()}

    def device_info(self):
        return self.devices()[self.ordinal]

    def rebase(self, base):
        self.mem.place(base)
        self.space = self.mem.space

    # memory
    def alloc(self, nbytes, at=None):
        return self.mem.alloc(nbytes, at)

    def free(self, ptr):
        self.mem.free(ptr)

    def mem_info(self):
        return self.mem.mem_info()

    def htod(self, dst, data, stream):
        self.mem.view(dst, len(data))[:] = memoryview(data).cast("B")

    def dtoh(self, src, out, stream):
        out[:] = self.mem.view(src, len(out))

    def register_host(self, buf, whole=False):
        pass            # host memory is all the same to the CPU

    def unregister_host(self, buf):
        pass

    def map_device_host(self, buf, address):
        self.mem.add_host_window(address, buf)     # kernels' loads and stores reach it (ptx/interp.py)
        return None

    def unmap_device_host(self, buf):
        self.mem.remove_host_window(buf.ctypes.data)

    def copy_pinned(self, device, host, to_device, stream):
        if to_device:
            self.htod(device, host, stream)
        else:
            self.dtoh(device, host, stream)     # calls run as they arrive: done at once

    def dtod(self, dst, src, nbytes, stream):
        self.mem.view(dst, nbytes)[:] = self.mem.view(src, nbytes)

    def memset(self, dst, value, elem_size, count, stream):
        view = self.mem.view(dst, elem_size * count)
        view.view({1: "u1", 2: "<u2", 4: "<u4"}[elem_size])[:] = value

    # modules
    def load_module(self, image):
        from phos.gpu_server.backends.ptx import parse_module
        from phos.gpu_server.backends.fatbin import extract_ptx
        from phos.gpu_server.backends.ptx.parser import check_deadline
        deadline = time.monotonic() + MODULE_LOAD_TIMEOUT if MODULE_LOAD_TIMEOUT > 0 else math.inf
        module = parse_module(extract_ptx(bytes(image)), deadline)
        module.allocations = []
        try:
            for k, (name, var) in enumerate(module.globals.items()):
                if not k % 1024:          # placing each global is a ledger charge: 512k of them took minutes
                    check_deadline(0, deadline)
                ptr = self.mem.alloc_global(max(var.size, 1), f"module global {name!r}")
                module.allocations.append((name, ptr, var.size))
                self.mem.view(ptr, len(var.data))[:] = memoryview(var.data)   # the rest reads as zeros
                module.bind_global(name, ptr)
            module.relocate(self.mem)      # pointer initialisers now, as the driver does at load
        except BaseException:
            self.unload_module(module)     # a module that failed to load holds no memory
            raise
        return module

    def module_host_bytes(self, image):
        """Its image and what its parse may take at most (parser.PARSE_BYTES_PER_TOKEN, each byte of
        its text a token at most, MAX_MODULE_TOKENS and a check's stride at most). The parsed module
        keeps part of it (its instructions, its initialisers' values) while loaded, so the whole is
        charged for the module's life: a bound, not a measure."""
        from phos.gpu_server.backends.fatbin import extract_ptx
        from phos.gpu_server.backends.ptx import parser
        tokens = min(len(extract_ptx(bytes(image))), parser.MAX_MODULE_TOKENS + parser.CHECK_EVERY)
        return len(image) + parser.PARSE_BYTES_PER_TOKEN * tokens

    def unload_module(self, module):
        for _, ptr, _ in module.allocations:
            self.mem.free_global(ptr)

    def module_globals(self, module):
        return list(module.allocations)

    def get_function(self, module, name):
        kernel = module.kernels.get(name)
        if kernel is None:
            raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no kernel named {name!r} in this module")
        # What a compute-capability-9.0 driver reports for a plain kernel: the interpreter
        # has no register allocation, so 32 registers a thread.
        static = kernel.shared_size
        attributes = (1024, static, 0, 0, 32, 90, 90, 0, max(0, (48 << 10) - static), -1, 0, 0, 0, 0, 0, 0)
        assert len(attributes) == FUNCTION_ATTRIBUTES
        return Function((module, name), name, list(kernel.params), attributes)

    def get_global(self, module, name):
        for var, ptr, size in module.allocations:
            if var == name:
                return ptr, size
        raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no global named {name!r} in this module")

    def launch(self, function, grid, block, shared_bytes, stream, params, options=0):
        if launch_cluster(options):
            raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED, f"launch of {function.name}: emu runs no thread-block clusters")
        module, name = function.handle
        module.launch(name, self.mem, grid, block, shared_bytes, bytes(params), self.output.append, LAUNCH_TIMEOUT,
                      cooperative=bool(options & LAUNCH_COOPERATIVE))

    def set_function_attribute(self, function, attribute, value):
        if attribute == MAX_DYNAMIC_SHARED:
            module, name = function.handle
            module.kernels[name].max_dynamic_shared = value
        # the others (carveout, cluster sizes) change nothing the interpreter does

    def get_limit(self, limit):
        if limit not in self.limits:
            raise CudaError(CUresult.CUDA_ERROR_UNSUPPORTED_LIMIT, f"cuCtxGetLimit: emu has no limit {limit}")
        return self.limits[limit]

    def set_limit(self, limit, value):
        if limit not in self.limits:
            raise CudaError(CUresult.CUDA_ERROR_UNSUPPORTED_LIMIT, f"cuCtxSetLimit: emu has no limit {limit}")
        if not EMU_LIMITS[limit][1] and value != self.limits[limit]:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuCtxSetLimit: limit {limit} cannot be changed")
        if limit == 5 and value not in (0, 32, 64, 128):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuCtxSetLimit: no L2 fetch granularity of {value} bytes")
        self.limits[limit] = value

    def occupancy(self, function, query, a, b, flags, grid=0):
        """What the device's limits allow, with the 32 registers a thread emu reports."""
        attrs, shared_static = EMU_ATTRIBUTES, function.attributes[1]

        def blocks(block_size, dynamic):
            if not 0 < block_size <= attrs[1]:
                return 0
            threads = -(-block_size // attrs[10]) * attrs[10]
            n = min(attrs[39] // threads, attrs[106], attrs[82] // (threads * 32))
            used = shared_static + dynamic
            return max(0, min(n, attrs[81] // used) if used else n)

        if query == "maxActiveBlocks":
            return (blocks(a, b),)
        if query == "availableDynamicShared":
            return (max(0, attrs[81] // max(a, 1) - shared_static) if blocks(b, 0) >= a else 0,)
        if query == "maxPotentialBlockSize":
            limit = min(b or attrs[1], attrs[1])
            size = max(range(attrs[10], limit + 1, attrs[10]), key=lambda s: (blocks(s, a) * s, s), default=0)
            return (blocks(size, a) * attrs[16], size)
        raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED, f"emu cannot answer occupancy query {query!r} (no clusters)")

    def tensor_map_encode(self, im2col, values):
        raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED, "emu has no tensor memory accelerator (cuTensorMapEncode)")

    def take_output(self):
        text, self.output = "".join(self.output), []
        return text

    # streams and events: work is done when it arrives, so everything is complete
    def stream_create(self, flags, priority):
        return object()

    def stream_destroy(self, stream):
        pass

    def stream_sync(self, stream):
        pass

    def stream_query(self, stream):
        return True

    def stream_wait_event(self, stream, event):
        pass

    def event_create(self, flags):
        return [None]

    def event_record(self, event, stream):
        event[0] = time.perf_counter()

    def event_sync(self, event):
        pass

    def event_query(self, event):
        return True

    def event_elapsed(self, start, end):
        if start[0] is None or end[0] is None:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_HANDLE, "event has not been recorded")
        return (end[0] - start[0]) * 1000.0

    def event_destroy(self, event):
        pass

    def synchronize(self):
        pass

    def idle(self):
        return True

    def native_synchronize(self):
        # nothing to wait for; printed output is told by the Python path's reply
        return None if self.output else native.address("phos_box_no_wait")    # a synchronize that waits for nothing

    def close(self):
        self.mem.close()


class EmuSnapshotOps:
    """The snapshot engine's device operations (SnapshotOps, snapshot/ops.py): NumPy on the arena."""

    def __init__(self, mem):
        self.mem = mem
        # What a device would have mapped, counted: tests see that the cut took the memory
        # mapped ahead, and that none of it outlives its checkpoint.
        self.mapped_ahead = 0    # map_ahead()'s buffers not yet released
        self.copies_ahead = 0    # freeze()s that copied into one

    def view(self, addr, n):
        return self.mem.arena[addr - self.mem.base:addr - self.mem.base + n]

    def fingerprints(self, chunks, fence, frozen=None):
        # calls run in order: the cut is now, and the memory holds what a frozen copy does
        fps = [fingerprint(self.view(a, n)) for a, n in chunks]
        return lambda block=True: fps

    def map_ahead(self, nbytes):
        """A buffer, at once: there is nothing to map, yet the worker waits for it as for a device's."""
        done = Future()
        done.set_result(np.empty(nbytes, np.uint8))
        self.mapped_ahead += 1
        return done

    def freeze(self, regions, step=None, ahead=None):
        """The regions copied now, in arrival order (the cut is now): a NumPy copy, not device
        memory; into map_ahead()'s buffer where they fit there. Its third item says whether
        they did (release)."""
        layout = FrozenLayout(regions)
        buffer = None if ahead is None else ahead.result()
        fits = buffer is not None and len(buffer) >= layout.nbytes > 0
        if ahead is not None and not fits:
            self.release(ahead)
        if not layout.nbytes or ahead is not None and buffer is None:    # none mapped ahead: no copy, as on a device
            return None
        copy = buffer[:layout.nbytes] if fits else np.empty(layout.nbytes, np.uint8)
        for start, off, size in zip(layout.starts.tolist(), layout.offsets.tolist(), layout.sizes.tolist()):
            copy[off:off + size] = self.view(start, size)
        self.copies_ahead += fits
        return copy, layout, fits

    def release(self, frozen):
        # the memory goes with its last reference: only what was mapped ahead is counted
        if isinstance(frozen, Future):
            if ahead_memory(frozen) is not None:
                self.mapped_ahead -= 1
        elif frozen[2]:
            self.mapped_ahead -= 1

    def threads_at_work(self):
        return False            # map_ahead's buffer is there at once

    def maps(self, host):
        return True             # no copy engines: any host memory will do

    def pin(self, memory, slot_bytes):
        return True             # nothing to pin (maps() takes it as it is)

    def prepare(self):
        pass                    # nothing made ahead

    def read(self, batches, urgent=False, frozen=None):
        def source(a, n):
            if frozen is None:
                return self.view(a, n)
            at = int(frozen[1].source(0, [a])[0])
            return frozen[0][at:at + n]

        for chunks, into, tag in batches:
            copied = []
            for i, (a, n) in enumerate(chunks):
                if copied:
                    yield None          # a chunk at a time, as a device copies beside the calls
                data = source(a, n).copy() if into is None else into[i]
                if into is not None:
                    data[:] = source(a, n)
                # the frozen copy holds the bytes the cut hashed: its fingerprint stands (None)
                copied.append((data, None if frozen is not None else fingerprint(data)))
            yield tag, copied

    def write(self, chunks, load, pool, urgent=False, sources=None):
        def place(i):
            a, n = chunks[i]
            if sources is None:
                load(i, self.view(a, n))
            else:
                self.view(a, n)[:] = sources[i]
            return fingerprint(self.view(a, n))
        return list(pool.map(place, range(len(chunks))))
