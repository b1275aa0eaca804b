"""The staging layout of a checkpoint's copies (gpu_server/backends/staging_layout.py): chunks at
16-byte boundaries, and one copy for neighbouring chunks only while they are of one region.
On the H200, one copy over two modules' globals whose addresses touched was refused
(CUDA_ERROR_INVALID_VALUE) and failed a handoff of a PyTorch process."""
from phos.gpu_server.backends.staging_layout import FrozenLayout, copy_runs, join_runs, pieces, stage_offsets

GLOBAL_A, GLOBAL_B = 0x7F0000000100, 0x7F0000019100     # two modules' globals, side by side


def test_chunks_sit_at_16_byte_boundaries():
    offsets, used = stage_offsets([(0x1000, 4), (0x2000, 20), (0x3000, 16)])
    assert offsets == [0, 16, 48] and used == 64


def test_neighbouring_chunks_of_one_region_are_one_copy():
    chunks = [(0x1000, 16), (0x1010, 16), (0x1020, 16)]
    offsets, _ = stage_offsets(chunks)
    assert copy_runs(chunks, offsets, [(0x1000, 48)] * 3) == [[0x1000, 0, 48]]


def test_neighbouring_chunks_of_two_regions_are_two_copies():
    chunks = [(GLOBAL_A, 0x19000), (GLOBAL_B, 2016)]
    offsets, _ = stage_offsets(chunks)
    runs = copy_runs(chunks, offsets, [(GLOBAL_A, 0x19000), (GLOBAL_B, 2016)])
    assert runs == [[GLOBAL_A, 0, 0x19000], [GLOBAL_B, 0x19000, 2016]]


def test_chunks_apart_in_memory_or_in_the_batch_are_apart():
    chunks = [(0x1000, 8), (0x1010, 8)]                     # a gap of 8 bytes in memory
    offsets, _ = stage_offsets(chunks)
    assert len(copy_runs(chunks, offsets, [(0x1000, 32)] * 2)) == 2
    chunks = [(0x1000, 8), (0x1008, 8)]                     # touching in memory, not in the batch (16-byte slots)
    offsets, _ = stage_offsets(chunks)
    assert offsets == [0, 16] and len(copy_runs(chunks, offsets, [(0x1000, 16)] * 2)) == 2


def test_a_frozen_copy_takes_regions_end_to_end_in_one_copy():
    MiB = 1 << 20
    lo = 0x600000000000
    # three allocations end to end, one after a gap, one unaligned (the next starts elsewhere in
    # the copy), and two globals that touch (each at a 256-byte boundary of its own in the copy)
    regions = [(lo, 2 * MiB), (lo + 2 * MiB, 4 * MiB), (lo + 6 * MiB, 2 * MiB), (lo + 10 * MiB, 2 * MiB),
               (lo + 12 * MiB, 100), (lo + 12 * MiB + 100, 2 * MiB), (0x7000, 16), (0x7010, 16)]
    layout = FrozenLayout(regions)
    dst, src, sizes = layout.runs(1 << 40)
    assert src.tolist() == [lo, lo + 10 * MiB, lo + 12 * MiB + 100, 0x7000, 0x7010]
    assert sizes.tolist() == [8 * MiB, 2 * MiB + 100, 2 * MiB, 16, 16]
    assert dst.tolist() == layout.source(1 << 40, src).tolist()
    assert sum(sizes.tolist()) == sum(n for _, n in regions)       # every byte once


def test_pieces_split_copies_into_blocks_of_work_that_keep_their_alignment():
    table = pieces([0x10000, 0x20000, 0x30000], [0x50000, 0x60004, 0x70000], [40, 17, 0], 16)
    assert table.tolist() == [[0x10000, 0x50000, 16], [0x10010, 0x50010, 16], [0x10020, 0x50020, 8],
                              [0x20000, 0x60004, 16], [0x20010, 0x60014, 1],
                              [0x30000, 0x70000, 0]]
    big = pieces([1 << 40], [1 << 41], [(9 << 30) + 5], 4 << 20)
    assert len(big) == 2305 and int(big[:, 2].sum()) == (9 << 30) + 5
    assert (big[:, 0] - (1 << 40) == big[:, 1] - (1 << 41)).all()     # each piece at its own offset in both


def test_copies_that_follow_one_another_at_both_ends_join_but_not_across_a_break():
    dsts = [0x1000, 0x1010, 0x1020, 0x1030, 0x2000, 0x2010]
    srcs = [0x9000, 0x9010, 0x9020, 0x5000, 0x5010, 0x5020]       # the 4th starts elsewhere at the source
    sizes = [16] * 6
    d, s, n = join_runs(dsts, srcs, sizes)
    assert (d.tolist(), s.tolist(), n.tolist()) == ([0x1000, 0x1030, 0x2000], [0x9000, 0x5000, 0x5010], [48, 16, 32])
    d, s, n = join_runs(dsts, srcs, sizes, breaks=[0x1020])      # a pinned piece starts at 0x1020
    assert (d.tolist(), n.tolist()) == ([0x1000, 0x1020, 0x1030, 0x2000], [32, 16, 16, 32])
