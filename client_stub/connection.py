"""One client connection (a ZeroMQ DEALER) to a front end or a context worker.

Asynchronous calls are batched and sent without waiting; a synchronous call
flushes the batch with `wantReply` and waits. Calls a restored worker may lack stay
in `log` so that they can be replayed after a handoff or a recovery: those the server
has not acknowledged, or, when it takes recovery images, those after the latest
image's cut, with their host bytes (schema/phos.capnp, "Recovery").
"""
import collections
import ctypes
import fcntl
import itertools
import logging
import mmap
import os
import struct
import sys
import threading
import time

import numpy as np
import zmq
import zmq.utils.monitor

from phos.base import settings
from phos.schema import wire
from phos.schema.wire import Result, read_result
from phos.schema.cuda_types import CudaError, CUresult

log = logging.getLogger("phos.client")

BATCH_CALLS = 64                 # flush an asynchronous batch after this many calls (launches too)...
BATCH_BYTES = 1 << 20            # ...or this many payload bytes...
BATCH_LAUNCH_BYTES = 256 << 10   # ...or launch records: the Request frame stays under wire.MAX_CONTROL_FRAME
ZERO_COPY = 64 << 10             # payloads above this are sent from the caller's buffer
CONNECT_TIMEOUT = settings.connect_timeout()
GONE_TIMEOUT = settings.gone_timeout()
REATTACH_TIMEOUT = settings.reattach_timeout()   # look for a restored context this long
LOG_CALLS = settings.log_calls()        # the replay log holds this many calls...
LOG_BYTES = settings.log_bytes()      # ...and bytes, else it asks to shrink
# Spin this long for a reply before sleeping in poll: a wake-up costs more than a short spin
# where cores are plentiful. 1 ms, as the worker: a sync on a short kernel takes longer than a
# much shorter spin to serve, and its reply would then pay a wake-up. Off on small machines,
# where the spin would starve the peer.
SPIN = settings.spin_us() / 1e6
STAGING_SLOT = wire.SLOT_SIZE     # bulk copies go through a shared staging area in slots this big...
STAGING_MIN = wire.MIN_COPY       # ...when at least this big and the worker shares our host
POLLIN = int(zmq.POLLIN)         # a plain int: `&` with the enum costs microseconds in the spin
DOORBELL = wire.Request.new_message(version=wire.PROTOCOL_VERSION, doorbell=True).to_bytes()


_zctx = None
_monitor_ids = itertools.count()


def zmq_context():
    """The process's ZeroMQ context: a gevent-aware one when gevent has patched the process
    (locust users are greenlets), so a call waiting in poll lets the other greenlets run."""
    global _zctx
    if _zctx is None or _zctx.closed:
        gevent_monkey = sys.modules.get("gevent.monkey")
        if gevent_monkey is not None and gevent_monkey.is_module_patched("socket"):
            _zctx = _green_context()
        else:
            _zctx = zmq.Context()
    return _zctx


def reply_spin():
    """How long a call spins for its reply: SPIN, but not at all among gevent's greenlets
    (locust's users), where a spin holds every other user of the process."""
    return 0.0 if getattr(zmq_context(), "green", False) else SPIN


def _green_context():
    """zmq.green, with sends that always copy: pyzmq's zero-copy sends are tracked by its
    garbage-collector thread, which gevent's patched threading breaks (stalls, cut frames)."""
    import zmq.green as zmq_green

    class Socket(zmq_green.Socket):
        def send_multipart(self, msg_parts, flags=0, copy=True, track=False, **kwargs):
            super().send_multipart(msg_parts, flags, copy=True, **kwargs)
            return zmq.MessageTracker() if track else None      # copied: the caller's buffer is free now

    class Context(zmq_green.Context):
        _socket_class = Socket
        green = True          # reply_spin
    return Context()


# endpoint -> the CURVE public key (z85) of the server behind it, where it is not
# PHOS_SERVER_KEY's: a context handed off to a server with keys of its own (Reply.moved)
SERVER_KEYS = {}


