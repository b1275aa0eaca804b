"""A context worker's loop: one OS process that owns one context (DESIGN decision 6).

After the handshake the client talks to this process directly. The hot path is a
tight synchronous ZeroMQ loop rather than an await per call: a worker serves one
client, and an event-loop round per call would cost more than the call itself.

Started by the front end as `python -m phos.gpu_server.worker ...`; it reads its
session token (and CURVE secret, if any) from stdin, binds, then prints
`READY <endpoint>` on stdout, or `ERROR <status> <message>` if the context could
not be created.
"""
import argparse
import collections
import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time

import zmq
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator

from phos.gpu_server.backends import load_backend
from phos.base import settings
from phos.gpu_server.client_keys import ClientKeys, frame_user_id, peer_credentials, pid_alive
from phos.gpu_server.worker import native_box
from phos.gpu_server.worker.module_cache import ModuleCache
# at import, not at the first attach: a handoff's client would wait 1.1-1.7 ms for it there (emu)
from phos.gpu_server.worker.recovery import Recovery, module_globals_noted
from phos.gpu_server.worker.strangers import PeerWarnings, Strangers
from phos.schema import wire
from phos.schema.control import remove_socket_file
from phos.schema.wire import build_reply, error_reply
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot import engine
from phos.snapshot.host_store import open_store
from phos.snapshot.image import ImageError, check_token

from phos.gpu_server.worker.session import Session

log = logging.getLogger("phos.worker")
ORPHAN_GRACE = settings.orphan_grace()   # seconds without a client before the context is freed
MOST_KEEP = 3600.0        # seconds a context may wait for a client that said it comes back (keep)
ATTACH_TIMEOUT = settings.attach_timeout()
REATTACH_TIMEOUT = settings.restore_grace()   # a restored context waits this long for its client
RECOVERY_PAUSED_BYTES = settings.recovery_paused_bytes()   # a recovery image this small is taken paused
# A restore on demand loads in the background once its client has attached and gone quiet
# this long (its re-attach and first calls served first: a loader thread would slow them
# down, competing for the interpreter), or by the deadline, whoever attached.
LOADER_QUIET, LOADER_DEADLINE = 0.002, 0.1
SLOW_MESSAGE = 0.1       # seconds: a message served slower than this is logged (INFO)
SLOW_CONTROL = 0.005     # ... and a control call (a checkpoint's start, say) slower than this
CATCH_UP_WAIT = 30.0     # seconds a mailbox request waits, with nothing arriving, for calls sent before it
PROGRESS_EVERY = 0.2     # seconds between progress Results of a checkpoint
# After a message, keep checking for the next one this long before sleeping in poll.
SPIN = settings.spin_us() / 1e6
NATIVE_BOX_SLICE_NS = 200_000  # a spin on the mailbox in compiled code, unless a socket has a message
# A paced worker (a handoff's rounds must converge) holds its client's calls for a share of
# each period this long, and serves one of its messages a period at most: short, so that each
# hold stays far below a handoff's downtime.
PACE_PERIOD = 0.005
PROFILE_DIR = settings.profile_dir()   # cProfile each checkpoint's run into DIR/checkpoint-PID-NS.prof
PROFILE_WORKER = bool(PROFILE_DIR and settings.profile_workers())   # ... or the whole loop into DIR/worker-PID.prof
POLLIN = int(zmq.POLLIN)   # a plain int: `&` with the enum costs microseconds, twice a loop
EVENTS = int(zmq.EVENTS)   # ... and getsockopt makes an enum of the enum it is given
BOX = object()            # the "peer" of a request that came through the shared mailbox


