"""Two tenants on one server: B, speaking raw frames as a hostile client would, cannot
reach A's handles, memory or context, and A goes on computing correct results.

Handles and device addresses are per context (each context has its own worker process,
its handles start at the same id and its allocations at the same base), so B meets A's
values as plain numbers: refused where B has no such object, B's own object where it has.
"""
import ctypes
import os
import struct

import numpy as np
import pytest

from phos.schema import wire
from phos.schema.cuda_types import CUresult
from ptx_helpers import compile_ptx
from wire_client import RawSession, client_file, dealer, decode_reply, encode

pytestmark = pytest.mark.gpu     # perf/device/run.sh runs this file with --backend cuda

INVALID_HANDLE, INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_HANDLE, CUresult.CUDA_ERROR_INVALID_VALUE
N = 1024                        # floats in A's vectors


def ok(res, cu):
    assert int(res[0]) == 0, (res, cu.last_error)
    return res[1] if len(res) == 2 else res[1:]


def vec_add_params(a, b, c, n):
    return struct.pack("<QQQi", a, b, c, n)


def vec_add_config(n, stream=0):
    return wire.LAUNCH_CONFIG.pack((n + 255) // 256, 1, 1, 256, 1, 1, 0, 0, stream)


class TenantA:
    """A's context through the Python client: buffers, a module, its kernel, a stream and an event."""

    def __init__(self, cu):
        self.cu = cu
        self.ctx = ok(cu.cuCtxGetCurrent(), cu)
        self.x = np.arange(N, dtype=np.float32)
        self.y = np.full(N, 0.5, np.float32)
        self.big = ok(cu.cuMemAlloc(1 << 20), cu)          # at the base of A's range (B's first allocation lands there too)
        self.px, self.py, self.out = (ok(cu.cuMemAlloc(N * 4), cu) for _ in range(3))
        ok(cu.cuMemsetD32(self.big, 0xA11CE, (1 << 20) // 4), cu)
        ok(cu.cuMemcpyHtoD(self.px, self.x, self.x.nbytes), cu)
        ok(cu.cuMemcpyHtoD(self.py, self.y, self.y.nbytes), cu)
        self.module = ok(cu.cuModuleLoadData(compile_ptx("vecadd.cu", "compute_75").encode()), cu)
        self.fn = ok(cu.cuModuleGetFunction(self.module, b"vec_add"), cu)
        self.stream = ok(cu.cuStreamCreate(0), cu)
        self.event = ok(cu.cuEventCreate(0), cu)
        self.endpoint = cu._contexts[int(self.ctx)].endpoint
        self.check()

    def check(self):
        """A's data are intact and its module, kernel, stream and event still work."""
        cu = self.cu
        big = np.empty((1 << 20) // 4, np.uint32)
        ok(cu.cuMemcpyDtoH(big, self.big, big.nbytes), cu)
        assert (big == 0xA11CE).all(), "A's buffer changed"
        ok(cu.cuMemsetD32(self.out, 0, N), cu)
        args = ((self.px, self.py, self.out, N), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int))
        ok(cu.cuLaunchKernel(self.fn, N // 256, 1, 1, 256, 1, 1, 0, self.stream, args, 0), cu)
        ok(cu.cuEventRecord(self.event, self.stream), cu)
        ok(cu.cuEventSynchronize(self.event), cu)
        out = np.empty(N, np.float32)
        ok(cu.cuMemcpyDtoH(out, self.out, out.nbytes), cu)
        assert np.array_equal(out, self.x + self.y), "A's kernel gave a wrong result"
        assert int(ok(cu.cuModuleGetFunction(self.module, b"saxpy"), cu)) != 0


@pytest.fixture
def a(cu):
    return TenantA(cu)


@pytest.fixture
def b(server):
    s = RawSession(server.address)
    yield s
    s.close()


def assert_refused(status_message, status, *words):
    got, message = status_message
    assert got == status, status_message
    assert all(w in message for w in words), status_message


def test_b_cannot_use_a_handles(a, b):
    m, f, s, e = int(a.module), int(a.fn), int(a.stream), int(a.event)
    [(_, status, _, [own], _)] = b.call(("memAlloc", {"size": 256}))
    assert status == 0
    cases = [
        (("moduleGetFunction", {"module": m, "name": "vec_add"}), "module"),
        (("moduleGetGlobal", {"module": m, "name": "x"}), "module"),
        (("moduleUnload", {"id": m}), "module"),
        (("launch", {"function": f, "config": vec_add_config(N), "params": vec_add_params(0, 0, 0, N)}), "function"),
        (("launchBatch", wire.launch_record(f, wire.LAUNCH_CONFIG.unpack(vec_add_config(N)), vec_add_params(0, 0, 0, N))), "function"),
        (("streamSynchronize", {"id": s}), "stream"),
        (("streamQuery", {"id": s}), "stream"),
        (("streamWaitEvent", {"stream": 0, "event": e}), "event"),
        (("streamDestroy", {"id": s}), "stream"),
        (("memset", {"dst": own, "value": 0, "elemSize": 1, "count": 16, "stream": s}), "stream"),
        (("memcpyDtoH", {"src": own, "size": 16, "stream": s}), "stream"),
        (("eventRecord", {"event": e, "stream": 0}), "event"),
        (("eventQuery", {"id": e}), "event"),
        (("eventSynchronize", {"id": e}), "event"),
        (("eventElapsedTime", {"start": e, "end": e}), "event"),
        (("eventDestroy", {"id": e}), "event"),
    ]
    for call, kind in cases:
        status, message = b.status(call)
        assert status == INVALID_HANDLE and f"is not a {kind} of this context" in message, (call, status, message)
    # B's own stream, created after all that, is B's: A's ids mean nothing to B's worker
    [(_, status, _, [own], _)] = b.call(("streamCreate", {"flags": 0}))
    assert status == 0 and b.status(("streamSynchronize", {"id": own})) == (0, "")
    a.check()


def test_b_cannot_touch_a_memory(a, b):
    px, big = int(a.px), int(a.big)
    [(_, status, _, [own], _)] = b.call(("memAlloc", {"size": 256}))
    assert status == 0
    outside = "outside this context's allocations"
    assert_refused(b.status(("memcpyDtoH", {"src": px, "size": 16})), INVALID_VALUE, outside)
    assert_refused(b.status(("memcpyHtoD", {"dst": px, "size": 16, "payload": 1}), payloads=[b"\xff" * 16]), INVALID_VALUE, outside)
    assert_refused(b.status(("memcpyDtoD", {"dst": own, "src": px, "size": 16})), INVALID_VALUE, outside)
    assert_refused(b.status(("memcpyDtoD", {"dst": px, "src": own, "size": 16})), INVALID_VALUE, outside)
    assert_refused(b.status(("memset", {"dst": px, "value": 0xFF, "elemSize": 1, "count": 16})), INVALID_VALUE, outside)
    assert_refused(b.status(("memFree", {"ptr": px})), INVALID_VALUE, "not an allocation of this context")
    assert_refused(b.status(("memGetAddressRange", {"ptr": px})), CUresult.CUDA_ERROR_NOT_FOUND, "not inside an allocation")
    # the same address as A's first buffer is B's own first allocation: B reaches only its own bytes
    assert own == big
    assert b.status(("memset", {"dst": own, "value": 0x42, "elemSize": 1, "count": 256})) == (0, "")
    [(_, status, _, _, data)] = b.call(("memcpyDtoH", {"src": big, "size": 256}))
    assert status == 0 and bytes(data) == b"\x42" * 256
    assert_refused(b.status(("memset", {"dst": big + 256, "value": 0, "elemSize": 1, "count": 4})), INVALID_VALUE, outside)
    a.check()


def b_kernel(b):
    [(_, status, message, [module], _)] = b.call(("moduleLoad", {"payload": 1}), payloads=[compile_ptx("vecadd.cu", "compute_75").encode()])
    assert status == 0, message
    [(_, status, message, [fn, *_figures], _)] = b.call(("moduleGetFunction", {"module": module, "name": "vec_add"}))
    assert status == 0, message
    return fn


def test_b_kernel_cannot_read_a_memory(a, b, server):
    """B's kernel given A's address faults in B's own context (one process per context)."""
    fn = b_kernel(b)
    [(_, _, _, [own], _)] = b.call(("memAlloc", {"size": N * 4}))   # B's only allocation: where A's `big` is, in B's space
    assert own == int(a.big)
    launch = ("launch", {"function": fn, "config": vec_add_config(N), "params": vec_add_params(int(a.px), own, own, N)})
    # emu's interpreter refuses the load at launch; a GPU faults and reports at the synchronize
    status, message = b.status(launch, ("ctxSynchronize", None))
    assert status == CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, message
    assert b.status(("memcpyDtoH", {"src": own, "size": 16}))[0] == CUresult.CUDA_ERROR_ILLEGAL_ADDRESS   # sticky, in B only
    a.check()

    # A's `big` address, read by a kernel in a fresh B: B's own bytes there, never A's
    b2 = RawSession(server.address)
    try:
        fn = b_kernel(b2)
        ptrs = [b2.call(("memAlloc", {"size": (1 << 20) if i == 0 else N * 4}))[-1][3][0] for i in range(3)]
        assert ptrs[0] == int(a.big)
        one = 0x3F800000                      # 1.0f
        assert b2.status(("memset", {"dst": ptrs[0], "value": one, "elemSize": 4, "count": (1 << 20) // 4})) == (0, "")
        assert b2.status(("memset", {"dst": ptrs[1], "value": 0, "elemSize": 4, "count": N})) == (0, "")
        params = vec_add_params(int(a.big), ptrs[1], ptrs[2], N)
        assert b2.status(("launch", {"function": fn, "config": vec_add_config(N), "params": params}), ("ctxSynchronize", None)) == (0, "")
        [(_, status, _, _, data)] = b2.call(("memcpyDtoH", {"src": ptrs[2], "size": N * 4}))
        assert status == 0 and (np.frombuffer(bytes(data), np.float32) == 1.0).all()
    finally:
        b2.close()
    a.check()


def test_b_cannot_attach_to_a_context(a, b):
    sock = dealer(a.endpoint)          # A's worker socket: its path is easy to guess
    try:
        def status(*calls):
            sock.send(encode(calls, range(1, len(calls) + 1)))
            return decode_reply(sock.recv_multipart())
        not_attached = "not attached to this context"
        for call in [("memGetInfo", None),
                     ("memcpyDtoH", {"src": int(a.px), "size": 16}),
                     ("attach", {"ctx": int(a.ctx), "token": b.token}),                  # A's id, B's token
                     ("attach", {"ctx": b.ctx, "token": b.token}),                       # B's own credentials
                     ("attach", {"ctx": int(a.ctx), "token": os.urandom(16)}),
                     ("attach", {"ctx": int(a.ctx), "token": b""})]:
            results = status(call, ("memcpyDtoH", {"src": int(a.px), "size": 16}))
            assert len(results) == 1 and results[0][1] == CUresult.CUDA_ERROR_INVALID_CONTEXT, (call, results)
            assert not_attached in results[0][2] and results[0][4] is None
    finally:
        sock.close()
    a.check()


def test_staging_file_must_be_the_clients(a, b, tmp_path):
    """attach's staging path cannot name a server file (a tenant could read and write it), nor a
    file the tenant could cut short under the worker's mapping (SIGBUS would kill the worker)."""
    cookie = b"\x7fELF\x02\x01\x01\x00" + bytes(8)      # every x86-64 ELF file starts so
    size = wire.SLOTS_OFFSET + 4096
    target = tmp_path / "server-file"
    target.write_bytes(cookie + b"secret" * size)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    by_path = os.open(target, os.O_PATH)                      # needs no right to write the file
    fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    small, small_fd = client_file(4096 + 16, cookie)          # no room for the mailbox
    unsealed, unsealed_fd = client_file(size, cookie, sealed=False)
    offered, offered_fd = client_file(size, cookie)           # what a client offers

    def mapped(path, n=size):
        [(_, status, message, u64s, _)] = b.call(("attach", {"ctx": b.ctx, "token": b.token, "shmPath": path,
                                                             "shmCookie": cookie, "shmSize": n}))
        assert status == 0, (path, message)
        return u64s[1]
    try:
        for path in [str(target), f"/proc/{os.getpid()}/fd/{by_path}", f"/proc/{os.getpid()}/fd/{fifo_fd}",
                     f"/proc/{os.getpid()}/fd/{by_path}/../../../..{target}", unsealed]:
            assert mapped(path) == 0, path
        assert mapped(small, 4096 + 16) == 0
        assert b.status(("memGetInfo", None)) == (0, "")
        assert mapped(offered) == 1
    finally:
        for fd in (by_path, fifo_fd, small_fd, unsealed_fd, offered_fd):
            os.close(fd)
    assert target.read_bytes() == cookie + b"secret" * size
    assert b.status(("memGetInfo", None)) == (0, "")
    a.check()


def test_b_cannot_checkpoint_or_restore_a(a, b, server, tmp_path):
    """Snapshots are the operator's: the admin socket is the server user's alone, the data plane
    has no snapshot calls, and the workers' control sockets want a token."""
    from phos.admin_cli import stub
    from phos.schema import admin_pb2 as pb
    from phos.schema import control_socket
    from phos.schema.control import admin_socket
    store = tmp_path / "images"
    image = list(stub(server.address).Checkpoint(pb.CheckpointRequest(ctx=int(a.ctx), store=str(store))))[-1]
    name = image.result.name
    assert os.stat(admin_socket(server.address)[len("unix:"):]).st_mode & 0o077 == 0, "admin socket open to others"
    control_kinds = set(control_socket.VERBS.values())
    assert not control_kinds & set(wire.phos_capnp.Call.schema.union_fields) - {"attach"}, "control requests on the data plane"
    steal = pb.WorkerCheckpointRequest(store=str(store), name="stolen")
    control = dealer(a.endpoint.replace(f".ctx{int(a.ctx)}", f".ctl{int(a.ctx)}"))
    try:
        for requests in [[steal], [pb.ControlAttachRequest(ctx=int(a.ctx), token=b.token), steal]]:
            for seq, request in enumerate(requests, 1):
                control.send(control_socket.request_frame(seq, request))
                reply = control_socket.read_reply(control.recv())
                assert reply[1] == "failed" and reply[2][0] == CUresult.CUDA_ERROR_NOT_PERMITTED, reply
        # a data-plane Request is no control request: refused, and the worker goes on
        control.send(encode([("ctxSynchronize", None)], [1]))
        _, kind, (status, _) = control_socket.read_reply(control.recv())
        assert kind == "failed" and status in (CUresult.CUDA_ERROR_NOT_PERMITTED, CUresult.CUDA_ERROR_INVALID_VALUE)
    finally:
        control.close()
    assert sorted(os.listdir(store / "images")) == [f"{name}.digest", f"{name}.json"]
    a.check()


def test_a_stranger_flooding_a_worker_without_reading_stalls_nobody(a, server):
    """A peer that never attaches (any local peer can reach a worker's socket) sends requests
    and reads none of the refusals: the worker drops what such a peer cannot take and cuts it
    off, and its owner keeps being served, during the flood and after it."""
    import threading
    import zmq
    stranger = dealer(a.endpoint)
    stranger.setsockopt(zmq.RCVHWM, 1)         # its queue fills at once: every refusal past it must wait or go
    frame = encode([("memGetInfo", None)], [1])
    done, failed = threading.Event(), []

    def owner():
        try:
            ok(a.cu.cuCtxSetCurrent(a.ctx), a.cu)       # the current context is the thread's
            for _ in range(3):
                a.check()
        except BaseException as e:      # the main thread asserts on it
            failed.append(e)
        finally:
            done.set()
    try:
        for _ in range(20000):
            try:
                stranger.send(frame, zmq.NOBLOCK)
            except zmq.Again:           # the worker cut it off, or reads slower than it sends
                pass
        worker = threading.Thread(target=owner, daemon=True)
        worker.start()
        for _ in range(20000):
            try:
                stranger.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass
        # a hang guard, not a speed bound: without the fix the owner waits forever
        assert done.wait(120), "the owner's calls stalled behind a stranger's unread replies"
        assert not failed, failed
    finally:
        stranger.close()
    a.check()
    assert "never attached" in server.output()
