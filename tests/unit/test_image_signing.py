"""Images as untrusted input: signed manifests (snapshot/image_key.py), every chunk's presence
and header checked before a restore says it succeeded, a damaged chunk found later failing its
context, and an image that a restore still loads on demand kept from deletion."""
import os
import re
import stat

import numpy as np
import pytest

from phos.gpu_server.backends.emu import EmuBackend
from phos.gpu_server.worker.session import Session
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot import DirStore, HostStore, ImageError, ImageWriter, MemoryStore, delete_image, gc, read_image
from phos.snapshot.engine import Checkpoint, Restore
from phos.snapshot.image import HEADER_SIZE, decode_manifest, encode_manifest, manifest_digest
from phos.snapshot.image_key import image_key, key_path
from phos.snapshot.store import ImageInUse

MiB = 1 << 20


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """Each test signs with a user key of its own, made on first use under its own config home."""
    monkeypatch.delenv("PHOS_IMAGE_KEY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def filler(nbytes, seed=0):
    return (np.arange(nbytes // 8, dtype=np.uint64) * 0x9E3779B97F4A7C15 + seed).view(np.uint8)


def checkpointed(store, nbytes=4 * MiB, name="a", **kw):
    """A context of an emulated device holding nbytes of distinct words, checkpointed into store
    in 1 MiB chunks; returns its address."""
    s = Session(EmuBackend(), 7, b"t" * 16)
    ptr = s.backend.alloc(nbytes)
    s.backend.htod(ptr, filler(nbytes).tobytes(), None)
    cp = Checkpoint(s, store, name, paused=True, chunk_size=MiB, **kw)
    cp.cut(1, paused=True)
    cp.finish(1)
    return ptr


def restored(store, name="a", **kw):
    r = Restore(Session(EmuBackend(), 0, b"t" * 16), store, name, **kw)
    r.recreate()
    return r


def refusal(call):
    with pytest.raises(CudaError) as e:
        call()
    return e.value


def rewrite_manifest(store, name, mutate, digest):
    raw, _ = store.get_manifest(name)
    d = decode_manifest(raw)
    mutate(d)
    new = encode_manifest(d)
    store.put_manifest(name, new, digest(new))


# -- signatures ----------------------------------------------------------------------------

def test_a_server_signs_its_manifests_with_its_image_key_made_private_on_first_use(tmp_path):
    store = DirStore(tmp_path / "store")
    checkpointed(store)
    _, digest = store.get_manifest("a")
    assert digest.startswith(b"hmac-sha256:")
    path = tmp_path / "config" / "phos" / "image.key"
    assert key_path() == str(path) and path.read_bytes().strip() == image_key()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(image_key()) >= 32
    assert read_image(store, "a", key=image_key()).name == "a"
    restored(store).start(full=True)


def test_a_hand_edited_manifest_with_its_digest_recomputed_is_refused(tmp_path):
    store = DirStore(tmp_path / "store")
    checkpointed(store)
    rewrite_manifest(store, "a", lambda d: d.update(cut_seq=d["cut_seq"] + 1), manifest_digest)
    e = refusal(lambda: restored(store))
    assert e.status == CUresult.CUDA_ERROR_INVALID_IMAGE and "image 'a'" in e.message and "not signed" in e.message
    # signed by someone else's key: refused too, and the error says neither key nor the signature it wanted
    other = b"another server's key, 32 bytes.."
    rewrite_manifest(store, "a", lambda d: None, lambda raw: manifest_digest(raw, other))
    e = refusal(lambda: restored(store))
    assert e.status == CUresult.CUDA_ERROR_INVALID_IMAGE
    assert "image 'a': its manifest's signature does not match this server's image key" in e.message
    raw, _ = store.get_manifest("a")
    wanted = manifest_digest(raw, image_key()).split(b":")[1].strip().decode()
    assert image_key().decode() not in e.message and wanted not in e.message and other.decode() not in e.message


def test_servers_sharing_a_key_file_restore_each_others_images_and_no_other(tmp_path, monkeypatch):
    shared = tmp_path / "group.key"
    shared.write_bytes(os.urandom(32).hex().encode())
    shared.chmod(0o640)
    store = DirStore(tmp_path / "store")
    monkeypatch.setenv("PHOS_IMAGE_KEY", str(shared))
    checkpointed(store)
    restored(store).start(full=True)              # a server of the group
    monkeypatch.delenv("PHOS_IMAGE_KEY")
    e = refusal(lambda: restored(store))         # the user's own key: another one
    assert "does not match this server's image key" in e.message


@pytest.mark.parametrize("problem, says", [
    ("missing", "does not exist"),
    ("readable by all", "may be read or written by others (mode 644)"),
    ("short", "fewer than the 16 bytes a key needs"),
    ("another user's", "belongs to uid 65534, neither root nor this user"),
])
def test_a_key_file_that_is_missing_open_to_others_or_short_is_refused_without_quoting_it(tmp_path, monkeypatch,
                                                                                            problem, says):
    path = tmp_path / "image.key"
    secret = "s3cr3t-0123456789abcdef"
    if problem != "missing":
        path.write_text(secret[:8] if problem == "short" else secret)
        path.chmod(0o644 if problem == "readable by all" else 0o600)
    if problem == "another user's":       # 0600, but its owner could write another key there
        if os.geteuid() != 0:
            pytest.skip("needs root, to give the key file to another user")
        os.chown(path, 65534, 65534)
    monkeypatch.setenv("PHOS_IMAGE_KEY", str(path))
    with pytest.raises(ImageError, match=re.escape(says)) as e:
        image_key()
    assert str(path) in str(e.value) and secret[:8] not in str(e.value)
    assert not os.path.exists(path) or problem != "missing", "an explicit key file is never made"


# -- chunks checked before a restore succeeds ---------------------------------------------

def chunk_file(store, name="a", j=2):
    key = read_image(store, name).allocations[0]["chunks"][j]
    return key, store._chunk_path(key)


@pytest.mark.parametrize("damage, says", [
    ("truncated", "is truncated"),
    ("header", "not a phos chunk"),
    ("symlink", "symbolic link"),
])
def test_a_chunk_truncated_linked_or_with_a_bad_header_refuses_the_restore(tmp_path, damage, says):
    store = DirStore(tmp_path / "store")
    checkpointed(store)
    key, path = chunk_file(store)
    blob = open(path, "rb").read()
    os.unlink(path)
    if damage == "truncated":
        open(path, "wb").write(blob[:-4096])
    elif damage == "header":
        open(path, "wb").write(b"X" + blob[1:])
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_bytes(blob)
        os.symlink(tmp_path / "elsewhere", path)
    e = refusal(lambda: Restore(Session(EmuBackend(), 0, b"t" * 16), store, "a"))
    assert e.status == CUresult.CUDA_ERROR_INVALID_IMAGE and "image 'a'" in e.message
    assert key in e.message and says in e.message


def test_a_host_stores_chunks_are_checked_too(tmp_path):
    store = HostStore.create(tmp_path / "host", 16 * MiB, capacity=MiB)
    checkpointed(store)
    key = read_image(store, "a").allocations[0]["chunks"][1]
    slot = store._where[key]
    store.memory[slot * store.slot_bytes + 8] ^= 0xFF          # the raw length in its header
    e = refusal(lambda: Restore(Session(EmuBackend(), 0, b"t" * 16), store, "a"))
    assert key in e.message and "holds" in e.message


def test_a_chunk_whose_contents_are_damaged_fails_its_context_when_it_loads(tmp_path):
    """Its header is sound, so the restore on demand succeeds; loading it finds the damage, and
    every later access of the context gets an error naming the chunk, never its wrong bytes."""
    store = DirStore(tmp_path / "store")
    ptr = checkpointed(store)
    key, path = chunk_file(store)
    blob = bytearray(open(path, "rb").read())
    blob[HEADER_SIZE + 100] ^= 0x01
    open(path, "wb").write(bytes(blob))
    r = restored(store)
    r.start(full=False, deferred=True)
    r.before_access(ptr, 8)                            # an intact chunk loads
    for _ in range(2):
        e = refusal(lambda: r.before_access(ptr + 2 * MiB + 5, 8))
        assert e.status == CUresult.CUDA_ERROR_ILLEGAL_STATE
        assert f"image 'a' is damaged: its chunk 2 of the memory at {ptr:#x} ({key})" in e.message
    assert r.error() is r.failure and r.held is None, "a failed restore still holds the store"
    delete_image(store, "a")


# -- an image loaded on demand is kept ----------------------------------------------------

@pytest.mark.parametrize("kind", ["dir", "host", "memory"])
def test_an_image_being_restored_on_demand_is_not_deleted_until_it_is_loaded(tmp_path, kind):
    store = {"dir": lambda: DirStore(tmp_path / "store"), "memory": MemoryStore,
             "host": lambda: HostStore.create(tmp_path / "host", 32 * MiB, capacity=MiB)}[kind]()
    ptr = checkpointed(store)
    r = restored(store)
    r.start(full=False, deferred=True)
    with pytest.raises(ImageInUse, match="image 'a' is being restored on demand"):
        delete_image(store, "a", verify=True)
    assert read_image(store, "a")
    # what another image's deletion or a writer's abort collects must wait too: no chunk goes
    ImageWriter(store, "b").commit({"backend": "emu", "device": {"name": "x", "uuid": "", "cc": [9, 0], "total_mem": 1}})
    delete_image(store, "b")
    assert gc(store) is None
    r.start_loader()
    r.wait()
    assert r.held is None
    out = np.empty(4 * MiB, np.uint8)
    r.session.backend.dtoh(ptr, out, None)
    assert out.tobytes() == filler(4 * MiB).tobytes()
    chunks, _ = delete_image(store, "a", verify=True)
    assert chunks > 0


def test_a_restore_keeps_its_image_from_another_processs_deletion(tmp_path):
    """The reader lock of a DirStore is an flock: a prune in another process (a recovery
    image's, the admin API's) is refused, and a process that dies lets go of it."""
    import subprocess
    import sys
    store = DirStore(tmp_path / "store")
    checkpointed(store)
    r = restored(store)
    r.start(full=False, deferred=True)
    delete = [sys.executable, "-c", f"from phos.snapshot import DirStore, delete_image; "
              f"delete_image(DirStore({str(tmp_path / 'store')!r}), 'a')"]
    out = subprocess.run(delete, capture_output=True, text=True)
    assert out.returncode != 0 and "ImageInUse" in out.stderr and "image 'a' is being restored" in out.stderr
    r.release_store()          # as the worker's exit would
    assert subprocess.run(delete, capture_output=True, text=True).returncode == 0
