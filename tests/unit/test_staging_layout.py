"""The staging layout of a checkpoint's copies (gpu_server/staging_layout.py): chunks at
16-byte boundaries, and one copy for neighbouring chunks only while they are of one region.
On the H200, one copy over two modules' globals whose addresses touched was refused
(CUDA_ERROR_INVALID_VALUE) and failed a handoff of a PyTorch process."""
from phos.gpu_server.staging_layout import FrozenLayout, copy_runs, stage_offsets

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


def test_a_frozen_copy_takes_regions_end_to_end_in_one_copy_inside_one_range():
    MiB = 1 << 20
    lo = 0x600000000000
    # three allocations end to end, one after a gap, one unaligned (the next starts elsewhere in
    # the copy), and two globals that touch, outside the range a copy may cross
    regions = [(lo, 2 * MiB), (lo + 2 * MiB, 4 * MiB), (lo + 6 * MiB, 2 * MiB), (lo + 10 * MiB, 2 * MiB),
               (lo + 12 * MiB, 100), (lo + 12 * MiB + 100, 2 * MiB), (0x7000, 16), (0x7010, 16)]
    layout = FrozenLayout(regions)
    dst, src, sizes = layout.runs(1 << 40, lo, lo + (1 << 30))
    assert src.tolist() == [lo, lo + 10 * MiB, lo + 12 * MiB + 100, 0x7000, 0x7010]
    assert sizes.tolist() == [8 * MiB, 2 * MiB + 100, 2 * MiB, 16, 16]
    assert dst.tolist() == layout.source(1 << 40, src).tolist()
    assert sum(sizes.tolist()) == sum(n for _, n in regions)       # every byte once
