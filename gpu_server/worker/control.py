"""A context worker's control: what its front end asks of it on the control socket (the verbs
of ControlRequest in schema/admin.proto), the checkpoints and restores it steps between its
client's calls, its recovery images, and the worker's State.

The call loop (loop.py) holds one ContextControl and calls it through this interface:
  state           the worker's State, which tells the loop what it serves
  on_frames       a message on the control socket
  tick            a running checkpoint's or restore's next step, between the client's calls
  poll_ms         how long the loop may sleep in poll, given that step
  take_recovery_image_if_due
  pacing          while PACED: Pace.held, how long the client's calls wait still, and Pace.served
  begin, accepted, attached, hung_up, expired     the client's connections, and its grace
  start_recovery  the client attached: recovery images from now on, if the server takes them
Of the loop it reads the last call answered (ack, which a restore sets), its clients (attached,
client_fds), its messages served (serving, last_call), call_waiting and backlog, and sends with
send_to.
"""
import enum
import logging
import os
import time

from phos.base import settings
# at import, not at the first attach: a handoff's client would wait for it there
from phos.gpu_server.worker.recovery import Recovery, module_globals_noted
from phos.schema import admin_pb2 as pb
from phos.schema import control_socket
from phos.schema.control import checkpoint_message
from phos.schema.cuda_types import CudaError, CUresult
from phos.schema.wire import build_reply
from phos.snapshot import engine
from phos.snapshot.host_store import open_store
from phos.snapshot.image import ImageError

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
SLOW_CONTROL = 0.005     # seconds: a control call (a checkpoint's start, say) slower than this is logged (INFO)
PROGRESS_EVERY = 0.2     # seconds between progress replies of a checkpoint
# A paced worker (a handoff's rounds must converge) holds its client's calls for a share of
# each period this long, and serves one of its messages a period at most: short, so that each
# hold stays far below a handoff's downtime.
PACE_PERIOD = 0.005
PROFILE_DIR = settings.profile_dir()   # cProfile each checkpoint's run into DIR/checkpoint-PID-NS.prof
PROFILE_WORKER = bool(PROFILE_DIR and settings.profile_workers())   # ... or the whole loop into DIR/worker-PID.prof
LATER = object()          # a verb's answer that comes later (a checkpoint's, once it ends)


class State(enum.Enum):
    """What the worker serves. Held in ContextControl.state, and changed only in its section
    "the worker's State" below:
        STANDBY -> ATTACHING           a connection came
        STANDBY, ATTACHING, ORPHANED -> SERVING (PACED, if paced meanwhile)   its client attached
        SERVING <-> PACED              pace, pace 0 (or thaw)
        SERVING, PACED -> ORPHANED     every connection of its client closed
        any -> FROZEN                  a checkpoint with freeze; back as its clients are (PACED, SERVING,
                                       ORPHANED or ATTACHING) on thaw, or once that checkpoint failed
        any -> ATTACHING               a restore (from STANDBY or ATTACHING: no client has attached)
    The context's end is the session's (closing: destroyed, retired, or a restore failed half-way).
    """
    STANDBY = "standby"        # pre-started: waits for a restore or a client, without a deadline
    ATTACHING = "attaching"    # its context waits for a client to attach, for its grace
    SERVING = "serving"        # a client is attached: its calls run as they come
    PACED = "paced"            # ... held for a share of each PACE_PERIOD (a handoff's rounds must converge)
    FROZEN = "frozen"          # a handoff's last image is taken or being taken: no call of the client's runs
    ORPHANED = "orphaned"      # every connection of its client has closed: it waits for it for its grace


STANDBY, ATTACHING, SERVING, PACED, FROZEN, ORPHANED = State


class Pace:
    """A PACED worker holds its client's calls for `hold` of each PACE_PERIOD, and serves one of
    its messages a period at most (else a client that fell behind catches up in the rest of the
    period)."""

    def __init__(self, hold):
        self.since, self.hold = time.perf_counter(), hold
        self.served_in = -1        # the period in which the last of the client's messages was served

    def held(self):
        """Seconds the client's calls wait still in the current period, or 0."""
        period, into = divmod(time.perf_counter() - self.since, PACE_PERIOD)
        if into < self.hold * PACE_PERIOD:
            return self.hold * PACE_PERIOD - into
        return PACE_PERIOD - into if period == self.served_in else 0.0

    def served(self, now):
        self.served_in = (now - self.since) // PACE_PERIOD


