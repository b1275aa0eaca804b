"""HostStore: an image store in shared host memory (snapshot/host_store.py). The image format's
own checks run on it in test_snapshot_image.py (its `store` fixture); checkpoints and restores
through servers in test_snapshot_engine.py. Here: what is its own, slots shared by processes."""
import os
import subprocess
import sys

import numpy as np
import pytest

from phos.snapshot import DirStore, HostStore, ImageWriter, gc, open_store, read_chunk
from phos.snapshot.host_store import INDEX_FILE, RECORD, parse_size
from phos.snapshot.fingerprint import fingerprint
from phos.snapshot.image import ImageError, chunk_blob_parts

SLOT = 8192


@pytest.fixture
def store(tmp_path):
    return HostStore.create(tmp_path / "host", 16 * (4096 + SLOT), capacity=SLOT)


def chunk(seed):
    return np.random.default_rng(seed).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


def add(store, *seeds):
    with ImageWriter(store, f"scratch{seeds[0]}", level=None) as w:
        return [w.add_chunk(chunk(s)) for s in seeds]


def test_open_store_tells_the_kinds_apart_and_keeps_one_mapping(tmp_path, store):
    assert isinstance(open_store(tmp_path / "plain"), DirStore) and not isinstance(open_store(tmp_path / "plain"), HostStore)
    assert open_store(store.path) is store        # one mapping per process: a worker pins it once
    with pytest.raises(ImageError, match="already holds a host store"):
        HostStore.create(store.path, 1 << 20)


def test_a_full_store_says_so_and_reserves_nothing(store):
    keys = add(store, *range(10))
    with pytest.raises(ImageError, match=r"is full: 7 more chunks .* 10 of its 16 slots are in use"):
        store.reserve(7)
    assert store.stats()["free_slots"] == 6
    assert [read_chunk(store, k) for k in keys] == [chunk(s) for s in range(10)]


def test_a_chunk_written_twice_is_stored_once(store):
    first = add(store, 1)
    slot, = store.reserve(1)
    store.payload(slot, SLOT)[:] = np.frombuffer(chunk(1), np.uint8)
    with ImageWriter(store, "again", level=None) as w:
        assert w.add_slots([slot], [store.payload(slot, SLOT)], [fingerprint(chunk(1))]) == first
        assert w.stats()["new_chunks"] == 0 and w.stats()["reused_chunks"] == 1
    assert store.stats()["chunks"] == 1 and store.stats()["free_slots"] == 15
    slots = store.reserve(3)                   # twice in one call, beside a new one
    for slot, s in zip(slots, (2, 3, 2)):
        store.payload(slot, SLOT)[:] = np.frombuffer(chunk(s), np.uint8)
    with ImageWriter(store, "twice", level=None) as w:
        fps = [fingerprint(chunk(s)) for s in (2, 3, 2)]
        keys = w.add_slots(slots, [store.payload(slot, SLOT) for slot in slots], fps)
        assert keys[0] == keys[2] and w.stats()["new_chunks"] == 2 and w.stats()["reused_chunks"] == 1
    assert store.stats()["chunks"] == 3 and store.stats()["free_slots"] == 13
    assert read_chunk(store, keys[0]) == chunk(2) and read_chunk(store, keys[1]) == chunk(3)


CHILD = """
import os, sys
from phos.snapshot import ImageWriter, open_store
store = open_store(sys.argv[1])
with ImageWriter(store, "child", level=None) as w:
    print(w.add_chunk(bytes(range(256)) * 32), flush=True)
store.reserve(int(sys.argv[2]))      # and die holding these
os._exit(0)
"""


