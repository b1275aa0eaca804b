"""How a batch of chunks is copied out through a staging buffer on the device: where each
chunk goes in the buffer, and which chunks one copy can take together. Plain arithmetic,
apart from the driver (gpu_server/backends/cuda_snapshot.py, CudaSnapshotOps.read), and where a checkpoint's
copy of the context on the device holds each region (FrozenLayout)."""
import numpy as np


def stage_offsets(chunks):
    """Where each chunk of a batch goes in a staging buffer, and the bytes used: each at a
    16-byte boundary, so that the hash kernel reads it two words at a time (after a module's
    4-byte global it would read the next chunks a byte at a time)."""
    offsets, off = [], 0
    for _, size in chunks:
        offsets.append(off)
        off = -(-(off + size) // 16) * 16
    return offsets, (offsets[-1] + chunks[-1][1] if chunks else 0)


def copy_runs(chunks, offsets, regions):
    """[(address, offset in the batch, bytes)] of the runs of chunks that follow each other in
    memory and in the batch, inside one region (regions[i]: chunk i's allocation or global). The
    driver refuses one copy over two of its allocations even where their addresses touch, as
    two modules' globals can."""
    out, last = [], None
    for (addr, size), off, region in zip(chunks, offsets, regions):
        if out and region == last and out[-1][0] + out[-1][2] == addr and out[-1][1] + out[-1][2] == off:
            out[-1][2] += size
        else:
            out.append([addr, off, size])
        last = region
    return out


def join_runs(dsts, srcs, sizes, breaks=()):
    """Copies (destinations, sources, sizes) with each run of copies that follow one another at
    both ends made one, but never across an address of `breaks` at the destination (sorted: a
    host copy runs pinned only within one registration, CudaSnapshotOps.pin)."""
    dsts, srcs, sizes = (np.asarray(a, np.uint64) for a in (dsts, srcs, sizes))
    joined = np.zeros(len(sizes), bool)       # copy i continues copy i - 1
    joined[1:] = (dsts[1:] == dsts[:-1] + sizes[:-1]) & (srcs[1:] == srcs[:-1] + sizes[:-1])
    if len(breaks):
        piece = np.searchsorted(np.asarray(breaks, np.uint64), dsts, side="right")
        joined[1:] &= piece[1:] == piece[:-1]
    first = np.flatnonzero(~joined)
    total = np.add.reduceat(sizes, first) if len(first) else np.zeros(0, np.uint64)
    return dsts[first], srcs[first], total.astype(np.uint64)


def pieces(dsts, srcs, sizes, most):
    """The copies (destination, source, bytes) as an (n, 3) uint64 table of pieces of at most
    `most` bytes (a multiple of 16, so that a piece keeps its copy's alignment): one block of
    the copy kernel each (snapshot/kernels/copy_pieces.cu), so that a big region is shared
    out over the device."""
    dsts, srcs, sizes = (np.asarray(a, np.uint64) for a in (dsts, srcs, sizes))
    counts = np.maximum(1, (sizes + np.uint64(most - 1)) // np.uint64(most)).astype(np.int64)
    copy = np.repeat(np.arange(len(sizes)), counts)
    starts = np.cumsum(counts) - counts          # each copy's first piece
    at = (np.arange(len(copy)) - starts[copy]).astype(np.uint64) * np.uint64(most)
    table = np.empty((len(copy), 3), np.uint64)
    table[:, 0] = dsts[copy] + at
    table[:, 1] = srcs[copy] + at
    table[:, 2] = np.minimum(sizes[copy] - at, np.uint64(most))
    return table


class FrozenLayout:
    """Where a checkpoint's copy of the context (SnapshotOps.freeze) holds each region: the
    regions side by side, each at a 256-byte boundary, in the order given. source() finds the
    copy of any device address inside them."""

    def __init__(self, regions):
        rows = np.asarray(regions, np.uint64).reshape(-1, 2)
        self.starts, self.sizes = rows[:, 0], rows[:, 1]
        aligned = (self.sizes + np.uint64(255)) // np.uint64(256) * np.uint64(256)
        self.offsets = np.concatenate([np.zeros(1, np.uint64), np.cumsum(aligned, dtype=np.uint64)[:-1]])
        self.nbytes = int(aligned.sum())
        self.order = np.argsort(self.starts, kind="stable")     # moved regions break the address order
        self.sorted_starts = self.starts[self.order]

    def runs(self, base):
        """The copies that fill a copy at `base`: (destinations, sources, sizes), one per run of
        regions that lie end to end both on the device and in the copy. For a kernel's copy
        (pieces): the driver's own copies refuse to cross two of its allocations, such as two
        modules' globals, even where their addresses touch."""
        return join_runs(np.uint64(base) + self.offsets, self.starts, self.sizes)

    def source(self, base, addrs):
        """The addresses in a copy at `base` of each of addrs (device addresses in the regions)."""
        a = np.asarray(addrs, np.uint64)
        r = self.order[np.searchsorted(self.sorted_starts, a, side="right") - 1]
        return np.uint64(base) + self.offsets[r] + (a - self.starts[r])
