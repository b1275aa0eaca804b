"""The admin API over TCP (gpu_server/admin_net.py, phos.schema.admin_net): served at a tcp://
server's port + 1, CURVE only, to the keys in its auth dir's admins/. Unauthenticated callers
get nothing; a handoff's inbox takes only verified chunks, at paths it gave."""
import os
import shutil
import subprocess

import grpc
import pytest
import zmq

from phos.schema import admin_pb2 as pb
from phos.schema.admin_net import PROTOCOL, admin_address, close_admin, open_admin, read_key_file
from phos.snapshot.image import encode_chunk
from share_nothing import free_port_pair, keygen


@pytest.fixture
def keyed(servers, tmp_path):
    keys = keygen(tmp_path / "keys")
    srv = servers("srv", listen=f"tcp://127.0.0.1:{free_port_pair()}", args=("--auth-dir", str(keys)))
    return srv, keys


def curve(keys, client_secret):
    return (read_key_file(str(keys / "server.key")), *read_key_file(str(client_secret), secret=True))


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
    """A plain (NULL mechanism) DEALER sends a well-formed call: no answer ever comes; the CLI
    without keys, for a server on another host, says which keys it needs (on this host it uses
    the server's Unix socket)."""
    srv, keys = keyed
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(admin_address(srv.address))
    sock.send_multipart([PROTOCOL, b"\0" * 8, b"ListContexts", b""])
    assert not sock.poll(2000)
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
    srv, keys = keyed
    stub = open_admin(srv.address, curve(keys, keys / "client.key_secret"))
    try:
        inbox = stub.OpenInbox(pb.OpenInboxRequest(ctx=7), timeout=10).store
        blob, fp = encode_chunk(os.urandom(4096))
        bad = bytearray(blob)
        bad[-1] ^= 1                     # its contents no longer match its fingerprint
        with pytest.raises(grpc.RpcError) as e:
            stub.PutChunks(pb.PutChunksRequest(store=inbox, chunks=[bytes(bad)]), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "corrupt" in e.value.details()
        assert stub.PutChunks(pb.PutChunksRequest(store=inbox, chunks=[blob]), timeout=10).stored == 1
        with pytest.raises(grpc.RpcError) as e:
            stub.PutChunks(pb.PutChunksRequest(store=str(srv.dir), chunks=[blob]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a handoff inbox" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:     # names a chunk the inbox does not hold
            stub.PutManifest(pb.PutManifestRequest(store=inbox, name="x", manifest=b'{"format":"phos-image"}'), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        close_admin(stub)
