"""Bad input of every kind gets a clear error, and the server and other sessions carry on."""
import os
import re
import signal
import subprocess
import sys
import textwrap

import capnp
import numpy as np
import pytest
import zmq

from conftest import wait_until
from wire_client import encode
from phos.schema import wire
from phos.schema.cuda_types import CUresult

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda


def request(*calls, version=wire.PROTOCOL_VERSION, want_reply=True):
    """Encode a Request from (name, args) pairs, seqs 1, 2, ...; args: a dict of fields, None (Void) or bytes (Data)."""
    return encode(calls, range(1, len(calls) + 1), want_reply, version)


def results(sock):
    frames = sock.recv_multipart()
    with wire.decode(wire.Reply, frames[0]) as reply:
        return [(r.status, r.message) for r in reply.results]


def assert_server_healthy(raw):
    raw.send(request(("deviceGetCount", None)))
    assert results(raw) == [(0, "")]


def test_malformed_frame(raw, server):
    raw.send(b"\x00\x01garbage that is not capnp\xff" * 3)
    [(status, message)] = results(raw)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "malformed" in message
    assert "malformed frame from a client" in server.output()
    assert_server_healthy(raw)


def test_malformed_frames_are_each_answered_but_logged_once_in_a_while_per_peer(raw, server):
    """25k malformed frames wrote 3 MB of log, a WARNING each: a peer's are said once in a while,
    with a count of those left unsaid, and each still gets its error reply."""
    before = server.output().count("malformed frame from a client")
    for _ in range(300):
        raw.send(b"\x00\x01not capnp\xff" * 3)
        [(status, message)] = results(raw)
        assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "malformed" in message
    sock, ctx, token, _ = open_worker(raw)
    sock.send(request(("attach", {"ctx": ctx, "token": token})))
    assert results(sock)[0][0] == 0
    for _ in range(300):
        sock.send(b"\xff" * 40)
        assert results(sock)[0][0] == CUresult.CUDA_ERROR_INVALID_VALUE
    sock.send(request(("ctxDestroy", None)))
    results(sock)
    sock.close()
    wait_until(lambda: server.output().count("malformed frame from a client") >= before + 2, 10)
    said = server.output().count("malformed frame from a client") - before
    assert 2 <= said < 20, said         # the front end's once and the worker's once, and not 600 times
    assert_server_healthy(raw)


def test_empty_frame(raw, server):
    raw.send(b"")
    [(status, message)] = results(raw)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "root pointer" in message and "stack" not in message
    assert_server_healthy(raw)


def test_oversized_control_frame(raw):
    raw.send(b"\0" * (wire.MAX_CONTROL_FRAME + 8))
    [(status, message)] = results(raw)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "exceeds" in message
    assert_server_healthy(raw)


def test_protocol_version_mismatch(raw):
    raw.send(request(("hello", {"version": 999}), version=999))
    [(status, message)] = results(raw)
    assert status == CUresult.CUDA_ERROR_NOT_SUPPORTED and "999" in message
    raw.send(request(("deviceGetCount", None), version=wire.PROTOCOL_VERSION + 1))
    [(status, message)] = results(raw)
    assert status == CUresult.CUDA_ERROR_NOT_SUPPORTED and "protocol version" in message


def test_unknown_call(raw, tmp_path):
    # A newer client's schema with a call this server has never heard of.
    src = open(wire.phos_capnp.__file__ if hasattr(wire.phos_capnp, "__file__") else
               os.path.join(os.path.dirname(wire.__file__), "phos.capnp")).read()
    src = src.replace("@0x945b8f6e2c5d67c5;", "@0xd3c1b2a4f5e6d7c8;")
    start = src.index("struct Call {")
    end = src.index("\n  }\n}", start)                   # the end of Call's union
    ordinal = max(int(n) for n in re.findall(r"@(\d+)", src[start:end])) + 1
    src = src[:end] + f"\n    teleport @{ordinal} :Void;" + src[end:]
    path = tmp_path / "future.capnp"
    path.write_text(src)
    future = capnp.load(str(path))
    msg = future.Request.new_message(version=wire.PROTOCOL_VERSION, wantReply=True)
    call = msg.init("calls", 1)[0]
    call.seq, call.teleport = 1, None
    raw.send(msg.to_bytes())
    [(status, message)] = results(raw)
    assert status in (CUresult.CUDA_ERROR_INVALID_VALUE, CUresult.CUDA_ERROR_NOT_SUPPORTED) and message
    assert_server_healthy(raw)


