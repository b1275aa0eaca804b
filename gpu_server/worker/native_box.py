"""The worker's synchronize round trip in C++ (gpu_server/native/mailbox.cpp, in phos/base/native.py's
library): the mailbox's plain ctxSynchronize requests answered in a spin, without Python.

The worker's loop calls serve() while its client is mid-burst (it would spin in Python
otherwise) and the context has nothing else going on (loop.py, Worker.box_serves_natively).
A request the native code does not answer stays in the box for the Python path: serve()
says so, and the loop's next look at the box takes it.
"""
import ctypes

import zmq

from phos.base import native
from phos.schema import wire

SPUN_OUT, FOR_PYTHON, WAKE, MESSAGE = range(4)       # mailbox.cpp's outcomes
_U64, _P = ctypes.c_uint64, ctypes.c_void_p


class BoxServer(ctypes.Structure):          # mailbox.cpp's, field for field
    _fields_ = [("area", _P), ("request_box", _U64), ("reply_box", _U64), ("asleep", _U64),
                ("call", _P), ("call_size", _U64), ("call_seq_at", _U64),
                ("reply", _P), ("reply_size", _U64), ("reply_ack_at", _U64), ("reply_seq_at", _U64),
                ("synchronize", _P), ("seen", _U64), ("ack", _U64), ("served", _U64),
                ("served_ns", _U64), ("socket_fd", ctypes.c_int64), ("control_fd", ctypes.c_int64)]


def load(path=None):
    """The native library with the mailbox's calls declared, or None where it was not built."""
    lib = native.library(path)
    if lib is None:
        return None
    lib.phos_box_serve.argtypes, lib.phos_box_serve.restype = [ctypes.POINTER(BoxServer), _U64], ctypes.c_int
    return lib


class NativeBox:
    """The compiled server of one staging area's mailbox. area: the staging area (a NumPy array
    of bytes, kept alive by the caller as long as this is used)."""
    CALL = wire.BARE_CALLS["ctxSynchronize"]
    REPLY = wire.PLAIN_REPLY

    def __init__(self, lib, area, sockets=()):
        """sockets: the ZeroMQ sockets whose messages end a spin (at most two)."""
        self.lib, self.area = lib, area
        fds = [sock.getsockopt(zmq.FD) for sock in sockets] + [-1, -1]
        self._call = ctypes.create_string_buffer(self.CALL.blank, len(self.CALL.blank))
        self._reply = ctypes.create_string_buffer(self.REPLY.blank, len(self.REPLY.blank))
        self.state = BoxServer(
            area=area.ctypes.data, request_box=wire.BOX_OFFSET, reply_box=wire.BOX_OFFSET + wire.BOX_SIZE,
            asleep=wire.ASLEEP_OFFSET, call=ctypes.addressof(self._call), call_size=len(self.CALL.blank),
            call_seq_at=self.CALL.offsets[0], reply=ctypes.addressof(self._reply), reply_size=len(self.REPLY.blank),
            reply_ack_at=self.REPLY.offsets[0], reply_seq_at=self.REPLY.offsets[1], socket_fd=fds[0], control_fd=fds[1])
        self.ref = ctypes.byref(self.state)

    def serve(self, synchronize, seen, ack, spin_ns):
        """Spin on the box for spin_ns, or until a socket may have a message (poll on its ZMQ_FD:
        the caller looked at its events, ZMQ_EVENTS, before), answering plain synchronizes (synchronize: the address
        of an `int f(void)` that waits for the device). Returns (outcome, seen, ack, served,
        seconds): the box's seq and the call seq taken last, how many were answered and the
        time they took."""
        s = self.state
        s.synchronize, s.seen, s.ack = synchronize, seen, ack
        outcome = self.lib.phos_box_serve(self.ref, spin_ns)
        return outcome, s.seen, s.ack, s.served, s.served_ns / 1e9
