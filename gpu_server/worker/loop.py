"""A context worker's call loop: one OS process owns one context (DESIGN decision 6), and this
loop serves its client's calls.

After the handshake the client talks to this process directly. The hot path is a tight
synchronous ZeroMQ loop rather than an await per call: a worker serves one client, and an
event-loop round per call would cost more than the call itself.

A call's way through it: a message on the socket (on_frames) or a request in the shared
mailbox (serve_box) goes to run_calls, which runs each call through the session's call table
(session.py, calls.py) and sends one Reply (send). A launch comes in a launchBatch that wants no
reply; a synchronize comes by the mailbox, where a worker spinning for its client answers it in
compiled code when nothing else goes on (box_serves_natively). What the front end asks on the
control socket, the checkpoints and restores stepped between calls, and the worker's State are
the ContextControl's (control.py); the process's start and end are main.py's.
"""
import collections
import logging
import threading
import time

import zmq
import zmq.utils.monitor

from phos.base import settings
from phos.gpu_server.client_keys import frame_user_id, peer_credentials, pid_alive
from phos.gpu_server.worker import native_box
from phos.gpu_server.worker.control import FROZEN, PACED, ContextControl
from phos.gpu_server.worker.strangers import PeerWarnings, Strangers
from phos.schema import wire
from phos.schema.cuda_types import CUresult
from phos.schema.wire import build_reply, error_reply
from phos.snapshot.image import check_token

log = logging.getLogger("phos.worker")
SLOW_MESSAGE = 0.1       # seconds: a message served slower than this is logged (INFO)
CATCH_UP_WAIT = 30.0     # seconds a mailbox request waits, with nothing arriving, for calls sent before it
# After a message, keep checking for the next one this long before sleeping in poll.
SPIN = settings.spin_us() / 1e6
NATIVE_BOX_SLICE_NS = 200_000  # a spin on the mailbox in compiled code, unless a socket has a message
POLLIN = int(zmq.POLLIN)   # a plain int: `&` with the enum costs microseconds, twice a loop
EVENTS = int(zmq.EVENTS)   # ... and getsockopt makes an enum of the enum it is given
BOX = object()            # the "peer" of a request that came through the shared mailbox


