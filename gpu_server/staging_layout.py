"""How a batch of chunks is copied out through a staging buffer on the device: where each
chunk goes in the buffer, and which chunks one copy can take together. Plain arithmetic,
apart from the driver (gpu_server/cuda.py, CudaSnapshotOps.read), and where a checkpoint's
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

    def runs(self, base, lo, hi):
        """The copies that fill a copy at `base`: (destinations, sources, sizes), one per run of
        regions that lie end to end both on the device and in the copy, inside [lo, hi): one
        range whose mappings a copy may cross (the driver refuses a copy over two of its own
        allocations, such as two modules' globals, even where their addresses touch)."""
        ends = self.starts + self.sizes
        inside = (self.starts >= np.uint64(lo)) & (ends <= np.uint64(hi))
        joined = np.zeros(len(self.starts), bool)       # region i continues region i - 1
        joined[1:] = ((self.starts[1:] == ends[:-1]) & (self.offsets[1:] == self.offsets[:-1] + self.sizes[:-1])
                      & inside[1:] & inside[:-1])
        first = np.flatnonzero(~joined)
        sizes = np.add.reduceat(self.sizes, first) if len(first) else np.zeros(0, np.uint64)
        return np.uint64(base) + self.offsets[first], self.starts[first], sizes.astype(np.uint64)

    def source(self, base, addrs):
        """The addresses in a copy at `base` of each of addrs (device addresses in the regions)."""
        a = np.asarray(addrs, np.uint64)
        r = self.order[np.searchsorted(self.sorted_starts, a, side="right") - 1]
        return np.uint64(base) + self.offsets[r] + (a - self.starts[r])
