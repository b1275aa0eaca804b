"""The worker's compiled mailbox (gpu_server/native/mailbox.cpp, gpu_server/worker/native_box.py): plain
synchronizes answered in a spin, every other request left in the box for the Python path.

The client's side is played here: its requests are put in a staging area's request box as the
stub puts them (wire.Mailbox), and a stand-in synchronize records its calls. tests/e2e/test_mailbox.py
runs the same path between a real client and worker (on emu: its synchronize waits for nothing).
"""
import ctypes
import os

import numpy as np
import pytest

from conftest import ROOT
from phos.base import native
from phos.gpu_server.worker import native_box
from phos.gpu_server.backends.emu import EmuBackend
from phos.gpu_server.worker.control import State
from phos.gpu_server.worker.loop import Worker
from phos.gpu_server.worker.session import Session
from phos.schema import wire

LIBRARY = os.path.join(ROOT, "phos", "stub", native.LIBRARY)
SYNCHRONIZE = ctypes.CFUNCTYPE(ctypes.c_int)
SLICE_NS = 2_000_000
ILLEGAL_ADDRESS = 700


@pytest.fixture
def lib():
    if not os.path.exists(LIBRARY):
        pytest.fail(f"{LIBRARY} is not built: make -C client_stub/native")
    return native_box.load(LIBRARY)


class Client:
    """A staging area's client: posts requests in the box and reads the replies."""

    def __init__(self):
        self.area = np.zeros(wire.SLOTS_OFFSET, np.uint8)
        self.box = wire.Mailbox(self.area)
        self.posted = 0

    def post(self, frame):
        self.posted += 1
        assert self.box.put(0, self.posted, frame)
        return self.posted

    def sync(self, seq):
        return self.post(wire.BARE_CALLS["ctxSynchronize"].fill(seq))

    def reply(self):
        """(box seq, ackSeq, the result's seq) of the reply box's Reply, which must be plain."""
        frame = self.box.take(1)
        ack, seq = wire.PLAIN_REPLY.read(frame)
        return self.box.seq(1), ack, seq


class StandIn:
    """A synchronize: counts its calls; `then` runs inside each (the client acting meanwhile)."""

    def __init__(self, status=0, then=None):
        self.calls, self.status, self.then = 0, status, then
        self.pointer = SYNCHRONIZE(self.run)         # kept alive while the native code may call it
        self.address = ctypes.cast(self.pointer, ctypes.c_void_p).value

    def run(self):
        self.calls += 1
        if self.then:
            self.then(self.calls)
        return self.status


def test_plain_synchronizes_are_answered_in_the_box(lib):
    client, sync = Client(), None
    # each synchronize's caller posts the next one as soon as it has its answer: here, meanwhile
    sync = StandIn(then=lambda n: n < 3 and client.sync(11 + n))
    box = native_box.NativeBox(lib, client.area)
    client.sync(11)
    outcome, seen, ack, served, seconds = box.serve(sync.address, 0, 10, SLICE_NS)
    assert (outcome, seen, ack, served, sync.calls) == (native_box.SPUN_OUT, 3, 13, 3, 3)
    assert 0 < seconds < SLICE_NS / 1e9
    assert client.reply() == (3, 13, 13)


@pytest.mark.parametrize("case", ["a call sent before it has not run", "another bare call", "the client sleeps on it",
                                  "a capnp request"])
def test_other_requests_stay_in_the_box_for_python(lib, case):
    client, sync = Client(), StandIn()
    if case == "a call sent before it has not run":
        client.sync(12)                      # the worker ran call 10; 11 is on its way by socket
    elif case == "another bare call":
        client.post(wire.BARE_CALLS["ctxDestroy"].fill(11))     # the same shape, another call
    elif case == "the client sleeps on it":
        client.box.asleep[0] = client.sync(11)
    else:
        client.post(wire.encode_request([(11, "ctxSynchronize", None, None), (12, "ctxSynchronize", None, None)])[0])
    before = client.area.copy()
    outcome, seen, ack, served, _ = native_box.NativeBox(lib, client.area).serve(sync.address, 0, 10, SLICE_NS)
    assert (outcome, seen, ack, served, sync.calls) == (native_box.FOR_PYTHON, 0, 10, 0, 0)
    assert (client.area == before).all()