def test_context_call_on_front_end(raw):
    raw.send(request(("memAlloc", {"size": 16})))
    [(status, message)] = results(raw)
    assert status == CUresult.CUDA_ERROR_INVALID_CONTEXT and "worker" in message


def test_bad_device(raw):
    raw.send(request(("deviceGetName", {"device": 7}), ("ctxCreate", {"device": -1, "flags": 0})))
    statuses = [s for s, _ in results(raw)]
    assert statuses == [CUresult.CUDA_ERROR_INVALID_DEVICE] * 2


def dealer(address, timeout_ms=30000):
    """A DEALER connected to `address` that never lingers and waits at most timeout_ms for a reply."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(address)
    return sock


def open_worker(raw):
    raw.send(request(("ctxCreate", {"device": 0, "flags": 0})))
    frames = raw.recv_multipart()
    with wire.decode(wire.Reply, frames[0]) as reply:
        r = reply.results[0]
        assert r.status == 0, r.message
        ctx, endpoint, token = r.u64s[0], r.text, bytes(r.data)
    sock = dealer(endpoint, timeout_ms=10000)
    return sock, ctx, token, endpoint


def test_worker_requires_the_session_token(raw):
    sock, ctx, token, _ = open_worker(raw)
    sock.send(request(("memAlloc", {"size": 16})))
    [(status, message)] = results(sock)
    assert status == CUresult.CUDA_ERROR_INVALID_CONTEXT and "attach" in message
    sock.send(request(("attach", {"ctx": ctx, "token": b"x" * 16})))
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_INVALID_CONTEXT
    sock.send(request(("attach", {"ctx": ctx, "token": token}), ("memAlloc", {"size": 16})))
    assert [s for s, _ in results(sock)] == [0, 0]          # attach (it returns the context id), memAlloc
    sock.send(request(("ctxDestroy", None)))
    results(sock)
    sock.close()


def test_worker_malformed_frames_and_payload_mismatch(raw):
    sock, ctx, token, _ = open_worker(raw)
    sock.send(request(("attach", {"ctx": ctx, "token": token}), ("memAlloc", {"size": 64})))
    frames = sock.recv_multipart()
    with wire.decode(wire.Reply, frames[0]) as reply:
        ptr = reply.results[-1].u64s[0]
    sock.send(b"\xff" * 40)
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_INVALID_VALUE
    # the call names payload frame 1 of 64 bytes but sends 3 bytes, then a frame that does not exist
    sock.send_multipart([request(("memcpyHtoD", {"dst": ptr, "size": 64, "payload": 1})), b"abc"])
    [(status, message)] = results(sock)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "3 bytes" in message
    sock.send(request(("memcpyHtoD", {"dst": ptr, "size": 64, "payload": 2})))
    [(status, message)] = results(sock)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "missing" in message
    # huge sizes are refused by the bounds check, not attempted
    sock.send(request(("memcpyDtoH", {"src": ptr, "size": 2**63})))
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_INVALID_VALUE
    sock.send(request(("memAlloc", {"size": 2**62})))
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_OUT_OF_MEMORY
    sock.send(request(("memset", {"dst": ptr, "value": 1 << 20, "elemSize": 1, "count": 1})))
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_INVALID_VALUE
    sock.send(request(("launch", {"function": 0x1234})))
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_INVALID_HANDLE
    sock.send(request(("moduleGetFunction", {"module": 0x1234, "name": "k"})))
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_INVALID_HANDLE
    # still serving
    sock.send(request(("memcpyDtoH", {"src": ptr, "size": 64})))
    frames = sock.recv_multipart()
    assert len(frames) == 2 and len(frames[1]) == 64
    sock.send(request(("ctxDestroy", None)))
    results(sock)
    sock.close()


def test_other_sessions_handles_and_pointers(cu, raw):
    """Session B cannot use A's handles or memory; A is unaffected."""
    err, a_ptr = cu.cuMemAlloc(4096)
    cu.cuMemsetD8(a_ptr, 7, 4096)
    err, a_stream = cu.cuStreamCreate(0)
    err, a_event = cu.cuEventCreate(0)
    sock, ctx, token, _ = open_worker(raw)
    sock.send(request(("attach", {"ctx": ctx, "token": token}), ("memcpyDtoH", {"src": int(a_ptr), "size": 16})))
    assert results(sock)[-1][0] == CUresult.CUDA_ERROR_INVALID_VALUE
    for name, args in [("streamSynchronize", {"id": int(a_stream)}), ("eventQuery", {"id": int(a_event)}),
                       ("memset", {"dst": int(a_ptr), "value": 0, "elemSize": 1, "count": 16})]:
        sock.send(request((name, args)))
        assert results(sock)[0][0] in (CUresult.CUDA_ERROR_INVALID_HANDLE, CUresult.CUDA_ERROR_INVALID_VALUE), name
    sock.send(request(("ctxDestroy", None)))
    results(sock)
    sock.close()
    out = np.zeros(4096, np.uint8)
    assert cu.cuMemcpyDtoH(out, a_ptr, 4096) == (0,) and (out == 7).all()
    assert cu.cuStreamSynchronize(a_stream) == (0,)


