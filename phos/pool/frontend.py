"""The pool's front end: the address applications set PHOS_SERVER to.

It speaks the front-end part of the data-plane protocol (schema/phos.capnp: hello, the
device queries, ctxCreate, reattach), as gpu_server/control/frontend.py does, and passes each
request on, frames unchanged, to one of the pool's servers; the server's reply goes back
unchanged. So the stub, Python or native, notices nothing and needs no other protocol:

- ctxCreate goes to the server the placement policy picks. Its reply names that server's
  new worker and the session token, and the stub talks to the worker directly from then on.
- reattach (a stub whose worker went away: schema/phos.capnp, "Recovery") goes to the
  server that holds the context. After a handoff that server answers with where the context
  went, as it does today. If that server is lost, the pool picks another, which restores the
  context from its recovery images in the store every server shares (gpu_server/control/frontend.py
  FrontEnd.recover), and the stub attaches there and replays its log. A server is only asked
  to restore a context once its own server is known lost: one still alive would leave two
  copies of the context.
- everything else goes to any server that is up (device queries).

It never sits on the data path. `directory` is the controller's view of the servers
(controller.py Directory).
"""
import asyncio
import logging
import threading
import time

import zmq
import zmq.asyncio

from phos.gpu_server.control.frontend import receive_until
from phos.schema import wire
from phos.schema.cuda_types import CUresult
from phos.schema.wire import error_reply

log = logging.getLogger("phos.pool")

ASK_TIMEOUT = 30.0           # seconds a server may take to answer a forwarded call (ctxCreate may start a worker)
REATTACH_ASK = 1.5           # ... a reattach, to the context's own server, before the pool checks that it lives
RESTORE_TIMEOUT = 120.0      # ... a reattach that restores the context from its recovery images
IDLE_CONNECTIONS = 8         # connections to each server kept open between requests


class Unanswered(Exception):
    pass


