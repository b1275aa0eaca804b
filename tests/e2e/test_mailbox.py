"""The shared mailbox for synchronous calls, with both sides spinning as on a many-core host."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ServerProc

from phos.schema import wire


def test_sync_calls_through_the_mailbox(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("PHOS_SPIN_US", "300")            # the server's workers inherit it
    srv = ServerProc(backend, tmp_path)
    try:
        script = textwrap.dedent(f"""
            import numpy as np
            from phos.client_stub import driver as cu
            assert cu.cuInit(0)[0] == 0
            err, ctx = cu.cuCtxCreate(None, 0, 0)
            conn = cu._contexts[int(ctx)]
            assert conn.box is not None
            err, p = cu.cuMemAlloc(1 << 20)
            for i in range(300):                           # sync calls mixed with async ones
                assert cu.cuMemsetD32(p, i, 1 << 18) == (0,)
                assert cu.cuCtxSynchronize() == (0,)
                if i % 50 == 0:
                    out = np.zeros(1 << 18, np.uint32)
                    assert cu.cuMemcpyDtoH(out, p, out.nbytes) == (0,) and (out == i).all()
            err, s = cu.cuStreamCreate(0)
            small = np.arange(100, dtype=np.uint32)
            got = np.zeros(100, np.uint32)
            cu.cuMemcpyHtoDAsync(p, small, small.nbytes, s)
            cu.cuMemcpyDtoHAsync(got, p, got.nbytes, s)     # its bytes come as a frame: the reply uses the socket
            assert cu.cuStreamSynchronize(s) == (0,) and (got == small).all()
            # past the end: the client refuses it at once; sent anyway, the worker's error is
            # deferred to the next synchronising call, through the box
            assert cu.cuMemsetD8(int(p) + (1 << 20) - 1, 0, 2)[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
            conn.post("memset", {{"dst": int(p) + (1 << 20) - 1, "value": 0, "elemSize": 1, "count": 2, "stream": 0}})
            assert cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE
            assert cu.cuCtxSynchronize() == (0,)
            # of the last syncs, those whose client slept: not every one, as a worker spinning in
            # compiled code may answer within the client's 1 us (and one descheduled may not sleep)
            asleep = 0
            for _ in range(500):
                assert cu.cuCtxSynchronize() == (0,)
                asleep += int(conn.box.asleep[0]) == conn.box_seq
            print("asleep for some of the last", asleep > 0)
            print("box requests", conn.box_seq)
        """)
        # a client that spins 1 us sleeps for many replies: the worker answers those over the socket
        for spin, asleep in (("300", None), ("1", "True")):
            env = dict(os.environ, PHOS_SERVER=srv.address, PHOS_SPIN_US=spin)
            out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert int(out.stdout.split()[-1]) > 300, out.stdout
            assert asleep is None or f"asleep for some of the last {asleep}" in out.stdout, out.stdout
    finally:
        srv.stop()


class Sent(list):
    """A worker's socket: what it sent."""

    def send_multipart(self, frames, copy=True, flags=0):
        self.append([bytes(f) for f in frames])


class LateSleeper(wire.Mailbox):
    """A client that says it sleeps just as the worker puts its answer in the box."""

    def put(self, box, seq, frame):
        done = super().put(box, seq, frame)
        self.asleep[0] = seq
        return done


@pytest.mark.parametrize("client", ["watching", "asleep", "falls asleep meanwhile"])
def test_a_sleeping_client_is_answered_over_the_socket(client):
    """A Reply in the box wakes nobody: once the client says in clientAsleep that it sleeps
    on the socket for this request, the worker answers there, or wakes it there if the
    answer already went into the box."""
    from phos.gpu_server.backends.emu import EmuBackend
    from phos.gpu_server.worker.loop import BOX, Worker
    from phos.gpu_server.worker.session import Session
    s = Session(EmuBackend(), 7, b"t" * 16)
    s.box = (LateSleeper if client == "falls asleep meanwhile" else wire.Mailbox)(np.zeros(wire.SLOTS_OFFSET, np.uint8))
    w = Worker(s, Sent())
    w.box_peer, w.box_seen, w.ack = b"client", 5, 5
    s.box.asleep[0] = 5 if client == "asleep" else 4         # 4: asleep for an earlier request
    w.send(BOX, [b"the reply"])
    if client == "asleep":
        assert w.sock == [[b"client", b"the reply"]] and s.box.seq(1) == 0
        return
    assert s.box.seq(1) == 5 and s.box.take(1) == b"the reply"
    if client == "watching":
        assert w.sock == []
    else:
        [(peer, wake)] = w.sock                               # an empty Reply: it only wakes the client
        with wire.decode(wire.Reply, wake) as reply:
            assert peer == b"client" and reply.ackSeq == 5 and len(reply.results) == 0


def test_a_replaced_staging_area_is_released_later_on_a_thread_of_its_own():
    """After a re-attach the old staging area goes a moment later, on another thread: its last
    unmapping frees its pages (milliseconds), which the re-attaching call must not wait for."""
    import mmap
    import threading
    import time
    import weakref
    from phos.client_stub.connection import release_later
    area = mmap.mmap(-1, 1 << 20)
    alive = weakref.ref(area)
    released_by = []
    weakref.finalize(area, lambda: released_by.append(threading.current_thread().name))
    release_later([area], after=0.2)
    del area
    assert alive() is not None, "released at once, on the caller's thread"
    deadline = time.monotonic() + 5
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert alive() is None and released_by == ["phos-staging-release"]


def test_a_call_does_not_spin_for_its_reply_among_greenlets(monkeypatch):
    """Under gevent (locust's users are greenlets of one process) a call waiting for its reply
    yields at once: a spin would hold every other user. Elsewhere it spins PHOS_SPIN_US."""
    import zmq
    from phos.client_stub import connection
    monkeypatch.setattr(connection, "SPIN", 0.001)
    monkeypatch.setattr(connection, "_zctx", connection._green_context())
    assert connection.reply_spin() == 0.0
    monkeypatch.setattr(connection, "_zctx", zmq.Context())
    assert connection.reply_spin() == 0.001
