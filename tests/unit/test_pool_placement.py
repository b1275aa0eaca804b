"""The pool's placement policies (phos/pool/placement.py)."""
import pytest

from phos.pool.placement import NoRoom, choose

GiB = 1 << 30


def server(address, free, contexts=0, state="up", max_contexts=0):
    return {"address": address, "free": free, "contexts": contexts, "state": state, "max_contexts": max_contexts}


def test_most_free_takes_the_server_with_the_most_free_memory_then_the_fewest_contexts():
    pool = [server("a", 4 * GiB, 1), server("b", 8 * GiB, 3), server("c", 8 * GiB, 2)]
    assert choose(pool, "most-free")["address"] == "c"


def test_pack_fills_the_fullest_server_that_still_has_room():
    pool = [server("a", 4 * GiB, 1), server("b", 8 * GiB, 3), server("c", 0, 9), server("d", 4 * GiB, 2)]
    assert choose(pool, "pack")["address"] == "d"


def test_servers_without_room_draining_or_excluded_are_passed_over():
    pool = [server("a", 8 * GiB, state="draining"), server("b", 8 * GiB, state="lost"), server("c", 8 * GiB, 4, max_contexts=4),
            server("d", 2 * GiB), server("e", 16 * GiB)]
    assert choose(pool, "most-free", exclude={"e"})["address"] == "d"
    with pytest.raises(NoRoom, match="no server has room"):
        choose(pool[:3], "most-free")


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="most-free, pack"):
        choose([server("a", GiB)], "spread")


def test_frees_a_few_mib_apart_tie_so_a_burst_spreads_by_contexts():
    """The controller's view of free memory lags a burst of new contexts by a poll: a server
    with 3 MiB more free would otherwise take them all."""
    pool = [server("a", 8 * GiB + (3 << 20), 2), server("b", 8 * GiB, 0), server("c", 8 * GiB + (1 << 20), 1)]
    assert choose(pool, "most-free")["address"] == "b"
    assert choose(pool, "pack")["address"] == "a"


def test_contexts_placed_since_a_servers_snapshot_count_against_its_free_memory():
    """A server whose snapshot lags (a slow poll) still shows the memory the others' snapshots
    show taken by the burst's first contexts: each context placed there since counts a step
    less free, so the burst does not all go to it."""
    stale, fresh = server("a", 16 * GiB, 2), server("b", 16 * GiB - (300 << 20), 2)
    stale["unpolled"] = 2                       # both of its contexts came after its snapshot
    assert choose([stale, fresh], "most-free")["address"] == "b"
    stale["unpolled"] = 0
    assert choose([stale, fresh], "most-free")["address"] == "a"
