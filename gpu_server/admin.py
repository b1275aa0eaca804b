"""The admin API (schema/admin.proto): gRPC on a Unix socket, served by the front end.

Only the server's user can reach the socket (mode 0600), so it needs no other
authentication; tenants never see it.
"""
import asyncio
import datetime
import json
import logging
import os
import time
import urllib.parse

import grpc

from phos.schema import admin_pb2 as pb
from phos.schema import admin_pb2_grpc
from phos.gpu_server.frontend import alive
from phos.gpu_server.handoff_store import HandoffStore
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot import ImageError, latest_image, open_store
from phos.snapshot.image import DEFAULT_CHUNK_SIZE
from phos.snapshot.store import images_in

GRPC_CODE = {   # how CUDA errors of the workers map onto gRPC status codes
    CUresult.CUDA_ERROR_INVALID_VALUE: grpc.StatusCode.INVALID_ARGUMENT,
    CUresult.CUDA_ERROR_INVALID_IMAGE: grpc.StatusCode.FAILED_PRECONDITION,
    CUresult.CUDA_ERROR_ILLEGAL_STATE: grpc.StatusCode.FAILED_PRECONDITION,
    CUresult.CUDA_ERROR_NOT_READY: grpc.StatusCode.UNAVAILABLE,
    CUresult.CUDA_ERROR_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED: grpc.StatusCode.NOT_FOUND,
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


MAX_ROUNDS = 12                  # pre-copy rounds of a handoff, at most
SMALL_ROUND = 4 << 20            # a pre-copy round this small ends them: the frozen one will be small too
HANDOFF_RESTORE_TIMEOUT = 120    # seconds the target may take to adopt the context
HANDOFF_ASK_TIMEOUT = 10         # ... and to say where the rounds go (Stats)
DESCRIBE_TIMEOUT = 5.0           # seconds a worker may take to describe its context (ListContexts)

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


def admin_socket(server):
    """The admin socket of the server listening on `server` (ipc://PATH or tcp://HOST:PORT)."""
    url = urllib.parse.urlparse(server)
    if url.scheme == "ipc":
        return f"unix:{server[len('ipc://'):]}.admin"
    if url.scheme == "tcp":
        return f"unix:/tmp/phos/admin-{url.port}.sock"
    raise ValueError(f"server address {server!r}: use ipc://PATH or tcp://HOST:PORT")


class Admin(admin_pb2_grpc.AdminServicer):
    def __init__(self, front):
        self.front = front
        self.described = {}        # ctx id -> its last description (ListContexts)

    async def fail(self, context, e):
        await context.abort(GRPC_CODE.get(e.status, grpc.StatusCode.INTERNAL), f"{e.message} (CUresult {int(e.status)})")

    def worker(self, ctx_id):
        w = self.front.workers.get(ctx_id)
        if w is None or w.proc.returncode is not None:
            raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no context {ctx_id} on this server")
        return w

    async def describe(self, w):
        res = await self.front.control(w, "ctxStats")
        job = json.loads(res.text)
        state = "checkpointing" if job["checkpoint"] else "restoring" if job["restoring"] else w.state
        return pb.Context(id=w.ctx_id, bytes=res.u64s[0], allocations=res.u64s[1], last_seq=res.u64s[2],
                          pid=w.proc.pid, state=state, first_call_loaded=job["first_call_loaded"] or 0)

    async def ListContexts(self, request, context):
        workers = list(self.front.workers.values())
        answers = await asyncio.gather(*(asyncio.wait_for(self.describe(w), DESCRIBE_TIMEOUT) for w in workers),
                                       return_exceptions=True)
        out, described = [], {}
        for w, c in zip(workers, answers):
            if w.proc.returncode is not None or isinstance(c, CudaError):
                continue           # it went away meanwhile
            if isinstance(c, asyncio.TimeoutError):
                # busy in one long call (a batch of kernels takes seconds on emu): listed as last
                # described, not left out as if it had gone
                c = pb.Context()
                c.CopyFrom(self.described.get(w.ctx_id) or pb.Context(id=w.ctx_id, pid=w.proc.pid))
                c.state = "busy"
            elif isinstance(c, BaseException):
                raise c
            described[w.ctx_id] = c
            out.append(c)
        self.described = described
        return pb.ListContextsReply(contexts=out)

    async def Checkpoint(self, request, context):
        try:
            w = self.worker(request.ctx)
            if not request.store:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "give the image store directory")
            name = request.name or f"ctx{request.ctx}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S.%fZ}"
            parent = ""
            if request.incremental:
                parent = await asyncio.to_thread(lambda: latest_image(open_store(request.store), request.ctx)) or ""
            queue = asyncio.Queue()

            async def progress(res):
                await queue.put(pb.CheckpointProgress(done_bytes=res.u64s[0], total_bytes=res.u64s[1]))

            args = {"store": os.path.abspath(request.store), "name": name, "parent": parent, "paused": request.paused,
                    "compress": request.compress, "chunkSize": request.chunk_size}
            task = asyncio.ensure_future(self.front.control(w, "checkpoint", args, progress))
            while not task.done() or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            res = task.result()
            self.front.counts["checkpoints"] += 1
            result = json.loads(res.text)
            yield pb.CheckpointProgress(done_bytes=result["bytes"], total_bytes=result["bytes"], finished=True,
                                        result_json=json.dumps(result))
        except CudaError as e:
            await self.fail(context, e)
        except (OSError, ImageError) as e:     # the store cannot be opened (a damaged host store's index, say)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image store {request.store!r}: {e}")

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
            result = json.loads(res.text)
            return pb.RestoreReply(ctx=w.ctx_id, cut_seq=res.u64s[1], name=result["name"], seconds=time.perf_counter() - t0,
                                   bytes=result["bytes"], endpoint=w.endpoint,
                                   phase_ms={**result["phase_ms"], "worker_call": (time.perf_counter() - t0) * 1e3})
        except CudaError as e:
            await self.fail(context, e)
        except (OSError, ImageError) as e:     # the store cannot be opened (a damaged host store's index, say)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"image store {request.store!r}: {e}")

    async def Handoff(self, request, context):
        """Pre-copy rounds while the application runs, then a frozen last round, then the target
        adopts it and this worker retires. The target keeps a warm copy: it restores the first
        round and advances with each later one, loading what changed, so that after the freeze
        it loads only what the last round changed. Pre-copy rounds hold nothing up (no cut);
        they go on while what they copy shrinks. Any failure before the target holds the
        context leaves it running here."""
        t0 = time.perf_counter()
        store = None                # a HandoffStore, once the target said where
        loading = warm = False      # warm: the target may hold a warm copy that is not yet the live one
        try:
            w = self.worker(request.ctx)
            try:
                target_socket = admin_socket(request.to)
            except ValueError as e:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"target server: {e}") from None
            async with grpc.aio.insecure_channel(target_socket) as channel:
                target = admin_pb2_grpc.AdminStub(channel)

                async def ask(call, timeout):
                    try:
                        return await call(timeout=timeout)
                    except (grpc.aio.AioRpcError, OSError) as e:
                        why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                        raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE,
                                        f"handoff of context {request.ctx} to {request.to} failed, it stays live here: {why}") from None

                async def adopt(name, **how):
                    return await ask(lambda timeout: target.Restore(
                        pb.RestoreRequest(store=store.path, name=name, ctx=request.ctx, **how), timeout=timeout),
                        HANDOFF_RESTORE_TIMEOUT)

                info = await ask(lambda timeout: target.Stats(pb.StatsRequest(), timeout=timeout), HANDOFF_ASK_TIMEOUT)
                # a host store both servers pin: the rounds go device to device through it
                shared = info.host_store if info.host_store and info.host_store == self.front.host_store else ""
                store = HandoffStore(request.ctx, info.recovery_dir, shared)

                # 2 MiB unless asked: 8 MiB chunks at 8 GiB cut the frozen round's per-chunk work
                # by 14 ms but copied twice the bytes, and the downtime grew (perf/RESULTS.md)
                chunk = request.chunk_size or DEFAULT_CHUNK_SIZE
                warm = True
                rounds, round_ms, parent = await self.pre_copy(w, store, request.max_rounds, chunk, adopt)
                frozen = time.perf_counter()
                phases = {"pre_copy": (frozen - t0) * 1e3}
                name = store.round_name(len(rounds))
                # The target adopts the last round: loaded in full before the client comes (the
                # delta is small, and a loader thread left running would slow the target's first
                # calls: GIL). Unless the round is the target's recovery image (which must be
                # committed first), the source sends it as a delta before committing, and the
                # target adopts that while the source commits.
                early, commit_failed, adopt_began = None, None, frozen    # early: the target adopting the delta

                def on_delta(text):
                    nonlocal early, adopt_began
                    adopt_began = time.perf_counter()
                    phases["last_round_delta"] = (adopt_began - frozen) * 1e3
                    early = asyncio.ensure_future(adopt(name, advance=True, full=True, delta=text))
                try:
                    copied, _, steps, ms = await self.handoff_round(w, store, len(rounds), parent, chunk, final=True,
                                                                    on_delta=None if store.recovery else on_delta)
                except CudaError as e:
                    if early is None:
                        raise               # before its delta: the source thawed itself
                    copied, steps, ms, commit_failed = 0, {}, 0.0, e
                rounds.append(copied)
                round_ms.append(ms)
                t = time.perf_counter()
                phases.update({f"last_round_{k}": v for k, v in steps.items()}, last_round=(t - frozen) * 1e3)
                reply = None
                if early is not None:
                    try:
                        reply = await early
                    except CudaError as e:
                        log.info("context %d: the target could not take the last round's delta (%s): it adopts the "
                                 "committed image", request.ctx, e.message)
                if reply is None:
                    try:
                        if commit_failed is not None:
                            raise commit_failed
                        adopt_began = time.perf_counter()
                        reply = await adopt(name, advance=True, full=True)
                    except CudaError:
                        await self.front.control(w, "thaw")
                        raise
                elif commit_failed is not None:      # the target holds it all: the image was for a fallback
                    log.warning("context %d: the handoff's last round was not committed (%s); the target took its "
                                "delta", request.ctx, commit_failed.message)
                phases["target_adopt"] = (time.perf_counter() - adopt_began) * 1e3
                phases.update({f"target_{k}": v for k, v in reply.phase_ms.items()})
                warm = False              # it is the live context there now
            self.front.moved[request.ctx] = (reply.endpoint, info.standby)
            t = time.perf_counter()
            try:
                await self.front.control(w, "retireTo", {"endpoint": reply.endpoint, "standby": info.standby})
            except CudaError:
                if alive(w.proc):
                    raise
                # it died after the target adopted the context: gone either way, the move stands
            phases["retire"] = (time.perf_counter() - t) * 1e3
            downtime = time.perf_counter() - frozen
            loading = True
            asyncio.ensure_future(self.remove_when_loaded(store, name, request.to, request.ctx))
            self.front.counts["handoffs"] += 1
            return pb.HandoffReply(ctx=request.ctx, to=request.to, round_bytes=rounds, downtime_ms=downtime * 1e3,
                                   seconds=time.perf_counter() - t0, phase_ms=phases, round_ms=round_ms, chunk_size=chunk,
                                   **({"recovery_store": store.path, "recovery_image": name} if store.recovery else {}))
        except CudaError as e:
            if warm:
                await self.drop_warm(request.to, request.ctx)
            if store is not None:      # gone before the caller hears of the failure
                await asyncio.to_thread(store.remove)
                store = None
            await self.fail(context, e)
        finally:
            if not loading and store is not None:
                await asyncio.to_thread(store.remove)     # off the loop: it may be gigabytes of files

    async def pre_copy(self, w, store, max_rounds, chunk, adopt):
        """Pre-copy rounds while the application runs; the target's warm copy loads each round
        (adopt) while the next one copies. Returns the bytes and milliseconds of each round,
        and the last round's name."""
        rounds, round_ms, name, warming = [], [], "", None
        smallest, grew = None, 0      # the smallest round after the first; rounds since it
        try:
            for i in range(max(2, max_rounds or MAX_ROUNDS)):
                copied, name, _, ms = await self.handoff_round(w, store, i, name, chunk, final=False)
                rounds.append(copied)
                round_ms.append(ms)
                if warming is not None:
                    await warming
                warming = asyncio.ensure_future(adopt(name, warm=True, full=True, advance=i > 0))
                if i == 0:
                    continue
                # On while they shrink, with a round's grace: one may grow while the target
                # catches up (round 2 waits for round 0's long load).
                if smallest is None or copied < smallest:
                    smallest, grew = copied, 0
                else:
                    grew += 1
                if copied <= SMALL_ROUND or grew >= 2:
                    break
            await warming        # before the freeze: after it, the target loads the last round alone
        finally:
            if warming is not None and not warming.done():
                warming.cancel()
        return rounds, round_ms, name

    @staticmethod
    async def drop_warm(target, ctx):
        """A failed handoff: the target frees its warm copy now (if it still has one, and lives)."""
        try:
            async with grpc.aio.insecure_channel(admin_socket(target)) as channel:
                await admin_pb2_grpc.AdminStub(channel).DropWarm(pb.DropWarmRequest(ctx=ctx), timeout=5)
        except grpc.aio.AioRpcError:
            pass

    async def handoff_round(self, w, store, i, parent, chunk, final, on_delta=None):
        """One round into the handoff's store: a pre-copy round, or the frozen last one.
        on_delta: given the last round's delta (text) when the source sends it, before committing."""
        async def progress(res):
            if on_delta is not None and res.text:
                on_delta(res.text)
        name = store.round_name(i)
        args = {"store": store.path, "name": name, "parent": parent, "paused": final, "freeze": final, "precopy": not final,
                "chunkSize": chunk, "noSync": True, "early": on_delta is not None}
        res = await self.front.control(w, "checkpoint", args, progress)
        result = json.loads(res.text)
        return result["copied_bytes"], name, result["phase_ms"], result["seconds"] * 1e3

    @staticmethod
    async def remove_when_loaded(store, last, target, ctx):
        """The target loads on demand from the handoff's store: remove the rounds once that is
        done, but the last one where it is the target's recovery image."""
        deadline = time.monotonic() + 600
        try:
            async with grpc.aio.insecure_channel(admin_socket(target)) as channel:
                stub = admin_pb2_grpc.AdminStub(channel)
                while time.monotonic() < deadline:
                    contexts = (await stub.ListContexts(pb.ListContextsRequest(), timeout=10)).contexts
                    if not any(c.id == ctx and c.state == "restoring" for c in contexts):
                        break
                    await asyncio.sleep(0.5)
        except grpc.aio.AioRpcError:
            pass
        await asyncio.to_thread(store.remove, last if store.recovery else None)

    async def DropWarm(self, request, context):
        w = self.front.workers.get(request.ctx)
        if w is None or w.state != "warming":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no warm copy of context {request.ctx} on this server")
        self.front.discard(request.ctx)
        return pb.DropWarmReply()

    async def DeleteImage(self, request, context):
        from phos.snapshot import delete_image
        try:
            freed = await asyncio.to_thread(lambda: delete_image(open_store(request.store), request.name, None, True))
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
                             recovery_dir=os.path.abspath(self.front.recovery.directory) if self.front.recovery else "",
                             standby=self.front.recovery.standby if self.front.recovery else "",
                             host_store=self.front.host_store or "")


async def start(front, address):
    """Serve the admin API at a unix: address, readable by this user only."""
    path = address[len("unix:"):]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)        # a stale socket of a server that died
    server = grpc.aio.server()
    admin_pb2_grpc.add_AdminServicer_to_server(Admin(front), server)
    old = os.umask(0o077)          # the socket is created at bind: make it ours alone
    try:
        server.add_insecure_port(address)
        await server.start()
    finally:
        os.umask(old)
    return server
