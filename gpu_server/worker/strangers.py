"""Peers of a worker's client socket that have not attached.

Any local peer can reach a worker's ipc socket, and any admitted CURVE key its tcp one. The
worker refuses such a peer's calls, but it must never wait for it: its attached client's
replies wait for room in the client's queue (Worker.send_to), and a stranger's refusals
queued the same way held the worker, and its owner, for as long as the stranger read none.
So a stranger's refusal is sent only where its queue has room, else dropped, and a peer that
keeps sending without attaching is cut off: its messages are ignored and its connection
closed (it may connect again, as anyone may, and is cut off again)."""
import collections
import logging
import os
import socket
import time

import zmq

log = logging.getLogger("phos.worker")

REFUSALS = 64          # refusals a peer gets before it is cut off (a client that lost its token needs one)
REMEMBERED = 4096      # routing ids remembered at most: an old one is forgotten, not the table grown
WARN_EVERY = 10.0      # seconds between two warnings about one peer's bad input


class Strangers:
    def __init__(self, sock, refusals=REFUSALS):
        self.sock, self.refusals = sock, refusals
        self.sent = collections.OrderedDict()    # routing id -> refusals sent to it
        self.cut_off = 0

    def seen(self, peer, frame, keep=()):
        """A message from a peer that has not attached: False where the peer is cut off (ignore
        the message). keep: descriptors never to close (the attached client's connections)."""
        n = self.sent.get(peer, 0)
        if n < self.refusals:
            return True
        if n == self.refusals:
            self.sent[peer] = n + 1
            self.hang_up(frame, keep)
        return False

    def attached(self, peer):
        self.sent.pop(peer, None)

    def answer(self, peer, frames):
        """A refusal, sent only where the stranger's queue has room."""
        if peer not in self.sent and len(self.sent) >= REMEMBERED:
            self.sent.popitem(last=False)
        self.sent[peer] = self.sent.get(peer, 0) + 1
        try:
            self.sock.send_multipart([peer, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass                  # it reads nothing: the refusal goes, not the worker's time
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise

    def hang_up(self, frame, keep):
        self.cut_off += 1
        if self.cut_off == 1 or self.cut_off % 100 == 0:     # said once, then once in a while
            log.warning("a peer that never attached sent more than %d requests: cut off (%d so far)",
                        self.refusals, self.cut_off)
        try:
            fd = frame.get(zmq.SRCFD)      # the connection this message came by, open now
        except (zmq.ZMQError, AttributeError):
            return
        if fd in keep:
            return
        # shutdown, not close: the descriptor stays ZeroMQ's, which sees the connection end and
        # drops it, and reads nothing more of it
        try:
            with socket.socket(fileno=os.dup(fd)) as conn:
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass                  # already gone


class PeerWarnings:
    """Warnings about what peers send (malformed frames), each peer's at most once in WARN_EVERY
    seconds, the next one counting those left unsaid: a peer sending 25k malformed frames wrote
    3 MB of log, a warning each. The peer still gets its error reply every time."""

    def __init__(self, logger, every=WARN_EVERY):
        self.log, self.every = logger, every
        self.last = collections.OrderedDict()     # peer -> [when last said, how many since unsaid]

    def warn(self, peer, message, *args):
        now = time.monotonic()
        entry = self.last.get(peer)
        if entry is not None and now - entry[0] < self.every:
            entry[1] += 1
            return
        if entry is None and len(self.last) >= REMEMBERED:
            self.last.popitem(last=False)
        unsaid = entry[1] if entry is not None else 0
        self.last[peer] = [now, 0]
        self.last.move_to_end(peer)
        if unsaid:
            message += f" (and {unsaid} more from this peer in the last {self.every:g} s, unlogged)"
        self.log.warning(message, *args)
