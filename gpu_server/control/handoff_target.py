"""A handoff's target party (handoff_parties.py HandoffTarget) over its server's admin API: on
this host it reads the rounds where the source put them; handoff_net.py's RemoteTarget is the
same party across hosts."""
import asyncio
import time

import grpc

from phos.schema import admin_pb2 as pb
from phos.schema.admin_net import open_admin_async
from phos.schema.cuda_types import CudaError, CUresult

HANDOFF_RESTORE_TIMEOUT = 120    # seconds the target may take to adopt the context
HANDOFF_ASK_TIMEOUT = 10         # ... and to say where the rounds go (Stats)


class TargetServer:
    """A handoff's target (HandoffTarget) over its admin API; use with `async with`.
    address: its admin API (unix:PATH, or the tcp:// server, with curve: see open_admin).
    Its failures become CudaErrors that say the context stays here."""
    same_server = False
    remote = False           # on this host: it reads the rounds where we put them

    def __init__(self, address, ctx, to, curve=None):
        self.address, self.ctx, self.to, self.curve = address, ctx, to, curve
        self.stub = None
        self.loads = None        # where restores go, if not on stub (handoff_net.RemoteTarget)

    async def __aenter__(self):
        self.stub = self.open()
        return self

    async def __aexit__(self, *exc):
        await self.stub.close()

    def open(self):
        try:
            return open_admin_async(self.address, self.curve)
        except ValueError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"target server {self.to}: {e}") from None

    async def ask(self, call, request, timeout):
        try:
            return await call(request, timeout=timeout)
        except (grpc.RpcError, OSError) as e:
            why = e.details() if isinstance(e, grpc.RpcError) else str(e)
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE,
                            f"handoff of context {self.ctx} to {self.to} failed, it stays live here: {why}") from None

    async def stats(self):
        return await self.ask(self.stub.Stats, pb.StatsRequest(), HANDOFF_ASK_TIMEOUT)

    async def send(self, store, name, delta=b""):
        """Nothing to send: it reads the rounds where we put them."""

    async def restore(self, store, name, warm=False, advance=False, full=False, delta=b""):
        request = pb.RestoreRequest(store=store, name=name, ctx=self.ctx, warm=warm, advance=advance, full=full, delta=delta)
        return await self.ask((self.loads or self.stub).Restore, request, HANDOFF_RESTORE_TIMEOUT)

    async def drop_warm(self):
        """A failed handoff: the target frees its warm copy now (if it still has one, and lives).
        Its own connection: the handoff's may be the one that failed."""
        stub = self.open()
        try:
            await stub.DropWarm(pb.DropWarmRequest(ctx=self.ctx), timeout=5)
        except grpc.RpcError:
            pass
        finally:
            await stub.close()

    async def wait_loaded(self, timeout):
        """Until the target no longer restores the context (it loads on demand), at most timeout
        seconds, or until it cannot be asked. Its own connection: the handoff's is closed by then."""
        deadline = time.monotonic() + timeout
        stub = self.open()
        try:
            while time.monotonic() < deadline:
                contexts = (await stub.ListContexts(pb.ListContextsRequest(), timeout=10)).contexts
                if not any(c.id == self.ctx and c.state == "restoring" for c in contexts):
                    break
                await asyncio.sleep(0.5)
        except grpc.RpcError:
            pass
        finally:
            await stub.close()
