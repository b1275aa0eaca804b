"""The device address range of one context: a fixed base, allocations inside it.

Both backends place allocations here (DESIGN decision 3), so a restored or handed-off
context gets the same addresses back. Every pointer a client passes is checked here. It is
also where every allocation enters and leaves, restored ones and mappings too: a ledger given
by charge_to (the tenant's, PHOS_TENANT_QUOTA) is charged here before the device allocates.
"""
import bisect

import numpy as np

from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot.relocations import Relocations

# Far below where Linux places mmap()s (top-down from 0x7fff...): a base inside that area,
# such as 0x7f0000000000, collides with the worker's own libraries on the H200, and
# the fixed-address reservation would fail now and then. The GPU's 49-bit space has room here.
BASE = 0x600000000000
# Each device of a server gives its contexts a terabyte of addresses of its own, from BASE up,
# so that an application's pointers on different devices differ, as CUDA's unified addressing
# has them (a copy finds its devices by its pointers). 16 terabytes stay below 0x700000000000.
DEVICE_SPAN = 1 << 40
MAX_DEVICES = 16


def device_base(ordinal):
    """Where the contexts made on device `ordinal` (as the server's backend numbers its devices)
    place their allocations. A context keeps its range wherever it goes: restored or handed off to
    another device, its pointers stay valid."""
    if not 0 <= ordinal < MAX_DEVICES:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_DEVICE,
                        f"device {ordinal}: phos serves devices 0 to {MAX_DEVICES - 1}")
    return BASE + ordinal * DEVICE_SPAN


def check_base(base):
    """Raise CudaError unless base is a device's (an image names the base its context had)."""
    if not (BASE <= base < BASE + MAX_DEVICES * DEVICE_SPAN and (base - BASE) % DEVICE_SPAN == 0):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"address space base {base:#x} is no device's")