class Worker:
    def __init__(self, session, sock, ctl=None, control_token=b"", recovery=None, standby_server=""):
        self.session, self.sock = session, sock
        self.attached = set()      # routing ids that presented the token
        self.strangers = Strangers(sock)   # ... and those that did not: never waited for
        self.warnings = PeerWarnings(log)  # about what peers send, rate-limited for each
        self.client_keys = None    # with CURVE: the admitted clients (gpu_server/client_keys.py)
        self.peer_keys = {}        # ... and the key each attached routing id came with
        self.keys_checked = 0.0    # when the attached clients' keys were last checked
        self.client_fds = {}       # their connections' descriptors: the context lives while one is open;
        #                            each with its client's pid where it is on this host (ClientWatch)
        self.accepted_at = time.perf_counter()     # when the socket last accepted a connection (the monitor says)
        self.backlog = collections.deque()   # (peer, frames) of replies waiting for room in the client's queue
        self.busy_since = None     # when the calls running now began (run_calls), else None
        self.pending = []          # results waiting for the next reply
        self.ack = 0               # the last call run
        self.box_peer = None       # routing id of the client whose mailbox is mapped
        self.box_seen = 0          # seq of the last mailbox request taken
        self.box_by_socket = False # answer it over the socket
        self.told_durable = 0      # the last Reply.durableSeq sent
        self.last_call = 0.0       # when the last message was served
        self.serving = [0, 0.0]    # messages served and their seconds, since a checkpoint began or ended
        self.native_box = None     # the compiled server of the mailbox (box_serves_natively)
        self.box_answers = [0, 0]  # mailbox requests answered in compiled code, and by Python
        self.native_box_lib = native_box.load() if settings.native_box() else None
        self.control = ContextControl(self, ctl, control_token, recovery, standby_server)

    # -- the client's messages -------------------------------------------------------------
    def on_frames(self, frames):
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
            self.admit(peer, peer_frame)
        n, want_reply = len(calls), req.wantReply
        execute = self.session.execute
        attached = None        # (when the attach began, ms mapping its staging area took)
        for i, call in enumerate(calls):
            name = call.which()
            last = want_reply and i == n - 1
            if name == "attach":
                attached, fields = self.attach(peer, call.attach)
                status, message = CUresult.CUDA_SUCCESS, ""
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

    def check_attach(self, attach):
        return attach.ctx == self.session.ctx_id and check_token(attach.token, self.session.token_digest)

    def admit(self, peer, peer_frame):
        """A peer presented the session token: it is the context's client from now on."""
        self.attached.add(peer)
        self.strangers.attached(peer)
        if isinstance(peer_frame, zmq.Frame):
            fd = peer_frame.get(zmq.SRCFD)       # the connection it came by (monitor events name it)
            creds = peer_credentials(fd)
            self.client_fds[fd] = creds[0] if creds and creds[0] else None     # its pid, known on this host
            self.session.client = creds
            if self.client_keys is not None:
                self.peer_keys[peer] = frame_user_id(peer_frame) or ""
        self.control.attached()

    def attach(self, peer, a):
        """The attach call: the client's staging area mapped where it shares our host. Returns
        ((when it began, ms mapping the area took), its Result's fields)."""
        s, t0 = self.session, time.perf_counter()
        shm = bool(a.shmPath) and s.map_staging(a.shmPath, bytes(a.shmCookie), a.shmSize)
        mapped = (t0, (time.perf_counter() - t0) * 1e3)
        if shm:
            self.box_peer, self.box_seen = peer, s.box.seq(0)
        self.control.start_recovery()      # a restore's kept (control.warm): dropping it here woke its threads (~1 ms)
        return mapped, {"u64s": [s.ctx_id, int(shm), self.ack, int(s.recovery is not None)],
                        "text": self.control.standby_server if s.recovery is not None else ""}

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
        control = self.control
        if control.state is PACED:
            control.pacing.served(now)
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

    def client_alive(self):
        """Whether a client connection is open whose process runs (or, over TCP, may)."""
        return any(pid is None or pid_alive(pid) for pid in self.client_fds.values())

    def on_connection(self, event):
        """A monitor event of the client socket: a connection accepted, or one closed."""
        if event["event"] == zmq.EVENT_ACCEPTED:
            self.accepted_at = time.perf_counter()
            self.control.accepted()
        elif event["event"] == zmq.EVENT_DISCONNECTED and event["value"] in self.client_fds:
            self.client_fds.pop(event["value"])     # a stranger's connection counts for nothing
            if not self.client_fds:
                self.control.hung_up()

    # -- the mailbox (the staging area's; wire.Mailbox) --------------------------------------
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
                self.on_frames(self.sock.recv_multipart(copy=False))
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > CATCH_UP_WAIT or not self.client_alive():
                break
        if self.ack < first - 1:
            log.warning("context %d: calls %d..%d, sent before mailbox request %d, never came",
                        self.session.ctx_id, self.ack + 1, first - 1, first)

    def box_serves_natively(self):
        """Spin on the mailbox in compiled code for a slice, answering the client's plain
        synchronizes there (gpu_server/worker/native_box.py), where the context has nothing else going
        on: no checkpoint, restore or recovery image (they watch the calls), nothing frozen or paced, no
        reply, result or error waiting. False where it may not: the Python loop serves."""
        s, state = self.session, self.control.state
        if self.native_box_lib is None or s.box is None or self.box_peer is None or s.snapshotting \
                or s.recovery is not None or s.sticky or s.deferred or state is FROZEN or state is PACED \
                or self.backlog or self.pending:
            return False
        synchronize = s.backend.native_synchronize()
        if not synchronize:
            return False
        if self.native_box is None or self.native_box.area is not s.shm:      # a re-attach maps a new area
            self.native_box = native_box.NativeBox(self.native_box_lib, s.shm,
                                                   [sock for sock in (self.sock, self.control.sock) if sock is not None])
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

    # -- replies ---------------------------------------------------------------------------
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
        ctl = self.control.sock
        if ctl is not None and ctl in ready:
            self.control.on_frames(ctl.recv_multipart(copy=False))
        elif self.sock in ready and not self.flush_backlog():
            time.sleep(0.001)       # room for another peer's queue, not this one's

    # -- the loop --------------------------------------------------------------------------
    def serve(self, monitor, standby=False):
        """Loop until the context is destroyed or its client is gone for its grace.

        standby: a pre-started worker waits for a client (or a restore) without a deadline."""
        session, sock, control = self.session, self.sock, self.control
        ctl = control.sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        held = zmq.Poller()      # FROZEN, or PACED while it holds: the front end only
        room = zmq.Poller()      # while replies wait in the backlog: room for them, and the front end
        room.register(sock, zmq.POLLOUT)
        if ctl is not None:
            for p in (poller, held, room):
                p.register(ctl, zmq.POLLIN)
        control.begin(standby)
        awake = False
        recovery_check = 0.0
        while not session.closing:
            if self.client_keys is not None and time.monotonic() > self.keys_checked and self.revoked():
                return
            if self.backlog and not self.flush_backlog():
                self.wait_for_room(room)
                continue
            if session.snapshotting:
                control.tick()
            elif session.recovery is not None and control.state is not FROZEN and time.perf_counter() > recovery_check:
                recovery_check = time.perf_counter() + 0.01     # a clock read per call is enough; due() is more
                control.take_recovery_image_if_due()
            state = control.state
            if state is FROZEN:
                if ctl is not None and ctl in dict(held.poll(50)):
                    control.on_frames(ctl.recv_multipart(copy=False))
                continue
            box = session.box
            if state is PACED and (left := control.pacing.held()):
                # the client's calls wait; a running checkpoint's next step is ours to take (tick).
                # The mailbox is looked at as the hold ends: a doorbell would only queue up unread.
                if box is not None and not awake:
                    box.awake[0] = awake = True
                ready = dict(held.poll(0 if session.snapshotting else max(1, round(left * 1e3))))
                if ctl is not None and ctl in ready:
                    control.on_frames(ctl.recv_multipart(copy=False))
                elif session.snapshotting:
                    time.sleep(0)          # the interpreter's lock, for the checkpoint's threads
                continue
            hot = SPIN and time.perf_counter() - self.last_call < SPIN
            if box is not None and hot != awake:
                box.awake[0] = awake = hot      # clients ring the doorbell only while we sleep
                if not awake:
                    store_load_barrier()        # before box_ready() below: a request posted now rang
            if ctl is not None and ctl.getsockopt(EVENTS) & POLLIN:
                # a busy client must not starve it: with a request always waiting in the mailbox,
                # the loop would never reach its poll (on machines of 4 cores or fewer: no spin)
                control.on_frames(ctl.recv_multipart(copy=False))
                continue               # it may have frozen the context
            if self.box_ready():
                t = time.perf_counter()
                self.serve_box()
                self.served(t)
                continue
            if hot:
                # a client mid-burst: catch its next message without the cost of sleeping in poll
                if sock.getsockopt(EVENTS) & POLLIN:
                    t = time.perf_counter()
                    if self.on_frames(sock.recv_multipart(copy=False)) is not False:
                        self.served(t)
                elif session.snapshotting:
                    # Spinning, this thread keeps the interpreter's lock: a restore's loader and
                    # a checkpoint's I/O threads would then get it once a switch interval, and
                    # run 15x slower (perf/probe_gil_spin.py). Let go of it while they have work,
                    # and leave the core to a handoff's senders while its pre-copy rounds run:
                    # over TCP each link's encryption takes a core, and how fast the rounds go
                    # sets how much the frozen one has left. Not otherwise: even sleep(0) lasts
                    # the kernel's timer slack, 50-85 us, and the application's next call waited
                    # for it (a launch-and-sync loop beside a paced checkpoint kept 72% of its
                    # speed, and all of it without).
                    cp = session.checkpoint
                    if session.threads_at_work() or cp is not None and cp.precopy:
                        time.sleep(0)
                else:
                    self.box_serves_natively()
                continue
            ready = dict(poller.poll(control.poll_ms()))
            if sock in ready:
                t = time.perf_counter()
                if self.on_frames(sock.recv_multipart(copy=False)) is not False:
                    self.served(t)
            if ctl is not None and ctl in ready:
                control.on_frames(ctl.recv_multipart(copy=False))
            if monitor in ready:
                self.on_connection(zmq.utils.monitor.recv_monitor_message(monitor))
            if control.expired():
                log.info("context %d: client gone, freeing it", session.ctx_id)
                return


_BARRIER = threading.Lock()


def store_load_barrier():
    """Our store of the mailbox's `awake` word must be seen before we read its request word,
    as the client fences between its two (Dekker's pattern): otherwise each may miss the other's
    and a request waits for our next wake-up. An uncontended lock's acquire is a locked
    instruction, a full barrier on x86-64."""
    with _BARRIER:
        pass