class PoolFrontEnd:
    def __init__(self, listen, directory, curve=None, client_curve=None):
        """curve: (public, secret, clients dir) for the listener (phos/base/keys.py load_curve), or None;
        client_curve: (server public, client public, client secret) for the pool's own
        connections to its servers, or None."""
        self.listen, self.directory = listen, directory
        self.curve, self.client_curve = curve, client_curve
        self.recovering = {}           # ctx -> (task restoring it on another server, when first asked)
        self.idle = {}                 # server -> connections to it no request is using
        self.ready = threading.Event()
        self.error = None
        self.loop = None
        self.stopping = None

    # -- the thread ---------------------------------------------------------------------------
    def start(self):
        threading.Thread(target=self._run, name="phos-pool-frontend", daemon=True).start()
        self.ready.wait(30)
        if self.error is not None:
            raise self.error

    def stop(self):
        if self.loop is not None and self.stopping is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)

    def _run(self):
        try:
            asyncio.run(self.serve())
        except BaseException as e:       # said by start(), in the caller's thread
            self.error = e
            self.ready.set()

    async def serve(self):
        self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
        self.zctx = zmq.asyncio.Context()
        sock = self.zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        auth = None
        if self.curve:
            from zmq.auth.asyncio import AsyncioAuthenticator
            from phos.gpu_server.client_keys import ClientKeys
            auth = AsyncioAuthenticator(self.zctx)
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=ClientKeys(self.curve[2]))
            sock.curve_server, sock.curve_secretkey = True, self.curve[1]
        sock.bind(self.listen)
        self.ready.set()
        tasks = set()
        try:
            async for frames in receive_until(sock, self.stopping):
                if len(frames) < 2:
                    continue
                task = asyncio.ensure_future(self.answer(sock, frames[0], frames[1:]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for t in tasks:
                t.cancel()
            for conns in self.idle.values():
                for c in conns:
                    c.close()
            sock.close()
            if auth:
                auth.stop()
            self.zctx.destroy(linger=0)

    # -- requests -------------------------------------------------------------------------------
    async def answer(self, sock, peer, frames):
        try:
            with wire.decode(wire.Request, frames[0]) as req:
                calls = [(c.which(), c) for c in req.calls]
                reattach = next((c.reattach.ctx for name, c in calls if name == "reattach"), None)
                create = any(name == "ctxCreate" for name, _ in calls)
        except wire.MALFORMED as e:
            return await sock.send_multipart([peer, *error_reply(CUresult.CUDA_ERROR_INVALID_VALUE,
                                                                  f"malformed request: {wire.describe(e)}")])
        try:
            if create:
                reply = await self.create(frames)
            elif reattach is not None:
                reply = await self.reattach(reattach, frames)
            else:
                server = self.directory.any_server()
                reply = await self.forward(server, frames, ASK_TIMEOUT) if server else error_reply(
                    CUresult.CUDA_ERROR_NO_DEVICE, "the pool has no server up")
        except Unanswered as e:
            reply = error_reply(CUresult.CUDA_ERROR_NOT_READY, str(e))
        except Exception as e:          # a bug of ours: the client hears of it, the pool serves on
            log.exception("the pool's front end failed a request")
            reply = error_reply(CUresult.CUDA_ERROR_UNKNOWN, f"the pool's front end failed: {e}")
        await sock.send_multipart([peer, *reply])

    async def create(self, frames):
        t0 = time.perf_counter()
        from phos.pool.placement import NoRoom
        try:
            server = self.directory.place()
        except NoRoom as e:
            return error_reply(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"ctxCreate: {e}")
        try:
            reply = await self.forward(server, frames, ASK_TIMEOUT)
        finally:
            self.directory.placing_done(server)
        ctx = created_context(reply)
        if ctx is not None:
            self.directory.placed(ctx, server, time.perf_counter() - t0)
        return reply

    async def reattach(self, ctx, frames):
        server = self.directory.where(ctx)
        if server is None:
            return error_reply(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED, f"reattach: context {ctx} is not in this pool")
        if ctx not in self.recovering:
            if not self.directory.lost(server):
                try:
                    return await self.forward(server, frames, REATTACH_ASK)
                except Unanswered:
                    if not await asyncio.to_thread(self.directory.confirm_lost, server):
                        return error_reply(CUresult.CUDA_ERROR_NOT_READY, f"reattach: {server} is busy: ask again")
            target = self.directory.recovery_target(ctx, exclude={server})
            if target is None:
                return error_reply(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED,
                                   f"reattach: context {ctx}'s server {server} is lost and no other has room")
            log.warning("context %d: its server %s is lost; restoring it on %s", ctx, server, target)
            task = asyncio.ensure_future(self.forward(target, frames, RESTORE_TIMEOUT))
            self.recovering[ctx] = (task, target, time.perf_counter())
            task.add_done_callback(lambda t: self._restored(ctx, t))
        task, target, _ = self.recovering[ctx]
        # The stub waits 2 s for an answer, then asks again: a later ask waits for the same restore.
        return await asyncio.shield(task)

    def _restored(self, ctx, task):
        _, target, began = self.recovering.pop(ctx)
        self.directory.placing_done(target)
        if not task.cancelled() and task.exception() is None and created_context(task.result(), "reattach") == ctx:
            self.directory.recovered(ctx, target, time.perf_counter() - began)

    async def forward(self, server, frames, timeout):
        """Send a request's frames to a server's front end; its reply's frames, or Unanswered.

        One request at a time on a connection, so that its reply is the next frame to come
        (the server answers concurrent requests in any order, and a forwarded request has no
        envelope to tell them apart); connections are kept for the next request (a new one
        costs a TCP and a ZeroMQ handshake: milliseconds, with CURVE more)."""
        idle = self.idle.setdefault(server, [])
        sock = idle.pop() if idle else self._connect(server)
        try:
            await sock.send_multipart(frames)
            if not await sock.poll(timeout * 1000):
                raise Unanswered(f"{server} did not answer within {timeout:g} s")
            reply = await sock.recv_multipart()
        except BaseException:
            sock.close()          # a late reply must not be taken for the next request's
            raise
        if len(idle) < IDLE_CONNECTIONS:
            idle.append(sock)
        else:
            sock.close()
        return reply

    def _connect(self, server):
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.client_curve:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.client_curve
        sock.connect(server)
        return sock


def created_context(reply, call="ctxCreate"):
    """The context id a successful ctxCreate (or reattach) reply names, else None."""
    try:
        with wire.decode(wire.Reply, reply[0]) as r:
            for res in r.results:
                if res.status == 0 and res._has("u64s") and len(res.u64s):
                    return res.u64s[0]
    except wire.MALFORMED:
        pass
    return None