def test_peer_vanishes_mid_call(server, cu):
    """A client SIGKILLed while its copy is in flight: its worker goes, the server and others stay."""
    script = textwrap.dedent(f"""
        import os, numpy as np
        os.environ["PHOS_SERVER"] = {server.address!r}
        from phos.client_stub import driver as cu
        cu.cuInit(0); cu.cuCtxCreate(None, 0, 0)
        err, p = cu.cuMemAlloc(64 << 20)
        print("ready", flush=True)
        data = np.ones(64 << 20, np.uint8)
        while True:
            cu.cuMemcpyHtoD(p, data, data.nbytes); cu.cuMemcpyDtoH(data, p, data.nbytes)
    """)
    before = set(server.workers())
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    mine = set(server.workers()) - before
    assert len(mine) == 1
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert wait_until(lambda: not (set(server.workers()) & mine), timeout=8), "worker outlived its dead client"
    err, p = cu.cuMemAlloc(16)
    assert err == 0 and cu.cuCtxSynchronize() == (0,)


def test_arguments_out_of_range_fail_the_call_that_made_them_and_nothing_after(cu):
    """The Python client checks each call's integers against its fields as it queues it: an
    out-of-range one fails that call with CUDA_ERROR_INVALID_VALUE, naming the field, instead
    of raising from Cap'n Proto when the batch holding it is sent (which failed every later
    call too). A negative copy size fails too."""
    err, ptr = cu.cuMemAlloc(4096)
    assert err == 0
    bad = CUresult.CUDA_ERROR_INVALID_VALUE
    assert cu.cuMemAlloc(-1)[0] == bad and "memAlloc: size = -1" in cu.last_error
    assert cu.cuMemsetD8(ptr, 0, -1) == (bad,) and "memset: count = -1" in cu.last_error
    assert cu.cuMemFree(-1) == (bad,) and "ptr = -1 is outside" in cu.last_error
    assert cu.cuMemcpyHtoD(ptr, bytes(16), -1) == (bad,) and "a copy of -1 bytes" in cu.last_error
    # everything after works
    assert cu.cuMemsetD8(ptr, 9, 4096) == (0,)
    out = np.zeros(4096, np.uint8)
    assert cu.cuMemcpyDtoH(out, ptr, 4096) == (0,) and (out == 9).all()
    assert cu.cuCtxSynchronize() == (0,)


def test_a_client_that_reads_no_replies_gets_every_one_later(raw):
    """The front end's replies to a client that sends without reading wait for room in its
    queue (ROUTER_MANDATORY): read later, every one is there. Without it ZeroMQ dropped those
    past the queue's high-water mark (1000) silently."""
    import time
    many = 8000
    time.sleep(0.2)                      # connected: a DEALER queues without a peer, and blocks at 1000
    for _ in range(many):
        raw.send(request(("deviceGetCount", None)))
    answered = 0
    while raw.poll(3000):
        raw.recv_multipart()
        answered += 1
    assert answered == many
    assert_server_healthy(raw)