class Worker:
    def __init__(self, session, sock, ctl=None, control_token=b"", recovery=None, standby=""):
        self.session, self.sock = session, sock
        self.ctl, self.control_token = ctl, control_token   # the front end's control socket
        self.ctl_peers = set()
        self.job = None            # (peer, seq) of the control call a running checkpoint answers
        self.progress_at = 0.0
        self.grace = ATTACH_TIMEOUT   # how long to wait for a client before freeing the context
        self.kept_for = 0.0           # the grace after the client's next hang-up, if it said it comes back (keep)
        self.waited_for = False       # ... and a new connection made it wait anew since a client last attached
        self.first_call_loaded = None # a restore on demand: bytes loaded when the first call touched memory
        self.accepted_at = time.perf_counter()     # when the socket last accepted a connection (the monitor says)
        self.frozen = False        # a handoff's last image is being taken, or taken: hold the client's calls
        self.control_steps = {}    # where a control call's time went (ms), for its log line if it was slow
        self.pace = None           # (since, share): hold the client's calls for that share of each PACE_PERIOD
        self.paced_served = -1     # ... and the period in which the last of its messages was served
        self.early = False         # ... and its delta goes to the front end before it is committed
        self.attached = set()      # routing ids that presented the token
        self.strangers = Strangers(sock)   # ... and those that did not: never waited for
        self.warnings = PeerWarnings(log)  # about what peers send, rate-limited for each
        self.client_keys = None    # with CURVE: the admitted clients (gpu_server/client_keys.py)
        self.peer_keys = {}        # ... and the key each attached routing id came with
        self.keys_checked = 0.0    # when the attached clients' keys were last checked
        self.backlog = collections.deque()   # (peer, frames) of replies waiting for room in the client's queue
        self.busy_since = None     # when the calls running now began (run_calls), else None
        self.client_fds = {}       # their connections' descriptors: the context lives while one is open;
        #                            each with its client's pid where it is on this host (ClientWatch)
        self.pending = []          # results waiting for the next reply
        self.ack = 0
        self.box_peer = None       # routing id of the client whose mailbox is mapped
        self.box_seen = 0          # seq of the last mailbox request taken
        self.box_by_socket = False # answer it over the socket
        self.recovery_options = recovery   # (directory, every seconds, every calls) or None
        self.standby_server = standby      # the server that restores us if ours dies, told to clients
        self.told_durable = 0              # the last Reply.durableSeq sent
        self.last_image = (None, None, (), None)  # (store, name, chunk keys, (regions, keys)) of the last image committed
        self.queued_checkpoint = None      # (peer, seq, args) of a control checkpoint waiting for it
        self.warm = None                   # the Restore the context came from (advance_restore: until a client attaches)
        self.last_call = 0.0               # when the last message was served
        self.loader_by = 0.0               # a restore on demand starts loading in the background by then
        self.profiler = None               # PROFILE_DIR's, while a checkpoint runs
        self.serving = [0, 0.0]            # messages served and their seconds, since a checkpoint began or ended
        self.served_before = self.serving  # ... and before the running one began
        self.native_box = None             # the compiled server of the mailbox (box_serves_natively)
        self.box_answers = [0, 0]          # mailbox requests answered in compiled code, and by Python
        self.native_box_lib = native_box.load() if settings.native_box() else None

    def handle(self, frames):
        """Serve one message: [routing id, Request, payload...]. False: it was a doorbell and
        the mailbox held nothing (the loop had served its request already): no message served."""
        if len(frames) < 2:
            log.warning("dropped a message with no request frame")
            return
        peer, body, payloads = frames[0].bytes, frames[1], frames[2:]
        if peer not in self.attached and not self.strangers.seen(peer, frames[0], self.client_fds):
            return
        bare = wire.read_bare_call(body.bytes if hasattr(body, "bytes") else body) if len(frames) == 2 else None
        if bare and peer in self.attached:
            return self.run_bare(peer, *bare)
        try:
            with wire.decode(wire.Request, body) as req:
                if req.version != wire.PROTOCOL_VERSION:
                    return self.send(peer, error_reply(CUresult.CUDA_ERROR_NOT_SUPPORTED,
                                     f"protocol version {req.version}; this server speaks {wire.PROTOCOL_VERSION}"))
                if req.doorbell:
                    return self.serve_box(by_socket=True) if peer in self.attached else False
                if (why := wire.too_many_calls(req)) is not None:
                    return self.send(peer, error_reply(CUresult.CUDA_ERROR_INVALID_VALUE, why))
                self.run_calls(peer, req, payloads, frames[0])
        except wire.MALFORMED as e:
            self.warnings.warn(peer, "malformed frame from a client: %s", wire.describe(e))
            self.send(peer, error_reply(CUresult.CUDA_ERROR_INVALID_VALUE, f"malformed request: {wire.describe(e)}"))

    def run_calls(self, peer, req, payloads, peer_frame=None):
        self.busy_since = time.monotonic()       # ClientWatch: a call that runs long, and whose client left
        try:
            self._run_calls(peer, req, payloads, peer_frame)
        finally:
            self.busy_since = None

    def _run_calls(self, peer, req, payloads, peer_frame):
        calls = req.calls
        if peer is not BOX and peer not in self.attached:
            if not (len(calls) and calls[0].which() == "attach" and self.check_attach(calls[0].attach)):
                return self.send(peer, error_reply(CUresult.CUDA_ERROR_INVALID_CONTEXT,
                                 "not attached to this context: the first call must be attach with the session token"))
            self.attached.add(peer)
            self.strangers.attached(peer)
            self.waited_for = False
            if isinstance(peer_frame, zmq.Frame):
                fd = peer_frame.get(zmq.SRCFD)       # the connection it came by (monitor events name it)
                creds = peer_credentials(fd)
                self.client_fds[fd] = creds[0] if creds and creds[0] else None     # its pid, known on this host
                self.session.client = creds
                if self.client_keys is not None:
                    self.peer_keys[peer] = frame_user_id(peer_frame) or ""
        n, want_reply = len(calls), req.wantReply
        execute = self.session.execute
        attached = None        # (when the attach began, ms mapping its staging area took)
        for i, call in enumerate(calls):
            name = call.which()
            last = want_reply and i == n - 1
            if name == "attach":
                a, t0 = call.attach, time.perf_counter()
                shm = bool(a.shmPath) and self.session.map_staging(a.shmPath, bytes(a.shmCookie), a.shmSize)
                attached = (t0, (time.perf_counter() - t0) * 1e3)
                if shm:
                    self.box_peer, self.box_seen = peer, self.session.box.seq(0)
                self.start_recovery(restored=self.warm)      # kept: dropping it here woke its threads (~1 ms)
                status, message, fields = CUresult.CUDA_SUCCESS, "", {
                    "u64s": [self.session.ctx_id, int(shm), self.ack, int(self.session.recovery is not None)],
                    "text": self.standby_server if self.session.recovery is not None else ""}
            else:
                status, message, fields = execute(name, getattr(call, name), payloads, last)
            if last or fields or status:      # only these need their seq: reading it costs a microsecond
                self.pending.append((call.seq, status, message, fields))
        if n and calls[n - 1].seq:      # seq 0: an attach that takes no place in the call stream
            self.ack = calls[n - 1].seq
        if want_reply:
            results, self.pending = self.pending, []
            self.send(peer, build_reply(self.ack, results, self.session.backend.take_output(), self.news()))
        if attached is not None:      # where a re-attach's time goes (perf/bench_handoff.py shows these lines)
            log.info("context %d: a client attached, %.1f ms after its connection was accepted (its staging area "
                     "mapped in %.1f ms, answered in %.1f ms)", self.session.ctx_id, (attached[0] - self.accepted_at) * 1e3,
                     attached[1], (time.perf_counter() - attached[0]) * 1e3)

    def catch_up(self, first):
        """Run the calls sent over the socket before a mailbox request whose first call is `first`.

        They were sent before it on this host, so they are here or on the way, however late: the
        client's ZeroMQ thread writes them, and on a loaded host it may not run for seconds while
        the mailbox, written by the application's thread, is already read. Running the request
        before them would answer it from a state they have not made yet (a copy's stale bytes). So
        they are waited for while the client lives, up to CATCH_UP_WAIT with none arriving (a
        client that lied), and the serve loop takes over when it died."""
        quiet_since = time.monotonic()
        while self.ack < first - 1 and not self.session.closing:
            if self.sock.poll(100):
                self.handle(self.sock.recv_multipart(copy=False))
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > CATCH_UP_WAIT or not self.client_alive():
                break
        if self.ack < first - 1:
            log.warning("context %d: calls %d..%d, sent before mailbox request %d, never came",
                        self.session.ctx_id, self.ack + 1, first - 1, first)

    def client_alive(self):
        """Whether a client connection is open whose process runs (or, over TCP, may)."""
        return any(pid is None or pid_alive(pid) for pid in self.client_fds.values())

    def run_bare(self, peer, name, seq):
        """A synchronous call with no arguments, read without capnp (wire.BARE_CALLS)."""
        self.busy_since = time.monotonic()
        try:
            status, message, fields = self.session.execute(name, None, [], True)
        finally:
            self.busy_since = None
        self.ack = seq
        results, self.pending = self.pending + [(seq, status, message, fields)], []
        self.send(peer, build_reply(seq, results, self.session.backend.take_output(), self.news()))

    def news(self):
        """The latest recovery image's cut, if the client has not been told it yet (else 0)."""
        r = self.session.recovery
        if r is None or r.durable <= self.told_durable:
            return 0
        self.told_durable = r.durable
        return r.durable

    def served(self, since):
        """A message was served since `since`: counted (serving), and a running checkpoint's
        trace shows it beside its steps (phase `calls`)."""
        self.last_call = now = time.perf_counter()
        if self.pace is not None:
            self.paced_served = (now - self.pace[0]) // PACE_PERIOD
        self.serving[0] += 1
        self.serving[1] += now - since
        if now - since > SLOW_MESSAGE:
            log.info("context %d: a message took %.1f ms to serve (restoring: %s, checkpoint: %s)", self.session.ctx_id,
                     (now - since) * 1e3, self.session.restoring is not None, self.session.checkpoint is not None)
        if self.session.checkpoint is not None:
            self.session.checkpoint.step("calls", since)

    def revoked(self):
        """Whether an attached client's key was revoked (its file removed): it ends the context."""
        self.keys_checked = time.monotonic() + 1.0
        gone = [peer for peer, key in self.peer_keys.items() if not self.client_keys.still_admitted(key)]
        if gone:
            log.warning("context %d: its client's key is no longer admitted: ending the context", self.session.ctx_id)
        return bool(gone)

    def call_waiting(self):
        return self.box_ready() or bool(self.sock.getsockopt(EVENTS) & POLLIN)

    def box_ready(self):
        box = self.session.box
        return box is not None and box.seq(0) != self.box_seen

    def serve_box(self, by_socket=False):
        """Run the request waiting in the mailbox, after every call sent before it by socket.

        by_socket: a doorbell woke us, so the client is likely asleep in poll: answer there.
        False when the mailbox holds no new request."""
        if not self.box_ready():
            return False
        box = self.session.box
        self.box_seen = box.seq(0)
        self.box_by_socket = by_socket
        self.box_answers[1] += 1
        try:
            frame = box.take(0)
            bare = wire.read_bare_call(frame)
            if bare:
                self.catch_up(bare[1])
                return self.run_bare(BOX, *bare)
            with wire.decode(wire.Request, frame) as req:
                if req.version != wire.PROTOCOL_VERSION or req.doorbell:
                    return self.send(BOX, error_reply(CUresult.CUDA_ERROR_NOT_SUPPORTED, "bad mailbox request"))
                self.catch_up(wire.first_seq(req.calls[0]) if len(req.calls) else 0)
                self.run_calls(BOX, req, [])
        except wire.MALFORMED as e:
            log.warning("malformed mailbox request: %s", wire.describe(e))
            self.send(BOX, error_reply(CUresult.CUDA_ERROR_INVALID_VALUE, f"malformed request: {wire.describe(e)}"))

    def box_serves_natively(self):
        """Spin on the mailbox in compiled code for a slice, answering the client's plain
        synchronizes there (gpu_server/worker/native_box.py), where the context has nothing else going
        on: no checkpoint, restore or recovery image (they watch the calls), nothing frozen, no
        reply, result or error waiting. False where it may not: the Python loop serves."""
        s = self.session
        if self.native_box_lib is None or s.box is None or self.box_peer is None or s.snapshotting \
                or s.recovery is not None or s.sticky or s.deferred or self.frozen or self.pace or self.backlog \
                or self.pending:
            return False
        synchronize = s.backend.native_synchronize()
        if not synchronize:
            return False
        if self.native_box is None or self.native_box.area is not s.shm:      # a re-attach maps a new area
            self.native_box = native_box.NativeBox(self.native_box_lib, s.shm,
                                                   [sock for sock in (self.sock, self.ctl) if sock is not None])
        self.busy_since = time.monotonic()       # ClientWatch: a synchronize that never ends
        try:
            outcome, self.box_seen, self.ack, served, seconds = self.native_box.serve(
                synchronize, self.box_seen, self.ack, NATIVE_BOX_SLICE_NS)
        finally:
            self.busy_since = None
        if served:
            self.box_answers[0] += served
            self.last_call = time.perf_counter()
            self.serving[0] += served
            self.serving[1] += seconds
        if outcome == native_box.WAKE:      # it fell asleep as we answered
            self.send_to(self.box_peer, build_reply(self.ack, []))
        return True

    def check_attach(self, attach):
        return attach.ctx == self.session.ctx_id and check_token(attach.token, self.session.token_digest)

    def send(self, peer, frames):
        if peer is BOX:      # answer in the reply box when it fits and its client watches it, else over the socket
            box = self.session.box
            if not self.box_by_socket and len(frames) == 1 and box.asleep[0] != self.box_seen and box.put(1, self.box_seen, frames[0]):
                if box.asleep[0] == self.box_seen:      # it fell asleep as we answered: wake it
                    self.send_to(self.box_peer, build_reply(self.ack, []))
                return
            peer = self.box_peer
        self.send_to(peer, frames)

    def send_to(self, peer, frames):
        """A message to one client. The socket routes mandatorily: where the client's queue is
        full (it sends without reading), the reply waits in our backlog, and we read nothing
        more from the client until it has room (the loop: wait_for_room), so that its sends
        block instead of its replies being dropped; a client that is gone loses them. A peer
        that has not attached is never waited for (gpu_server/worker/strangers.py)."""
        if peer not in self.attached:
            return self.strangers.answer(peer, frames)
        self.backlog.append((peer, frames))
        self.flush_backlog()

    def flush_backlog(self):
        """Send what the backlog holds, oldest first, while there is room; True when it is empty."""
        while self.backlog:
            peer, frames = self.backlog[0]
            try:
                self.sock.send_multipart([peer, *frames], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
            self.backlog.popleft()
        return True

    def wait_for_room(self, room):
        """The backlog waits for the client's queue: serve the front end meanwhile, not the client."""
        ready = dict(room.poll(50))
        if self.ctl is not None and self.ctl in ready:
            self.handle_control(self.ctl.recv_multipart(copy=False))
        elif self.sock in ready and not self.flush_backlog():
            time.sleep(0.001)       # room for another peer's queue, not this one's

    # -- the control socket: the front end's checkpoint, restore and stats ------------------
    # (ControlRequest and ControlReply in schema/phos.capnp; read and written by schema/wire.py)
    def handle_control(self, frames):
        if len(frames) < 2:
            return
        peer = frames[0].bytes
        try:
            seq, kind, args = wire.read_control(frames[1])
        except wire.MALFORMED as e:
            log.warning("malformed control frame: %s", wire.describe(e))
            self.answer_control(peer, 0, "failed", (CUresult.CUDA_ERROR_INVALID_VALUE, f"malformed request: {wire.describe(e)}"))
            return
        self.control_call(peer, seq, kind, args)

    def control_call(self, peer, seq, kind, args):
        t, self.control_steps = time.perf_counter(), {}
        try:
            if kind == "attach":
                if args.token != self.control_token or not self.control_token:
                    raise CudaError(CUresult.CUDA_ERROR_NOT_PERMITTED, "wrong control token")
                self.ctl_peers.add(peer)
                answer = ("done", None)
            elif peer not in self.ctl_peers:
                raise CudaError(CUresult.CUDA_ERROR_NOT_PERMITTED, "attach with the control token first")
            elif kind not in CONTROL_CALLS:
                raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED, f"request {kind!r} is not served on the control socket")
            else:
                answer = CONTROL_CALLS[kind](self, peer, seq, args)
            if answer is not None:        # None: answered later (a checkpoint)
                self.answer_control(peer, seq, *answer)
        except CudaError as e:
            self.answer_control(peer, seq, "failed", (e.status, f"{kind}: {e.message}"))
        except Exception as e:     # a bug of ours: fail the call loudly, keep the context
            log.exception("context %d: control call %s raised", self.session.ctx_id, kind)
            self.answer_control(peer, seq, "failed", (CUresult.CUDA_ERROR_UNKNOWN, f"{kind}: internal error: {type(e).__name__}: {e}"))
        if time.perf_counter() - t > SLOW_CONTROL:      # the client's calls waited for it
            log.info("context %d: control call %s took %.1f ms%s", self.session.ctx_id, kind, (time.perf_counter() - t) * 1e3,
                     "".join(f", {k} {v:.1f}" for k, v in self.control_steps.items()))

    def answer_control(self, peer, seq, kind, value=None):
        """One ControlReply (wire.control_reply's kinds and values)."""
        self.ctl.send_multipart([peer, wire.control_reply(seq, kind, value)])

    def start_checkpoint(self, peer, seq, a):
        s = self.session
        if s.checkpoint is not None and self.recovering and self.queued_checkpoint is None:
            self.queued_checkpoint = (peer, seq, a)       # after the recovery image: it is seconds at most
            return None
        if s.checkpoint is not None or s.restoring is not None:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "a checkpoint or restore of this context is still running")
        self.begin_checkpoint(a.store, a.name, a.parent, a.paused, a.compress, a.chunkSize, a.precopy, not a.noSync,
                              a.rate)
        # Frozen from the cut on: a call run while the image is still being written would be
        # acknowledged to the client, yet missing from the image the target restores.
        self.frozen = a.freeze and a.paused
        self.early = self.frozen and a.early     # its delta goes out before the commit (Checkpoint.early)
        self.job, self.progress_at = (peer, seq), time.monotonic()
        self.tick()

    def begin_checkpoint(self, store_path, name, parent="", paused=False, compress=False, chunk_size=0, precopy=False,
                         sync=True, rate=0):
        s = self.session
        t = time.perf_counter()
        try:
            store = open_store(store_path, fsync=sync)
        except (OSError, ImageError) as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"image store {store_path!r}: {e}") from None
        opened = time.perf_counter()
        last_store, last_name, last_keys, last_layout = self.last_image     # its chunks need no asking the store
        ours = bool(parent) and (last_store, last_name) == (store.path, parent)
        cp = engine.Checkpoint(s, store, name, parent=parent or None, paused=paused, compress=compress,
                               chunk_size=chunk_size or engine.DEFAULT_CHUNK_SIZE, precopy=precopy,
                               known=last_keys if ours else (), prior=last_layout if ours else None, rate=rate)
        self.control_steps = {"open_store": (opened - t) * 1e3, "new_checkpoint": (time.perf_counter() - opened) * 1e3}
        try:
            cp.map_ahead()
            if cp.before_cut:
                # Its cut waits for the memory it maps ahead (tick), the application's calls
                # served meanwhile. It is the session's checkpoint already: other checkpoints
                # and restores are refused or queued as while it runs.
                s.checkpoint, s.snapshotting = cp, True
            else:
                self.take_cut(cp, paused)
        except BaseException:
            cp.abort()
            raise

    def take_cut(self, cp, paused=False):
        """Take checkpoint cp's cut now, at the last call answered: it runs from then on."""
        cp.cut(self.ack, paused=paused)
        s = self.session
        s.checkpoint, s.snapshotting = cp, True
        self.served_before, self.serving = self.serving, [0, 0.0]
        if PROFILE_DIR and not PROFILE_WORKER:
            import cProfile
            self.profiler = cProfile.Profile()
            self.profiler.enable()

    # -- recovery images (gpu_server/worker/recovery.py) -----------------------------------------
    def start_recovery(self, restored=None):
        """The context is live here: take recovery images of it from now on, if the server does.
        restored: the Restore it came from (at the cut self.ack)."""
        s = self.session
        if self.recovery_options is None or s.recovery is not None:
            return
        s.recovery = Recovery(self.recovery_options[0], s.ctx_id, *self.recovery_options[1:])
        if restored and restored.store.path == os.path.abspath(s.recovery.path):
            s.recovery.restored_from(restored.name, self.ack)       # its parent, as it is in our store
            self.remember(restored)          # the chunks it holds

    def remember(self, job):
        """The image a Checkpoint committed, or a Restore came from, is the last image here: a
        checkpoint with it as parent need not ask the store about its chunks (begin_checkpoint)."""
        self.last_image = (job.store.path, job.name, job.chunk_keys(), (job.chunks.regions, job.keys))

    @property
    def recovering(self):
        """The running checkpoint is a recovery image (begun, not yet committed or failed)."""
        r = self.session.recovery
        return r is not None and r.running is not None

    def take_recovery_image(self):
        r = self.session.recovery
        paused = r.paused(self.session.space.used(), RECOVERY_PAUSED_BYTES)
        path, name, parent = r.begin(paused)
        try:
            self.begin_checkpoint(path, name, parent, paused=paused)
        except Exception as e:       # the store is full or gone: the client keeps its log, we try again later
            r.failed(getattr(e, "message", None) or f"{type(e).__name__}: {e}")

    def start_restore(self, peer, seq, a):
        s = self.session
        if a.advance:
            return self.advance_restore(a)
        if s.objects or s.space.allocations() or s.restoring is not None or self.attached:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "this worker already holds a context")
        try:
            r = engine.Restore(s, open_store(a.store, create=False), a.name)
            s.globals_noted = module_globals_noted(r.store.path)
        except (OSError, ImageError) as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"image store {a.store!r}: {e}") from None
        try:
            s.take_base(getattr(r.manifest, "address_space", {}).get("base", s.space.base))
            sess = getattr(r.manifest, "session", None)
            if isinstance(sess, dict) and "tenant" in sess:
                s.join_tenant(sess["tenant"])     # before its allocations are made again: each is charged
            self.ack = r.recreate()
            s.restoring, s.snapshotting = r, True
            t = time.perf_counter()
            r.start(full=a.full, deferred=not a.warm)
            r.step("load" if a.full else "start", t)
            self.loader_by = time.perf_counter() + LOADER_DEADLINE
        except BaseException:
            s.closing = True          # half a context: let the front end start a fresh worker
            raise
        self.grace, self.standby, self.alone_since = REATTACH_TIMEOUT, False, time.monotonic()
        self.waited_for = False       # its client's connection, which may come any time now, gives it the grace anew
        self.warm = r
        self.tick()
        return self.restored(r)

    def advance_restore(self, a):
        """A handoff's last image, for the warm copy restored here from an earlier one."""
        r, s = self.warm, self.session
        if r is None or self.attached or os.path.abspath(a.store) != r.store.path:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "this worker holds no restore to advance")
        cut = r.advance(a.name, a.full, a.delta)
        if cut is None:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"image {a.name!r} holds other objects: restore it afresh")
        self.ack = cut
        s.restoring, s.snapshotting = r, True
        self.tick()
        return self.restored(r)

    def restored(self, r):
        """The restore's reply: the context, its cut and what is loaded so far."""
        return "restored", {"ctx": self.session.ctx_id, "cut_seq": self.ack, "name": r.name, "bytes": r.bytes_total,
                            "loaded": r.bytes_done, "phase_ms": r.phase_ms}

    def set_tenant(self, peer, seq, a):
        """A new context's tenant, from the front end before it hands the context out."""
        if self.attached or self.session.restoring is not None:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "a context in use gets no tenant")
        self.session.join_tenant(a.name)
        return "done", None

    def thaw(self, peer, seq, a):
        self.frozen, self.pace = False, None
        return "done", None

    def keep(self, peer, seq, a):
        """The client will hang up and come back (a whole-process checkpoint: its process is
        dumped between): after its next hang-up the context waits a.seconds for it."""
        if not 0.0 < a.seconds <= MOST_KEEP:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"keep: {a.seconds:g} s; more than 0, at most {MOST_KEEP:g}")
        self.kept_for = a.seconds
        if not self.client_fds:            # it hung up already
            self.grace = max(self.grace, a.seconds)
        return "done", None

    def set_pace(self, peer, seq, a):
        """Hold the client's calls for a.hold of each PACE_PERIOD from now on (0: no longer), and
        serve one of its messages a period at most (else a client that fell behind catches up in
        the rest of the period): a handoff slows an application that writes about as fast as its
        rounds travel, so that they shrink, and its last one (the downtime) is small. Control
        messages and a running checkpoint go on meanwhile."""
        if not 0.0 <= a.hold <= settings.MOST_HOLD:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE,
                            f"pace: a hold of {a.hold:g} of the time; 0 to {settings.MOST_HOLD:g}")
        self.pace = (time.perf_counter(), a.hold) if a.hold > 0 else None
        return "done", None

    def held_by_pace(self):
        """Seconds the client's calls wait still in the current period, or 0."""
        since, hold = self.pace
        period, into = divmod(time.perf_counter() - since, PACE_PERIOD)
        if into < hold * PACE_PERIOD:
            return hold * PACE_PERIOD - into
        return PACE_PERIOD - into if period == self.paced_served else 0.0

    def retire(self, peer, seq, a):
        """The context lives at a.endpoint now: say so to the client, which attaches there at
        once (without asking a front end, ~1 ms), and exit."""
        if not self.frozen:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "only a frozen context (after a handoff's last image) retires")
        self.session.closing = True
        if self.session.recovery is not None:
            self.session.recovery.retire()
        if a.endpoint:
            moved = build_reply(self.ack, [], moved=(a.endpoint, a.standby, a.server_key))
            for client in self.attached:
                self.send_to(client, moved)
        log.info("context %d: retired at call %d, its clients told of %s (%d replies wait for room)", self.session.ctx_id,
                 self.ack, a.endpoint or "nowhere", len(self.backlog))
        return "done", None

    def tell_moving_to(self, peer, seq, a):
        """A handoff is about to freeze the context for its move to a.endpoint: the client
        connects there ahead (Reply.movingTo), so that its re-attach finds the handshake done."""
        moving = build_reply(self.ack, [], moving_to=(a.endpoint, a.standby, a.server_key))
        for client in self.attached:
            self.send_to(client, moving)
        return "done", None

    def ctx_stats(self, peer, seq, a):
        s = self.session
        if self.warm is not None and self.warm.failure is not None:
            # its image was damaged: the admin API lists it as "failed" on this status
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"the context failed: {self.warm.error().message}")
        job = s.checkpoint or s.restoring
        return "stats", {"bytes": s.space.used(), "allocations": len(s.space.allocations()), "last_seq": self.ack,
                         "checkpoint": s.checkpoint is not None, "restoring": s.restoring is not None,
                         "done": job.bytes_done if job else 0, "total": job.bytes_total if job else 0,
                         "first_call_loaded": self.first_call_loaded}

    def tick(self):
        """Finish or report on a running checkpoint; retire a restore whose loading ended."""
        s = self.session
        cp = s.checkpoint
        if cp is not None and cp.before_cut:
            if not cp.mapped:
                cp = None              # nothing to step, finish or report before its cut
            else:
                try:
                    self.take_cut(cp)
                except Exception as e:     # answered below, as a checkpoint that failed while copying
                    if not isinstance(e, CudaError):
                        log.exception("context %d: a checkpoint's cut failed", s.ctx_id)
                    cp.fail(e)
        if cp is not None:             # its copies run in steps on this thread, between calls
            cp.advance(busy=self.call_waiting)
        if cp is not None and not cp.running:
            sent = []      # the delta, once it went out: the target may be adopting it
            # the time a message took to serve, before the checkpoint and during it: what its
            # steps and copies cost the application's calls (perf/bench_snapshot.py)
            served = {"before": [self.served_before[0], round(self.served_before[1] * 1e3, 3)],
                      "during": [self.serving[0], round(self.serving[1] * 1e3, 3)]}
            self.serving = [0, 0.0]

            def send_delta(delta):
                self.answer_control(*self.job, "delta", delta)
                sent.append(True)
            try:
                result = cp.finish(self.ack, send_delta if self.early and self.job else None)
                self.remember(cp)
                result["messages_served"] = served
                answer = ("checkpointed", result)
            except Exception as e:     # the image is lost, not the context
                if not isinstance(e, CudaError):
                    log.exception("context %d: checkpoint failed", s.ctx_id)
                    e = CudaError(CUresult.CUDA_ERROR_UNKNOWN, f"{type(e).__name__}: {e}")
                result, answer = None, ("failed", (e.status, f"checkpoint: {e.message}"))
                # A handoff's last round failed: the context goes on here, unless its delta went
                # out first; the target may hold the context then, and the front end decides.
                self.frozen = bool(sent)
            s.checkpoint = None
            if self.profiler is not None:
                self.profiler.disable()
                self.profiler.dump_stats(os.path.join(PROFILE_DIR, f"checkpoint-{os.getpid()}-{time.monotonic_ns()}.prof"))
                self.profiler = None
            if self.recovering:
                if result:
                    log.info("context %d: recovery image %s at call %d: %d of %d bytes copied in %.1f ms, paused %.1f ms",
                             s.ctx_id, result["name"], result["cut_seq"], result["copied_bytes"], result["bytes"],
                             result["seconds"] * 1e3, result["pause_ms"])
                s.recovery.committed(result["cut_seq"], result["copied_bytes"], result["pause_ms"]) if result else s.recovery.failed(answer[1][1])
                queued, self.queued_checkpoint = self.queued_checkpoint, None
                if queued:
                    try:
                        self.start_checkpoint(*queued)
                    except CudaError as e:
                        self.answer_control(*queued[:2], "failed", (e.status, f"checkpoint: {e.message}"))
            elif self.job:
                self.answer_control(*self.job, *answer)
                self.job = None
        elif cp is not None and self.job and time.monotonic() - self.progress_at > PROGRESS_EVERY:
            self.progress_at = time.monotonic()
            self.answer_control(*self.job, "progress", (cp.bytes_done, cp.bytes_total))
        r = s.restoring
        if r is not None and r.loader_held:
            now = time.perf_counter()
            if now > self.loader_by or self.attached and now - self.last_call > LOADER_QUIET:
                r.start_loader()
        if r is not None and r.first_touch is not None and self.first_call_loaded is None:
            self.first_call_loaded = r.first_touch
        if r is not None and r.failure is not None and s.sticky is None:
            e = r.error()                  # a chunk failed its check: the context cannot go on, from the next call
            s.sticky = (e.status, e.message)
        if r is not None and not r.running:
            try:
                r.wait()
            except CudaError as e:
                s.sticky = (e.status, e.message)
            s.restoring = None
            log.info("context %d: restore of image %s loaded %d bytes in %.1f ms (calls first touched memory after "
                     "%s bytes)", s.ctx_id, r.name, r.bytes_done, (time.perf_counter() - r.started) * 1e3, r.first_touch)
        s.snapshotting = s.checkpoint is not None or s.restoring is not None

    def serve(self, monitor, standby=False):
        """Loop until the context is destroyed or its client is gone for the grace period.

        standby: a pre-started worker waits for a client (or a restore) without a deadline."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        if self.ctl is not None:
            poller.register(self.ctl, zmq.POLLIN)
        self.standby, self.alone_since = standby, time.monotonic()
        awake = False
        held = zmq.Poller()      # while frozen: the front end only (connection events wait for a thaw)
        if self.ctl is not None:
            held.register(self.ctl, zmq.POLLIN)
        recovery_check = 0.0
        room = zmq.Poller()      # while replies wait in the backlog: room for them, and the front end
        room.register(self.sock, zmq.POLLOUT)
        if self.ctl is not None:
            room.register(self.ctl, zmq.POLLIN)
        while not self.session.closing:
            if self.client_keys is not None and time.monotonic() > self.keys_checked and self.revoked():
                return
            if self.backlog and not self.flush_backlog():
                self.wait_for_room(room)
                continue
            if self.session.snapshotting:
                self.tick()
            elif self.session.recovery is not None and not self.frozen and time.perf_counter() > recovery_check:
                recovery_check = time.perf_counter() + 0.01     # a clock read per call is enough; due() is more
                if self.session.recovery.due(self.ack):
                    self.take_recovery_image()
            if self.frozen:
                ready = dict(held.poll(50))
                if self.ctl is not None and self.ctl in ready:
                    self.handle_control(self.ctl.recv_multipart(copy=False))
                continue
            box = self.session.box
            if self.pace is not None and (left := self.held_by_pace()):
                # the client's calls wait; a running checkpoint's next step is ours to take (tick).
                # The mailbox is looked at as the hold ends: a doorbell would only queue up unread.
                if box is not None and not awake:
                    box.awake[0] = awake = True
                ready = dict(held.poll(0 if self.session.snapshotting else max(1, round(left * 1e3))))
                if self.ctl is not None and self.ctl in ready:
                    self.handle_control(self.ctl.recv_multipart(copy=False))
                elif self.session.snapshotting:
                    time.sleep(0)          # the interpreter's lock, for the checkpoint's threads
                continue
            hot = SPIN and time.perf_counter() - self.last_call < SPIN
            if box is not None and hot != awake:
                box.awake[0] = awake = hot      # clients ring the doorbell only while we sleep
                if not awake:
                    store_load_barrier()        # before box_ready() below: a request posted now rang
            if self.ctl is not None and self.ctl.getsockopt(EVENTS) & POLLIN:
                # a busy client must not starve it: with a request always waiting in the mailbox,
                # the loop would never reach its poll (on machines of 4 cores or fewer: no spin)
                self.handle_control(self.ctl.recv_multipart(copy=False))
                continue               # it may have frozen the context
            if self.box_ready():
                t = time.perf_counter()
                self.serve_box()
                self.served(t)
                continue
            if hot:
                # a client mid-burst: catch its next message without the cost of sleeping in poll
                if self.sock.getsockopt(EVENTS) & POLLIN:
                    t = time.perf_counter()
                    if self.handle(self.sock.recv_multipart(copy=False)) is not False:
                        self.served(t)
                elif self.session.snapshotting:
                    # Spinning, this thread keeps the interpreter's lock: a restore's loader and
                    # a checkpoint's I/O threads would then get it once a switch interval, and
                    # run 15x slower (perf/probe_gil_spin.py). Let go of it while they have work,
                    # and leave the core to a handoff's senders while its pre-copy rounds run:
                    # over TCP each link's encryption takes a core, and how fast the rounds go
                    # sets how much the frozen one has left. Not otherwise: even sleep(0) lasts
                    # the kernel's timer slack, 50-85 us, and the application's next call waited
                    # for it (a launch-and-sync loop beside a paced checkpoint kept 72% of its
                    # speed, and all of it without).
                    cp = self.session.checkpoint
                    if self.session.threads_at_work() or cp is not None and cp.precopy:
                        time.sleep(0)
                else:
                    self.box_serves_natively()
                continue
            timeout = 20 if self.session.snapshotting else 250
            if self.session.checkpoint is not None and self.session.checkpoint.running:
                timeout = 0                # its next step is ours to take
            elif self.session.checkpoint is not None:
                timeout = 1                # its cut follows its memory's mapping (tick)
            if self.session.restoring is not None and self.session.restoring.loader_held:
                timeout = 1                # its loader starts once we are quiet (tick)
            ready = dict(poller.poll(timeout))
            if self.sock in ready:
                t = time.perf_counter()
                if self.handle(self.sock.recv_multipart(copy=False)) is not False:
                    self.served(t)
            if self.ctl is not None and self.ctl in ready:
                self.handle_control(self.ctl.recv_multipart(copy=False))
            if monitor in ready:
                event = zmq.utils.monitor.recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_ACCEPTED:
                    self.standby, self.accepted_at = False, time.perf_counter()
                    # it has the grace anew to present the token; once until a client attaches, or a
                    # stranger connecting again and again kept a context whose client was gone
                    if not self.client_fds and not self.waited_for:
                        self.alone_since, self.waited_for = time.monotonic(), True
                elif event["event"] == zmq.EVENT_DISCONNECTED and event["value"] in self.client_fds:
                    self.client_fds.pop(event["value"])     # a stranger's connection counts for nothing
                    if not self.client_fds:
                        self.alone_since, self.grace = time.monotonic(), self.kept_for or ORPHAN_GRACE
                        self.kept_for = 0.0
            if not self.standby and not self.client_fds and time.monotonic() - self.alone_since > self.grace:
                log.info("context %d: client gone, freeing it", self.session.ctx_id)
                return


def client_socket(zctx):
    """The socket clients attach on.

    A peer that vanished without closing (its host gone) is found by TCP keepalive, not by
    ZeroMQ's heartbeats: a heartbeat's answer waits behind the messages queued before it, and
    where we read none for a while (a paced or frozen context, a long call) and the client's
    queue to us is full, it never comes, and the connection would be dropped with the answers
    on their way to the client (the client stub does the same, client_stub/native/transport.cpp)."""
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    for option, value in KEEPALIVE.items():
        sock.setsockopt(option, value)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # a reply that cannot be queued waits (Worker.send_to)
    return sock


# probes after 5 idle seconds, one a second, 5 unanswered: a vanished peer is found in ~10 s
KEEPALIVE = {zmq.TCP_KEEPALIVE: 1, zmq.TCP_KEEPALIVE_IDLE: 5, zmq.TCP_KEEPALIVE_INTVL: 1, zmq.TCP_KEEPALIVE_CNT: 5}


CONTROL_CALLS = {
    "checkpoint": Worker.start_checkpoint,
    "restore": Worker.start_restore,
    "ctxStats": Worker.ctx_stats,
    "thaw": Worker.thaw,
    "retireTo": Worker.retire,
    "tenant": Worker.set_tenant,
    "pace": Worker.set_pace,
    "movingTo": Worker.tell_moving_to,
    "keep": Worker.keep,
}


class ClientWatch(threading.Thread):
    """Ends the worker when every connection of its client has hung up while one call runs
    long (a kernel that never ends, a synchronize behind it): the serve loop, which frees a
    context whose client is gone, is not running then, and cannot take a new connection's
    attach either. So a client that hung up to connect again (a re-attach that tired of
    waiting) must not count as gone: on this host, its process still runs; over TCP, only the
    orphan grace tells, as in the serve loop."""

    def __init__(self, worker):
        super().__init__(name="client-watch", daemon=True)
        self.worker = worker

    def run(self):
        w = self.worker
        alone_since = None
        while True:
            time.sleep(0.5)
            since, fds = w.busy_since, dict(w.client_fds)
            if since is None or time.monotonic() - since < 1.0 or not fds or not all(map(hung_up, fds)) \
                    or any(pid is not None and pid_alive(pid) for pid in fds.values()):
                alone_since = None
                continue
            alone_since = alone_since or time.monotonic()
            if None in fds.values() and time.monotonic() - alone_since < ORPHAN_GRACE:
                continue
            log.warning("context %d: its client is gone while a call runs: ending the context", w.session.ctx_id)
            if w.session.recovery is not None:
                w.session.recovery.discard()       # nobody will restore it
            os._exit(0)                # the device frees the context with the process, kernel and all


def hung_up(fd):
    """Whether the peer of a connection (a client's, by its descriptor) has closed it."""
    p = select.poll()
    p.register(fd, select.POLLRDHUP | select.POLLHUP)
    try:
        return bool(p.poll(0))
    except OSError:
        return True


_BARRIER = threading.Lock()


def store_load_barrier():
    """Our store of the mailbox's `awake` word must be seen before we read its request word,
    as the client fences between its two (Dekker's pattern): otherwise each may miss the other's
    and a request waits for our next wake-up. An uncontended lock's acquire is a locked
    instruction, a full barrier on x86-64."""
    with _BARRIER:
        pass


def _die_with_parent():
    """Ask Linux to SIGTERM us when the front end dies, so no worker is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exit_on_sigterm(*_):
    """Exit through the cleanup in main(). The SystemExit lands wherever the main thread is,
    and where that is a callback whose exceptions Python ignores (a weakref callback run by the
    garbage collector, which a signal may interrupt), it is lost and the worker lives on alone.
    So a timer ends the process anyway if the cleanup has not within 5 s."""
    timer = threading.Timer(5.0, os._exit, (0,))
    timer.daemon = True
    timer.start()
    sys.exit(0)


def pin_host_store(backend, path):
    """Pin a HostStore's memory (SnapshotOps.pin); without it, checkpoints and restores
    through that store copy through buffers (slower, still correct)."""
    try:
        store = open_store(path)
    except (OSError, ImageError) as e:
        log.warning("host store %s cannot be used: %s", path, e)
        return
    t = time.perf_counter()
    if backend.snap.pin(store.memory, store.slot_bytes):
        log.info("pinned host store %s (%d MiB) in %.2f s", path, store.memory.nbytes >> 20, time.perf_counter() - t)
    store.refresh()       # a restore into this worker then reads only the index's later changes


def main(argv=None):
    ap = argparse.ArgumentParser(prog="phos-worker")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--endpoint", required=True, help="bind address, e.g. ipc:///tmp/w.sock or tcp://127.0.0.1:*")
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--flags", type=int, default=0)
    ap.add_argument("--control", help="bind address of the control socket for the front end")
    ap.add_argument("--standby", action="store_true", help="pre-started: wait for a client or a restore without a deadline")
    ap.add_argument("--recovery-dir", help="take recovery images of the context into DIR/ctx<ID> (gpu_server/worker/recovery.py)")
    ap.add_argument("--checkpoint-every", type=float, default=0.0, help="seconds between recovery images")
    ap.add_argument("--checkpoint-calls", type=int, default=0, help="calls between recovery images")
    ap.add_argument("--standby-server", default="", help="the server that restores the context if this one dies")
    ap.add_argument("--host-store", help="a HostStore whose memory to pin, for copies straight to and from it")
    ap.add_argument("--module-cache", help="the server's module images by digest (gpu_server/worker/module_cache.py)")
    ap.add_argument("--emu-ledger", help="emu: the device memory the server's contexts hold (gpu_server/backends/emu_memory.py)")
    ap.add_argument("--tenant-ledgers", help="the device memory each tenant holds (gpu_server/device_ledger.py)")
    ap.add_argument("--tenant-quota", type=int, default=0, help="bytes a tenant's contexts may hold (PHOS_TENANT_QUOTA)")
    ap.add_argument("--tenant-host-quota", type=int, default=0,
                    help="bytes of host memory a tenant's contexts may hold (PHOS_TENANT_HOST_QUOTA)")
    ap.add_argument("--client-keys", help="CURVE: the directory of admitted client keys (gpu_server/client_keys.py)")
    opts = ap.parse_args(argv)
    logging.basicConfig(level=settings.log_level(), format="%(asctime)s %(name)s[%(process)d] %(message)s")
    _die_with_parent()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # A restore's loader and the I/O threads share the GIL with the loop serving the client: hand it back fast.
    sys.setswitchinterval(settings.switch_us() / 1e6)
    token = bytes.fromhex(sys.stdin.readline().strip())
    curve_secret = sys.stdin.readline().strip().encode()
    control_token = bytes.fromhex(sys.stdin.readline().strip())
    try:
        backend = load_backend(opts.backend)(opts.device, **({"ledger": opts.emu_ledger} if opts.emu_ledger else {}))
    except CudaError as e:
        print(f"ERROR {int(e.status)} {e.message}", flush=True)
        return 1
    except Exception as e:     # the device could not be opened: say why instead of dying silently
        log.exception("context %d: backend %s failed to start", opts.ctx, opts.backend)
        print(f"ERROR {int(CUresult.CUDA_ERROR_UNKNOWN)} {opts.backend} backend failed to start: {e}", flush=True)
        return 1
    zctx = zmq.Context()
    sock = client_socket(zctx)
    client_keys = None
    if curve_secret:
        # the front end's allowlist, here too: a client may reach a worker without it
        client_keys = ClientKeys(opts.client_keys or "")
        auth = ThreadAuthenticator(zctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=client_keys)
        sock.curve_server, sock.curve_secretkey = True, curve_secret
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    sock.bind(opts.endpoint)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    ctl, ctl_endpoint = None, "-"
    if opts.control:
        ctl = zctx.socket(zmq.ROUTER)
        ctl.setsockopt(zmq.LINGER, 1000)
        ctl.bind(opts.control)
        ctl_endpoint = ctl.getsockopt_string(zmq.LAST_ENDPOINT)
    # Cached now: a checkpoint's cut must not pay for it. A pre-started worker also readies the
    # snapshot kernels and copy buffers, before it says READY: the front end hands it out then,
    # and a restore sent to it meanwhile would wait ~150 ms on the H200 (perf/bench_snapshot.py).
    if opts.standby:
        backend.device_info()
        if backend.pins_host_memory:
            backend.snap.prepare()
            if opts.host_store:
                pin_host_store(backend, opts.host_store)
    print(f"READY {endpoint} {ctl_endpoint}", flush=True)
    if not opts.standby:
        backend.device_info()
        if backend.pins_host_memory and opts.host_store:
            # a worker started for a waiting client pins the store behind its calls: unpinned, a
            # checkpoint or restore through the store would copy through buffers
            threading.Thread(target=pin_host_store, args=(backend, opts.host_store), name="phos-pin-store",
                             daemon=True).start()
    session = Session(backend, opts.ctx, token)
    if (opts.tenant_quota > 0 or opts.tenant_host_quota > 0) and opts.tenant_ledgers:
        session.tenants = (opts.tenant_ledgers, opts.tenant_quota, opts.tenant_host_quota)
    if opts.module_cache:
        session.modules = ModuleCache(opts.module_cache, settings.module_cache_bytes())
    recovery = (opts.recovery_dir, opts.checkpoint_every, opts.checkpoint_calls) if opts.recovery_dir else None
    ended = False          # destroyed, or its client is gone (not killed): nobody will restore it
    try:
        worker = Worker(session, sock, ctl, control_token, recovery, opts.standby_server)
        worker.client_keys = client_keys
        ClientWatch(worker).start()
        if PROFILE_WORKER:
            import cProfile
            profiler = cProfile.Profile()
            try:
                profiler.runcall(worker.serve, monitor, standby=opts.standby)
            finally:
                profiler.dump_stats(os.path.join(PROFILE_DIR, f"worker-{os.getpid()}.prof"))
        else:
            worker.serve(monitor, standby=opts.standby)
        ended = True
        if any(worker.box_answers):      # how much of the synchronous traffic the compiled path took
            log.info("context %d: mailbox requests answered in compiled code %d, by Python %d", session.ctx_id,
                     *worker.box_answers)
    finally:
        if session.checkpoint is not None:
            session.checkpoint.abort("the context went away during the checkpoint")
        if ended and session.recovery is not None and not session.recovery.retired:
            session.recovery.discard()
        # The client's socket first: after a handoff it learns the worker left at once, not after
        # the device has freed gigabytes (backend.close).
        sock.close(linger=500)
        if ctl is not None:
            ctl.close(linger=500)
        t = time.perf_counter()
        backend.close()
        if session.space.ledger is not None:      # the tenant's share back now, not at another worker's recount
            session.space.ledger.close()
        if session.host_ledger is not None:
            session.host_ledger.close()
        # when, and how long: freeing a big context may stall the device's other contexts
        log.info("context %d: its device memory freed in %.1f ms", session.ctx_id, (time.perf_counter() - t) * 1e3)
        for ep in (endpoint, ctl_endpoint):
            remove_socket_file(ep)
    return 0