class ContextControl:
    def __init__(self, loop, sock=None, token=b"", recovery=None, standby_server=""):
        self.loop, self.session = loop, loop.session
        self.sock, self.token = sock, token   # the control socket, and the token its front end attaches with
        self.peers = set()         # ... the front ends attached to it
        self.state = ATTACHING
        self.grace = ATTACH_TIMEOUT   # how long to wait for a client before freeing the context
        self.alone_since = time.monotonic()   # ... since when it has waited
        self.kept_for = 0.0           # the grace after the client's next hang-up, if it said it comes back (keep)
        self.waited_for = False       # ... and a new connection made it wait anew since a client last attached
        self.pacing = None         # a Pace, from a pace verb until pace 0 or thaw
        self.job = None            # (peer, seq) of the control call a running checkpoint answers
        self.early = False         # ... and its delta goes to the front end before it is committed
        self.progress_at = 0.0
        self.control_steps = {}    # where a control call's time went (ms), for its log line if it was slow
        self.first_call_loaded = None # a restore on demand: bytes loaded when the first call touched memory
        self.recovery_options = recovery   # (directory, every seconds, every calls) or None
        self.standby_server = standby_server   # the server that restores us if ours dies, told to clients
        self.last_image = (None, None, (), None)  # (store, name, chunk keys, (regions, keys)) of the last image committed
        self.queued_checkpoint = None      # (request, asker) of a control checkpoint waiting for a recovery image
        self.warm = None                   # the Restore the context came from (advance: until a client attaches)
        self.loader_by = 0.0               # a restore on demand starts loading in the background by then
        self.profiler = None               # PROFILE_DIR's, while a checkpoint runs
        self.served_before = loop.serving  # messages served and their seconds before the running checkpoint began

    # -- the worker's State: every change of it is made here ----------------------------------
    def begin(self, standby):
        """The loop starts: a pre-started worker waits without a deadline."""
        self.alone_since = time.monotonic()
        self._set(STANDBY if standby else ATTACHING)

    def accepted(self):
        """A connection came: it has the grace anew to present the token; once until a client
        attaches, or a stranger connecting again and again kept a context whose client was gone."""
        if self.state is STANDBY:
            self._set(ATTACHING)
        if not self.loop.client_fds and not self.waited_for:
            self.alone_since, self.waited_for = time.monotonic(), True

    def attached(self):
        """A client presented the session token."""
        self.waited_for = False
        if self.state in (STANDBY, ATTACHING, ORPHANED):
            self._set(PACED if self.pacing else SERVING)

    def hung_up(self):
        """Every connection of the client has closed."""
        self.alone_since, self.grace = time.monotonic(), self.kept_for or ORPHAN_GRACE
        self.kept_for = 0.0
        if self.state is not FROZEN:
            self._set(ORPHANED)

    def expired(self):
        """Whether the context has waited out its grace without a client."""
        return self.state in (ATTACHING, ORPHANED) and time.monotonic() - self.alone_since > self.grace

    def _restored(self):
        """Its context came from an image: its client comes back within REATTACH_TIMEOUT, its
        connection, which may come any time now, giving it the grace anew."""
        self.grace, self.alone_since, self.waited_for = REATTACH_TIMEOUT, time.monotonic(), False
        self._set(ATTACHING)

    def _pace(self, hold):
        self.pacing = Pace(hold) if hold > 0 else None
        if self.pacing and self.state is SERVING:
            self._set(PACED)
        elif not self.pacing and self.state is PACED:
            self._set(SERVING)

    def _freeze(self, frozen):
        """Frozen from a checkpoint's cut on; no longer once thawed, or its checkpoint failed."""
        if frozen:
            self._set(FROZEN)
        elif self.state is FROZEN:
            self._set(PACED if self.pacing else SERVING if self.loop.client_fds
                      else ORPHANED if self.loop.attached else ATTACHING)

    def _set(self, state):
        if state is not self.state:
            log.debug("context %d: %s -> %s", self.session.ctx_id, self.state.value, state.value)
            self.state = state

    # -- the control socket ------------------------------------------------------------------
    def on_frames(self, frames):
        """Serve one message of the control socket: [routing id, ControlRequest]."""
        if len(frames) < 2:
            return
        peer = frames[0].bytes
        try:
            seq, verb, request = control_socket.read_request(frames[1])
        except control_socket.MALFORMED as e:
            log.warning("malformed control frame: %s", control_socket.describe(e))
            self.answer((peer, 0), (CUresult.CUDA_ERROR_INVALID_VALUE, f"malformed request: {control_socket.describe(e)}"))
            return
        self.call(peer, seq, verb, request)

    def call(self, peer, seq, verb, request):
        t, self.control_steps = time.perf_counter(), {}
        try:
            if verb == "attach":
                if request.token != self.token or not self.token:
                    raise CudaError(CUresult.CUDA_ERROR_NOT_PERMITTED, "wrong control token")
                self.peers.add(peer)
                answer = None
            elif peer not in self.peers:
                raise CudaError(CUresult.CUDA_ERROR_NOT_PERMITTED, "attach with the control token first")
            elif verb not in VERBS:
                raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED, f"request {verb!r} is not served on the control socket")
            else:
                answer = VERBS[verb](self, request, (peer, seq))
            if answer is not LATER:
                self.answer((peer, seq), answer)
        except CudaError as e:
            self.answer((peer, seq), (e.status, f"{verb}: {e.message}"))
        except Exception as e:     # a bug of ours: fail the call loudly, keep the context
            log.exception("context %d: control call %s raised", self.session.ctx_id, verb)
            self.answer((peer, seq), (CUresult.CUDA_ERROR_UNKNOWN, f"{verb}: internal error: {type(e).__name__}: {e}"))
        if time.perf_counter() - t > SLOW_CONTROL:      # the client's calls waited for it
            log.info("context %d: control call %s took %.1f ms%s", self.session.ctx_id, verb, (time.perf_counter() - t) * 1e3,
                     "".join(f", {k} {v:.1f}" for k, v in self.control_steps.items()))

    def answer(self, asker, value=None):
        """One ControlReply to asker, (peer, seq): value as control_socket.reply_frame takes it."""
        peer, seq = asker
        self.sock.send_multipart([peer, control_socket.reply_frame(seq, value)])

    # -- the verbs (VERBS): each takes its request message and the asker, and returns its answer
    def checkpoint(self, a, asker):
        s = self.session
        if s.checkpoint is not None and self.recovering and self.queued_checkpoint is None:
            self.queued_checkpoint = (a, asker)       # after the recovery image: it is seconds at most
            return LATER
        if s.checkpoint is not None or s.restoring is not None:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "a checkpoint or restore of this context is still running")
        self.begin_checkpoint(a.store, a.name, a.parent, a.paused, a.compress, a.chunk_size, a.precopy, not a.no_sync,
                              a.rate)
        # Frozen from the cut on: a call run while the image is still being written would be
        # acknowledged to the client, yet missing from the image the target restores.
        self._freeze(a.freeze and a.paused)
        self.early = self.state is FROZEN and a.early     # its delta goes out before the commit (Checkpoint.early)
        self.job, self.progress_at = asker, time.monotonic()
        self.tick()
        return LATER

    def restore(self, a, asker):
        s = self.session
        if a.advance:
            return self.advance(a)
        if s.objects or s.space.allocations() or s.restoring is not None or self.loop.attached:
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
            self.loop.ack = r.recreate()
            s.restoring, s.snapshotting = r, True
            t = time.perf_counter()
            r.start(full=a.full, deferred=not a.warm)
            r.step("load" if a.full else "start", t)
            self.loader_by = time.perf_counter() + LOADER_DEADLINE
        except BaseException:
            s.closing = True          # half a context: let the front end start a fresh worker
            raise
        self._restored()
        self.warm = r
        self.tick()
        return self.restored(r)

    def advance(self, a):
        """A handoff's later image (its last, or a pre-copy round's), for the warm copy restored
        here from an earlier one; by the early delta where it came with one."""
        r, s = self.warm, self.session
        if r is None or self.loop.attached or os.path.abspath(a.store) != r.store.path:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "this worker holds no restore to advance")
        cut = r.advance(a.name, a.full, a.delta or None)     # the delta's bytes: the restore reads and checks them
        if cut is None:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"image {a.name!r} holds other objects: restore it afresh")
        self.loop.ack = cut
        s.restoring, s.snapshotting = r, True
        self.tick()
        return self.restored(r)

    def restored(self, r):
        """The restore's reply: the context, its cut and what is loaded so far."""
        return pb.RestoreReply(ctx=self.session.ctx_id, cut_seq=self.loop.ack, name=r.name, bytes=r.bytes_total,
                               loaded=r.bytes_done, phase_ms=r.phase_ms)

    def ctx_stats(self, a, asker):
        s = self.session
        if self.warm is not None and self.warm.failure is not None:
            # its image was damaged: the admin API lists it as "failed" on this status
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"the context failed: {self.warm.error().message}")
        job = s.checkpoint or s.restoring
        return pb.CtxStats(bytes=s.space.used(), allocations=len(s.space.allocations()), last_seq=self.loop.ack,
                           checkpointing=s.checkpoint is not None, restoring=s.restoring is not None,
                           done_bytes=job.bytes_done if job else 0, total_bytes=job.bytes_total if job else 0,
                           first_call_loaded=self.first_call_loaded)

    def tenant(self, a, asker):
        """A new context's tenant, from the front end before it hands the context out."""
        if self.loop.attached or self.session.restoring is not None:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "a context in use gets no tenant")
        self.session.join_tenant(a.name)

    def thaw(self, a, asker):
        self._pace(0.0)
        self._freeze(False)

    def keep(self, a, asker):
        """The client will hang up and come back (a whole-process checkpoint: its process is
        dumped between): after its next hang-up the context waits a.seconds for it."""
        if not 0.0 < a.seconds <= MOST_KEEP:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"keep: {a.seconds:g} s; more than 0, at most {MOST_KEEP:g}")
        self.kept_for = a.seconds
        if not self.loop.client_fds:            # it hung up already
            self.grace = max(self.grace, a.seconds)

    def pace(self, a, asker):
        """Hold the client's calls for a.hold of each PACE_PERIOD from now on (0: no longer) (Pace):
        a handoff slows an application that writes about as fast as its rounds travel, so that
        they shrink, and its last one (the downtime) is small. Control messages and a running
        checkpoint go on meanwhile."""
        if not 0.0 <= a.hold <= settings.MOST_HOLD:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE,
                            f"pace: a hold of {a.hold:g} of the time; 0 to {settings.MOST_HOLD:g}")
        self._pace(a.hold)

    def retire(self, a, asker):
        """The context lives at a.to.endpoint now: say so to the client, which attaches there at
        once (without asking a front end, ~1 ms), and exit."""
        if self.state is not FROZEN:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, "only a frozen context (after a handoff's last image) retires")
        loop = self.loop
        self.session.closing = True
        if self.session.recovery is not None:
            self.session.recovery.retire()
        if a.to.endpoint:
            moved = build_reply(loop.ack, [], moved=(a.to.endpoint, a.to.standby, a.to.server_key))
            for client in loop.attached:
                loop.send_to(client, moved)
        log.info("context %d: retired at call %d, its clients told of %s (%d replies wait for room)", self.session.ctx_id,
                 loop.ack, a.to.endpoint or "nowhere", len(loop.backlog))

    def moving_to(self, a, asker):
        """A handoff is about to freeze the context for its move to a.to.endpoint: the client
        connects there ahead (Reply.movingTo), so that its re-attach finds the handshake done."""
        loop = self.loop
        moving = build_reply(loop.ack, [], moving_to=(a.to.endpoint, a.to.standby, a.to.server_key))
        for client in loop.attached:
            loop.send_to(client, moving)

    # -- checkpoints, stepped between the client's calls --------------------------------------
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
        loop = self.loop
        cp.cut(loop.ack, paused=paused)
        s = self.session
        s.checkpoint, s.snapshotting = cp, True
        self.served_before, loop.serving = loop.serving, [0, 0.0]
        if PROFILE_DIR and not PROFILE_WORKER:
            import cProfile
            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def remember(self, job):
        """The image a Checkpoint committed, or a Restore came from, is the last image here: a
        checkpoint with it as parent need not ask the store about its chunks (begin_checkpoint)."""
        self.last_image = (job.store.path, job.name, job.chunk_keys(), (job.chunks.regions, job.keys))

    def poll_ms(self):
        """How long the loop may sleep in poll for a message: not past a running checkpoint's or
        restore's next step, which is ours to take (tick)."""
        s = self.session
        timeout = 20 if s.snapshotting else 250
        if s.checkpoint is not None and s.checkpoint.running:
            timeout = 0                # its next step is ours to take
        elif s.checkpoint is not None:
            timeout = 1                # its cut follows its memory's mapping (tick)
        if s.restoring is not None and s.restoring.loader_held:
            timeout = 1                # its loader starts once we are quiet (tick)
        return timeout

    def tick(self):
        """Finish or report on a running checkpoint; retire a restore whose loading ended."""
        s, loop = self.session, self.loop
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
            cp.advance(busy=loop.call_waiting)
        if cp is not None and not cp.running:
            self.finished(cp)
        elif cp is not None and self.job and time.monotonic() - self.progress_at > PROGRESS_EVERY:
            self.progress_at = time.monotonic()
            self.answer(self.job, pb.CheckpointProgress(done_bytes=cp.bytes_done, total_bytes=cp.bytes_total))
        r = s.restoring
        if r is not None and r.loader_held:
            now = time.perf_counter()
            if now > self.loader_by or loop.attached and now - loop.last_call > LOADER_QUIET:
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

    def finished(self, cp):
        """Checkpoint cp has ended, committed or failed: answer it (or, a recovery image, note it)."""
        s, loop = self.session, self.loop
        sent = []      # the delta, once it went out: the target may be adopting it
        # the time a message took to serve, before the checkpoint and during it: what its
        # steps and copies cost the application's calls (perf/bench_snapshot.py)
        served = {"before": [self.served_before[0], round(self.served_before[1] * 1e3, 3)],
                  "during": [loop.serving[0], round(loop.serving[1] * 1e3, 3)]}
        loop.serving = [0, 0.0]

        def send_delta(delta):
            self.answer(self.job, delta)      # an ImageDelta message's bytes, passed on unread
            sent.append(True)
        try:
            result = cp.finish(loop.ack, send_delta if self.early and self.job else None)
            self.remember(cp)
            result["messages_served"] = served
            answer = checkpoint_message(result)
        except Exception as e:     # the image is lost, not the context
            if not isinstance(e, CudaError):
                log.exception("context %d: checkpoint failed", s.ctx_id)
                e = CudaError(CUresult.CUDA_ERROR_UNKNOWN, f"{type(e).__name__}: {e}")
            result, answer = None, (e.status, f"checkpoint: {e.message}")
            # A handoff's last round failed: the context goes on here, unless its delta went
            # out first; the target may hold the context then, and the front end decides.
            self._freeze(bool(sent))
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
            s.recovery.committed(result["cut_seq"], result["copied_bytes"], result["pause_ms"]) if result else s.recovery.failed(answer[1])
            queued, self.queued_checkpoint = self.queued_checkpoint, None
            if queued:
                try:
                    self.checkpoint(*queued)
                except CudaError as e:
                    self.answer(queued[1], (e.status, f"checkpoint: {e.message}"))
        elif self.job:
            self.answer(self.job, answer)
            self.job = None

    # -- recovery images (gpu_server/worker/recovery.py) -----------------------------------------
    def start_recovery(self):
        """The context is live here: take recovery images of it from now on, if the server does;
        a restored one's first is incremental to the image it came from (self.warm)."""
        s = self.session
        if self.recovery_options is None or s.recovery is not None:
            return
        s.recovery = Recovery(self.recovery_options[0], s.ctx_id, *self.recovery_options[1:])
        restored = self.warm
        if restored and restored.store.path == os.path.abspath(s.recovery.path):
            s.recovery.restored_from(restored.name, self.loop.ack)       # its parent, as it is in our store
            self.remember(restored)          # the chunks it holds

    @property
    def recovering(self):
        """The running checkpoint is a recovery image (begun, not yet committed or failed)."""
        r = self.session.recovery
        return r is not None and r.running is not None

    def take_recovery_image_if_due(self):
        if self.session.recovery.due(self.loop.ack):
            self.take_recovery_image()

    def take_recovery_image(self):
        r = self.session.recovery
        paused = r.paused(self.session.space.used(), RECOVERY_PAUSED_BYTES)
        path, name, parent = r.begin(paused)
        try:
            self.begin_checkpoint(path, name, parent, paused=paused)
        except Exception as e:       # the store is full or gone: the client keeps its log, we try again later
            r.failed(getattr(e, "message", None) or f"{type(e).__name__}: {e}")


# the verbs of ControlRequest (schema/admin.proto) but attach, which ContextControl.call answers itself
VERBS = {
    "checkpoint": ContextControl.checkpoint,
    "restore": ContextControl.restore,
    "ctx_stats": ContextControl.ctx_stats,
    "thaw": ContextControl.thaw,
    "retire_to": ContextControl.retire,
    "tenant": ContextControl.tenant,
    "pace": ContextControl.pace,
    "moving_to": ContextControl.moving_to,
    "keep": ContextControl.keep,
}
