"""A handoff to a server that shares nothing with this one but the network (a tcp:// target).

The source (gpu_server/handoff.py) takes its rounds into a store of its own in /dev/shm, as
for any target without a shared store. RemoteTarget, the target party it talks to, sends each
round to the target over the target's network admin API (gpu_server/admin_net.py; CURVE,
this server's own key pair) before asking it to adopt the round: the chunks the target does
not hold yet (PutChunks, in batches), then the manifest (PutManifest); the final round's
delta goes before its commit with only its changed chunks. The target keeps what it receives
in an inbox of its own (Inboxes, below), checks each chunk as it lands and signs each manifest
with its own image key once every chunk it names is there and sound, then restores from the
inbox as from any store. A failure on either side or of the link is a CudaError, and the
handoff leaves the context live here.
"""
import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import types

from phos.gpu_server.admin import TargetServer
from phos.schema import admin_pb2 as pb
from phos.schema import wire
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot import DirStore, ImageError, read_image
from phos.snapshot.image import put_received_chunk, put_received_manifest

log = logging.getLogger("phos.admin")
BATCH_BYTES = 32 << 20          # chunk bytes a PutChunks carries, about
SEND_TIMEOUT = 120              # seconds the target may take to store one batch
VERIFIERS = 4                   # threads that verify and store a batch's chunks on the target
IN_FLIGHT = 3                   # batches on their way at once (send_chunks)


class RemoteTarget(TargetServer):
    """TargetServer over the network: rounds are sent before they are adopted (see above).
    curve: (the target's public key, this server's public key, this server's secret key)."""

    def __init__(self, to, ctx, curve):
        super().__init__(to, ctx, to, curve)
        self.inbox = None        # its store for this handoff's rounds, on the target
        self.sent = set()        # chunk keys the inbox holds
        self.sent_bytes = 0

    async def stats(self):
        info = await super().stats()
        # its recovery directory and host store are paths on its host, not ours: the rounds
        # go to our /dev/shm, then over the network
        return types.SimpleNamespace(recovery_dir="", host_store="", standby=info.standby,
                                     server_key=self.curve[0].decode())

    async def restore(self, store, name, **how):
        if self.inbox is None:
            self.inbox = (await self.ask(self.stub.OpenInbox, pb.OpenInboxRequest(ctx=self.ctx), 10)).store
        local = DirStore(store, create=False)
        if how.get("delta"):          # the last round, not committed yet: its changed chunks alone
            keys = {key for _, _, key in wire.read_delta(how["delta"])["changes"]}
            await self.send_chunks(local, keys)
        else:
            try:
                man = await asyncio.to_thread(read_image, local, name)
            except ImageError as e:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"handoff round {name}: {e}") from None
            await self.send_chunks(local, man.chunk_keys())
            await self.ask(self.stub.PutManifest, pb.PutManifestRequest(store=self.inbox, name=name, manifest=man.raw), 60)
        return await super().restore(self.inbox, name, **how)

    async def send_chunks(self, local, keys):
        """The chunks of `keys` the inbox lacks, in batches, IN_FLIGHT of them travelling at once
        while the next is read: one at a time, the link waited for the target's verifying and
        storing each batch, and the target for the link."""
        todo = sorted(k for k in keys if k not in self.sent)

        def read_batch(start):
            blobs, size, i = [], 0, start
            while i < len(todo) and (not blobs or size < BATCH_BYTES):
                blobs.append(local.get_chunk(todo[i]))
                size += len(blobs[-1])
                i += 1
            return blobs, size, i

        async def put(blobs, sent, size):
            await self.ask(self.stub.PutChunks, pb.PutChunksRequest(store=self.inbox, chunks=blobs), SEND_TIMEOUT)
            self.sent.update(sent)
            self.sent_bytes += size
        travelling, i = set(), 0
        try:
            while i < len(todo):
                try:
                    blobs, size, end = await asyncio.to_thread(read_batch, i)
                except (OSError, ImageError) as e:
                    raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"handoff of context {self.ctx}: a round's "
                                    f"chunk cannot be read here: {e}") from None
                while len(travelling) >= IN_FLIGHT:
                    done, travelling = await asyncio.wait(travelling, return_when=asyncio.FIRST_COMPLETED)
                    for d in done:
                        d.result()          # a failed batch fails the round
                travelling.add(asyncio.ensure_future(put(blobs, todo[i:end], size)))
                i = end
            while travelling:
                done, travelling = await asyncio.wait(travelling, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    d.result()
        finally:
            for t in travelling:
                t.cancel()


class Inboxes:
    """The target's side: stores in /dev/shm that handoffs from other hosts send rounds into,
    one a context (a later handoff of it replaces it). Named as the source's own rounds are
    (phos-handoff-<pid>-...), so that frontend.sweep_shm removes what a killed server left."""

    def __init__(self):
        self.paths = {}          # ctx -> path
        self.verifiers = concurrent.futures.ThreadPoolExecutor(VERIFIERS, thread_name_prefix="inbox")

    def open(self, ctx):
        self.drop(ctx)
        path = tempfile.mkdtemp(prefix=f"phos-handoff-{os.getpid()}-in{ctx}-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        DirStore(path, fsync=False)      # in memory: a lost one is a failed handoff, the context stays at the source
        self.paths[ctx] = path
        return path

    def store(self, path):
        """The store of an inbox OpenInbox gave; any other path is refused (the admin API writes
        only there)."""
        if path not in self.paths.values():
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{path!r} is not a handoff inbox of this server")
        return DirStore(path, fsync=False, create=False)

    def put_chunks(self, path, blobs):
        """Verify and store a batch of chunks, several at a time: hashing one and writing it
        leave the interpreter's lock free for much of their time (a batch is 32 MiB)."""
        store = self.store(path)
        try:
            return sum(self.verifiers.map(lambda b: put_received_chunk(store, b), blobs))
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"a handoff's chunk was refused: {e}") from None

    def put_manifest(self, path, name, raw):
        store = self.store(path)
        try:
            put_received_manifest(store, name, raw)
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"a handoff's manifest was refused: {e}") from None

    def is_inbox(self, path):
        return path in self.paths.values()

    def drop(self, ctx):
        path = self.paths.pop(ctx, None)
        if path:
            shutil.rmtree(path, ignore_errors=True)

    def drop_path(self, path):
        for ctx, p in list(self.paths.items()):
            if p == path:
                self.drop(ctx)

    def close(self):
        for ctx in list(self.paths):
            self.drop(ctx)
        self.verifiers.shutdown(wait=False)