def _configure_curve(sock, endpoint=""):
    """Encrypt and authenticate when the server asks for it (PHOS_SERVER_KEY, PHOS_CLIENT_KEY;
    the server behind `endpoint` by the key it was named with, SERVER_KEYS)."""
    server_key, learned = settings.server_key(), SERVER_KEYS.get(endpoint)
    if not server_key and not (learned and settings.client_key()):
        return
    import zmq.auth
    sock.curve_serverkey = learned or zmq.auth.load_certificate(server_key)[0]
    client = settings.client_key()
    if not client:
        raise CudaError(CUresult.CUDA_ERROR_NOT_PERMITTED, "PHOS_SERVER_KEY is set but PHOS_CLIENT_KEY is not")
    sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(client)


def connect(endpoint):
    """A DEALER connected (in the background) to a worker or front end, and its monitor socket."""
    sock = zmq_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    _configure_curve(sock, endpoint)
    # a unique name: pyzmq's default reuses the fd number, which a closed socket may still hold
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED,
                                      f"inproc://phos-monitor-{next(_monitor_ids)}")
    sock.connect(endpoint)
    return sock, monitor


def close_socket(sock, monitor):
    sock.disable_monitor()
    monitor.close()
    sock.close()


def release_later(holder, after=1.0):
    """Drop the staging area in holder (its only reference) a moment later, on a thread of its
    own. Its last unmapping frees its pages, which takes milliseconds that a re-attach after its
    worker died would otherwise add to the application's wait (its GIL is free meanwhile)."""
    def release():
        time.sleep(after)
        holder.clear()
    threading.Thread(target=release, name="phos-staging-release", daemon=True).start()


