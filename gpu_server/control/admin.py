"""The admin API (schema/admin.proto): gRPC on a Unix socket, served by the front end.

Only the server's user can reach the socket (mode 0600), so it needs no other
authentication; tenants never see it. A thin adapter: requests become the front end's
calls on its workers' control sockets (gpu_server/control/frontend.py) or a Handoff
(gpu_server/control/handoff.py), and their results or CudaErrors become replies or gRPC statuses.
"""
import asyncio
import contextlib
import datetime
import logging
import os
import time

import grpc

from phos.gpu_server.control.handoff import DeviceTarget, Handoff
from phos.gpu_server.control.handoff_target import TargetServer
from phos.schema import admin_pb2 as pb
from phos.schema import admin_pb2_grpc
from phos.schema.admin_net import is_loopback
from phos.schema.control import admin_socket, private_directory
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot import ImageError, delete_image, gc, latest_image, open_store, read_image
from phos.snapshot.store import ImageInUse, images_in

GRPC_CODE = {   # how CUDA errors of the workers map onto gRPC status codes
    CUresult.CUDA_ERROR_INVALID_VALUE: grpc.StatusCode.INVALID_ARGUMENT,
    CUresult.CUDA_ERROR_INVALID_DEVICE: grpc.StatusCode.INVALID_ARGUMENT,
    CUresult.CUDA_ERROR_INVALID_IMAGE: grpc.StatusCode.FAILED_PRECONDITION,
    CUresult.CUDA_ERROR_ILLEGAL_STATE: grpc.StatusCode.FAILED_PRECONDITION,
    CUresult.CUDA_ERROR_NOT_READY: grpc.StatusCode.UNAVAILABLE,
    CUresult.CUDA_ERROR_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED: grpc.StatusCode.NOT_FOUND,
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


DESCRIBE_TIMEOUT = 5.0           # seconds a worker may take to describe its context (ListContexts)
DESCRIBE_WAIT = 1.0              # ... and how long a listing waits for it: a busy one is listed as last known
DROP_WAIT = 3.0                  # seconds DropWarm waits for the killed worker to be gone

log = logging.getLogger("phos.admin")


def has_images(path):
    """Whether the store at path holds an image. Listed without opening the store (a HostStore's
    first opening reads its whole index, on a restore's path); one without images is opened, so
    that a damaged one says why (ImageError). A path that holds no store is not made one."""
    if images_in(path):
        return True
    if os.path.isdir(os.path.join(path, "images")):
        open_store(path)
    return False


class Admin(admin_pb2_grpc.AdminServicer):
    def __init__(self, front):
        self.front = front
        self.described = {}        # ctx id -> its last description (ListContexts)
        self.describing = {}       # ctx id -> the description asked for and not yet given

    async def fail(self, context, e):
        log.info("admin call failed: %s (CUresult %d)", e.message, int(e.status))
        await context.abort(GRPC_CODE.get(e.status, grpc.StatusCode.INTERNAL), f"{e.message} (CUresult {int(e.status)})")

    def worker(self, ctx_id):
        w = self.front.workers.get(ctx_id)
        if w is None or w.proc.returncode is not None:
            raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no context {ctx_id} on this server")
        return w

    async def describe(self, w):
        try:
            st = await self.front.ctx_stats(w)
        except CudaError as e:
            if e.status != CUresult.CUDA_ERROR_ILLEGAL_STATE:
                raise
            # a chunk of the image it was restored from was damaged: its calls fail (ContextControl.ctx_stats)
            log.info("context %d: %s", w.ctx_id, e.message)
            c = pb.Context()
            c.CopyFrom(self.described.get(w.ctx_id) or pb.Context(id=w.ctx_id, pid=w.proc.pid))
            c.state = "failed"
            return c
        state = "checkpointing" if st.checkpointing else "restoring" if st.restoring else w.state
        return pb.Context(id=w.ctx_id, bytes=st.bytes, allocations=st.allocations, last_seq=st.last_seq,
                          pid=w.proc.pid, state=state, first_call_loaded=st.first_call_loaded, device=w.device)

    async def ListContexts(self, request, context):
        """Every context, as its worker describes it now, or, where the worker is in one long call
        (a batch of kernels takes seconds on emu), as it was last described, "busy": the listing
        waits DESCRIBE_WAIT for none, and a description still on its way from an earlier listing
        is not asked for again. It waited DESCRIBE_TIMEOUT for each busy context before."""
        workers = [w for w in self.front.workers.values() if w.proc.returncode is None]
        for w in workers:
            if w.ctx_id not in self.describing:
                task = asyncio.ensure_future(asyncio.wait_for(self.describe(w), DESCRIBE_TIMEOUT))
                self.describing[w.ctx_id] = task
                task.add_done_callback(lambda t, ctx=w.ctx_id: self.described_now(ctx, t))
        tasks = {w.ctx_id: self.describing[w.ctx_id] for w in workers}
        if tasks:
            await asyncio.wait(tasks.values(), timeout=DESCRIBE_WAIT)
        out = []
        for w in workers:
            task = tasks[w.ctx_id]
            if w.proc.returncode is not None:
                continue           # it went away meanwhile
            if task.cancelled():   # the server stops
                task = asyncio.get_running_loop().create_future()
            if task.done() and task.exception() is None:
                out.append(task.result())
                continue
            if task.done() and isinstance(task.exception(), CudaError):
                continue           # it went away meanwhile
            if task.done() and not isinstance(task.exception(), asyncio.TimeoutError):
                raise task.exception()
            c = pb.Context()
            c.CopyFrom(self.described.get(w.ctx_id) or pb.Context(id=w.ctx_id, pid=w.proc.pid))
            c.state = "busy"
            out.append(c)
        live = {w.ctx_id for w in self.front.workers.values()}
        self.described = {k: v for k, v in self.described.items() if k in live}
        return pb.ListContextsReply(contexts=out)

    def described_now(self, ctx, task):
        """A description arrived (or failed): kept for the listings that find its worker busy."""
        if self.describing.get(ctx) is task:
            del self.describing[ctx]
        if not task.cancelled() and task.exception() is None:
            self.described[ctx] = task.result()

    async def Checkpoint(self, request, context):
        name, began = None, time.time()
        try:
            w = self.worker(request.ctx)
            if not request.store:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "give the image store directory")
            name = request.name or f"ctx{request.ctx}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S.%fZ}"
            parent = ""
            if request.incremental:
                parent = await asyncio.to_thread(lambda: latest_image(open_store(request.store), request.ctx)) or ""
            queue = asyncio.Queue()       # the worker's progress messages, passed on as they are
            task = asyncio.ensure_future(self.front.checkpoint(
                w, pb.WorkerCheckpointRequest(store=os.path.abspath(request.store), name=name, parent=parent,
                                              paused=request.paused, compress=request.compress,
                                              chunk_size=request.chunk_size, rate=request.bytes_per_second),
                on_progress=queue.put_nowait))
            while not task.done() or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            result = task.result()        # the worker's CheckpointResult, passed on as it is
            self.front.counts["checkpoints"] += 1
            self.front.counts["checkpoint_seconds"] += result.seconds
            yield pb.CheckpointProgress(done_bytes=result.bytes, total_bytes=result.bytes, finished=True, result=result)
        except CudaError as e:
            if name is not None:
                e = await self.after_failed_checkpoint(e, request.store, name, request.ctx, began)
            await self.fail(context, e)
        except (OSError, ImageError) as e:     # the store cannot be opened (a damaged host store's index, say)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image store {request.store!r}: {e}")

    @staticmethod
    async def after_failed_checkpoint(e, store, name, ctx, began):
        """What is true of a checkpoint that failed: its worker may have died after committing
        its image, before answering (a killed one was reported failed, its image whole in the
        store), so the store is asked; what a failed one left there goes at once. Returns the
        error to report."""
        def look():
            s = open_store(store, create=False)
            if s.has_image(name):
                m = read_image(s, name)          # verified, as a restore would
                if getattr(m, "session", {}).get("ctx") == ctx and m.created >= began:
                    return True
            gc(s)
            return False
        try:
            committed = await asyncio.to_thread(look)
        except (OSError, ImageError):
            return e
        if not committed:
            return e
        return CudaError(e.status, f"{e.message}; but image {name!r} had been committed: it is whole in the store "
                                   "and can be restored")

    async def Restore(self, request, context):
        t0 = time.perf_counter()
        try:
            store = os.path.abspath(request.store)
            if not request.name and not await asyncio.to_thread(has_images, store):
                # said here: a worker that failed a restore is not given back (a fresh one pins the host store again)
                raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no image in {request.store}")
            if request.advance and not request.name:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "advancing a warm copy needs the image's name")
            if request.advance:
                w, res = await self.front.advance(store, request.name, request.ctx, final=not request.warm, full=request.full,
                                                  delta=request.delta)
            else:       # without a name, the worker restores the store's latest image
                w, res = await self.front.restore(store, request.name, request.full, warm=request.warm)
            if not request.warm and request.full and self.front.inboxes.is_inbox(store):
                self.front.inboxes.drop_path(store)     # a handoff's last round, loaded: its inbox has served
            # the worker's RestoreReply, passed on with what only the front end knows
            res.ctx, res.endpoint, res.seconds = w.ctx_id, w.endpoint, time.perf_counter() - t0
            res.phase_ms["worker_call"] = (time.perf_counter() - t0) * 1e3
            return res
        except CudaError as e:
            await self.fail(context, e)
        except (OSError, ImageError) as e:     # the store cannot be opened (a damaged host store's index, say)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image store {request.store!r}: {e}")

    async def Handoff(self, request, context):
        """Move a live context to the server at request.to, or to request.to_device of this one
        (gpu_server/control/handoff.py)."""
        try:
            w = self.worker(request.ctx)
            to = f"device {request.to_device}" if request.HasField("to_device") else request.to
            async with self.target(request, w) as target:
                r = await Handoff(self.front, w, target, request.ctx, to, request.max_rounds, request.chunk_size).run()
            return pb.HandoffReply(ctx=r.ctx, to=r.to, round_bytes=r.round_bytes, downtime_ms=r.downtime_ms,
                                   seconds=r.seconds, phase_ms=r.phase_ms, round_ms=r.round_ms, chunk_size=r.chunk_size,
                                   recovery_store=r.recovery_store, recovery_image=r.recovery_image)
        except CudaError as e:
            await self.fail(context, e)

    def target(self, request, worker):
        """The Handoff's target: another device of this server; or a server over its Unix admin
        socket on this host, or, for a tcp:// server when this one has keys, over the network
        (gpu_server/control/handoff_net.py: the rounds stream there, as between hosts), authenticated with
        this server's key pair."""
        if request.HasField("to_device"):
            return self.device_target(request, worker)
        if not request.to:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE,
                            "a handoff needs a target: a server (to) or a device (to_device)")
        if not request.to.startswith("tcp://") or (is_loopback(request.to) and not self.front.curve):
            # on this host: its Unix admin socket (a keyless loopback server has no other)
            try:
                return TargetServer(admin_socket(request.to), request.ctx, request.to)
            except ValueError as e:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"target server: {e}") from None
        from phos.gpu_server.control.handoff_net import RemoteTarget
        if not self.front.curve:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a handoff to {request.to}, on another host, needs "
                            "this server's CURVE keys (--auth-dir): it authenticates to the target's admin API with them")
        public, secret = self.front.curve[0], self.front.curve[1]
        target_key = request.to_server_key.encode() if request.to_server_key else public
        if len(target_key) != 40:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "to_server_key: give the target's public key in z85 "
                            "(40 characters, as in its server.key)")
        return RemoteTarget(request.to, request.ctx, (target_key, public, secret))

    def device_target(self, request, worker):
        if request.to:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a handoff goes to a server ({request.to}) or to a "
                            f"device of this one ({request.to_device}), not both")
        device = request.to_device
        if device >= len(self.front.devices):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_DEVICE, f"this server has no device {device}: it serves "
                            f"{len(self.front.devices)} device(s) (phos server --devices)")
        if device == worker.device:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"context {request.ctx} is on device {device} already")
        return DeviceTarget(self.front, request.ctx, device)

    async def OpenInbox(self, request, context):
        return pb.OpenInboxReply(store=await asyncio.to_thread(self.front.inboxes.open, request.ctx))

    async def PutChunks(self, request, chunks, context):
        """The network admin API's bulk call, not one of the gRPC service's: `chunks` are the
        frames of the stored chunk blobs that came after the request (schema/admin_net.py)."""
        try:
            stored = await self.front.inboxes.put_chunks(request.store, chunks, request.pieces)
        except CudaError as e:
            await self.fail(context, e)
        except OSError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a handoff's chunks cannot be stored: {e}")
        return pb.PutChunksReply(stored=stored)

    async def PutManifest(self, request, context):
        try:
            await asyncio.to_thread(self.front.inboxes.put_manifest, request.store, request.name, request.manifest)
        except CudaError as e:
            await self.fail(context, e)
        except OSError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a handoff's manifest cannot be stored: {e}")
        return pb.PutManifestReply()

    async def DropWarm(self, request, context):
        self.front.inboxes.drop(request.ctx)
        w = self.front.workers.get(request.ctx)
        if w is None or w.state != "warming":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no warm copy of context {request.ctx} on this server")
        self.front.discard(request.ctx)
        # answered once it is gone: until then it holds the image it loads (Restore.hold), and the
        # source, told the copy is dropped, removes the handoff's rounds
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(w.proc.wait(), DROP_WAIT)
        return pb.DropWarmReply()

    async def KillContext(self, request, context):
        try:
            self.front.kill(request.ctx)
        except CudaError as e:
            await self.fail(context, e)
        return pb.KillContextReply()

    async def KeepContext(self, request, context):
        try:
            await self.front.keep(self.worker(request.ctx), request.seconds)
        except CudaError as e:
            await self.fail(context, e)
        return pb.KeepContextReply()

    async def DeleteImage(self, request, context):
        """Refused while a context of any server still loads the image on demand (ImageInUse)."""
        try:
            freed = await asyncio.to_thread(lambda: delete_image(open_store(request.store, create=False), request.name,
                                                                 verify=True))
        except ImageInUse as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ImageError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except OSError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image store {request.store!r}: {e}")
        chunks, nbytes = freed or (0, 0)
        return pb.DeleteImageReply(freed_chunks=chunks, freed_bytes=nbytes)

    async def Stats(self, request, context):
        contexts = (await self.ListContexts(request, context)).contexts
        return pb.StatsReply(backend=self.front.backend_name, devices=len(self.front.devices), contexts=len(contexts),
                             standby_workers=len(self.front.pool), bytes=sum(c.bytes for c in contexts),
                             checkpoints=self.front.counts["checkpoints"], restores=self.front.counts["restores"],
                             checkpoint_seconds=self.front.counts["checkpoint_seconds"],
                             recovery_dir=os.path.abspath(self.front.recovery.directory) if self.front.recovery else "",
                             standby=self.front.recovery.standby if self.front.recovery else "",
                             host_store=self.front.host_store or "", admin_endpoint=self.front.admin_endpoint,
                             server_key=self.front.curve[0].decode() if self.front.curve else "")


async def start(front, address):
    """Serve the admin API at a unix: address, readable by this user only."""
    path = address[len("unix:"):]
    private_directory(os.path.dirname(os.path.abspath(path)), create=True)
    if os.path.exists(path):
        os.unlink(path)        # a stale socket of a server that died
    server = grpc.aio.server()
    front.admin = Admin(front)       # the network admin API (gpu_server/control/admin_net.py) serves the same one
    admin_pb2_grpc.add_AdminServicer_to_server(front.admin, server)
    old = os.umask(0o077)          # the socket is created at bind: make it ours alone
    try:
        server.add_insecure_port(address)
        await server.start()
    finally:
        os.umask(old)
    return server
