"""The emu backend: an emulated device on the CPU.

Memory is one arena at the fixed base (emu_memory.py); kernels run in the PTX
interpreter (ptx/). Calls run in arrival order, which is one valid schedule of the
streams, so stream and event ordering holds; events record the time they ran.
"""
import time
import uuid

from phos import settings
from phos.gpu_server.address_space import BASE
from phos.gpu_server.backend import DeviceInfo, Function
from phos.gpu_server.emu_memory import EmuMemory
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot.fingerprint import fingerprint

GiB = 1 << 30
EMU_MEMORY = settings.emu_memory()

# An sm_90-class device, so PTX built for compute_75..compute_90 loads.
EMU_ATTRIBUTES = {
    1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2**31 - 1, 6: 65535, 7: 65535, 8: 48 * 1024, 9: 64 * 1024,
    10: 32, 11: 2**31 - 1, 12: 65536, 13: 1_000_000, 14: 512, 15: 1, 16: 2, 17: 0, 18: 0, 19: 1, 20: 0,
    31: 1, 32: 0, 33: 0, 34: 0, 36: 1_000_000, 37: 64, 38: 4 * 1024 * 1024, 39: 2048, 40: 1, 41: 1,
    50: 0, 75: 9, 76: 0, 81: 228 * 1024, 82: 65536, 83: 0, 84: 0, 97: 227 * 1024, 102: 0, 106: 32,
}


class EmuBackend:
    name = "emu"

    @staticmethod
    def devices():
        return [DeviceInfo("phos emu (PTX interpreter)", uuid.uuid5(uuid.NAMESPACE_DNS, "phos.emu").bytes,
                           EMU_MEMORY, EMU_ATTRIBUTES)]

    @staticmethod
    def driver_version():
        return 13000        # the CUDA version whose PTX the interpreter follows

    def __init__(self, device=0):
        if device != 0:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_DEVICE, f"emu has one device, not {device}")
        self.mem = EmuMemory(EMU_MEMORY)
        self.space = self.mem.space
        self.output = []
        self.snap = EmuSnapshotOps(self.mem)

    def device_info(self):
        return self.devices()[0]

    # memory
    def alloc(self, nbytes, at=None):
        return self.mem.alloc(nbytes, at)

    def free(self, ptr):
        self.mem.free(ptr)

    def mem_info(self):
        return EMU_MEMORY - self.mem.used(), EMU_MEMORY

    def htod(self, dst, data, stream):
        self.mem.view(dst, len(data))[:] = memoryview(data).cast("B")

    def dtoh(self, src, out, stream):
        out[:] = self.mem.view(src, len(out))

    def register_host(self, buf):
        pass            # host memory is all the same to the CPU

    def dtod(self, dst, src, nbytes, stream):
        self.mem.view(dst, nbytes)[:] = self.mem.view(src, nbytes)

    def memset(self, dst, value, elem_size, count, stream):
        view = self.mem.view(dst, elem_size * count)
        view.view({1: "u1", 2: "<u2", 4: "<u4"}[elem_size])[:] = value

    # modules
    def load_module(self, image):
        from phos.gpu_server.ptx import parse_module
        from phos.gpu_server.fatbin import extract_ptx
        module = parse_module(extract_ptx(bytes(image)))
        module.allocations = []
        for name, var in module.globals.items():
            ptr = self.mem.alloc_global(max(var.size, 1))
            self.mem.view(ptr, len(var.init))[:] = memoryview(var.init)
            module.bind_global(name, ptr)
            module.allocations.append((name, ptr, var.size))
        module.relocate(self.mem)      # pointer initialisers now, as the driver does at load
        return module

    def unload_module(self, module):
        for _, ptr, _ in module.allocations:
            self.mem.free_global(ptr)

    def module_globals(self, module):
        return list(module.allocations)

    def get_function(self, module, name):
        kernel = module.kernels.get(name)
        if kernel is None:
            raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no kernel named {name!r} in this module")
        return Function((module, name), name, list(kernel.params))

    def get_global(self, module, name):
        for var, ptr, size in module.allocations:
            if var == name:
                return ptr, size
        raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no global named {name!r} in this module")

    def launch(self, function, grid, block, shared_bytes, stream, params):
        module, name = function.handle
        module.launch(name, self.mem, grid, block, shared_bytes, bytes(params), self.output.append)

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

    def close(self):
        pass


class EmuSnapshotOps:
    """The snapshot engine's device operations (snapshot/engine.py): NumPy on the arena."""

    def __init__(self, mem):
        self.mem = mem

    def view(self, addr, n):
        return self.mem.arena[addr - BASE:addr - BASE + n]

    def fingerprints(self, chunks, fence):
        fps = [fingerprint(self.view(a, n)) for a, n in chunks]   # calls run in order: the cut is now
        return lambda block=True: fps

    def maps(self, host):
        return True             # no copy engines: any host memory will do

    def read(self, batches, urgent=False):
        for chunks, into, tag in batches:
            copied = []
            for i, (a, n) in enumerate(chunks):
                if copied:
                    yield None          # a chunk at a time, as a device copies beside the calls
                data = self.view(a, n).copy() if into is None else into[i]
                if into is not None:
                    data[:] = self.view(a, n)
                copied.append((data, fingerprint(data)))
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
