"""A context's address space answering to a restored module global's old address: the device
placed the global elsewhere (the driver does, in each process), the application holds the old one."""
import numpy as np
import pytest

from phos.gpu_server.address_space import BASE, AddressSpace
from phos.schema.cuda_types import CudaError
from phos.snapshot.relocations import Relocations

OLD, NEW = 0x7E0000000100, 0x7F0000000100     # a 16-byte global: where it was, where it is now


def space_with_moved_global():
    space = AddressSpace(1 << 30, 256)
    space.adopt(NEW, 16)                      # the restored module's global, as the device placed it
    return space


def test_an_alias_reaches_the_moved_global_until_its_module_goes():
    space = space_with_moved_global()
    assert space.alias(OLD, NEW, 16)
    space.check(OLD + 8, 8)
    with pytest.raises(CudaError, match="runs past the end"):
        space.check(OLD + 8, 16)
    assert space.to_device(OLD + 8) == NEW + 8 and space.to_device(NEW + 8) == NEW + 8
    assert space.to_device(space.base) == space.base
    assert space.to_app(NEW) == OLD
    space.forget(NEW)                         # its module was unloaded
    assert space.moved == {} and space.find(OLD) is None and space.find(NEW) is None
    with pytest.raises(CudaError, match="outside this context's allocations"):
        space.check(OLD, 1)


@pytest.mark.parametrize("taken", [(OLD - 0x100, 0x1000), (OLD - 8, 16), (OLD + 8, 8)])
def test_an_old_address_another_range_holds_now_is_not_aliased(taken):
    space = space_with_moved_global()
    space.adopt(*taken)                       # the new process put something of its own there
    assert not space.alias(OLD, NEW, 16)
    assert space.moved == {} and space.to_app(NEW) == NEW


def test_a_launchs_words_into_a_moved_global_are_moved_and_nothing_else():
    space = space_with_moved_global()
    space.alias(OLD, NEW, 16)
    words = np.array([OLD, OLD + 8, OLD + 16, 5, space.base], np.uint64)
    tail = b"\x01\x02\x03\x04"                # an int after the last pointer
    out = space.translate_words(words.tobytes() + tail)
    assert np.frombuffer(out[:40], np.uint64).tolist() == [NEW, NEW + 8, OLD + 16, 5, space.base]
    assert out[40:] == tail


def test_a_launch_after_more_globals_moved_or_went_sees_the_change():
    space = space_with_moved_global()
    space.alias(OLD, NEW, 16)
    assert space.translate_words(np.array([OLD], np.uint64).tobytes()) == np.array([NEW], np.uint64).tobytes()
    space.adopt(NEW + 0x1000, 8)
    space.alias(OLD + 0x1000, NEW + 0x1000, 8)
    assert space.translate_words(np.array([OLD + 0x1004], np.uint64).tobytes()) == \
        np.array([NEW + 0x1004], np.uint64).tobytes()
    space.forget(NEW)
    assert space.translate_words(np.array([OLD], np.uint64).tobytes()) == np.array([OLD], np.uint64).tobytes()


# -- Relocations: thousands of moved globals, many words at once ----------------------------

def moved_one_by_one(words, ranges):
    """What Relocations must give: each word moved by the first range holding it, once."""
    out = []
    for w in words:
        hit = next(((lo, new) for lo, hi, new in ranges if lo <= w < hi), None)
        out.append(w - hit[0] + hit[1] if hit else w)
    return out


