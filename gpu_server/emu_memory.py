"""Device memory of the emu backend: one lazily-committed arena at the fixed base.

Device address a lives at arena[a - BASE], so kernels gather and scatter with plain
NumPy fancy indexing; `offsets` checks every access against the allocations first.
Module globals live above the allocations, where each process starts them at its own
place, as the driver does on a GPU: a restored context's globals move, as they do there.
"""
import mmap
import random

import numpy as np

from phos.gpu_server.address_space import BASE, AddressSpace
from phos.schema.cuda_types import CudaError, CUresult

ALIGN = 256
MODULE_AREA = 1 << 30      # room for module globals, above the allocations
MODULE_SKEW = 2 << 20      # the step of a process's first global's place (the driver's: 2 MiB)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)   # Linux value; Python < 3.13 lacks the name


class EmuMemory:
    def __init__(self, capacity):
        self.capacity = capacity
        self._map = mmap.mmap(-1, capacity + MODULE_AREA, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.arena = np.frombuffer(self._map, dtype=np.uint8)
        self.space = AddressSpace(capacity, ALIGN)
        self.module_space = AddressSpace(MODULE_AREA, ALIGN, base=BASE + capacity)
        self.module_space.alloc(MODULE_SKEW * random.randrange(1, MODULE_AREA // MODULE_SKEW // 2))
        self._bases = np.zeros(0, np.uint64)
        self._ends = np.zeros(0, np.uint64)

    def _reindex(self):
        # a moved global's old address is the application's, not the device's: kernels fault on it
        bases = [b for b in self.space.bases if b not in self.space.moved]
        self._bases = np.array(bases, np.uint64)
        self._ends = self._bases + np.array([self.space.sizes[b] for b in bases], np.uint64)

    def alloc(self, nbytes, at=None):
        ptr = self.space.alloc(nbytes, at)
        self._reindex()
        return ptr

    def alloc_global(self, nbytes):
        """Room for a module global, which pointer checks accept as the device's own range."""
        ptr = self.module_space.alloc(nbytes)
        self.space.adopt(ptr, nbytes)
        self._reindex()
        return ptr

    def free_global(self, ptr):
        self.space.forget(ptr)
        self._clear(ptr, self.module_space.release(ptr))
        self._reindex()

    def free(self, ptr):
        self._clear(ptr, self.space.release(ptr))
        self._reindex()

    def _clear(self, ptr, nbytes):
        off = ptr - BASE
        self.arena[off:off + nbytes] = 0
        # Give whole pages back to the OS so a freed arena costs no memory.
        start, end = -(-off // mmap.PAGESIZE) * mmap.PAGESIZE, (off + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def view(self, ptr, nbytes, what="pointer"):
        """A writable uint8 view of [ptr, ptr+nbytes), checked against the allocations."""
        self.space.check(ptr, nbytes, what)
        off = ptr - BASE
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
        return (addrs - np.uint64(BASE)).astype(np.int64)

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

    def used(self):
        return self.space.used()
