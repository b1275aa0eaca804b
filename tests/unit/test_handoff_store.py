"""Where a handoff's rounds go (gpu_server/control/handoff_store.py), on a real HostStore shared with
other images: the rounds the target holds already are dropped while the handoff goes on."""
import os

import numpy as np
import pytest

from phos.gpu_server.control.handoff_store import HandoffStore
from phos.snapshot import HostStore, read_image
from test_snapshot_image import CS, write_image

CHUNKS = 12


def contents(changed, seed):
    """One region of CHUNKS chunks; those in `changed` hold new bytes (seed), the rest stay."""
    rng = np.random.default_rng(seed)
    data = bytearray(np.random.default_rng(0).integers(0, 256, CHUNKS * CS, dtype=np.uint8).tobytes())
    for i in changed:
        data[i * CS:(i + 1) * CS] = rng.integers(0, 256, CS, dtype=np.uint8).tobytes()
    return {0x7F0000000000: bytes(data)}


@pytest.fixture
def rounds(tmp_path):
    """A host store holding another context's image, and a handoff's three rounds, each
    changing a few chunks of the one before."""
    host = HostStore.create(tmp_path / "host", 64 * (4096 + 8192), capacity=8192)
    write_image(host, "ctx9-0001", contents(range(CHUNKS), seed=9))
    hs = HandoffStore(1, "", host.path)
    names = [hs.round_name(i) for i in range(3)]
    parent = None
    for i, name in enumerate(names):
        write_image(host, name, contents(range(3 * i, 3 * i + 3), seed=i + 1), parent=parent)
        parent = name
    return host, hs, names


def test_dropping_the_earlier_rounds_frees_what_only_they_named(rounds):
    host, hs, names = rounds
    before = len(host.list_chunks())
    hs.drop_rounds_before(names[1])       # round 0: round 1 names what it kept of it
    assert sorted(host.list_images()) == sorted(["ctx9-0001", names[1], names[2]])
    assert len(host.list_chunks()) == before - 3        # the chunks round 0 alone had
    for name in ("ctx9-0001", names[1], names[2]):
        read_image(host, name)                            # whole: every chunk it names is there, and sound
    hs.remove()
    assert host.list_images() == ["ctx9-0001"]
    read_image(host, "ctx9-0001")


def test_a_round_a_restore_reads_stays_until_the_handoff_is_removed(rounds):
    host, hs, names = rounds
    with host.reading(names[0]):
        hs.drop_rounds_before(names[2])
        assert names[0] in host.list_images()
        read_image(host, names[0])
    hs.remove()
    assert host.list_images() == ["ctx9-0001"]


def test_dropping_rounds_of_a_store_that_went_says_so_and_makes_none(rounds, caplog):
    host, hs, names = rounds
    hs.path = str(host.path) + "-gone"
    hs.drop_rounds_before(names[2])
    assert "could not drop the handoff's earlier rounds" in caplog.text
    assert not os.path.exists(hs.path)
    assert len(host.list_images()) == 4
