"""The admin API over TCP (gpu_server/control/admin_net.py, phos.schema.admin_net): served at a tcp://
server's port + 1, CURVE only, to the keys in its auth dir's admins/. Unauthenticated callers
get nothing; a handoff's inbox takes only verified chunks, at paths it gave, and a round's
chunks travel on several connections at once (gpu_server/control/handoff_net.py), a link cut
mid-batch failing the round."""
import asyncio
import os
import shutil
import subprocess

import grpc
import numpy as np
import pytest
import zmq

from phos.gpu_server.control import handoff_net
from phos.gpu_server.control.handoff_net import RemoteTarget
from phos.schema import admin_pb2 as pb
from phos.schema.admin_net import (PROTOCOL, PUT_CHUNKS, NetAdminConnection, admin_address, close_admin, open_admin,
                                   read_key_file)
from phos.schema.cuda_types import CudaError
from phos.snapshot import DirStore, HostStore
from phos.snapshot.image import encode_chunk
from share_nothing import Relay, free_port_pair, keygen

MiB = 1 << 20


@pytest.fixture
def keyed(servers, tmp_path):
    keys = keygen(tmp_path / "keys")
    srv = servers("srv", listen=f"tcp://127.0.0.1:{free_port_pair()}", args=("--auth-dir", str(keys)))
    return srv, keys


def curve(keys, client_secret):
    return (read_key_file(str(keys / "server.key")), *read_key_file(str(client_secret), secret=True))


def server_curve(keys):
    """A handoff source's curve: the server key pair, which `phos keygen` admits to admins/ (servers
    sharing an auth dir hand off to each other)."""
    return (read_key_file(str(keys / "server.key")), *read_key_file(str(keys / "server.key_secret"), secret=True))


def put_chunks(link, store, blobs, pieces=()):
    """The bulk call as a handoff's source makes it: a PutChunksRequest, then the chunks' frames
    (one each, or `pieces` each)."""
    request = pb.PutChunksRequest(store=store, pieces=pieces).SerializeToString()
    [(_, answer)] = link.calls(PUT_CHUNKS, [[request, *blobs]], 10, 1)
    return pb.PutChunksReply.FromString(answer).stored


