"""Snapshot storage layer: fingerprint, image format, stores, verification on read."""
import json
import os
import random
import re
import threading

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import phos.snapshot.fingerprint as fpmod
from phos.snapshot.fingerprint import fingerprint, fingerprints, reference_fingerprint
from phos.snapshot.image import (HEADER, HEADER_SIZE, ImageError, ImageWriter, decode_chunk, decode_manifest,
                                 delete_image, encode_chunk, encode_manifest, gc, latest_image, manifest_digest,
                                 put_received_chunk, put_received_manifest, read_chunk, read_chunk_into, read_image,
                                 read_region, validate_manifest)
from phos.snapshot.host_store import HostStore
from phos.snapshot.store import DirStore, MemoryStore

# ------------------------------------------------------------------ fingerprint

KNOWN = {
    b"": "3338822534e18f2973c2cd5f9cdfc9dd",
    bytes(range(256)) * 17: "b3ec6b17740d8ce79967b02b3c9e55e3",
}


def test_fingerprint_known_answers():
    for data, hexfp in KNOWN.items():
        assert fingerprint(data).hex() == hexfp
        assert reference_fingerprint(data).hex() == hexfp


def test_fingerprint_matches_word_at_a_time_reference():
    rng = random.Random(1)
    for n in list(range(0, 70)) + [1000, 8191 * 8 + 3, fpmod.BLOCK_WORDS * 8 * 2 + 5]:
        data = rng.randbytes(n)
        assert fingerprint(data) == reference_fingerprint(data), n


def test_fingerprint_deterministic_and_buffer_types():
    data = os.urandom(100_003)
    fp = fingerprint(data)
    assert len(fp) == 16
    assert fingerprint(data) == fp
    assert fingerprint(bytearray(data)) == fp
    assert fingerprint(memoryview(data)) == fp
    assert fingerprint(np.frombuffer(data, dtype=np.uint8)) == fp
    assert fingerprint(np.frombuffer(data[:100_000], dtype=np.uint32)) == fingerprint(data[:100_000])