class Connection:
    def __init__(self, endpoint):
        self.ahead = None        # (endpoint, socket, monitor) connected ahead to where a handoff moves it (Reply.movingTo)
        self.open_socket(endpoint)
        self.seq = 0
        self.batch = []          # (seq, name, args, payload) not yet sent; args of launchBatch: its blob
        self.batch_calls = 0     # calls in the batch, each launch of a launchBatch counted
        self.batch_bytes = 0
        self.log = collections.deque()   # (seq, name, args, payload) sent, that a restored worker may lack
        self.log_bytes = 0       # host bytes the log holds
        self.recovery = False    # the worker takes recovery images: log every call after durable
        self.durable = 0         # the cut of its latest recovery image
        self.answered = 0        # after a re-attach: Results of calls up to here were delivered before
        self.standby = ""        # the server that restores the context if its own dies
        self.dtoh = {}           # seq -> writer(frame) for asynchronous device-to-host copies
        self.keep = set()        # seqs whose Results are kept for a later collect()
        self.kept = {}           # seq -> Result
        self.late_error = None   # a kept Result that failed, reported by the next synchronous call
        self.staging = None      # numpy view of the shared staging area, once the worker mapped it
        self.slot_seq = [0, 0]   # the last call that used each staging slot
        self.box = None          # its mailbox (wire.Mailbox), for synchronous calls
        self.box_seq = 0         # seq of our last mailbox request
        self.box_waiting = False # its reply has not been read yet
        self.find_again = None   # set for a context's worker: () -> (endpoint, attach args) of where it lives now
        self.moved_to = None     # (endpoint, standby) its retiring worker named after a handoff (Reply.moved)
        self.making_room = False # inside make_room
        self.outstanding = set() # seqs sent with wantReply whose Results have not come
        self.acked = 0           # the highest seq the worker acknowledged: we hold every call after it
        self.prefer = None       # a server the next re-attach asks first: a resumed process's (resume)

    def open_socket(self, endpoint):
        """Connect to endpoint; or take the connection made ahead to it, whose handshake is done
        (returns True then)."""
        self.endpoint = endpoint
        ahead = self.ahead is not None and self.ahead[0] == endpoint
        if ahead:
            _, self.sock, self.monitor = self.ahead
            self.ahead = None
        else:
            self.sock, self.monitor = connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        return ahead

    def close(self, keep_ahead=False):
        close_socket(self.sock, self.monitor)
        if not keep_ahead:
            self.drop_ahead()

    def drop_ahead(self):
        if self.ahead is not None:
            close_socket(*self.ahead[1:])
            self.ahead = None

    def connect_ahead(self, endpoint):
        """A handoff is about to move the context to endpoint (Reply.movingTo): connect now, so
        that the handshake is done by the time the re-attach needs it."""
        if self.ahead is not None and self.ahead[0] == endpoint:
            return
        self.drop_ahead()
        try:
            self.ahead = (endpoint, *connect(endpoint))
        except (CudaError, OSError, ValueError, zmq.ZMQError):
            pass        # keys or an endpoint that cannot be used: the re-attach will say so

    # -- sending ---------------------------------------------------------------------------
    def post(self, name, args=None, payload=None, on_bytes=None, want_reply=False, via_box=False):
        """Queue a call (sent at once if want_reply); returns its seq."""
        try:
            wire.check_args(name, args)      # here, not when its batch is encoded with later calls
        except ValueError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, str(e)) from None
        if self.log_full():
            self.make_room()
        self.seq += 1
        if want_reply:
            self.outstanding.add(self.seq)
        big = payload is not None and len(payload) > ZERO_COPY
        if payload is not None and (not big or self.recovery):
            payload = bytes(payload)      # capture now: the caller may reuse its buffer at once
        self.batch.append((self.seq, name, args, payload))
        if on_bytes is not None:
            self.dtoh[self.seq] = on_bytes
        if payload is not None:
            self.batch_bytes += len(payload)
        self.batch_calls += 1
        if want_reply or big or self.batch_calls >= BATCH_CALLS or self.batch_bytes >= BATCH_BYTES:
            self.flush(want_reply, via_box)
        return self.seq

    def post_launch(self, function, config, params):
        """Queue a launch: appended to the batch's last entry when that is a launchBatch.

        The entry's seq becomes this launch's, so it stays the seq of its last launch, and
        each launch takes one seq as if sent alone (phos.capnp, "Launch batches")."""
        try:
            record = wire.launch_record(function, config, params)    # before taking a seq
        except struct.error as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch: a dimension or size does not fit ({e})") from None
        if self.log_full():
            self.make_room()
        self.seq += 1
        last = self.batch[-1] if self.batch else None
        if last is not None and last[1] == "launchBatch":
            blob = last[2]
            blob += record
            self.batch[-1] = (self.seq, "launchBatch", blob, None)
        else:
            blob = bytearray(record)
            self.batch.append((self.seq, "launchBatch", blob, None))
        self.batch_calls += 1
        if self.batch_calls >= BATCH_CALLS or len(blob) >= BATCH_LAUNCH_BYTES:
            self.flush()

    def call(self, name, args=None, payload=None, timeout=None):
        """Run a synchronous call: flush the batch, wait for the reply, return its Result."""
        result = self.wait(self.post(name, args, payload, want_reply=True, via_box=True), timeout)
        if self.late_error is not None and result.status == 0:
            result, self.late_error = self.late_error, None
        return result

    def flush(self, want_reply=False, via_box=False):
        """Send the batch. via_box: the caller waits for the reply at once, so the mailbox may carry it."""
        if not self.batch:
            return
        if want_reply and len(self.batch) == 1 and self.batch[0][2] is None and self.batch[0][1] in wire.BARE_CALLS:
            seq, name, _, _ = self.batch[0]
            return self.send_frames([wire.BARE_CALLS[name].fill(seq)], via_box)
        self.send_frames(wire.encode_request(self.batch, want_reply), via_box)

    def send_frames(self, frames, via_box):
        """Send an encoded batch: through the mailbox when allowed and possible, else the socket."""
        for call in self.batch:        # a launchBatch's blob is never appended to once sent
            if self.recovery:
                call = self.off_staging(call, self.staging, htod_only=True)   # the slot will be reused
            self.log.append(call)
            self.log_bytes += log_size(call)
        self.batch, self.batch_calls, self.batch_bytes = [], 0, 0
        if via_box and self.box is not None and len(frames) == 1:
            if self.box.put(0, self.box_seq + 1, frames[0]):
                self.box_seq += 1
                self.box_waiting = True
                if not self.box.awake[0]:          # the worker may be asleep: ring
                    self.sock.send(DOORBELL)
                return
        big = any(len(f) > ZERO_COPY for f in frames[1:])
        while True:
            try:
                tracker = self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=not big, track=big)
                break
            except zmq.Again:      # the queue to the worker is full: it reads no more, or not yet
                if self.unblock():
                    return         # re-attached elsewhere: the log's replay sent these calls again
        if big:                    # the caller may reuse its buffer once zmq has handed it off
            tracker.wait()

    def unblock(self):
        """The socket's queue to the worker is full: an application that only makes
        asynchronous calls would block here for good if its worker retired (a handoff) or
        died. Read what the worker sent, a Reply naming where a handoff moved the context
        among it; then re-attach there (True: the replay carried the calls not yet sent), or
        wait a moment for room."""
        while (frames := self.next_reply()) is not None:
            refused = self.take_reply(frames, 0)        # a whole request refused: seq 0
            if refused is not None and self.late_error is None:
                self.late_error = refused
        if self.moved_to is not None and self.find_again is not None:
            self.reattach(self.seq + 1)      # no call of ours waits: none can be lost at the cut
            return True
        self.sock.poll(100, zmq.POLLOUT)
        return False

    def over_bound(self):
        return len(self.log) > LOG_CALLS or self.log_bytes > LOG_BYTES

    def log_full(self):
        """Whether the log must shrink before the next call, and may: a Result someone waits
        for would be lost in make_room's own wait unless it is one that route() keeps."""
        return self.over_bound() and not self.making_room and self.outstanding <= self.keep

    def make_room(self):
        """Ask the worker to acknowledge (and, with recovery, to take an image) until the log
        may drop enough; a slow image holds the application back."""
        self.making_room = True
        deadline = time.monotonic() + REATTACH_TIMEOUT
        try:
            while self.over_bound():
                res = self.call("logFull")
                if res.status:
                    raise CudaError(res.status, res.message)
                self.durable = max(self.durable, res.u64s[0])
                self.acknowledge(self.acked)
                if self.over_bound():
                    if time.monotonic() > deadline:
                        raise CudaError(CUresult.CUDA_ERROR_NOT_READY, f"the replay log stayed full for {REATTACH_TIMEOUT:g} s: "
                                        "the worker took no recovery image")
                    time.sleep(0.005)
        finally:
            self.making_room = False

    # -- receiving -------------------------------------------------------------------------
    def wait(self, seq, timeout=None):
        if seq in self.kept:
            return self.kept.pop(seq)
        deadline = None if timeout is None else time.monotonic() + timeout
        gone_since = None
        spin_end = time.perf_counter() + reply_spin()
        while True:
            frames = self.next_reply()
            if frames is None and time.perf_counter() < spin_end:
                continue
            if frames is None and self.box_waiting and self.box.asleep[0] != self.box_seq:
                self.box.asleep[0] = self.box_seq      # the worker answers over the socket, which wakes us
                continue                               # (one more look: it may have answered just now)
            if frames is None and self.sock in dict(self.poller.poll(1 if self.box_waiting else 200)):
                frames = self.next_reply()      # (the monitor wakes us too: a dead worker is noticed at once)
            if frames is not None:
                result = self.take_reply(frames, seq)
                if result is not None:
                    self.box_waiting = False     # answered over the socket if it did not fit the box
                    self.outstanding.discard(seq)
                    return result
                if self.moved_to is None:
                    continue
            now = time.monotonic()
            while self.monitor.poll(0):
                event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
                gone_since = None if event == zmq.EVENT_CONNECTED else now
                if gone_since is not None:
                    log.info("the connection to the worker at %s closed, waiting for call %d", self.endpoint, seq)
            if self.moved_to is not None:     # handed off: no need to wait until the worker has gone
                gone_since = gone_since or now
            if deadline is not None and now > deadline:
                raise CudaError(CUresult.CUDA_ERROR_NO_DEVICE, f"no phos server answered at {self.endpoint} within {timeout:g} s")
            if gone_since is not None and self.find_again is not None:
                if self.box_waiting and self.box.seq(1) == self.box_seq or self.sock.getsockopt(zmq.EVENTS) & POLLIN:
                    continue                 # the worker answered, then left (ctxDestroy): read the answer first
                self.reattach(seq)           # the worker went away: find the context again and replay
                gone_since, spin_end = None, time.perf_counter() + reply_spin()
                continue
            if gone_since is not None and now - gone_since > GONE_TIMEOUT:
                raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED, f"the phos server at {self.endpoint} went away")

    def next_reply(self):
        """A reply's frames if one has arrived, in the mailbox or on the socket; else None."""
        if self.box_waiting and self.box.seq(1) == self.box_seq:
            self.box_waiting = False
            return [self.box.take(1)]
        if self.sock.getsockopt(zmq.EVENTS) & POLLIN:
            return self.sock.recv_multipart(copy=False)
        return None

    def take_reply(self, frames, seq):
        """Apply a Reply: deliver copied bytes, drop acknowledged calls; return our Result if present."""
        body = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        plain = wire.PLAIN_REPLY.read(body)
        if plain is not None:        # the commonest reply, read without capnp
            self.acknowledge(plain[0])
            return self.route(Result(plain[1], 0, "", [], 0.0, "", b"", None, []), seq)
        mine = None
        with wire.decode(wire.Reply, body) as reply:
            self.durable = max(self.durable, reply.durableSeq)
            self.acknowledge(reply.ackSeq)
            if reply._has("output"):          # device printf: show it where the application runs
                print(reply.output, end="", flush=True)
            if reply._has("moved"):           # handed off: re-attach there (wait)
                self.moved_to = (reply.moved.endpoint, reply.moved.standby)
                if reply.moved.serverKey:     # a server with keys of its own: authenticate it by them
                    SERVER_KEYS[reply.moved.endpoint] = reply.moved.serverKey.encode()
            if reply._has("movingTo"):
                if reply.movingTo.serverKey:
                    SERVER_KEYS[reply.movingTo.endpoint] = reply.movingTo.serverKey.encode()
                self.connect_ahead(reply.movingTo.endpoint)
            for r in reply.results:
                mine = self.route(read_result(r, frames), seq) or mine
        return mine

    def acknowledge(self, ack_seq):
        """Drop the calls no restored worker can lack: acknowledged ones, or with recovery
        images, those up to the latest image's cut."""
        self.acked = max(self.acked, ack_seq)
        floor = self.log_floor()
        while self.log and self.log[0][0] <= floor:
            self.log_bytes -= log_size(self.log.popleft())

    def log_floor(self):
        """The log holds every call after this seq."""
        return self.durable if self.recovery else self.acked

    def route(self, res, seq):
        """Deliver one Result; returns it if it answers `seq`."""
        self.outstanding.discard(res.seq)
        if res.seq <= self.answered and res.seq != seq and res.seq:
            return None                   # replayed after a recovery: its Result was delivered before
        writer = self.dtoh.pop(res.seq, None)
        if writer is not None and res.status == 0 and res.payload is not None:
            writer(res.payload)
        if res.seq == seq or (res.seq == 0 and res.status):   # seq 0: the whole request was refused
            return res
        if res.seq in self.keep:      # a staged copy nobody waits for: its failure is deferred
            self.keep.discard(res.seq)
            self.kept[res.seq] = res
            if res.status and self.late_error is None:
                self.late_error = res
        return None


    # -- a whole-process checkpoint (client_stub/agent.py) ------------------------------------
    def detach(self):
        """Every call sent and answered, then the socket closed and the staging area dropped: the
        process's image holds no call in flight, no unread Reply and no connection to a server.
        A failure the drain collects stays for the application's next synchronizing call."""
        res = self.call("ctxSynchronize")
        if res.status and self.late_error is None:
            self.late_error = res
        self.close()
        self.open_socket("inproc://phos-detached")      # reattach closes a socket first
        self.forget_staging()

    def forget_staging(self):
        """The staging area was the worker's we talked to: the next one maps one of its own."""
        self.staging, self.box, self.box_waiting, self.slot_seq = None, None, False, [0, 0]

    def resume(self, server):
        """Attach again through the front end at `server` first (the same worker, or one that
        restored the context's image anywhere); nothing is in flight, so nothing is resent."""
        self.prefer = server
        self.reattach(self.seq + 1)

    # -- re-attaching to a restored context ---------------------------------------------------
    def reattach(self, seq):
        """Attach to wherever the context lives now, then resend what its image lacks.

        The restored worker has executed every call up to the image's cut (attach's u64s[2]);
        we resend the unacknowledged calls after it. Calls we no longer hold are lost: then
        the context cannot go on, and we say so."""
        started = time.perf_counter()
        deadline, why, old_staging, passed_over = time.monotonic() + REATTACH_TIMEOUT, "", None, False
        while True:
            told = self.moved_to is not None and not passed_over
            try:
                endpoint, args = self.find_again(passed_over)
            except CudaError as e:
                if e.status == CUresult.CUDA_ERROR_NOT_PERMITTED:
                    raise
                why, passed_over = e.message, False
            else:
                found = time.perf_counter()
                old_staging = self.staging if self.staging is not None else old_staging
                self.close(keep_ahead=True)
                ahead = self.open_socket(endpoint)
                self.forget_staging()
                try:
                    res = self.attach(args, lambda a: self.call_now("attach", a))
                except CudaError as e:
                    res = Result(0, e.status, e.message, [], 0.0, "", b"", None, [])
                if res.status == 0:
                    log.info("context re-attached at %s in %.1f ms (%s in %.1f, attached in %.1f%s)", endpoint,
                             (time.perf_counter() - started) * 1e3, "told by its old worker" if told else "found",
                             (found - started) * 1e3, (time.perf_counter() - found) * 1e3,
                             ", connected ahead" if ahead else "")
                    break
                why, passed_over = res.message, True      # where it pointed, nobody answered for the context
            if time.monotonic() > deadline:
                raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED,
                                f"the context's worker went away and no server restored it within {REATTACH_TIMEOUT:g} s ({why})")
            time.sleep(0.1)
        cut = res.u64s[2]
        floor = self.log_floor()
        if floor > cut:
            raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED,
                            f"the context was restored from an image taken at call {cut}, but calls {cut + 1}..{floor} "
                            "are no longer held to replay: it cannot continue")
        if seq <= cut:        # it ran there, and its answer (a copy's bytes, say) is lost with the worker
            raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED,
                            f"the context was restored from an image taken at call {cut}, which ran call {seq}, but "
                            f"its answer never came ({'told by its old worker' if told else 'found'}): it cannot continue")
        replay = [c for c in self.log if c[0] > cut]     # a batch runs whole, so none straddles the cut
        self.log.clear()
        self.log_bytes, self.durable, self.answered = 0, cut, max(self.answered, self.acked)
        pending, self.batch, self.batch_calls, self.batch_bytes = self.batch, [], 0, 0
        for call in [self.off_staging(c, old_staging) for c in replay] + pending:
            self.batch.append(call)          # in Requests no bigger than the ones first sent
            self.batch_calls, self.batch_bytes = self.batch_calls + 1, self.batch_bytes + log_size(call)
            if call[0] in self.outstanding or self.batch_calls >= BATCH_CALLS or self.batch_bytes >= BATCH_LAUNCH_BYTES:
                self.flush(want_reply=call[0] in self.outstanding)
        self.flush(want_reply=True)
        if old_staging is not None:
            release_later([old_staging])
            del old_staging
        log.info("replayed %d calls after the image's cut; %.1f ms since the worker went", len(replay),
                 (time.perf_counter() - started) * 1e3)

    def off_staging(self, call, area, htod_only=False):
        """A copy that named a staging area (one being replayed, or logged with recovery on):
        its bytes travel as frames instead."""
        seq, name, args, payload = call
        if not isinstance(args, dict) or not args.get("viaShm") or htod_only and name != "memcpyHtoD":
            return call
        off, size = args["shmOffset"], args["size"]
        args = {k: v for k, v in args.items() if k not in ("viaShm", "shmOffset")}
        if name == "memcpyHtoD":
            return seq, name, args, area[off:off + size].tobytes()
        self.dtoh[seq] = host_writer(area[off:off + size], size)    # the caller reads the bytes from there
        return seq, name, args, None

    def call_now(self, name, args):
        """Send one call alone, as seq 0 (it takes no place in the call stream), and wait for its Result."""
        self.sock.send(wire.encode_request([(0, name, args, None)])[0])
        find_again, self.find_again = self.find_again, None     # no re-attaching from inside a re-attach
        try:
            return self.wait(0, timeout=CONNECT_TIMEOUT)
        finally:
            self.find_again = find_again

    # -- the shared staging area ------------------------------------------------------------
    def attach(self, args, call):
        """Attach through call(args), offering a staging area; its file is gone whatever happens."""
        offer = self.offer_staging()
        if offer:
            args = dict(args, shmPath=offer[0], shmCookie=offer[1], shmSize=offer[2])
        accepted = False
        try:
            res = call(args)
            accepted = res.status == 0 and len(res.u64s) > 1 and res.u64s[1] == 1
            if res.status == 0 and len(res.u64s) > 3:
                self.recovery, self.standby = bool(res.u64s[3]), res.text or self.standby
            return res
        finally:
            if offer:
                self.accept_staging(accepted)

    def offer_staging(self):
        """Make a staging file the worker may map: (path, cookie, size), or None if it can't share our
        host. A memfd sealed against shrinking, as the native stub makes it (session.cpp,
        create_shared_file): a file cut short under the worker's mapping would kill the worker."""
        if not (self.endpoint.startswith("ipc://") or self.endpoint.startswith("tcp://127.") or settings.staging() is True):
            return None
        if settings.staging() is False:
            return None
        size = wire.SLOTS_OFFSET + 2 * STAGING_SLOT
        cookie = os.urandom(wire.COOKIE_BYTES)
        fd = os.memfd_create("phos", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, cookie, 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            area = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        self._offer = (fd, area)
        return f"/proc/{os.getpid()}/fd/{fd}", cookie, size

    def accept_staging(self, accepted):
        """The worker answered the offer; the file's descriptor, its name, is closed either way."""
        fd, area = self._offer
        os.close(fd)
        self.staging = np.frombuffer(area, np.uint8) if accepted else None
        if accepted:
            self.box = wire.Mailbox(self.staging)
        else:
            area.close()

    def _slot(self, i):
        """Staging slot i once the worker is done with it; returns (offset, view)."""
        if self.slot_seq[i]:
            self.collect(self.slot_seq[i])
        off = wire.SLOTS_OFFSET + i * STAGING_SLOT
        return off, self.staging[off:off + STAGING_SLOT]

    def collect(self, seq):
        """Wait for a kept call (take_reply defers its failure to the next synchronous call)."""
        if seq in self.keep or seq in self.kept:
            self.wait(seq)

    def copy_to_device(self, dst, src, nbytes, stream):
        """Host-to-device copy; returns once the caller's buffer may be reused."""
        if self.staging is None or nbytes < STAGING_MIN:
            self.post("memcpyHtoD", {"dst": dst, "size": nbytes, "stream": stream}, host_bytes(src, nbytes))
            return
        view = np.frombuffer(host_bytes(src, nbytes), np.uint8)
        for n, start in enumerate(range(0, nbytes, STAGING_SLOT)):
            i = n % 2
            chunk = view[start:start + STAGING_SLOT]
            off, slot = self._slot(i)
            slot[:len(chunk)] = chunk
            seq = self.post("memcpyHtoD", {"dst": dst + start, "size": len(chunk), "stream": stream, "viaShm": True,
                                           "shmOffset": off, "chunkOffset": start, "totalSize": nbytes}, want_reply=True)
            self.keep.add(seq)
            self.slot_seq[i] = seq

    def copy_from_device(self, dst, src, nbytes, stream):
        """Device-to-host copy, waiting for the bytes. Returns a failed Result, or None."""
        if self.staging is None or nbytes < STAGING_MIN:
            write = host_writer(dst, nbytes)
            res = self.call("memcpyDtoH", {"src": src, "size": nbytes, "stream": stream})
            if res.status == 0:
                write(res.payload)
            return res if res.status else None
        out = np.frombuffer(host_bytes_writable(dst, nbytes), np.uint8)
        chunks = list(range(0, nbytes, STAGING_SLOT))
        inflight = collections.deque()

        def issue(n):
            i = n % 2
            off, slot = self._slot(i)
            size = min(STAGING_SLOT, nbytes - chunks[n])
            seq = self.post("memcpyDtoH", {"src": src + chunks[n], "size": size, "stream": stream, "viaShm": True,
                                           "shmOffset": off, "chunkOffset": chunks[n], "totalSize": nbytes}, want_reply=True)
            self.slot_seq[i] = 0          # waited for below, in order
            inflight.append((seq, n, slot[:size]))

        for n in range(min(2, len(chunks))):
            issue(n)
        failure = None
        while inflight:
            seq, n, slot = inflight.popleft()
            res = self.wait(seq)
            if res.status:
                failure = failure or res
            else:
                out[chunks[n]:chunks[n] + len(slot)] = slot
            if n + 2 < len(chunks) and failure is None:
                issue(n + 2)
        if self.late_error is not None and failure is None:
            failure, self.late_error = self.late_error, None
        return failure


def log_size(call):
    """The host bytes a logged call holds: its payload, or a launchBatch's blob."""
    seq, name, args, payload = call
    return (len(payload) if payload is not None else 0) + (len(args) if name == "launchBatch" else 0)


def host_bytes_writable(dst, nbytes):
    """A writable view of a host buffer or int address."""
    if nbytes < 0:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a copy of {nbytes} bytes")
    if isinstance(dst, int):
        return (ctypes.c_char * nbytes).from_address(dst)
    view = memoryview(dst).cast("B")
    if view.readonly or view.nbytes < nbytes:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"host buffer must be writable and hold {nbytes} bytes")
    return view[:nbytes]


def host_bytes(src, nbytes):
    """The first nbytes of a host buffer (bytes-like, NumPy array or int address), without copying buffers."""
    if nbytes < 0:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a copy of {nbytes} bytes")
    if isinstance(src, int):
        return ctypes.string_at(src, nbytes)
    view = memoryview(src).cast("B")
    if view.nbytes < nbytes:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"host buffer holds {view.nbytes} bytes, copy wants {nbytes}")
    return view[:nbytes]


def host_writer(dst, nbytes):
    """A function that writes a received frame into a host buffer or int address."""
    out = np.frombuffer(host_bytes_writable(dst, nbytes), np.uint8)

    def write(frame):
        out[:] = np.frombuffer(frame.buffer, np.uint8)
    return write