class AddressSpace:
    def __init__(self, size, align, base=BASE):
        self.base, self.size, self.align = base, size, align
        self.bases = []          # sorted allocation bases
        self.sizes = {}          # base -> size
        self.free = [(base, size)]  # sorted (start, length) holes
        self.external = set()       # bases of ranges the device placed outside (module globals)
        # A restored module global the device put elsewhere: the application keeps its old
        # address (app), calls reach the new one (device). One per global of every module the
        # context loaded: a PyTorch context has thousands.
        self.moved = {}             # app base -> device base
        self.app_of = {}            # device base -> app base
        self._moves = None          # Relocations of moved, made as a launch first needs them
        # Ranges cuMemAddressReserve took: out of the holes, and only cuMemMap places
        # allocations in them (alloc with `at` there); an allocation's leaving gives nothing back.
        self.reserved = {}          # base -> length
        self.mapped = set()         # bases of allocations inside them
        self.ledger = None          # a DeviceLedger (gpu_server/device_ledger.py) every allocation is charged to

    def charge_to(self, ledger):
        """Charge the allocations held now, and every later one, to ledger, until it is closed."""
        ledger.charge(sum(self._length(n) for _, n in self.allocations()), "the allocations held")
        self.ledger = ledger

    def _length(self, nbytes):
        return -(-nbytes // self.align) * self.align

    def _charge(self, length, what):
        if self.ledger is not None:
            self.ledger.charge(length, what)

    def alloc(self, nbytes, at=None):
        """Reserve nbytes (rounded up to the alignment); `at` places it at a given address, a
        free one or one inside a reserved range (a mapping)."""
        if nbytes <= 0:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "allocation size must be positive")
        length = self._length(nbytes)
        if at is not None and self.reservation_of(at, length) is not None:
            return self._map(at, nbytes, length)
        want = self._fit(length, at)
        if want is not None:
            self._charge(length, "an allocation")     # placed, not yet taken: a refusal leaves nothing
            self._take(want, length)
            bisect.insort(self.bases, want)
            self.sizes[want] = nbytes
            return want
        where = "" if at is None else f" at {at:#x}"
        raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"no room for {nbytes} bytes{where}")

    def adopt(self, ptr, nbytes):
        """Record a range the device placed itself (a module global), so pointer checks accept it."""
        bisect.insort(self.bases, ptr)
        self.sizes[ptr] = nbytes
        self.external.add(ptr)

    def forget(self, ptr):
        """Drop a range the device placed (its module is gone), and the old address it answers to."""
        app = self.app_of.pop(ptr, None)
        if app is not None:
            del self.moved[app]
            self._moves = None
            self.forget(app)
        self.external.discard(ptr)
        self.sizes.pop(ptr, None)
        self.bases.remove(ptr)

    def alias(self, app, device, nbytes):
        """Let the application's old address of a restored module global reach where the device
        put it now (the driver places a module's globals itself). False when another range holds
        that address already: the application's old pointer is then stale."""
        ends = [self.find(app), self.find(app + max(nbytes, 1) - 1)]
        inside = bisect.bisect_left(self.bases, app) != bisect.bisect_left(self.bases, app + max(nbytes, 1))
        if any(ends) or inside:
            return False
        self.adopt(app, nbytes)
        self.moved[app], self.app_of[device] = device, app
        self._moves = None
        return True

    def to_device(self, ptr):
        """Where the device has the address ptr the application passed (itself, unless moved)."""
        if self.moved:
            hit = self.find(ptr)
            if hit is not None and hit[0] in self.moved:
                return self.moved[hit[0]] + ptr - hit[0]
        return ptr

    def to_app(self, ptr):
        """The address the application knows for a range's base the device reports."""
        return self.app_of.get(ptr, ptr)

    def relocations(self):
        """The moved globals as one Relocations (None if none moved), the same object until a
        global moves or goes: the compiled launch path keeps a copy while it is."""
        if not self.moved:
            return None
        if self._moves is None:
            self._moves = Relocations((app, app + max(self.sizes[app], 1), device) for app, device in self.moved.items())
        return self._moves

    def translate_words(self, blob):
        """A launch's parameters with every word that points into a moved global pointed at
        where it lies now (pointer arguments, and pointers inside by-value structs)."""
        words = np.frombuffer(blob, np.uint64, len(blob) // 8).copy()
        moves = self.relocations()
        if moves is not None:
            moves.apply(words)
        return words.tobytes() + bytes(blob[len(words) * 8:])

    def release(self, ptr):
        """Forget the allocation at ptr; returns its size."""
        if ptr not in self.sizes or ptr in self.external:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} is not an allocation of this context")
        nbytes = self.sizes.pop(ptr)
        self.bases.remove(ptr)
        if self.ledger is not None:
            self.ledger.refund(self._length(nbytes))
        if ptr in self.mapped:           # its range stays reserved
            self.mapped.discard(ptr)
            return nbytes
        self._give_back(ptr, self._length(nbytes))
        return nbytes

    def _give_back(self, ptr, length):
        bisect.insort(self.free, (ptr, length))
        merged = []
        for start, hole in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + hole)
            else:
                merged.append((start, hole))
        self.free = merged

    # -- reserved ranges (cuMemAddressReserve) and the mappings in them --------------------
    def reserve(self, nbytes, alignment=0, at=0):
        """Take a free range of nbytes (rounded up to the alignment) for mappings alone: at
        `at` if it is free there, else wherever one fits, aligned to `alignment`."""
        if nbytes <= 0 or (alignment & (alignment - 1)):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"cannot reserve {nbytes} bytes aligned to {alignment}")
        align = max(alignment, self.align)
        length = -(-nbytes // self.align) * self.align
        base = self._fit(length, at, align) if at and at % align == 0 else None
        if base is None:
            base = self._fit(length, None, align)
        if base is None:
            raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"no room to reserve {nbytes} bytes")
        self._take(base, length)
        self.reserved[base] = length
        return base

    def unreserve(self, base):
        """Give a reserved range back; nothing may be mapped in it."""
        length = self.reserved.get(base)
        if length is None:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{base:#x} is not the start of a reserved range")
        inside = [b for b in self.mapped if base <= b < base + length]
        if inside:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE,
                            f"the range at {base:#x} still has {len(inside)} mapping(s): unmap them first")
        del self.reserved[base]
        self._give_back(base, length)

    def reservation_of(self, ptr, nbytes):
        """The base of the reserved range holding [ptr, ptr+nbytes), or None."""
        for base, length in self.reserved.items():
            if base <= ptr and ptr + nbytes <= base + length:
                return base
        return None

    def adopt_reservation(self, base, length):
        """A restored context's reserved range again, around the mappings already placed in it."""
        if length <= 0 or base % self.align or length % self.align or any(
                b < base + length and base < b + n for b, n in self.reserved.items()):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"cannot reserve {length} bytes at {base:#x} again")
        self._take(base, length)
        self.mapped |= {b for b in self.bases if base <= b < base + length and b not in self.external}
        self.reserved[base] = length

    def _fit(self, length, at=None, align=None):
        """The base of a free range of length bytes: at `at` if it is free there, else the first
        one aligned to align (the space's own by default); None when there is none."""
        align = align or self.align
        for start, hole in self.free:
            base = at if at is not None else -(-start // align) * align
            if start <= base and base + length <= start + hole:
                return base
        return None

    def _take(self, base, length):
        """Take [base, base + length) out of the holes; the parts of them outside it stay holes."""
        free, end = [], base + length
        for start, hole in self.free:
            if start + hole <= base or start >= end:
                free.append((start, hole))
                continue
            if start < base:
                free.append((start, base - start))
            if start + hole > end:
                free.append((end, start + hole - end))
        self.free = free

    def _map(self, at, nbytes, length):
        if at % self.align:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a mapping at {at:#x} is not aligned to {self.align} bytes")
        i = bisect.bisect_left(self.bases, at)
        if self.find(at) is not None or (i < len(self.bases) and self.bases[i] < at + length):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{at:#x}+{nbytes} overlaps a mapping already there")
        self._charge(length, "a mapping")
        self.bases.insert(i, at)
        self.sizes[at] = nbytes
        self.mapped.add(at)
        return at

    def find(self, ptr):
        """(base, size) of the allocation holding ptr, or None."""
        i = bisect.bisect_right(self.bases, ptr) - 1
        if i >= 0:
            base = self.bases[i]
            if ptr < base + self.sizes[base]:
                return base, self.sizes[base]
        return None

    def check(self, ptr, nbytes, what="pointer"):
        """Raise unless [ptr, ptr+nbytes) lies inside one allocation (or mappings side by side)."""
        hit = self.find(ptr)
        if hit is None:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{what} {ptr:#x} is outside this context's allocations")
        base, size = hit
        end = base + size
        while ptr + nbytes > end and base in self.mapped and end in self.mapped:
            base = end                    # mappings side by side in a reserved range are one range, as in CUDA
            end = base + self.sizes[base]
        base, size = hit
        if ptr + nbytes > end:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE,
                            f"{what} {ptr:#x}+{nbytes} runs past the end of the {size}-byte allocation at {base:#x}")

    def used(self):
        return sum(n for b, n in self.sizes.items() if b not in self.external)

    def allocations(self):
        return [(b, self.sizes[b]) for b in self.bases if b not in self.external]
