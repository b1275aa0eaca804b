"""Device memory of the emu backend: one lazily-committed arena at the fixed base.

Device address a lives at arena[a - BASE], so kernels gather and scatter with plain
NumPy fancy indexing; `offsets` checks every access against the allocations first.
Module globals live above the allocations, where each process starts them at its own
place, as the driver does on a GPU: a restored context's globals move, as they do there.

The device's capacity is shared by every context of a server, as a GPU's memory is: each
context's worker is a process with an arena of its own, so what they hold together is kept
in a DeviceLedger that all of them read (below).
"""
import contextlib
import fcntl
import mmap
import os
import random
import secrets
import struct
import threading

import numpy as np

from phos.gpu_server.address_space import BASE, AddressSpace
from phos.schema.control import private_directory
from phos.schema.cuda_types import CudaError, CUresult

ALIGN = 256
MODULE_AREA = 1 << 30      # room for module globals beyond the device's capacity (which globals may fill too)
MODULE_SKEW = 2 << 20      # the step of a process's first global's place (the driver's: 2 MiB)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)   # Linux value; Python < 3.13 lacks the name
ENTRY = struct.Struct("<Q")   # a ledger entry: the bytes its worker holds


class DeviceLedger:
    """The device memory that the contexts of one server hold, each in a worker of its own.

    Every worker keeps the bytes it holds in a file of its own in the server's ledger directory,
    and holds an flock on that file for its whole life. The kernel drops the lock when the process
    ends, however it ends (SIGKILL too): a file nobody holds locked is a dead worker's, and a
    recount deletes it, which gives its memory back. The `.lock` file's flock makes every change
    one step for all the workers, and the file keeps their total, so that a charge that fits
    reads one number instead of every file. A worker changes the total before its own file when
    it charges, after it when it gives back: killed in between, it leaves the total too high,
    never too low, and a recount (when a charge does not fit, and for free()) makes it exact.
    Without a directory the ledger counts this process alone (an EmuMemory of its own, as the
    interpreter's tests make).
    """

    def __init__(self, capacity, directory=None, quota=0):
        self.capacity, self.directory, self.quota = capacity, directory, quota
        self.held = 0
        self._thread_lock = threading.Lock()     # flock does not part the threads of one process
        self._lock_fd = self._entry_fd = None
        self._entry = None
        if directory is not None:
            private_directory(directory, create=True)
            self._lock_fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with self._locked():
                self._entry = f"{os.getpid()}.{secrets.token_hex(4)}"
                self._entry_fd = os.open(os.path.join(directory, self._entry),
                                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                fcntl.flock(self._entry_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._set_held(0)

    @contextlib.contextmanager
    def _locked(self):
        with self._thread_lock:
            if self._lock_fd is None:
                yield
                return
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # -- under the lock ----------------------------------------------------------------------------
    def _set_held(self, held):
        self.held = held
        if self._entry_fd is not None:
            os.pwrite(self._entry_fd, ENTRY.pack(held), 0)

    def _total(self):
        """What the workers hold together, or more (see the class)."""
        if self._lock_fd is None:
            return self.held
        return self._read(self._lock_fd)

    def _set_total(self, total):
        if self._lock_fd is not None:
            os.pwrite(self._lock_fd, ENTRY.pack(max(total, 0)), 0)

    def _recount(self):
        """What the live workers hold together, exactly; deletes the entries of dead ones."""
        total = self.held
        if self.directory is not None:
            for name in os.listdir(self.directory):
                if not name.startswith(".") and name != self._entry:
                    total += self._held_by_live(os.path.join(self.directory, name))
        self._set_total(total)
        return total

    @classmethod
    def _held_by_live(cls, path):
        """The bytes an entry's worker holds, or 0 after deleting the entry when that worker is gone."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:          # its worker holds it: alive
                return cls._read(fd)
            os.unlink(path)                  # nobody holds it: its worker died without closing it
            return 0
        finally:
            os.close(fd)

    @staticmethod
    def _read(fd):
        raw = os.pread(fd, ENTRY.size, 0)
        return ENTRY.unpack(raw)[0] if len(raw) == ENTRY.size else 0

    def _free(self, total):
        free = self.capacity - total
        return max(0, min(free, self.quota - self.held) if self.quota else free)

    # -- the ledger's operations -------------------------------------------------------------------
    def free(self):
        """The bytes this context could still take: what the device has free, within its quota."""
        with self._locked():
            return self._free(self._recount())

    def charge(self, nbytes, what="an allocation"):
        """Take nbytes for this context, or raise CUDA_ERROR_OUT_OF_MEMORY when they are not free."""
        with self._locked():
            if self.quota and self.held + nbytes > self.quota:
                raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                                f"{what} of {nbytes} bytes exceeds this context's quota: it holds {self.held} of "
                                f"its {self.quota} bytes (PHOS_EMU_CONTEXT_QUOTA)")
            total = self._total()
            if total + nbytes > self.capacity:
                total = self._recount()
            if total + nbytes > self.capacity:
                raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                                f"{what} of {nbytes} bytes does not fit in the {self.capacity - total} bytes free of "
                                f"the emu device's {self.capacity} (PHOS_EMU_MEMORY, shared by all the contexts of "
                                "this server)")
            self._set_total(total + nbytes)
            self._set_held(self.held + nbytes)

    def refund(self, nbytes):
        with self._locked():
            self._set_held(self.held - nbytes)
            self._set_total(self._total() - nbytes)

    def close(self):
        """Give back everything this context holds."""
        with self._locked():
            held = self.held
            if self._entry_fd is not None:
                os.unlink(os.path.join(self.directory, self._entry))
                os.close(self._entry_fd)
                self._entry_fd = None
            self.held = 0
            self._set_total(self._total() - held)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class EmuMemory:
    def __init__(self, capacity, ledger=None):
        self.capacity = capacity
        self.ledger = ledger or DeviceLedger(capacity)
        # Globals may take up the whole device (the ledger counts them): room for that beyond the skew.
        module_area = capacity + MODULE_AREA
        self._map = mmap.mmap(-1, capacity + module_area, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.arena = np.frombuffer(self._map, dtype=np.uint8)
        self.space = AddressSpace(capacity, ALIGN)
        self.module_space = AddressSpace(module_area, ALIGN, base=BASE + capacity)
        self.module_space.alloc(MODULE_SKEW * random.randrange(1, MODULE_AREA // MODULE_SKEW // 2))
        self._bases = np.zeros(0, np.uint64)
        self._ends = np.zeros(0, np.uint64)
        # The client's memory that kernels read and write in place (managed, mapped host memory),
        # mapped by the worker at the client's own addresses: (base, end, uint8 array) each.
        self.host_windows = []

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
        off, end = ptr - BASE, ptr - BASE + nbytes
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

    def mem_info(self):
        """(free, total) bytes, as cuMemGetInfo gives them: free counts every context of the device."""
        return self.ledger.free(), self.capacity
