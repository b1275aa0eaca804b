"""How a batch of chunks is copied out through a staging buffer on the device: where each
chunk goes in the buffer, and which chunks one copy can take together. Plain arithmetic,
apart from the driver (gpu_server/cuda.py, CudaSnapshotOps.read)."""


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