def test_processes_share_chunks_and_a_dead_writers_reservations_come_back(store):
    out = subprocess.run([sys.executable, "-c", CHILD, store.path, "12"], capture_output=True, text=True, check=True)
    key = out.stdout.strip()
    assert store.has_chunk(key) and read_chunk(store, key) == bytes(range(256)) * 32
    assert store.stats()["free_slots"] == 3          # 1 published, 12 reserved by a process now gone
    assert len(store.reserve(10)) == 10              # short of slots: the dead writer's come back
    store.release(store.reserve(3))
    subprocess.run([sys.executable, "-c", CHILD, store.path, "3"], check=True, capture_output=True)
    assert store.stats()["free_slots"] == 2          # 10 ours, 3 the second child's (its chunk was there)
    gc(store)                                        # garbage collection gives them back too
    assert store.stats()["free_slots"] == 2 + 3 + 1 and not store.list_chunks()    # and the chunk: in no image


def test_a_writers_own_changes_keep_its_map_current_and_others_are_still_seen(store):
    """A checkpoint publishes a batch at a time: its own changes must not make the next
    publish read the index again, while another opening's changes still reach it."""
    add(store, 1)
    store.refresh()
    store.release(store.reserve(2))
    mine = add(store, 2)                       # reserve and publish, as a checkpoint does
    assert store._seen == store._seq()         # nothing left for _refresh to read
    other = HostStore(store.path)              # another process's mapping
    theirs = add(other, 3)
    deleted = add(other, 4)
    other.delete_chunk(deleted[0])
    assert store._seen < store._seq()
    assert store.missing(mine + theirs + deleted) == set(deleted) and read_chunk(store, theirs[0]) == chunk(3)


def test_deleted_chunks_free_their_slots(store):
    keys = add(store, 1, 2, 3)
    store.delete_chunk(keys[1])
    assert store.missing(keys) == {keys[1]} and store.stats()["free_slots"] == 14
    with pytest.raises(ImageError, match="missing"):
        read_chunk(store, keys[1])
    assert HostStore(store.path).missing(keys) == {keys[1]}       # another opening sees the same
    with pytest.raises(ImageError, match="invalid chunk key"):      # checked where the index lacks it
        store.missing(keys + ["../../etc/passwd"])


def test_a_damaged_index_or_arena_is_refused_clearly(tmp_path, store):
    index = os.path.join(store.path, INDEX_FILE)
    with open(index, "r+b") as f:
        f.write(b"NOTPHOS!")
    with pytest.raises(ImageError, match="not a phos host store index"):
        HostStore(store.path)
    with open(index, "r+b") as f:
        f.write(b"PHOSHOST\x07")
    with pytest.raises(ImageError, match="index version 7"):
        HostStore(store.path)
    with open(index, "r+b") as f:
        f.write(b"PHOSHOST\x01")
        f.truncate(os.path.getsize(index) - RECORD.itemsize)
    with pytest.raises(ImageError, match="not what 16 slots need"):
        HostStore(store.path)
    other = HostStore.create(tmp_path / "other", 4 * (4096 + SLOT), capacity=SLOT)
    os.truncate(os.path.join(other.path, "arena"), 4096)
    with pytest.raises(ImageError, match="arena is 4096 bytes"):
        HostStore(other.path)


def test_a_slot_too_small_for_the_chunk_is_a_clear_error(store):
    slot, = store.reserve(1)
    with pytest.raises(ImageError, match="does not fit the host store's 8192-byte slots"):
        store.payload(slot, SLOT + 8)