def test_relocations_move_each_word_by_its_range_among_thousands():
    rng = np.random.default_rng(7)
    starts = np.sort(rng.choice(1 << 30, 3000, replace=False)) * 64 + OLD
    ranges = [(int(lo), int(lo) + int(rng.integers(1, 64)), int(NEW + i * 4096)) for i, lo in enumerate(starts)]
    inside = [lo + (hi - lo) // 2 for lo, hi, _ in ranges[::7]]
    edges = [x for lo, hi, _ in ranges[::11] for x in (lo - 1, lo, hi - 1, hi)]
    words = inside + edges + [0, 5, 2**64 - 1, OLD - 1]
    rng.shuffle(words)
    have = np.array(words, np.uint64)
    assert Relocations(reversed(ranges)).apply(have)          # the order they come in does not matter
    assert have.tolist() == moved_one_by_one(words, ranges)


def test_a_word_moved_into_another_range_moves_once():
    r = Relocations([(100, 110, 200), (200, 210, 300)])
    words = np.array([105, 205, 99], np.uint64)
    assert r.apply(words) and words.tolist() == [205, 305, 99]


def test_overlapping_ranges_the_earlier_one_wins():
    ranges = [(100, 120, 1000), (110, 140, 2000), (90, 105, 3000), (95, 150, 4000)]
    words = list(range(85, 155))
    have = np.array(words, np.uint64)
    Relocations(ranges).apply(have)
    assert have.tolist() == moved_one_by_one(words, ranges)


def test_no_ranges_or_no_words_move_nothing():
    assert not Relocations(()).apply(np.array([1, 2], np.uint64))
    assert not Relocations([(1, 3, 10)]).apply(np.array([], np.uint64))
    assert not Relocations([(1, 3, 10)]).apply(np.array([3, 0], np.uint64))


# -- reserved ranges: what cuMemAddressReserve takes and cuMemMap places allocations in -----

MIB2 = 2 << 20


def test_a_reserved_range_takes_only_mappings_and_keeps_its_addresses():
    space = AddressSpace(64 * MIB2, MIB2, base=BASE)
    r = space.reserve(8 * MIB2)
    assert space.reservation_of(r, 8 * MIB2) == r
    a = space.alloc(MIB2)                                # plain allocations go elsewhere
    assert not r <= a < r + 8 * MIB2
    assert space.alloc(2 * MIB2, at=r + MIB2) == r + MIB2    # a mapping, where asked
    assert space.find(r + MIB2 + 5) == (r + MIB2, 2 * MIB2)
    with pytest.raises(CudaError, match="overlaps"):
        space.alloc(2 * MIB2, at=r + 2 * MIB2)
    with pytest.raises(CudaError, match="still has 1 mapping"):
        space.unreserve(r)
    space.release(r + MIB2)                              # unmapped: the range stays reserved
    assert space.reservation_of(r, 8 * MIB2) == r
    assert all(not (r <= s < r + 8 * MIB2) for s, _ in space.free)
    space.unreserve(r)
    assert space.reservation_of(r, 1) is None
    assert space.reserve(8 * MIB2, at=r) == r            # the range is free again: the wish is met


def test_a_restored_reservation_surrounds_the_mappings_recreated_in_it():
    space = AddressSpace(64 * MIB2, MIB2, base=BASE)
    r = BASE + 16 * MIB2
    space.alloc(MIB2, at=r + 3 * MIB2)                   # as a restore recreates allocations first
    space.adopt_reservation(r, 8 * MIB2)
    assert space.mapped == {r + 3 * MIB2}
    assert all(s + n <= r or s >= r + 8 * MIB2 for s, n in space.free)
    assert sum(n for _, n in space.free) == 64 * MIB2 - 8 * MIB2
    with pytest.raises(CudaError):
        space.adopt_reservation(r + MIB2, MIB2)          # it overlaps a reservation


@pytest.mark.parametrize("size, alignment", [(0, 0), (MIB2, 3 * MIB2), (1 << 40, 0)])
def test_a_reservation_that_cannot_be_made_is_refused(size, alignment):
    space = AddressSpace(64 * MIB2, MIB2, base=BASE)
    with pytest.raises(CudaError):
        space.reserve(size, alignment)
    assert space.free == [(BASE, 64 * MIB2)] and space.reserved == {}


def test_every_allocation_and_mapping_is_charged_to_the_ledger_first(tmp_path):
    """A tenant's ledger (PHOS_TENANT_QUOTA) takes each allocation and mapping, rounded as the
    space rounds it, before it is placed; a refused one leaves the space as it was; a release
    gives it back. Two spaces of one tenant share its quota."""
    from phos.gpu_server.device_ledger import tenant_ledger, tenant_name
    name = tenant_name("uid 1000")
    mine, other = AddressSpace(1 << 30, 256), AddressSpace(1 << 30, 256)
    held = mine.alloc(100)                        # held before the ledger: charged when it is given
    mine.charge_to(tenant_ledger(str(tmp_path), name, 4096))
    other.charge_to(tenant_ledger(str(tmp_path), name, 4096))
    assert mine.ledger.held == 256
    base = mine.reserve(2048)
    mine.alloc(1024, at=base)
    ptr = other.alloc(2000)                       # 2048 once rounded: 3328 of 4096 held
    with pytest.raises(CudaError, match=r"hold 3328 of its 4096 bytes \(PHOS_TENANT_QUOTA\)") as e:
        mine.alloc(1000)
    assert e.value.status == 2 and len(mine.allocations()) == 2      # CUDA_ERROR_OUT_OF_MEMORY, nothing placed
    with pytest.raises(CudaError, match="PHOS_TENANT_QUOTA"):
        mine.alloc(1024, at=base + 1024)          # a mapping too
    assert mine.ledger.free() == 768
    other.release(ptr)
    mine.release(held)
    assert mine.ledger.free() == 3072 and mine.alloc(3000)
    other.ledger.close()
    mine.ledger.close()
