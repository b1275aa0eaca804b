"""Images are untrusted input, through real servers: an image that a context still loads on
demand cannot be deleted, a damaged chunk refuses the restore or fails the context it reaches
(listed "failed", its calls refused saying so), and manifests are signed with the servers' image
key (snapshot/image_key.py), which servers of one user share unless given another."""
import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from conftest import wait_until
from phos.admin_cli import stub
from phos.schema import admin_pb2 as pb
from phos.snapshot import DirStore, read_image
from phos.snapshot.image import HEADER_SIZE, decode_manifest, encode_manifest, manifest_digest
from test_snapshot_engine import MiB, App, checkpoint, filler, kill, restore, state_of

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """The servers of a test (and the test itself) share a user key of their own."""
    monkeypatch.delenv("PHOS_IMAGE_KEY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def image_of(servers, client, tmp_path, nbytes):
    """A program's context holding nbytes of distinct words, checkpointed into tmp_path/images
    by a server that is then killed; returns (app, its allocation, the store, the image's name)."""
    one = servers("one")
    app = App(client(one))
    ptr = app.put(filler(nbytes))
    app.sync()
    store = tmp_path / "images"
    name = checkpoint(one, app.id, store)["name"]
    kill(one)
    return app, ptr, store, name


def delete(server, store, name):
    return stub(server.address).DeleteImage(pb.DeleteImageRequest(store=str(store), name=name))


def refused(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_an_image_restored_on_demand_is_kept_until_its_last_chunk_is_in(servers, client, tmp_path, monkeypatch):
    app, ptr, store, name = image_of(servers, client, tmp_path, 256 * MiB)
    two = servers("two")
    reply = restore(two, store)
    e = refused(lambda: delete(two, store, name))          # its loader has yet to start
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"image {name!r} is being restored on demand" in e.details()
    assert read_image(DirStore(store), name), "the refused deletion took part of the image"
    assert wait_until(lambda: state_of(two, reply.ctx) == "running", 60)
    freed = delete(two, store, name)
    assert freed.freed_chunks >= 128, "the restore held the store after its last chunk was in"
    monkeypatch.setenv("PHOS_SERVER", two.address)
    assert app.get(ptr, 256 * MiB, np.uint8).tobytes() == filler(256 * MiB).tobytes()


def chunk_path(store, name, j):
    key = read_image(DirStore(store), name).allocations[0]["chunks"][j]
    return key, store / "chunks" / key[:2] / key


def test_a_chunk_damaged_inside_fails_the_context_it_reaches_and_nothing_else(servers, client, tmp_path, monkeypatch):
    app, ptr, store, name = image_of(servers, client, tmp_path, 8 * MiB)
    key, path = chunk_path(store, name, 2)
    blob = bytearray(path.read_bytes())
    blob[HEADER_SIZE + 4096] ^= 0x01                # its header is sound: the restore succeeds
    path.write_bytes(bytes(blob))
    two = servers("two")
    reply = restore(two, store)
    monkeypatch.setenv("PHOS_SERVER", two.address)
    cu = app.cu
    out = np.zeros(8 * MiB, np.uint8)
    for _ in range(2):         # the call that reaches it, and the next: the same clear error, not its bytes
        status = cu.cuMemcpyDtoH(out, ptr, out.nbytes)[0]
        assert status == cu.CUresult.CUDA_ERROR_ILLEGAL_STATE
        assert f"image {name!r} is damaged" in cu.last_error and key in cu.last_error
    assert cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_ERROR_ILLEGAL_STATE
    listed = json.loads(subprocess.run([sys.executable, "-m", "phos.cli", "ctx", "list", "--json", "--server", two.address],
                                       capture_output=True, text=True, check=True).stdout)
    assert {c["id"]: c["state"] for c in listed}[reply.ctx] == "failed"
    other = App(client(two))                         # another context on that server is unaffected
    assert other.get(other.put(filler(MiB, 7)), MiB, np.uint8).tobytes() == filler(MiB, 7).tobytes()
    assert state_of(two, other.id) == "running" and state_of(two, reply.ctx) == "failed"


@pytest.mark.parametrize("damage", ["truncated", "symlink", "header"])
def test_a_chunk_truncated_linked_or_with_a_bad_header_refuses_the_restore_at_once(servers, client, tmp_path, damage):
    app, ptr, store, name = image_of(servers, client, tmp_path, 8 * MiB)
    key, path = chunk_path(store, name, 3)
    blob = path.read_bytes()
    path.unlink()
    if damage == "truncated":
        path.write_bytes(blob[:-1])
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_bytes(blob)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.write_bytes(blob[:16] + bytes(8) + blob[24:])      # its stored length zeroed
    two = servers("two")
    e = refused(lambda: restore(two, store))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and f"image {name!r}" in e.details() and key in e.details()
    assert not stub(two.address).ListContexts(pb.ListContextsRequest()).contexts


def test_a_hand_edited_manifest_is_refused(servers, client, tmp_path):
    app, ptr, store, name = image_of(servers, client, tmp_path, MiB)
    images = store / "images"
    m = decode_manifest((images / f"{name}.json").read_bytes())
    m["allocations"][0]["size"] -= 8                  # the digest recomputed, as anyone could
    m["allocations"][0]["chunks"] = m["allocations"][0]["chunks"][:1]
    raw = encode_manifest(m)
    (images / f"{name}.json").write_bytes(raw)
    (images / f"{name}.digest").write_bytes(manifest_digest(raw))
    two = servers("two")
    e = refused(lambda: restore(two, store))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and f"image {name!r}: its manifest is not signed" in e.details()
    assert not stub(two.address).ListContexts(pb.ListContextsRequest()).contexts


def test_a_server_given_another_image_key_restores_its_own_images_only(servers, client, tmp_path, monkeypatch):
    app, ptr, store, name = image_of(servers, client, tmp_path, MiB)
    key = tmp_path / "their.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    theirs = servers("theirs", args=["--image-key", str(key)])
    e = refused(lambda: restore(theirs, store))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"image {name!r}: its manifest's signature does not match this server's image key" in e.details()
    assert key.read_text() not in theirs.output() + e.details()
    own = App(client(theirs))
    own.put(filler(MiB, 3))
    own.sync()
    mine = checkpoint(theirs, own.id, tmp_path / "theirs-images")["name"]
    own.ok(own.cu.cuCtxDestroy(own.ctx))
    # its worker exits a moment after the destroy is answered: a restore waits for that
    assert wait_until(lambda: not stub(theirs.address).ListContexts(pb.ListContextsRequest()).contexts, 30)
    assert restore(theirs, tmp_path / "theirs-images", name=mine).name == mine
    missing = subprocess.run([sys.executable, "-m", "phos.cli", "server", "--listen", f"ipc://{tmp_path}/x.sock",
                              "--image-key", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "image key" in missing.stderr and "does not exist" in missing.stderr
