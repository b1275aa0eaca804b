"""Device memory of the emu backend: one lazily-committed arena at the fixed base.

Device address a lives at arena[a - base], base being the context's (address_space.py
device_base), so kernels gather and scatter with plain NumPy fancy indexing; `offsets` checks
every access against the allocations first.
Module globals live above the allocations, where each process starts them at its own
place, as the driver does on a GPU: a restored context's globals move, as they do there.

A device's capacity is shared by every context of a server on it, as a GPU's memory is: each
context's worker is a process with an arena of its own, so what they hold together is kept
in a DeviceLedger that all of them read (gpu_server/device_ledger.py, emu_ledger below).
"""
import contextlib
import mmap
import random

import numpy as np

from phos.gpu_server.address_space import BASE, AddressSpace
from phos.gpu_server.device_ledger import DeviceLedger
from phos.schema.cuda_types import CudaError, CUresult

ALIGN = 256
MODULE_AREA = 1 << 30      # room for module globals beyond the device's capacity (which globals may fill too)
MODULE_SKEW = 2 << 20      # the step of a process's first global's place (the driver's: 2 MiB)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)   # Linux value; Python < 3.13 lacks the name


# A charge that does not fit names the emu device's settings.
EMU_FULL = ("{what} of {nbytes} bytes does not fit in the {free} bytes free of the emu device's {capacity} "
            "(PHOS_EMU_MEMORY, at most what the host's memory can back, cgroup limits included; shared by all "
            "the contexts of this server)")
EMU_OVER_QUOTA = ("{what} of {nbytes} bytes exceeds this context's quota: it holds {held} of its {quota} bytes "
                  "(PHOS_EMU_CONTEXT_QUOTA)")


def emu_ledger(capacity, directory=None, quota=0):
    """The emu device's DeviceLedger: capacity its memory, shared through directory by the
    server's contexts (None: this process alone), quota what one context may hold (0: no quota)."""
    return DeviceLedger(capacity, directory, quota, full=EMU_FULL, over_quota=EMU_OVER_QUOTA)


class EmuMemory:
    def __init__(self, capacity, ledger=None, base=BASE):
        self.capacity = capacity
        self.ledger = ledger or emu_ledger(capacity)
        # Globals may take up the whole device (the ledger counts them): room for that beyond the skew.
        self._map = mmap.mmap(-1, 2 * capacity + MODULE_AREA, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.arena = np.frombuffer(self._map, dtype=np.uint8)
        self.place(base)
        # The client's memory that kernels read and write in place (managed, mapped host memory),
        # mapped by the worker at the client's own addresses: (base, end, uint8 array) each.
        self.host_windows = []

    def place(self, base):
        """Give this context the addresses from base on (nothing allocated yet): its device's range
        when it is made, its image's when it is restored, on whichever device."""
        self.base = base
        self.space = AddressSpace(self.capacity, ALIGN, base=base)
        self.module_space = AddressSpace(self.capacity + MODULE_AREA, ALIGN, base=base + self.capacity)
        self.module_space.alloc(MODULE_SKEW * random.randrange(1, MODULE_AREA // MODULE_SKEW // 2))
        self._reindex()

    def add_host_window(self, base, buf):
        self.host_windows.append((base, base + len(buf), buf))

    def remove_host_window(self, base):
        self.host_windows = [w for w in self.host_windows if w[0] != base]

    def _reindex(self):
        # a moved global's old address is the application's, not the device's: kernels fault on it
        bases = [b for b in self.space.bases if b not in self.space.moved]
        self._bases = np.array(bases, np.uint64)
        self._ends = self._bases + np.array([self.space.sizes[b] for b in bases], np.uint64)

    def alloc(self, nbytes, at=None):
        with self._charged(nbytes, "an allocation"):
            ptr = self.space.alloc(nbytes, at)
        self._reindex()
        return ptr

    def alloc_global(self, nbytes, name="a module global"):
        """Room for a module global, which pointer checks accept as the device's own range."""
        with self._charged(nbytes, name):
            ptr = self.module_space.alloc(nbytes)
        self.space.adopt(ptr, nbytes)
        self._reindex()
        return ptr

    @contextlib.contextmanager
    def _charged(self, nbytes, what):
        """Charge nbytes (as the address space rounds them) to the ledger, first: back if placing them fails."""
        length = -(-nbytes // ALIGN) * ALIGN if nbytes > 0 else 0
        self.ledger.charge(length, what)
        try:
            yield
        except BaseException:
            self.ledger.refund(length)
            raise

    def free_global(self, ptr):
        self.space.forget(ptr)
        self._release(ptr, self.module_space.release(ptr))
        self._reindex()

    def free(self, ptr):
        self._release(ptr, self.space.release(ptr))
        self._reindex()

    def _release(self, ptr, nbytes):
        self._clear(ptr, nbytes)
        self.ledger.refund(-(-nbytes // ALIGN) * ALIGN)

    def _clear(self, ptr, nbytes):
        # Whole pages go back to the OS (they read as zeros after), so a freed arena costs no
        # memory and freeing gigabytes does not write them first; only the pages at the ends are zeroed.
        off, end = ptr - self.base, ptr - self.base + nbytes
        first, last = -(-off // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            self.arena[off:end] = 0
            return
        self.arena[off:first] = 0
        self.arena[last:end] = 0
        self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def close(self):
        """Give the device memory this context holds back to the others."""
        self.ledger.close()

    def view(self, ptr, nbytes, what="pointer"):
        """A writable uint8 view of [ptr, ptr+nbytes), checked against the allocations."""
        self.space.check(ptr, nbytes, what)
        off = ptr - self.base
        return self.arena[off:off + nbytes]

    def offsets(self, addrs, width):
        """Arena offsets of per-thread accesses of `width` bytes at `addrs` (uint64 array).

        Raises CUDA_ERROR_ILLEGAL_ADDRESS, as a GPU does, if any access leaves its allocation.
        """
        addrs = np.asarray(addrs, dtype=np.uint64)
        i = np.searchsorted(self._bases, addrs, side="right") - 1
        ok = i >= 0
        ok[ok] &= addrs[ok] + np.uint64(width) <= self._ends[i[ok]]
        if not ok.all():
            bad = int(addrs[~ok][0])
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, f"{width}-byte access at {bad:#x} is outside every allocation")
        return (addrs - np.uint64(self.base)).astype(np.int64)

    def load(self, addrs, dtype):
        """Gather one value of `dtype` per address."""
        dtype = np.dtype(dtype)
        off = self.offsets(addrs, dtype.itemsize)
        raw = self.arena[off[:, None] + np.arange(dtype.itemsize)]
        return raw.view(dtype).reshape(len(off))

    def store(self, addrs, values, dtype):
        """Scatter one value of `dtype` per address; later threads win on conflicts."""
        dtype = np.dtype(dtype)
        off = self.offsets(addrs, dtype.itemsize)
        raw = np.ascontiguousarray(np.asarray(values, dtype=dtype)).reshape(len(off)).view(np.uint8)
        self.arena[off[:, None] + np.arange(dtype.itemsize)] = raw.reshape(len(off), dtype.itemsize)

    def mem_info(self):
        """(free, total) bytes, as cuMemGetInfo gives them: free counts every context of the device."""
        return self.ledger.free(), self.capacity
