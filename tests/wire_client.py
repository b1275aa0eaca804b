"""Hand-made data-plane frames for tests that play a careless or hostile client.

RawSession speaks phos.capnp directly, without the client stub's own checks: what a
tenant that bypasses the stub can send to the front end and to its context worker.
"""
import fcntl
import itertools
import os

import zmq

from phos.schema import wire

TIMEOUT_MS = 15000


def dealer(endpoint, timeout_ms=TIMEOUT_MS):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(endpoint)
    return sock


def encode(calls, seqs, want_reply=True, version=wire.PROTOCOL_VERSION):
    """A Request frame from (name, args): args None (Void), a dict of fields, or a value (Data members)."""
    return wire.encode_request([(seq, name, args, None) for seq, (name, args) in zip(seqs, calls)], want_reply, version)[0]


def client_file(size, cookie, name="phos", sealed=True):
    """A file for a worker to map, as the client stub makes it (session.cpp, create_shared_file):
    a memfd of this process of `size` bytes starting with `cookie`, sealed against shrinking and
    growing. (its name for the worker, its descriptor); the caller closes the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, cookie[:size], 0)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return f"/proc/{os.getpid()}/fd/{fd}", fd


def decode_reply(frames):
    """[(seq, status, message, u64s, payload frame or None)] of a Reply's frames."""
    with wire.decode(wire.Reply, frames[0]) as reply:
        return [(r.seq, r.status, r.message, list(r.u64s),
                 frames[r.payload] if 0 < r.payload < len(frames) else None) for r in reply.results]


class RawSession:
    """A context of our own, driven by raw frames: ctxCreate on the front end, attach on the worker."""

    def __init__(self, address):
        self.front = dealer(address)
        self.seqs = itertools.count(1)
        [(_, status, message, u64s, _)] = self.call_on(self.front, ("ctxCreate", {"device": 0, "flags": 0}), raw=True)
        assert status == 0, message
        self.ctx = u64s[0]
        self.endpoint, self.token = self._last_text, self._last_data
        self.sock = dealer(self.endpoint)
        results = self.call(("attach", {"ctx": self.ctx, "token": self.token}))
        assert results[-1][1] == 0, results

    def call_on(self, sock, *calls, payloads=(), raw=False):
        """Send calls in one Request wanting a reply; returns the Reply's results."""
        sock.send_multipart([encode(calls, [next(self.seqs) for _ in calls]), *payloads])
        frames = sock.recv_multipart()
        if raw:              # keep the text and data fields too (ctxCreate's endpoint and token)
            with wire.decode(wire.Reply, frames[0]) as reply:
                r = reply.results[-1]
                self._last_text, self._last_data = r.text, bytes(r.data)
        return decode_reply(frames)

    def call(self, *calls, payloads=()):
        return self.call_on(self.sock, *calls, payloads=payloads)

    def status(self, *calls, payloads=()):
        """(status, message) of the last call."""
        return self.call(*calls, payloads=payloads)[-1][1:3]

    def close(self, destroy=True):
        if destroy:
            try:
                self.call(("ctxDestroy", None))
            except zmq.Again:
                pass
        self.sock.close()
        self.front.close()