@pytest.mark.parametrize("text, size", [("40G", 40 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_a_bad_size_is_a_clear_error():
    with pytest.raises(ValueError, match="expected a number of bytes"):
        parse_size("lots")


def test_the_servers_options_make_or_find_the_store(tmp_path):
    import argparse
    from phos.cli import host_store_option
    opts = lambda **kw: argparse.Namespace(**{"host_store": None, "host_memory": None, **kw})     # noqa: E731
    assert host_store_option(opts()) is None
    with pytest.raises(SystemExit, match="--host-memory needs --host-store"):
        host_store_option(opts(host_memory="1G"))
    where = str(tmp_path / "host")
    with pytest.raises(SystemExit, match="holds no host store; give --host-memory"):
        host_store_option(opts(host_store=where))
    with pytest.raises(SystemExit, match="expected a number of bytes"):
        host_store_option(opts(host_store=where, host_memory="big"))
    assert host_store_option(opts(host_store=where, host_memory="16M")) == where
    assert HostStore(where).slots == 7 and host_store_option(opts(host_store=where)) == where


def test_a_store_bigger_than_its_file_system_is_refused_at_once(tmp_path):
    """Its memory is allocated when it is made: a sparse arena on a full /dev/shm would kill
    the worker that first touched a missing page."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ImageError, match="cannot be allocated there"):
        HostStore.create(tmp_path / "huge", free + (64 << 30))
    assert not os.path.exists(tmp_path / "huge" / "arena") and not os.path.exists(tmp_path / "huge" / INDEX_FILE)


def test_a_chunk_bigger_than_a_slot_is_kept_in_a_file(store, monkeypatch):
    """A module's image may be bigger than a slot: it goes to a file, as a DirStore keeps it,
    and reads, lists, counts and deletes like any chunk. A store without such files answers
    which chunks it lacks from its index alone."""
    big = np.random.default_rng(5).integers(0, 256, 3 * SLOT + 1, dtype=np.uint8).tobytes()
    small, = add(store, 1)
    with monkeypatch.context() as m:
        m.setattr(DirStore, "missing", lambda *a: pytest.fail("looked for chunk files in a store without any"))
        assert store.missing([small, "0" * 32]) == {"0" * 32}
    with ImageWriter(store, "module", level=None) as w:
        key = w.add_chunk(big)
    assert os.path.isfile(os.path.join(store.path, "chunks", key[:2], key))
    assert read_chunk(store, key) == big and store.source(key) is None
    assert store.missing([key, small, "0" * 32]) == {"0" * 32}
    assert store.list_chunks() == sorted([key, small])
    assert store.stats()["chunks"] == 2 and store.stats()["free_slots"] == 15
    store.delete_chunk(key)
    assert store.missing([key]) == {key} and store.list_chunks() == [small]


def test_a_chunk_reads_as_the_buffers_it_lies_in(store, tmp_path):
    """chunk_blob_parts (what a handoff sends): a slot's header and a view of its payload, no
    copy; a chunk kept in a file, or in a DirStore, is read whole. Either way, the blob."""
    key, = add(store, 1)
    header, payload = chunk_blob_parts(store, key)
    assert np.shares_memory(np.frombuffer(payload, np.uint8), store.memory)
    assert header + bytes(payload) == store.get_chunk(key)
    big = np.random.default_rng(5).integers(0, 256, 3 * SLOT + 1, dtype=np.uint8).tobytes()
    with ImageWriter(store, "module", level=None) as w:
        in_file = w.add_chunk(big)
    plain = DirStore(tmp_path / "plain")
    with ImageWriter(plain, "one", level=None) as w:
        w.add_chunk(chunk(1))
    assert chunk_blob_parts(store, in_file) == [store.get_chunk(in_file)]
    assert chunk_blob_parts(plain, key) == [store.get_chunk(key)]


def test_a_chunk_size_over_the_slots_is_refused_before_anything_is_copied(store):
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.session import Session
    from phos.schema.cuda_types import CudaError
    from phos.snapshot.engine import Checkpoint
    s = Session(EmuBackend(), 7, b"t" * 16)
    s.backend.alloc(1 << 20)
    with pytest.raises(CudaError, match="chunk size 65536 is over the 8192-byte slots of the host store"):
        Checkpoint(s, store, "big", chunk_size=1 << 16)
    assert store.stats()["free_slots"] == 16 and not store.list_images()


def test_a_store_made_again_at_the_same_path_is_mapped_again(tmp_path, store):
    import shutil
    add(store, 1)
    shutil.rmtree(store.path)
    again = HostStore.create(store.path, 4 * (4096 + SLOT), capacity=SLOT)
    assert again is not store and open_store(store.path) is again and again.slots == 4 and not again.list_chunks()


def test_a_bad_store_leaves_no_file_open(tmp_path, store):
    os.truncate(os.path.join(store.path, "arena"), 4096)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(ImageError, match="arena is 4096 bytes"):
            HostStore(store.path)
    assert len(os.listdir("/proc/self/fd")) == before