def test_a_request_of_too_many_calls_is_refused_before_any_runs(raw):
    """The front end and a worker refuse a Request of more than maxRequestCalls (phos.capnp)
    calls whole: none of them runs, so one message cannot hold a server for long."""
    too_many = wire.MAX_REQUEST_CALLS + 1
    raw.send(request(*[("deviceGetCount", None)] * too_many))
    [(status, message)] = results(raw)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and f"a request of {too_many} calls" in message
    assert_server_healthy(raw)
    sock, ctx, token, _ = open_worker(raw)
    sock.send(request(("attach", {"ctx": ctx, "token": token})))
    assert results(sock)[0][0] == 0
    sock.send(encode([("memAlloc", {"size": 1 << 20})] * too_many, range(2, too_many + 2), True, wire.PROTOCOL_VERSION))
    [(status, message)] = results(sock)
    assert status == CUresult.CUDA_ERROR_INVALID_VALUE and "at most" in message
    sock.send(encode([("memGetInfo", None)], [too_many + 2], True, wire.PROTOCOL_VERSION))
    [(status, _)] = results(sock)
    assert status == 0
    sock.send(encode([("memGetAddressRange", {"ptr": 0x600000000000})], [too_many + 3], True, wire.PROTOCOL_VERSION))
    assert results(sock)[0][0] == CUresult.CUDA_ERROR_NOT_FOUND        # nothing was allocated
    sock.close()


def test_contexts_past_the_servers_limit_are_refused(servers, monkeypatch):
    """Each context is a worker process: a client asking for more than PHOS_MAX_CONTEXTS gets
    CUDA_ERROR_OUT_OF_MEMORY, and the server and its contexts carry on."""
    monkeypatch.setenv("PHOS_MAX_CONTEXTS", "2")
    srv = servers("limited")
    sock = dealer(srv.address)
    try:
        made = []
        for _ in range(3):
            sock.send(request(("ctxCreate", {"device": 0, "flags": 0})))
            made += results(sock)
        assert [s for s, _ in made] == [0, 0, CUresult.CUDA_ERROR_OUT_OF_MEMORY]
        assert "PHOS_MAX_CONTEXTS=2" in made[2][1]
        assert len(srv.workers()) == 2 + 1          # the two contexts and the pre-started worker
        assert_server_healthy(sock)
    finally:
        sock.close()


def test_contexts_past_a_clients_limit_are_refused_to_that_client_alone(servers, monkeypatch):
    """One client (here, a local user: every connection of this test's uid) may hold
    PHOS_MAX_CONTEXTS_PER_CLIENT contexts, however many connections it opens."""
    monkeypatch.setenv("PHOS_MAX_CONTEXTS_PER_CLIENT", "2")
    srv = servers("per-client")
    socks = []
    for _ in range(2):      # two connections of one user are one client
        sock = dealer(srv.address)
        socks.append(sock)
    try:
        made = []
        for sock in (socks[0], socks[1], socks[1]):
            sock.send(request(("ctxCreate", {"device": 0, "flags": 0})))
            made += results(sock)
        assert [s for s, _ in made] == [0, 0, CUresult.CUDA_ERROR_OUT_OF_MEMORY], made
        assert "PHOS_MAX_CONTEXTS_PER_CLIENT=2" in made[2][1]
        assert_server_healthy(socks[0])
    finally:
        for sock in socks:
            sock.close()


NOBODY_CREATES = """
import os, sys, zmq
from phos.schema import wire
frame = wire.encode_request([(1, "ctxCreate", {"device": 0, "flags": 0}, None)], True, wire.PROTOCOL_VERSION)[0]
os.setgid(65534); os.setuid(65534)      # all imported first: the interpreter may be root's alone
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0); sock.setsockopt(zmq.RCVTIMEO, 30000)
sock.connect(sys.argv[1])
sock.send(frame)
with wire.decode(wire.Reply, sock.recv_multipart()[0]) as reply:
    print("STATUS", reply.results[0].status, reply.results[0].message)
"""