def test_fingerprint_single_bit_flips():
    rng = random.Random(2)
    for size in (1, 8, 13, 4096, 1 << 20):
        data = bytearray(rng.randbytes(size))
        base = fingerprint(data)
        for _ in range(40 if size > 8 else 8 * size):
            bit = rng.randrange(size * 8)
            data[bit // 8] ^= 1 << (bit % 8)
            assert fingerprint(data) != base, (size, bit)
            data[bit // 8] ^= 1 << (bit % 8)
        assert fingerprint(data) == base


def test_fingerprint_word_reorder_and_length():
    rng = random.Random(3)
    words = np.frombuffer(rng.randbytes(8 * 512), dtype="<u8").copy()
    base = fingerprint(words)
    for _ in range(50):
        i, j = rng.sample(range(512), 2)
        w = words.copy()
        w[i], w[j] = w[j], w[i]
        assert fingerprint(w) != base
    assert fingerprint(words[::-1].copy()) != base
    # zero padding: same words after padding, different lengths
    assert fingerprint(b"ab") != fingerprint(b"ab\0")
    assert fingerprint(b"ab") != fingerprint(b"ab" + bytes(6))
    z = bytes(4096)
    assert len({fingerprint(z[:n]) for n in range(0, 4097, 1)}) == 4097
    assert fingerprint(words.tobytes()) != fingerprint(words.tobytes() + bytes(8))


def test_fingerprints_chunks():
    data = os.urandom(10 * 4096 + 123)
    fps = fingerprints(data, 4096)
    assert len(fps) == 11
    assert fps == [fingerprint(data[o:o + 4096]) for o in range(0, len(data), 4096)]
    assert fingerprints(b"", 4096) == []
    # the same chunk contents at a different offset have the same fingerprint
    assert fingerprints(data[:4096] * 3, 4096) == [fps[0]] * 3


# ------------------------------------------------------------------ stores and images

@pytest.fixture(params=["dir", "memory", "host"])
def store(request, tmp_path):
    if request.param == "host":       # slots of 8 KiB: a 4 KiB chunk, or a tampered longer blob
        return HostStore.create(tmp_path / "store", 1024 * (4096 + 8192), capacity=8192)
    return DirStore(tmp_path / "store") if request.param == "dir" else MemoryStore()


def set_chunk_blob(store, key, blob):
    if isinstance(store, MemoryStore):
        store._chunks[key] = bytes(blob)
    elif isinstance(store, HostStore):        # the slot's header and payload, and the index's length
        slot, blob = store._slot(key), bytes(blob)
        start = slot * store.slot_bytes
        store.memory[start:start + min(len(blob), HEADER_SIZE)] = np.frombuffer(blob[:HEADER_SIZE], np.uint8)
        payload = np.frombuffer(blob[HEADER_SIZE:], np.uint8)
        store.memory[start + store.head:start + store.head + len(payload)] = payload
        store._records["length"][slot] = len(blob)
    else:
        with open(store._chunk_path(key), "wb") as f:
            f.write(blob)


def remove_chunk(store, key):
    store.delete_chunk(key)


def set_manifest(store, name, raw, digest=None):
    if isinstance(store, MemoryStore):
        store._images[name] = (bytes(raw), store._images[name][1] if digest is None else digest)
    else:
        mpath, dpath = store._image_paths(name)
        with open(mpath, "wb") as f:
            f.write(raw)
        if digest is not None:
            with open(dpath, "wb") as f:
                f.write(digest)


CS = 4096


def make_contents(seed=0):
    rng = np.random.default_rng(seed)
    return {
        0x7F0000000000: rng.integers(0, 256, 50 * CS, dtype=np.uint8).tobytes(),        # 50 chunks
        0x7F0000200000: bytes(3 * CS + 100),                                           # zeros, partial last
        0x7F0000400000: (np.arange(2500, dtype=np.float32) * 0.5).tobytes(),           # compressible floats
        0x7F0000600000: b"",
    }


def write_image(store, name, contents, parent=None, key=None, globals_data=b"\x01\x02\x03\x04" * 5):
    with ImageWriter(store, name, parent=parent, key=key) as w:
        ptx = b"//\n.version 8.0\n.target sm_90\n.visible .entry axpy(.param .u64 x)\n{ ret; }\n"
        mod_key = w.add_chunk(ptx)
        allocs = [{"address": a, "size": len(d), "chunk_size": CS, "chunks": w.add_region(d, CS)}
                  for a, d in contents.items()]
        man = w.commit({
            "backend": "emu",
            "device": {"name": "NVIDIA H200", "uuid": "0123456789abcdef0123456789abcdef",
                       "cc": [9, 0], "total_mem": 150 << 30},
            "address_space": {"base": 0x7F0000000000, "size": 1 << 36},
            "cut_seq": 1234,
            "modules": [{"id": 1, "name": "axpy.ptx", "kind": "ptx", "image": mod_key, "size": len(ptx)}],
            "functions": [{"id": 2, "module": 1, "name": "axpy", "params": [[0, 8], [8, 4], [16, 8]]}],
            "globals": [{"module": 1, "name": "counter", "address": 0x7E0000000000, "size": len(globals_data),
                         "chunk_size": CS, "chunks": w.add_region(globals_data, CS)}],
            "streams": [{"id": 3, "flags": 1, "priority": -1}],
            "events": [{"id": 4, "flags": 2}],
            "allocations": allocs,
            "error": {"status": 0, "message": ""},
            "session": {"ctx": 7, "token": "ab" * 32, "next_id": 0x1005},
            "metadata": {"paused": False, "pause_ms": 0.25, "recopied_chunks": 0, "mode": "concurrent"},
        })
    return man, w


def test_round_trip(store):
    contents = make_contents()
    man, w = write_image(store, "ctx1-0001", contents)
    assert w.new_chunks > 0
    got = read_image(store, "ctx1-0001")
    assert got.to_dict() == man.to_dict()
    assert got.name == "ctx1-0001" and got.parent is None and got.version == 2
    assert got.format == "phos-image" and got.cut_seq == 1234 and got.backend == "emu"
    assert got.device["cc"] == [9, 0]
    assert got.functions[0]["params"] == [[0, 8], [8, 4], [16, 8]]
    assert got.metadata["mode"] == "concurrent"
    for e in got.allocations:
        assert bytes(read_region(store, e)) == contents[e["address"]]
    assert bytes(read_region(store, got.globals[0])) == b"\x01\x02\x03\x04" * 5
    assert read_chunk(store, got.modules[0]["image"], expected_len=got.modules[0]["size"]).startswith(b"//")
    assert store.list_images() == ["ctx1-0001"]
    st_ = store.stats()
    assert st_["chunks"] == len(store.list_chunks()) and st_["images"] == 1
    # the floats and zeros compressed: fewer bytes stored than raw
    assert st_["chunk_bytes"] < sum(len(d) for d in contents.values()) + 60 * HEADER_SIZE
    # the manifest is a Manifest message (schema/image.capnp) that names its format and version
    raw, digest = store.get_manifest("ctx1-0001")
    d = decode_manifest(raw)
    assert d["format"] == "phos-image" and d["version"] == 2 and encode_manifest(d) == raw
    assert digest.startswith(b"blake2b-256:")
    # an existing image is never overwritten
    with pytest.raises(ImageError, match="already exists"):
        ImageWriter(store, "ctx1-0001")


@pytest.mark.parametrize("kind", ["dir", "host"])
def test_two_checkpoints_committing_one_name_at_once_one_wins_and_the_other_is_refused(tmp_path, kind):
    """Two writers (two workers, each with its own view of the store) both begin an image of one
    name, and the second commits while the first is between its check and its commit: exactly
    one commits, and the other is refused by name; the image is the winner's, not replaced."""
    path = tmp_path / "store"
    if kind == "host":
        HostStore.create(path, 1024 * (4096 + 8192), capacity=8192)
    a, b = (HostStore(path), HostStore(path)) if kind == "host" else (DirStore(path), DirStore(path))
    outcome = {}

    def commit(store, who, seed):
        try:
            outcome[who] = write_image(store, "same", make_contents(seed))[0]
        except ImageError as e:
            outcome[who] = e

    put = a.put_manifest

    def a_commits(name, manifest, digest):      # b's whole commit runs as a is about to put its manifest
        other = threading.Thread(target=commit, args=(b, "b", 1))
        other.start()
        other.join(2)      # where b must wait for a (the fix), it cannot finish meanwhile
        put(name, manifest, digest)
        outcome["b thread"] = other
    a.put_manifest = a_commits
    commit(a, "a", 0)
    outcome.pop("b thread").join()
    won = [who for who in "ab" if not isinstance(outcome[who], ImageError)]
    assert len(won) == 1, outcome
    lost = outcome["b" if won == ["a"] else "a"]
    assert "'same' already exists" in str(lost) and "another checkpoint" in str(lost)
    assert read_image(DirStore(path) if kind == "dir" else HostStore(path), "same").raw == outcome[won[0]].raw


def test_a_store_whose_directories_are_links_or_open_to_others_is_refused(tmp_path):
    """Files are opened without following links, and the store's directories must not be links
    either: chunks (tenant bytes) and manifests went wherever they led. Nor may another user
    write in them, nor may its lock file be a link (a dangling one had its target made)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = tmp_path / "store"
    DirStore(path)
    for xx in (f"{i:02x}" for i in range(256)):        # every chunk's subdirectory leads elsewhere
        (elsewhere / xx).mkdir()
        (path / "chunks" / xx).symlink_to(elsewhere / xx)
    with pytest.raises(ImageError, match=r"chunks/[0-9a-f]{2} is a symbolic link: refused"):
        write_image(DirStore(path), "img", make_contents())
    assert [f for f in elsewhere.rglob("*") if f.is_file()] == []       # no chunk landed there

    images = tmp_path / "images-link"
    DirStore(images)
    (images / "images").rename(elsewhere / "images")
    (images / "images").symlink_to(elsewhere / "images")
    with pytest.raises(ImageError, match=r"images is a symbolic link: refused"):
        DirStore(images)

    locked = tmp_path / "lock-link"
    DirStore(locked)
    (locked / ".lock").symlink_to(elsewhere / "made-by-the-lock")
    with pytest.raises(ImageError, match=r"lock file .* is a symbolic link: refused"):
        write_image(DirStore(locked), "img", make_contents())
    assert not (elsewhere / "made-by-the-lock").exists()

    shared = tmp_path / "shared"
    DirStore(shared)
    for d, mode in ((shared, 0o777), (shared / "chunks", 0o775)):
        d.chmod(mode)
        with pytest.raises(ImageError, match="writable by other users"):
            DirStore(shared)
        d.chmod(0o755)
    if os.geteuid() == 0:               # root can give it to another user
        os.chown(shared / "images", 65534, 65534)
        with pytest.raises(ImageError, match="belongs to uid 65534"):
            DirStore(shared)


def test_a_checkpoint_that_fails_for_want_of_room_leaves_no_chunks(tmp_path):
    """Its chunks went only at a later deletion's garbage collection, keeping the room."""
    import errno
    store = DirStore(tmp_path / "store")
    kept, _ = write_image(store, "kept", make_contents(0))
    held = set(store.list_chunks())

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")
    store.put_manifest = full
    with pytest.raises(OSError, match="No space left"):
        write_image(store, "failed", make_contents(1))
    assert set(store.list_chunks()) == held
    assert read_image(store, "kept").raw == kept.raw


def test_a_killed_writers_temporary_files_go_at_the_next_collection(tmp_path):
    store = DirStore(tmp_path / "store")
    write_image(store, "kept", make_contents())
    sub = tmp_path / "store" / "chunks" / store.list_chunks()[0][:2]
    leftovers = [sub / ".tmp-killed", tmp_path / "store" / "images" / ".tmp-killed"]
    for f in leftovers:
        f.write_bytes(b"half a chunk")
    with store.session():              # a live writer's may be its own: kept
        assert gc(store) is None and all(f.exists() for f in leftovers)
    assert gc(store) is not None
    assert not any(f.exists() for f in leftovers)
    assert read_image(store, "kept").name == "kept"


def test_incremental_stores_only_changed_chunk(store):
    contents = make_contents()
    write_image(store, "base", contents)
    before = store.stats()
    changed = dict(contents)
    buf = bytearray(contents[0x7F0000000000])
    buf[17 * CS + 5] ^= 0xFF                   # one byte in chunk 17 of 50
    changed[0x7F0000000000] = bytes(buf)
    man, w = write_image(store, "incr", changed, parent="base")
    after = store.stats()
    assert w.new_chunks == 1
    assert after["chunks"] == before["chunks"] + 1
    assert after["chunk_bytes"] - before["chunk_bytes"] <= CS + HEADER_SIZE
    assert read_image(store, "incr").parent == "base"
    assert bytes(read_region(store, read_image(store, "incr").allocations[0])) == bytes(buf)
    with pytest.raises(ImageError, match="parent image 'nope'"):
        ImageWriter(store, "x", parent="nope")


def test_a_writer_takes_its_parents_known_chunks_without_asking_the_store(store, monkeypatch):
    """A worker hands the writer the keys of the image it committed before (the parent): those
    are taken as present, so a round over thousands of unchanged chunks asks the store nothing;
    a key it was not given is still checked, and a missing one still refused at commit."""
    contents = make_contents()
    base, _ = write_image(store, "base", contents)
    known = base.chunk_keys()
    asked = []
    has, missing = store.has_chunk, store.missing
    monkeypatch.setattr(store, "has_chunk", lambda k: asked.append(k) or has(k))
    monkeypatch.setattr(store, "missing", lambda keys: asked.extend(keys) or missing(keys))
    w = ImageWriter(store, "next", parent="base", known=known)
    assert all(w.reuse_chunk(k) for k in known) and asked == []
    m = base.to_dict()
    for f in ("name", "parent", "created", "format", "version"):
        m.pop(f)
    assert w.commit(m).chunk_keys() == known and asked == []
    m["allocations"][0]["chunks"][0] = "ab" * 16          # in no store, and not known
    with pytest.raises(ImageError, match=r"chunk abab.* \(allocations\[0\]\.chunks\[0\] at 0x7f0000000000\) was never added"):
        ImageWriter(store, "bad", parent="base", known=known).commit(m)
    assert asked == ["ab" * 16]


def test_finish_many_equals_the_one_at_a_time_finish():
    """The GPU path finishes thousands of chunks' lane sums at once, in NumPy: bit for bit the same."""
    rng = random.Random(5)
    cases = [(rng.getrandbits(64), rng.getrandbits(64), rng.choice([0, 1, 7, 8, 4096, 2 << 20, (1 << 64) - 1]))
             for _ in range(300)]
    assert fpmod.finish_many([[h0, h1] for h0, h1, _ in cases], [n for *_, n in cases]) == \
        [fpmod._finish(h0, h1, n) for h0, h1, n in cases]
    assert fpmod.finish_many(np.zeros((0, 2), np.uint64), []) == []
    few = cases[:8]                # a batch of copies: finished one by one, in Python
    assert fpmod.finish_many(np.array([[h0, h1] for h0, h1, _ in few], np.uint64), np.array([n for *_, n in few], np.uint64)) == \
        [fpmod._finish(h0, h1, n) for h0, h1, n in few]


def test_corrupt_chunk_bit_flip(store):
    man, _ = write_image(store, "img", make_contents())
    key = man.allocations[0]["chunks"][3]
    blob = bytearray(store.get_chunk(key))
    blob[HEADER_SIZE + 100] ^= 0x10
    set_chunk_blob(store, key, blob)
    read_image(store, "img")                   # the manifest is fine; the chunk is checked on read
    with pytest.raises(ImageError, match=f"chunk {key} is corrupt"):
        read_region(store, man.allocations[0])


def test_corrupt_compressed_chunk(store):
    man, _ = write_image(store, "img", make_contents())
    key = man.allocations[2]["chunks"][0]       # floats: stored compressed
    blob = bytearray(store.get_chunk(key))
    assert HEADER.unpack_from(blob)[2] == 1
    blob[-3] ^= 0x01
    set_chunk_blob(store, key, blob)
    with pytest.raises(ImageError, match=key):
        read_chunk(store, key)


def test_truncated_chunk(store):
    man, _ = write_image(store, "img", make_contents())
    key = man.allocations[0]["chunks"][0]
    blob = store.get_chunk(key)
    set_chunk_blob(store, key, blob[:-10])
    with pytest.raises(ImageError, match=f"chunk {key} is truncated"):
        read_chunk(store, key)
    set_chunk_blob(store, key, blob[:20])
    with pytest.raises(ImageError, match=f"chunk {key} is truncated.*header"):
        read_chunk(store, key)


@pytest.mark.parametrize("count", [3, 300])      # a few keys are asked one by one, hundreds by listing
def test_missing_names_the_chunks_the_store_lacks(store, count):
    w = ImageWriter(store, "x")
    keys = [w.add_chunk(np.full(8, i, np.uint64).tobytes()) for i in range(count)]
    w.close()
    assert store.missing(keys) == set() and store.missing(set(keys)) == set()
    lacking = "cd" * 16
    assert store.missing([*keys, lacking]) == {lacking}
    remove_chunk(store, keys[count // 2])
    remove_chunk(store, keys[-1])
    assert store.missing(keys) == {keys[count // 2], keys[-1]}
    for bad in ("../../etc/passwd", "AB" * 16, keys[0][:16] + "," + keys[0][17:], 7):
        with pytest.raises(ImageError, match="invalid chunk key"):
            store.missing([*keys, bad])


def test_a_manifest_key_hiding_two_keys_or_a_comma_is_refused(store):
    """Keys are checked all at once, joined by commas: a key holding a comma must not pass."""
    man, _ = write_image(store, "img", make_contents())
    m = man.to_dict()
    chunks = m["allocations"][0]["chunks"]
    for bad in (chunks[0][:31] + ",", chunks[0][:16] + "," + chunks[0][17:], chunks[0] + "," + chunks[1]):
        m["allocations"][0]["chunks"] = [bad, *chunks[1:]]
        with pytest.raises(ImageError, match=r"allocations\[0\]\.chunks\[0\]: expected a chunk key"):
            validate_manifest(m, "img")


def test_missing_chunk(store):
    man, _ = write_image(store, "img", make_contents())
    key = man.allocations[0]["chunks"][7]
    remove_chunk(store, key)
    with pytest.raises(ImageError, match=rf"chunk {key} \(allocations\[0\]\.chunks\[7\] at 0x7f0000007000\) is missing"):
        read_image(store, "img")
    with pytest.raises(ImageError, match=f"chunk {key} is missing"):
        read_chunk(store, key)


def test_a_directory_in_place_of_a_chunk_or_manifest_is_a_clear_error(tmp_path):
    """A store's file replaced by a directory (tampering, a bad copy) is an ImageError naming
    it, on every way in, never an OSError out of the server."""
    store = DirStore(tmp_path / "store")
    man, _ = write_image(store, "img", make_contents())
    key = man.allocations[0]["chunks"][2]
    path = tmp_path / "store" / "chunks" / key[:2] / key
    path.unlink()
    path.mkdir()
    with pytest.raises(ImageError, match=f"chunk {key} cannot be read"):
        read_chunk(store, key)
    with pytest.raises(ImageError, match=f"chunk {key} cannot be read"):
        read_chunk_into(store, key, bytearray(man.allocations[0]["chunk_size"]))
    manifest = tmp_path / "store" / "images" / "img.json"
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(ImageError, match="manifest of image 'img' cannot be read"):
        read_image(store, "img")


def edited(raw, mutate):
    """A manifest's bytes with a field changed (its digest not recomputed)."""
    d = decode_manifest(raw)
    mutate(d)
    return encode_manifest(d)


def test_tampered_manifest(store):
    write_image(store, "img", make_contents())
    raw, digest = store.get_manifest("img")
    bad = edited(raw, lambda d: d["allocations"][0].update(address=0x7F0000001000))
    assert bad != raw
    set_manifest(store, "img", bad)
    with pytest.raises(ImageError, match="manifest digest mismatch"):
        read_image(store, "img")


def test_a_received_manifest_takes_the_chunks_verified_as_they_landed_without_a_second_look(tmp_path, monkeypatch):
    """A handoff's inbox: each chunk is verified as it lands (put_received_chunk, which records
    its raw length); the round's manifest then needs no header read of those chunks (~40 ms a
    round of 4,096 chunk files). A chunk it names that did not land that way is looked at in the
    store, as a restore would: there with a sound header it passes, absent it is refused."""
    source, inbox = DirStore(tmp_path / "source"), DirStore(tmp_path / "inbox")
    man, _ = write_image(source, "round0", make_contents())
    raw, _ = source.get_manifest("round0")
    keys = sorted(man.chunk_keys())
    landed = {}
    for k in keys:
        assert put_received_chunk(inbox, source.get_chunk(k), landed) == 1
    assert landed == {k: len(read_chunk(source, k)) for k in keys}
    looked_at = []
    heads = inbox.heads
    monkeypatch.setattr(inbox, "heads", lambda ks, n: (looked_at.append(list(ks)), heads(ks, n))[1])
    key = b"inbox's server key"
    assert put_received_manifest(inbox, "round0", raw, key=key, known=landed).name == "round0"
    assert looked_at == [] and read_image(inbox, "round0", key=key).name == "round0"
    # one chunk not known as landed: looked at alone, and sound, it passes
    some = keys[0]
    assert put_received_manifest(inbox, "round0", raw, key=key, known={k: n for k, n in landed.items() if k != some})
    assert looked_at[-1] == [some]
    # not known and not in the store: refused, by its key
    inbox.delete_chunk(some)
    with pytest.raises(ImageError, match=f"chunk {some}.*is missing from the store"):
        put_received_manifest(inbox, "round0", raw, key=key, known={k: n for k, n in landed.items() if k != some})
    # a chunk known with another length than the image gives it is looked at in the store too (gone here)
    with pytest.raises(ImageError, match="is missing from the store"):
        put_received_manifest(inbox, "round0", raw, key=key, known={**landed, some: landed[some] + 1})


def test_keyed_manifest(store):
    secret = b"server secret"
    write_image(store, "img", make_contents(), key=secret)
    assert read_image(store, "img", key=secret).name == "img"
    with pytest.raises(ImageError, match="signed with a server key"):
        read_image(store, "img")
    with pytest.raises(ImageError, match="digest mismatch.*key is wrong"):
        read_image(store, "img", key=b"another")
    # an attacker edits the manifest and writes a fresh unkeyed digest: refused under the key
    raw, _ = store.get_manifest("img")
    bad = edited(raw, lambda d: d.update(cut_seq=1235))
    set_manifest(store, "img", bad, manifest_digest(bad))
    with pytest.raises(ImageError, match="not signed"):
        read_image(store, "img", key=secret)


def rewrite(store, name, mutate):
    raw, _ = store.get_manifest(name)
    new = edited(raw, mutate)
    set_manifest(store, name, new, manifest_digest(new))


def test_wrong_format_version_and_fields(store):
    write_image(store, "img", make_contents())
    good, _ = store.get_manifest("img")

    def put(mutate):      # each a change of the image as written (a manifest of another version is read no further)
        new = edited(good, mutate)
        set_manifest(store, "img", new, manifest_digest(new))
    put(lambda d: d.update(version=3))
    with pytest.raises(ImageError, match="unsupported image version 3"):
        read_image(store, "img")
    put(lambda d: d.update(format="criu"))
    with pytest.raises(ImageError, match="not a phos image: format is 'criu'"):
        read_image(store, "img")
    put(lambda d: d.update(format="phos-image"))
    read_image(store, "img")
    put(lambda d: d["allocations"][1].update(address=d["allocations"][0]["address"] + 8))
    with pytest.raises(ImageError, match=r"allocations\[1\]\.address.*overlaps"):
        read_image(store, "img")
    with pytest.raises(ImageError, match=r"allocations\[1\]\.address: expected an integer"):     # the schema cannot hold it
        put(lambda d: d["allocations"][1].update(address="0x10"))
    put(lambda d: d["allocations"][0]["chunks"].pop())
    with pytest.raises(ImageError, match=r"allocations\[0\]\.chunks: 49 chunks, expected 50"):
        read_image(store, "img")
    # a manifest renamed into another image's name
    raw, digest = store.get_manifest("img")
    store.put_manifest("other", raw, digest)
    with pytest.raises(ImageError, match="stored as 'other'"):
        read_image(store, "other")


def test_non_canonical_and_garbage_manifest(store):
    write_image(store, "img", make_contents())
    raw, _ = store.get_manifest("img")
    padded = raw + bytes(8)          # bytes beyond its message, signed but never read
    set_manifest(store, "img", padded, manifest_digest(padded))
    with pytest.raises(ImageError, match="canonical"):
        read_image(store, "img")
    version1 = json.dumps(decode_manifest(raw), sort_keys=True, separators=(",", ":")).encode()
    set_manifest(store, "img", version1, manifest_digest(version1))
    with pytest.raises(ImageError, match="canonical JSON, of image version 1: this reader reads version 2 only"):
        read_image(store, "img")
    for junk in (b"", b"\xff\xfe", b"[" * 100000, b'{"format":"phos-image","version":1', b"null", b"1e999999"):
        set_manifest(store, "img", junk, manifest_digest(junk))
        with pytest.raises(ImageError):
            read_image(store, "img")
    set_manifest(store, "img", raw, b"sha1:abc\n")
    with pytest.raises(ImageError, match="digest file is malformed"):
        read_image(store, "img")


def test_the_chunks_of_a_version_1_image_stay_though_no_reader_reads_it(store):
    """A version-1 manifest (canonical JSON) is refused, but collection keeps the chunks it
    names, for a reader of that version; bytes that are no manifest at all name none."""
    man, _ = write_image(store, "img", make_contents())
    raw, _ = store.get_manifest("img")
    version1 = json.dumps(decode_manifest(raw), sort_keys=True, separators=(",", ":")).encode()
    store.put_manifest("old", version1, manifest_digest(version1))
    store.put_manifest("junk", b"\x00" * 64, manifest_digest(b"\x00" * 64))
    delete_image(store, "img")
    assert store.missing(man.chunk_keys()) == set()
    with pytest.raises(ImageError, match="image 'old': its manifest is canonical JSON, of image version 1"):
        read_image(store, "old")
    delete_image(store, "old")
    assert store.stats()["chunks"] == 0


def test_hostile_chunk_headers():
    data = os.urandom(1000)
    blob, fp = encode_chunk(data, level=None)
    key = fp.hex()
    assert decode_chunk(blob, key) == data
    _, v, c, raw_len, stored_len, f = HEADER.unpack_from(blob)
    huge = HEADER.pack(b"PHCK", v, c, 1 << 62, stored_len, f) + blob[HEADER_SIZE:]
    with pytest.raises(ImageError, match="over the limit"):
        decode_chunk(huge, key)
    with pytest.raises(ImageError, match="magic"):
        decode_chunk(b"XXXX" + blob[4:], key)
    with pytest.raises(ImageError, match="unknown compression id 7"):
        decode_chunk(HEADER.pack(b"PHCK", v, 7, raw_len, stored_len, f) + blob[HEADER_SIZE:], key)
    with pytest.raises(ImageError, match="chunk format version 9"):
        decode_chunk(HEADER.pack(b"PHCK", 9, c, raw_len, stored_len, f) + blob[HEADER_SIZE:], key)
    with pytest.raises(ImageError, match="not its key"):
        decode_chunk(blob, "0" * 32)
    with pytest.raises(ImageError, match="expected 999"):
        decode_chunk(blob, key, expected_len=999)
    # a zstd frame that claims more than the header, or no content size: refused before inflating
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(50 << 20))
    hdr = HEADER.pack(b"PHCK", 1, 1, 1000, len(bomb), f)
    with pytest.raises(ImageError, match="declares 52428800 bytes, header says 1000"):
        decode_chunk(hdr + bomb, key)
    nosize = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(data)
    with pytest.raises(ImageError, match="compressed"):
        decode_chunk(HEADER.pack(b"PHCK", 1, 1, 1000, len(nosize), f) + nosize, key)


def test_delete_keeps_shared_chunks(store):
    contents = make_contents()
    write_image(store, "a", contents)
    changed = dict(contents)
    changed[0x7F0000000000] = os.urandom(10 * CS) + contents[0x7F0000000000][10 * CS:]
    write_image(store, "b", changed, parent="a")
    n_before = store.stats()["chunks"]
    freed = delete_image(store, "a")
    assert freed[0] == 10 and freed[1] > 0              # only a's ten unique chunks go
    assert store.stats()["chunks"] == n_before - 10
    b = read_image(store, "b")                           # b still complete, though its parent is gone
    for e in b.allocations:
        assert bytes(read_region(store, e)) == changed[e["address"]]
    with pytest.raises(ImageError, match="not in the store"):
        read_image(store, "a")
    with pytest.raises(ImageError, match="not in the store"):
        delete_image(store, "a")
    delete_image(store, "b")
    assert store.stats()["chunks"] == 0 and store.list_images() == []


def test_gc_waits_for_writers(store):
    write_image(store, "a", make_contents())
    w = ImageWriter(store, "b")
    k = w.add_chunk(b"x" * 100)
    store.delete_image("a")
    assert gc(store) is None                             # a writer is active: nothing is freed
    assert store.has_chunk(k)
    w.commit({"backend": "emu", "device": {"name": "d", "uuid": "", "cc": [9, 0], "total_mem": 1},
              "allocations": [{"address": 4096, "size": 100, "chunk_size": 4096, "chunks": [k]}]})
    freed, _ = gc(store)
    assert freed > 0 and store.has_chunk(k)
    assert bytes(read_region(store, read_image(store, "b").allocations[0])) == b"x" * 100


def test_invalid_names_and_keys(store):
    for bad in ("../x", "", "a/b", ".hidden", "x" * 200):
        with pytest.raises(ImageError):
            ImageWriter(store, bad)
        with pytest.raises(ImageError):
            read_image(store, bad)
    with pytest.raises(ImageError, match="invalid chunk key"):
        read_chunk(store, "../../etc/passwd")


def test_commit_refuses_unadded_chunk(store):
    with pytest.raises(ImageError, match="never added"):
        with ImageWriter(store, "img") as w:
            w.commit({"backend": "emu", "device": {"name": "d", "uuid": "ab", "cc": [9, 0], "total_mem": 1},
                      "allocations": [{"address": 0, "size": 1, "chunk_size": 4096, "chunks": ["ab" * 16]}]})
    assert store.list_images() == []


# ------------------------------------------------------------------ random damage

_SMALL = os.urandom(300) + bytes(700)
_CHUNKS = {name: encode_chunk(d, level=lvl) for name, (d, lvl) in
           {"raw": (os.urandom(1000), None), "zstd": (_SMALL, 1)}.items()}


@st.composite
def damage(draw, n):
    ops = draw(st.lists(st.tuples(st.sampled_from(["flip", "set", "cut", "insert", "delete"]),
                                  st.integers(0, max(0, n - 1)), st.integers(0, 255)), min_size=1, max_size=4))
    return ops


def apply_damage(blob, ops):
    b = bytearray(blob)
    for op, pos, val in ops:
        pos = min(pos, max(0, len(b) - 1))
        if op == "flip" and b:
            b[pos] ^= 1 << (val % 8)
        elif op == "set" and b:
            b[pos] = val
        elif op == "cut":
            del b[pos:]
        elif op == "insert":
            b[pos:pos] = bytes([val])
        elif op == "delete" and b:
            del b[pos]
    return bytes(b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(["raw", "zstd"]), data=st.data())
def test_random_chunk_damage(which, data):
    blob, fp = _CHUNKS[which]
    original = decode_chunk(blob, fp.hex())
    bad = apply_damage(blob, data.draw(damage(len(blob))))
    try:
        out = decode_chunk(bad, fp.hex())
    except ImageError:
        return
    assert out == original                   # only harmless "damage" (e.g. a byte set to itself) passes


_MAN_STORE = MemoryStore()
_MAN, _ = write_image(_MAN_STORE, "img", {0x1000: os.urandom(3 * CS), 0x100000: bytes(CS + 1)})
_MAN_RAW, _MAN_DIGEST = _MAN_STORE.get_manifest("img")


def _fresh_store():
    s = MemoryStore()
    s._chunks = _MAN_STORE._chunks
    return s


def _check_read(s, name="img"):
    try:
        man = read_image(s, name)
    except ImageError:
        return None
    for e in man.allocations + man.globals:   # a manifest that passes must be self-consistent
        try:
            read_region(s, e)
        except ImageError:
            pass
    return man


@settings(max_examples=300, deadline=None)
@given(data=st.data(), redigest=st.booleans())
def test_random_manifest_byte_damage(data, redigest):
    bad = apply_damage(_MAN_RAW, data.draw(damage(len(_MAN_RAW))))
    s = _fresh_store()
    s.put_manifest("img", bad, manifest_digest(bad) if redigest else _MAN_DIGEST)
    man = _check_read(s)
    if man is not None and not redigest:
        assert man.raw == _MAN_RAW


_json = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False,
                     allow_infinity=False) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                     max_leaves=6)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


_MAN_PATHS = [p for p in _paths(decode_manifest(_MAN_RAW)) if p]


@settings(max_examples=400, deadline=None)
@given(path=st.sampled_from(_MAN_PATHS), value=_json, delete=st.booleans())
def test_random_manifest_field_damage(path, value, delete):
    """Replace or delete any one field (digest recomputed, as by someone without the key):
    the writer or the reader refuses with ImageError, or the reader returns a manifest that
    passes every check."""
    d = decode_manifest(_MAN_RAW)
    parent = d
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    try:
        raw = encode_manifest(d)
    except ImageError:
        return
    s = _fresh_store()
    s.put_manifest("img", raw, manifest_digest(raw))
    man = _check_read(s)
    if man is not None:
        validate_manifest(man.to_dict(), "img")


def test_latest_image_is_the_newest_that_reads_and_qualifies(store):
    """Newest by `created`; a newer image that is tampered with, another context's, or a
    handoff's pre-copy round is passed over for the next."""
    import time as _time
    write_image(store, "old", make_contents(1))
    _time.sleep(0.01)
    write_image(store, "newer", make_contents(2))
    assert latest_image(store) == "newer"
    rewrite(store, "newer", lambda m: m["metadata"].update(mode="precopy"))     # digest kept: unreadable now
    assert latest_image(store) == "old"
    _time.sleep(0.01)
    write_image(store, "newest", make_contents(3))
    assert latest_image(store) == "newest" and latest_image(store, ctx=12345) is None
    raw, _ = store.get_manifest("newest")
    set_manifest(store, "newest", edited(raw, lambda d: d.update(cut_seq=1235)))       # tampered: its digest fails
    assert latest_image(store) == "old"


def test_latest_image_under_a_key_passes_over_a_newer_forged_one(store):
    """Recovery picks its image by the key its restore checks: a newer image that someone
    without the key edited (a fresh unkeyed digest) or wrote unsigned would be refused by the
    restore, so the older good one is the latest; without a key, the forgery reads."""
    import time as _time
    secret = b"server secret"
    write_image(store, "good", make_contents(1), key=secret)
    _time.sleep(0.01)
    write_image(store, "newer", make_contents(2), key=secret)
    raw, _ = store.get_manifest("newer")
    forged = edited(raw, lambda d: d.update(cut_seq=1235))
    set_manifest(store, "newer", forged, manifest_digest(forged))
    assert latest_image(store, key=secret) == "good"
    assert latest_image(store) == "newer"
    _time.sleep(0.01)
    write_image(store, "unsigned", make_contents(3))
    assert latest_image(store, key=secret) == "good" and latest_image(store, key=b"another") is None


def test_read_latest_image_is_latest_image_read_once(store):
    """read_latest_image (an on-demand restore without a name) gives what read_image of
    latest_image gives, and refuses that image as read_image does: it never falls back
    silently to an older one whose chunks are all there."""
    from phos.snapshot.image import read_latest_image
    import time as _time
    assert read_latest_image(store) is None
    write_image(store, "old", make_contents(1))
    _time.sleep(0.01)
    newer, _ = write_image(store, "newer", make_contents(2))
    assert read_latest_image(store).raw == read_image(store, "newer").raw
    gone = next(k for k in newer.allocations[0]["chunks"] if k not in read_image(store, "old").chunk_keys())
    store.delete_chunk(gone)
    with pytest.raises(ImageError, match=f"image 'newer': chunk {gone} .* is missing"):
        read_latest_image(store)


def test_the_created_time_is_read_from_the_message_alone():
    """latest_image reads each manifest's `created` from its message, not the whole: a name
    holding the same words does not fool it."""
    from phos.snapshot.image import _created
    assert _created(edited(_MAN_RAW, lambda d: d.update(created=1764491234.25, name='x"created":9,'))) == 1764491234.25
    assert _created(edited(_MAN_RAW, lambda d: d.update(created=5))) == 5.0
    assert _created(edited(_MAN_RAW, lambda d: d.update(created=1e-05))) == 1e-05


def test_a_manifests_mode_and_session_are_read_from_the_message_alone():
    """latest_image glances at each manifest's metadata mode and session, not its chunk keys.
    The session is checked as validate_manifest checks it."""
    from phos.snapshot.image import _glance
    session = {"ctx": 7, "next_id": 3, "token": "ab" * 32}
    raw = edited(_MAN_RAW, lambda d: d.update(metadata={"mode": "concurrent", "paused": False}, session=session,
                                              name='a"session":{"ctx":1}"mode":"precopy"'))
    assert _glance(raw) == ("concurrent", session)
    raw = edited(_MAN_RAW, lambda d: d.update(metadata={"mode": "precopy"}, session=dict(session, limits=[[1, 2]])))
    assert _glance(raw) == ("precopy", dict(session, limits=[[1, 2]]))
    assert _glance(edited(_MAN_RAW, lambda d: d.update(metadata={"mode": "paused"}) or d.pop("session"))) == ("paused", {})
    for bad in ({"ctx": 7, "token": "cd", "next_id": 3}, {"ctx": 7, "token": "ab" * 32, "next_id": 3, "tenant": "cd"}):
        with pytest.raises(ImageError, match="manifest field session"):
            _glance(edited(_MAN_RAW, lambda d: d.update(session=bad)))
    with pytest.raises(ImageError, match="manifest is not a Manifest message"):
        _glance(_MAN_RAW[:-64])


# A session the schema cannot hold: refused as it is written, naming the field.
UNWRITABLE_SESSIONS = [
    ("7", r"session: expected an object, found str"),
    ({"token": "ab" * 32, "next_id": 1}, r"session\.ctx: missing"),
    ({"ctx": -1, "token": "ab" * 32, "next_id": 1}, r"session\.ctx: -1 is out of range"),
    ({"ctx": True, "token": "ab" * 32, "next_id": 1}, r"session\.ctx: expected an integer, found bool"),
    ({"ctx": 7, "token": "AB" * 32, "next_id": 1}, r"session\.token: expected lowercase hex digits"),
    ({"ctx": 7, "token": 5, "next_id": 1}, r"session\.token: expected lowercase hex digits"),
    ({"ctx": 7, "token": "ab" * 32}, r"session\.next_id: missing"),
    ({"ctx": 7, "token": "ab" * 32, "next_id": 1 << 64}, r"session\.next_id: .* is out of range"),
    ({"ctx": 7, "token": "ab" * 32, "next_id": 1.5}, r"session\.next_id: expected an integer, found float"),
    ({"ctx": 7, "token": "ab" * 32, "next_id": 1, "limits": [[2, -1]]}, r"session\.limits\[0\]: expected \[CUlimit, value\]"),
    ({"ctx": 7, "token": "ab" * 32, "next_id": 1, "limits": 5}, r"session\.limits: expected a list"),
    ({"ctx": 7, "token": "ab" * 32, "next_id": 1, "tenant": "../x"}, r"session\.tenant: expected lowercase hex digits"),
    ({"ctx": 7, "token": "ab" * 32, "next_id": 1, "tenant": 5}, r"session\.tenant: expected lowercase hex digits"),
]
# A session the schema holds, which the reader refuses.
BAD_SESSIONS = [
    ({"ctx": 7, "token": "ab" * 31, "next_id": 1}, r"session\.token: expected a token digest"),
    ({"ctx": 7, "token": "ab" * 32, "next_id": 1, "tenant": "ab" * 31}, r"session\.tenant: expected a tenant's name"),
]


@pytest.mark.parametrize("bad, says", UNWRITABLE_SESSIONS)
def test_a_session_the_schema_cannot_hold_is_refused_as_written(store, bad, says):
    write_image(store, "img", make_contents())
    with pytest.raises(ImageError, match=f"image 'img': manifest field {says}"):
        rewrite(store, "img", lambda d: d.update(session=bad))
    with pytest.raises(ImageError, match=says):
        validate_manifest(dict(decode_manifest(store.get_manifest("img")[0]), session=bad), "img")
    assert read_image(store, "img").session == {"ctx": 7, "token": "ab" * 32, "next_id": 0x1005}


@pytest.mark.parametrize("bad, says", BAD_SESSIONS)
def test_a_bad_session_is_refused(store, bad, says):
    """A manifest's session is optional, and checked when it is there: as read, as validated,
    and as latest_image glances at it (which passes such an image over)."""
    write_image(store, "img", make_contents())
    assert read_image(store, "img").session == {"ctx": 7, "token": "ab" * 32, "next_id": 0x1005}
    assert latest_image(store, ctx=7) == "img"
    rewrite(store, "img", lambda d: d.update(session=bad))
    with pytest.raises(ImageError, match=f"image 'img': manifest field {says}"):
        read_image(store, "img")
    with pytest.raises(ImageError, match=says):
        validate_manifest(decode_manifest(store.get_manifest("img")[0]), "img")
    assert latest_image(store) is None
    rewrite(store, "img", lambda d: d.pop("session"))
    assert read_image(store, "img") and latest_image(store) == "img" and latest_image(store, ctx=7) is None


def delta_message(blob, mutate):
    """An ImageDelta message's bytes with fields set as no writer of ours sets them."""
    from phos.schema.image_messages import ImageDelta
    with ImageDelta.from_bytes(blob) as d:
        b = d.as_builder()
    mutate(b)
    return b.to_bytes()


def test_a_delta_is_encoded_and_checked_in_one_place():
    """The delta a handoff's last round sends (an ImageDelta message, phos-delta-3): encode_delta
    makes it, and read_delta reads it and refuses a malformed one with ImageError naming the field."""
    from phos.snapshot.image import DELTA_FORMAT, encode_delta, read_delta
    key = "ab" * 16
    good = encode_delta("b", "a", 12, "0" * 32, 0x1005, {"status": 0, "message": ""}, [[0x7F0000000000, 3, key]])
    assert DELTA_FORMAT == "phos-delta-3"
    d = read_delta(good, "b")
    assert d == ("b", "a", 12, "0" * 32, 0x1005, {"status": 0, "message": ""}, [(0x7F0000000000, 3, key)])
    assert d.parent == "a" and d.changes[0][2] == key
    assert read_delta(encode_delta("b", None, 12, "0" * 32, 1, {"status": 0, "message": ""}, []), "b").parent is None

    def key_of(n):
        return lambda b: setattr(b.changes[0], "key", bytes(n))
    cases = [(delta_message(good, lambda b: setattr(b, "format", "phos-delta-2")), "not a phos-delta-3 delta of that image"),
             (good, None), (encode_delta("c", "a", 12, "0" * 32, 1, {"status": 0, "message": ""}, []),
                            "not a phos-delta-3 delta of that image"),
             (delta_message(good, key_of(15)), "changes are not [region address, chunk index, chunk key] triples"),
             (delta_message(good, key_of(0)), "changes are not"),
             (delta_message(good, lambda b: setattr(b, "objects", "")), "it names no objects")]
    for blob, says in cases:
        if says is None:
            assert read_delta(blob, "b").changes == [(0x7F0000000000, 3, key)]
            continue
        with pytest.raises(ImageError, match=f"delta of image 'b': {re.escape(says)}"):
            read_delta(blob, "b")
    for junk in (b"{", b"", b"\x00" * 8, good[:-8]):
        with pytest.raises(ImageError, match="delta of image 'b' is not an ImageDelta message"):
            read_delta(junk, "b")


def catch(call):
    try:
        call()
    except Exception as e:
        return e
    return None


@pytest.mark.parametrize("replace", ["symlink", "fifo", "directory"])
def test_a_chunk_file_that_is_not_a_regular_file_is_refused_without_waiting(tmp_path, replace):
    """A symbolic link could lead to any file (its bytes must not reach an error message), a
    FIFO would block the reader, a directory is no chunk."""
    store = DirStore(tmp_path / "store")
    man, _ = write_image(store, "img", make_contents())
    key = man.allocations[0]["chunks"][0]
    path = store._chunk_path(key)
    os.unlink(path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cr3t-contents:x:0:0\n" * 100)
    {"symlink": lambda: os.symlink(secret, path), "fifo": lambda: os.mkfifo(path), "directory": lambda: os.mkdir(path)}[replace]()
    for read in (lambda: store.get_chunk(key), lambda: store.get_chunk_into(key, bytearray(HEADER_SIZE), bytearray(64))):
        outcome = []
        reader = threading.Thread(target=lambda: outcome.append(catch(read)), daemon=True)
        reader.start()
        reader.join(10)
        if reader.is_alive():     # a FIFO opened for reading waits for a writer: be one, then fail
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            reader.join()
            pytest.fail("reading the chunk blocked")
        [error] = outcome
        assert isinstance(error, ImageError), error
        assert "s3cr" not in str(error) and (replace != "symlink" or "symbolic link" in str(error))


def test_a_chunk_of_foreign_bytes_is_refused_without_quoting_them(tmp_path):
    store = DirStore(tmp_path / "store")
    man, _ = write_image(store, "img", make_contents())
    key = man.allocations[0]["chunks"][0]
    set_chunk_blob(store, key, b"s3cr3t-contents:x:0:0\n" * 100)
    with pytest.raises(ImageError) as e:
        read_region(store, man.allocations[0])
    assert "s3cr" not in str(e.value) and "magic" in str(e.value)


def test_reading_a_store_that_is_not_there_makes_none(tmp_path):
    with pytest.raises(ImageError, match="no image store"):
        DirStore(tmp_path / "nothing", create=False)
    assert not (tmp_path / "nothing").exists()