def a_round(path, nbytes, chunk, store=None):
    """A store in path (or `store`) holding nbytes of distinct raw chunks, as a handoff's round
    leaves them; and their keys."""
    store, rng, keys = store or DirStore(path, fsync=False), np.random.default_rng(7), []
    for _ in range(nbytes // chunk):
        blob, fp = encode_chunk(rng.integers(0, 1 << 63, chunk // 8, dtype=np.uint64).tobytes(), level=None)
        store.put_chunk(fp.hex(), blob)
        keys.append(fp.hex())
    return store, keys


def send_round(address, keys, local, chunk_keys):
    """What a handoff's source does with a round's chunks: into a fresh inbox of the server at
    `address`, over its network admin API; returns the inbox's path."""
    async def send():
        async with RemoteTarget(address, 7, server_curve(keys)) as target:
            target.inbox = (await target.ask(target.stub.OpenInbox, pb.OpenInboxRequest(ctx=7), 10)).store
            await target.send_chunks(local, chunk_keys)
            assert target.sent == set(chunk_keys)
            return target.inbox
    return asyncio.run(send())


def admin_port(srv):
    return int(admin_address(srv.address).rsplit(":", 1)[1])


def phos(*args, **env):
    return subprocess.run(["phos", *args], capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))


def test_the_cli_lists_contexts_of_a_tcp_server_with_the_keys_clients_use(keyed):
    srv, keys = keyed
    assert f"admin API on {admin_address(srv.address)}" in srv.output()
    r = phos("ctx", "list", "--server", srv.address, "--json",
             PHOS_SERVER_KEY=str(keys / "server.key"), PHOS_CLIENT_KEY=str(keys / "client.key_secret"))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    stub = open_admin(srv.address, curve(keys, keys / "client.key_secret"))
    stats = stub.Stats(pb.StatsRequest(), timeout=10)
    close_admin(stub)
    assert stats.admin_endpoint == admin_address(srv.address)
    assert stats.server_key == read_key_file(str(keys / "server.key")).decode()


def test_a_key_not_in_admins_is_refused_at_its_handshake(keyed, tmp_path):
    """A stranger's key, and a tenant's (admitted in clients/ to make contexts, not in admins/)."""
    srv, keys = keyed
    other = keygen(tmp_path / "other")
    tenant = keygen(tmp_path / "tenant")
    shutil.copy(tenant / "clients" / "client.key", keys / "clients" / "tenant.key")
    for secret in (other / "client.key_secret", tenant / "client.key_secret"):
        stub = open_admin(srv.address, curve(keys, secret))
        with pytest.raises(grpc.RpcError) as e:
            stub.ListContexts(pb.ListContextsRequest(), timeout=10)
        close_admin(stub)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "refused this client's key" in e.value.details()
    r = phos("ctx", "list", "--server", srv.address,
             PHOS_SERVER_KEY=str(keys / "server.key"), PHOS_CLIENT_KEY=str(other / "client.key_secret"))
    assert r.returncode == 1 and "refused this client's key" in r.stderr


def test_a_caller_without_keys_gets_nothing(keyed):
    """A plain (NULL mechanism) DEALER sends a well-formed call, and a batch of chunks: no answer
    ever comes; the CLI without keys, for a server on another host, says which keys it needs (on
    this host it uses the server's Unix socket)."""
    srv, keys = keyed
    blob, _ = encode_chunk(os.urandom(4096))
    socks = []
    # a socket each: a message is queued at once on a fresh connection, before its handshake fails
    for call in ([b"ListContexts", b""], [PUT_CHUNKS.encode(), pb.PutChunksRequest(store="/tmp").SerializeToString(), blob]):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(admin_address(srv.address))
        sock.send_multipart([PROTOCOL, b"\0" * 8, *call])
        socks.append(sock)
    assert not any(sock.poll(2000) for sock in socks)
    for sock in socks:
        sock.close()
    r = phos("ctx", "list", "--server", "tcp://192.0.2.1:5555", PHOS_SERVER_KEY="", PHOS_CLIENT_KEY="")
    assert r.returncode == 1 and "PHOS_SERVER_KEY" in r.stderr


def test_a_removed_admin_key_is_refused_at_its_next_call(keyed):
    srv, keys = keyed
    stub = open_admin(srv.address, curve(keys, keys / "client.key_secret"))
    stub.ListContexts(pb.ListContextsRequest(), timeout=10)
    os.unlink(keys / "admins" / "client.key")
    with pytest.raises(grpc.RpcError) as e:
        stub.ListContexts(pb.ListContextsRequest(), timeout=10)
    close_admin(stub)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_an_inbox_takes_only_verified_chunks_at_paths_it_gave(keyed):
    """A batch holding a chunk whose contents do not match its fingerprint is refused, naming that
    chunk, which is not stored; sound chunks (raw and compressed) are, once; only at an inbox's path."""
    srv, keys = keyed
    stub = open_admin(srv.address, curve(keys, keys / "client.key_secret"))
    link = NetAdminConnection(admin_address(srv.address), curve(keys, keys / "client.key_secret"))
    try:
        inbox = stub.OpenInbox(pb.OpenInboxRequest(ctx=7), timeout=10).store
        blobs = [encode_chunk(os.urandom(4096), level=None)[0], encode_chunk(os.urandom(4096), level=None)[0],
                 encode_chunk(bytes(1 << 16))[0]]          # zeros: stored compressed
        chunk_keys = [bytes(b[24:40]).hex() for b in blobs]
        bad = bytearray(blobs[1])
        bad[-1] ^= 1                     # its contents no longer match its fingerprint
        with pytest.raises(grpc.RpcError) as e:
            put_chunks(link, inbox, [blobs[0], bytes(bad), blobs[2]])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"chunk {chunk_keys[1]} is corrupt" in e.value.details(), e.value.details()
        store = DirStore(inbox, create=False)
        assert not store.has_chunk(chunk_keys[1])
        lacking = sum(not store.has_chunk(k) for k in chunk_keys)
        assert put_chunks(link, inbox, blobs) == lacking
        assert put_chunks(link, inbox, blobs) == 0
        assert [store.get_chunk(k) for k in chunk_keys] == blobs
        with pytest.raises(grpc.RpcError) as e:
            put_chunks(link, inbox, [blobs[0][:20]])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "shorter than its" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            put_chunks(link, str(srv.dir), [blobs[0]])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a handoff inbox" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:     # names a chunk the inbox does not hold
            stub.PutManifest(pb.PutManifestRequest(store=inbox, name="x", manifest=b'{"format":"phos-image"}'), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        link.close()
        close_admin(stub)


def test_an_inbox_puts_each_chunk_together_from_its_pieces(keyed):
    """A chunk may come in several frames (PutChunksRequest.pieces), cut anywhere: the inbox
    joins them and checks the chunk whole. Counts that do not add up to the frames are refused,
    and so are pieces out of order (the chunk they make is not the one its header names)."""
    srv, keys = keyed
    stub = open_admin(srv.address, curve(keys, keys / "client.key_secret"))
    link = NetAdminConnection(admin_address(srv.address), curve(keys, keys / "client.key_secret"))
    try:
        inbox = stub.OpenInbox(pb.OpenInboxRequest(ctx=7), timeout=10).store
        one, two = (encode_chunk(os.urandom(n), level=None)[0] for n in (10_000, 4096))
        key_one, key_two = bytes(one[24:40]).hex(), bytes(two[24:40]).hex()
        for pieces, frames in (([2], [one[:5000], one[5000:], two]), ([0, 3], [one[:7], one[7:], two]),
                               ([1, 1, 1, 1], [one, two])):
            with pytest.raises(grpc.RpcError) as e:
                put_chunks(link, inbox, frames, pieces)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot hold" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            put_chunks(link, inbox, [one[:100], one[5000:], one[100:5000]], [3])      # its payload's pieces swapped
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"chunk {key_one} is corrupt" in e.value.details(), e.value.details()
        store = DirStore(inbox, create=False)
        assert not store.has_chunk(key_one) and not store.has_chunk(key_two)
        assert put_chunks(link, inbox, [one[:7], one[7:5000], one[5000:], two], [3, 1]) == 2
        assert store.get_chunk(key_one) == one and store.get_chunk(key_two) == two
    finally:
        link.close()
        close_admin(stub)


def test_pieces_are_joined_in_a_buffer_the_thread_keeps_up_to_a_bound(monkeypatch):
    """A chunk's pieces are joined in the verifier thread's own buffer, kept for its next chunk;
    one bigger than KEPT_JOIN_BYTES is joined afresh, and the buffer kept stays as it was."""
    monkeypatch.setattr(handoff_net, "KEPT_JOIN_BYTES", 1 << 16)
    blob = os.urandom(40_000)
    first = handoff_net.joined([blob[:3], memoryview(blob)[3:20_000], blob[20_000:]])
    assert bytes(first) == blob
    kept = handoff_net._joins.buffer
    second = handoff_net.joined([blob[:100], blob[100:]])
    assert bytes(second) == blob and handoff_net._joins.buffer is kept
    big = os.urandom(100_000)
    assert bytes(handoff_net.joined([big[:1], big[1:]])) == big and handoff_net._joins.buffer is kept
    assert len(kept) < 1 << 16


def test_chunks_go_from_a_host_stores_memory_in_pieces_and_land_whole(keyed, monkeypatch, tmp_path):
    """From a HostStore, a round's chunks are sent as they lie in its slots (a header, then the
    payload in pieces of PIECE_BYTES: frames of one message) and land whole."""
    srv, keys = keyed
    chunk = 256 << 10
    monkeypatch.setattr(handoff_net, "PIECE_BYTES", 100_000)       # a payload in 3 pieces, one short
    host = HostStore.create(tmp_path / "host", 16 * (4096 + chunk), capacity=chunk)
    local, chunk_keys = a_round(None, 8 * chunk, chunk, store=host)
    frames_sent, calls = [], NetAdminConnection.calls

    def counted(self, method, bodies, *args):
        return calls(self, method, (frames_sent.append(len(body)) or body for body in bodies), *args)
    monkeypatch.setattr(NetAdminConnection, "calls", counted)
    inbox = DirStore(send_round(srv.address, keys, local, chunk_keys), create=False)
    assert all(inbox.get_chunk(k) == local.get_chunk(k) for k in chunk_keys)
    assert sum(frames_sent) == len(frames_sent) + 4 * len(chunk_keys), frames_sent     # a request, 4 frames a chunk


def test_a_round_travels_on_every_connection_and_lands_intact(keyed, monkeypatch, tmp_path):
    """PHOS_HANDOFF_CONNECTIONS=3: the round's batches (of one chunk here) go over three
    connections of their own at once, besides the one that opened the inbox, and every chunk
    lands in the inbox as it was sent."""
    srv, keys = keyed
    monkeypatch.setenv("PHOS_HANDOFF_CONNECTIONS", "3")
    monkeypatch.setattr(handoff_net, "BATCH_BYTES", 256 << 10)
    local, chunk_keys = a_round(tmp_path / "round", 24 * MiB, 256 << 10)
    port = free_port_pair()
    relay = Relay(port + 1, admin_port(srv))
    try:
        inbox = DirStore(send_round(f"tcp://127.0.0.1:{port}", keys, local, chunk_keys), create=False)
    finally:
        relay.close()
    assert all(inbox.get_chunk(k) == local.get_chunk(k) for k in chunk_keys)
    assert len(relay.carried) == 4 and sum(c > 256 << 10 for c in relay.carried) == 3, relay.carried


def test_a_link_cut_mid_batch_fails_the_round_saying_the_context_stays(keyed, tmp_path):
    """The connection carrying a batch is reset a megabyte into it: the round fails at once with
    a CudaError that says the link was lost and the context stays live at the source."""
    srv, keys = keyed
    local, chunk_keys = a_round(tmp_path / "round", 8 * MiB, 2 * MiB)
    port = free_port_pair()
    relay = Relay(port + 1, admin_port(srv), cut_after=MiB)
    try:
        with pytest.raises(CudaError) as e:
            send_round(f"tcp://127.0.0.1:{port}", keys, local, chunk_keys)
    finally:
        relay.close()
    assert relay.was_cut.is_set()
    assert "stays live here" in e.value.message and "was lost during PutChunks" in e.value.message, e.value.message