def test_local_users_over_loopback_tcp_are_told_apart_by_uid(servers, monkeypatch):
    """Keyless loopback clients were one client: one local user could take every other local
    user's contexts. Each is its user, by the owner of its connection's other end."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to connect as another user")
    from share_nothing import free_port_pair
    monkeypatch.setenv("PHOS_MAX_CONTEXTS_PER_CLIENT", "1")
    srv = servers("loopback", listen=f"tcp://127.0.0.1:{free_port_pair()}", args=("--insecure",))
    sock = dealer(srv.address)
    try:
        made = []
        for _ in range(2):
            sock.send(request(("ctxCreate", {"device": 0, "flags": 0})))
            made += results(sock)
        assert [s for s, _ in made] == [0, CUresult.CUDA_ERROR_OUT_OF_MEMORY], made
        out = subprocess.run([sys.executable, "-c", NOBODY_CREATES, srv.address], capture_output=True,
                             text=True, timeout=60, cwd="/")
        assert "STATUS 0" in out.stdout, out.stdout + out.stderr
    finally:
        sock.close()


NOBODY_LOADS_BY_DIGEST = """
import os, sys
sys.path.insert(0, sys.argv[2])
from wire_client import RawSession
os.setgid(65534); os.setuid(65534)
s = RawSession(sys.argv[1])
print("STATUS", *s.status(("moduleLoad", {"digest": bytes.fromhex(sys.argv[3])})))
"""


def test_a_tenant_cannot_tell_whether_another_loaded_a_module(servers):
    """The server keeps module images by digest for its clients; a load by digest finds only
    the images its own tenant sent (here, tenants are local users over loopback TCP)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to connect as another user")
    from share_nothing import free_port_pair
    from ptx_helpers import compile_ptx
    from wire_client import RawSession
    from phos.gpu_server.worker.module_cache import image_digest
    srv = servers("modules", listen=f"tcp://127.0.0.1:{free_port_pair()}", args=("--insecure",))
    image = compile_ptx("vecadd.cu", "compute_75").encode()
    digest = image_digest(image)
    mine = RawSession(srv.address)
    try:
        assert mine.status(("moduleLoad", {"payload": 1, "digest": digest}), payloads=[image])[0] == 0
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, "-c", NOBODY_LOADS_BY_DIGEST, srv.address, tests, digest.hex()],
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert f"STATUS {int(CUresult.CUDA_ERROR_NOT_FOUND)} " in out.stdout and "is not kept" in out.stdout, \
            out.stdout + out.stderr
        assert mine.status(("moduleLoad", {"digest": digest}))[0] == 0     # its own: found
    finally:
        mine.close()


def test_a_bad_pointer_fails_its_own_call_at_once(cu):
    """The client answers what it knows at once, as CUDA's driver does: a memset where nothing
    is allocated, a copy to freed memory and a second cuMemFree fail their own call, and the
    next call is unaffected (they failed the next synchronising call before)."""
    bad = CUresult.CUDA_ERROR_INVALID_VALUE
    err, ptr = cu.cuMemAlloc(4096)
    assert cu.cuMemsetD8(0x10, 1, 16) == (bad,) and "outside this context's allocations" in cu.last_error
    assert cu.cuMemsetD8(ptr, 1, 4097) == (bad,) and "runs past the end" in cu.last_error
    assert cu.cuMemFree(ptr) == (0,)
    assert cu.cuMemcpyHtoD(ptr, bytes(16), 16) == (bad,)
    assert cu.cuMemFree(ptr) == (bad,)
    assert cu.cuMemFree(0) == (0,)
    err, other = cu.cuMemAlloc(64)
    assert cu.cuMemsetD8(other, 3, 64) == (0,) and cu.cuCtxSynchronize() == (0,)
    out = np.zeros(64, np.uint8)
    assert cu.cuMemcpyDtoH(out, other, 64) == (0,) and (out == 3).all()
    assert cu.cuMemcpyDtoD(other, int(other) + 32, 64) == (bad,)
    assert cu.cuMemFree(other) == (0,)