def test_a_failed_synchronize_is_left_for_python_to_tell(lib):
    """The Python path runs it again and says what failed (the device's error is sticky)."""
    client, sync = Client(), StandIn(status=ILLEGAL_ADDRESS)
    client.sync(11)
    outcome, seen, ack, served, _ = native_box.NativeBox(lib, client.area).serve(sync.address, 0, 10, SLICE_NS)
    assert (outcome, seen, ack, served, sync.calls) == (native_box.FOR_PYTHON, 0, 10, 0, 1)
    assert client.box.seq(1) == 0


def test_a_client_that_falls_asleep_as_it_is_answered_is_woken(lib):
    client = Client()
    sync = StandIn(then=lambda n: client.box.asleep.__setitem__(0, 1))
    client.sync(11)
    outcome, seen, ack, served, _ = native_box.NativeBox(lib, client.area).serve(sync.address, 0, 10, SLICE_NS)
    assert (outcome, seen, ack, served) == (native_box.WAKE, 1, 11, 1)
    assert client.reply() == (1, 11, 11)


def test_a_message_on_a_socket_ends_the_spin(lib):
    """The worker's loop takes socket messages between spins: one arriving ends a spin at once
    (ZMQ_FD readable), not when its slice ends."""
    import threading
    import time
    import zmq
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        b.bind("inproc://box-test")
        a.connect("inproc://box-test")
        assert not b.getsockopt(zmq.EVENTS) & zmq.POLLIN       # looked at, as the loop does before a spin
        box = native_box.NativeBox(lib, Client().area, [b])
        threading.Timer(0.05, a.send, (b"a launch batch",)).start()
        t = time.perf_counter()
        outcome, *_ = box.serve(StandIn().address, 0, 10, 5_000_000_000)
        assert outcome == native_box.MESSAGE and time.perf_counter() - t < 2.0
        assert b.recv() == b"a launch batch"
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


class Sent(list):
    """The worker's socket: what it sent. It has no descriptor for the spin to watch."""

    def send_multipart(self, frames, copy=True, flags=0):
        self.append([bytes(f) for f in frames])

    def getsockopt(self, option):
        return -1


@pytest.fixture
def worker(lib, monkeypatch):
    """A worker on emu whose client's staging area is mapped, its call 10 run."""
    monkeypatch.setattr(native_box, "load", lambda path=None: lib)
    client = Client()
    s = Session(EmuBackend(), 7, b"t" * 16)
    s.shm, s.box = client.area, wire.Mailbox(client.area)
    w = Worker(s, Sent())
    w.box_peer, w.box_seen, w.ack = b"client", 0, 10
    w.client = client
    return w


def test_the_worker_answers_natively_while_nothing_else_goes_on(worker):
    worker.client.sync(11)
    assert worker.box_serves_natively()
    assert (worker.box_seen, worker.ack, worker.serving[0]) == (1, 11, 1)
    assert worker.client.reply() == (1, 11, 11)
    assert worker.sock == []


@pytest.mark.parametrize("busy", ["an asynchronous call's error waits", "printed output waits", "a checkpoint runs",
                                  "the context is frozen"])
def test_the_worker_leaves_the_box_to_python_while_more_goes_on(worker, busy):
    s = worker.session
    if busy == "an asynchronous call's error waits":
        s.deferred = (1, "memset: out of range")
    elif busy == "printed output waits":
        s.backend.output.append("hello\n")
    elif busy == "a checkpoint runs":
        s.snapshotting = True
    else:
        worker.control.state = State.FROZEN
    worker.client.sync(11)
    assert not worker.box_serves_natively()
    assert (worker.box_seen, worker.ack) == (0, 10) and worker.client.box.seq(1) == 0
    assert worker.box_ready()            # the Python path's to take
