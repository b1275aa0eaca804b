"""A handoff to a server that shares nothing with this one but the network (a tcp:// target).

The source (gpu_server/handoff.py) takes its rounds into its own host store where it has one
(--host-store: the device copies them straight into its slots), else into a directory in
/dev/shm, as for any target without a shared store. RemoteTarget, the target party it talks to, sends each
round to the target over the target's network admin API (gpu_server/admin_net.py; CURVE,
this server's own key pair) before asking it to adopt the round (send, then restore; it loads
one round while the next travels): the chunks the target does
not hold yet (PUT_CHUNKS, in batches), then the manifest (PutManifest); the final round's
delta goes before its commit with only its changed chunks. The target keeps what it receives
in an inbox of its own (Inboxes, below), checks each chunk as it lands and signs each manifest
with its own image key once every chunk it names is there and sound, then restores from the
inbox as from any store. A failure on either side or of the link is a CudaError, and the
handoff leaves the context live here.

The chunks are the bulk of a handoff, and they travel as fast as both machines' cores allow:
on PHOS_HANDOFF_CONNECTIONS connections at once (ZeroMQ encrypts a connection on one I/O
thread, here and at the target), each a thread here that reads its batches and keeps WINDOW of
them in flight; each chunk a frame of its own, sent as read and verified where it lands. A
round of fewer chunks than connections (the frozen round's delta, often) goes in pieces, on
every connection at once, and the target puts each chunk together before it verifies it.
"""
import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
import types

import grpc

from phos import settings
from phos.gpu_server.admin import TargetServer
from phos.schema import admin_pb2 as pb
from phos.schema import wire
from phos.schema.admin_net import PUT_CHUNKS, AdminCallError, NetAdminConnection, admin_address
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot import DirStore, ImageError, open_store, read_image
from phos.snapshot.image import HEADER_SIZE, MAX_CHUNK_BYTES, check_key, put_received_chunk, put_received_manifest

log = logging.getLogger("phos.admin")
BATCH_BYTES = 16 << 20          # chunk bytes a PUT_CHUNKS carries, about, at most
WINDOW = 2                      # batches in flight on a connection: the next travels while the target stores one
PIECE_BYTES = 256 << 10         # a chunk cut into pieces (fewer chunks than connections): pieces this big at least
SEND_TIMEOUT = 120              # seconds the target may take to store one batch
# threads that verify and store chunks on the target: fingerprinting and writing leave the
# interpreter's lock free for most of their time
VERIFIERS = min(8, max(4, os.cpu_count() or 1))
PIECES_BYTES = 256 << 20        # bytes of chunks an inbox holds in pieces at once, at most


class RemoteTarget(TargetServer):
    """TargetServer over the network: rounds are sent before they are adopted (see above).
    curve: (the target's public key, this server's public key, this server's secret key)."""
    remote = True

    def __init__(self, to, ctx, curve):
        super().__init__(to, ctx, to, curve)
        self.inbox = None        # its store for this handoff's rounds, on the target
        self.sent = set()        # chunk keys the inbox holds
        self.sent_bytes = 0
        self.links = []          # the connections chunks travel on (NetAdminConnection), once a round has sent some
        self.senders = None      # a thread for each
        self.tally = threading.Lock()       # the senders count into sent and sent_bytes

    async def __aexit__(self, *exc):
        await super().__aexit__(*exc)
        if self.loads is not None:
            await self.loads.close()
        if self.links:
            self.senders.shutdown(wait=False)
            await asyncio.to_thread(lambda: [link.close() for link in self.links])

    async def stats(self):
        info = await super().stats()
        # its recovery directory and host store are paths on its host, not ours: the rounds
        # go to our /dev/shm, then over the network
        return types.SimpleNamespace(recovery_dir="", host_store="", standby=info.standby,
                                     server_key=self.curve[0].decode())

    async def send(self, store, name, delta=b""):
        """Round `name` into the target's inbox: the chunks it lacks, then its manifest; or, for
        the last round not yet committed, its delta's changed chunks alone."""
        if self.inbox is None:
            self.inbox = (await self.ask(self.stub.OpenInbox, pb.OpenInboxRequest(ctx=self.ctx), 10)).store
        local = open_store(store, create=False)      # our host store, or a directory in /dev/shm
        if delta:
            keys = {key for _, _, key in wire.read_delta(delta)["changes"]}
            t, before = time.perf_counter(), self.sent_bytes
            await self.send_chunks(local, keys)
            log.info("context %d: the last round's delta sent: %.1f MiB of chunks in %.1f ms", self.ctx,
                     (self.sent_bytes - before) / (1 << 20), (time.perf_counter() - t) * 1e3)
            return
        t0 = time.perf_counter()
        try:     # its chunks are not looked at here: each is read as it goes, and checked where it lands
            man = await asyncio.to_thread(read_image, local, name, check_chunks=False)
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"handoff round {name}: {e}") from None
        t1, before = time.perf_counter(), self.sent_bytes
        await self.send_chunks(local, man.chunk_keys())
        t2 = time.perf_counter()
        await self.ask(self.stub.PutManifest, pb.PutManifestRequest(store=self.inbox, name=name, manifest=man.raw), 60)
        log.info("context %d: round %s sent: %.1f MiB of chunks in %.1f ms, its manifest read in %.1f ms and put in "
                 "%.1f ms", self.ctx, name, (self.sent_bytes - before) / (1 << 20), (t2 - t1) * 1e3, (t1 - t0) * 1e3,
                 (time.perf_counter() - t2) * 1e3)

    async def restore(self, store, name, **how):
        """The target restores from its inbox, where send() put the round. On a connection of
        their own: a call holds its connection until answered, and the next round's manifest
        must not wait behind the target's load of this one."""
        if self.loads is None:
            self.loads = self.open()
        return await super().restore(self.inbox, name, **how)

    async def send_chunks(self, local, keys):
        """Send the chunks of `keys` the inbox lacks, on every link at once; the first failure
        stops them all and fails the round (a CudaError saying the context stays here)."""
        todo = sorted(k for k in keys if k not in self.sent)
        if not todo:
            return
        if not self.links:
            n = settings.handoff_connections()
            self.links = [NetAdminConnection(admin_address(self.address), self.curve) for _ in range(n)]
            self.senders = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="handoff-send")
        await self.ask(self.send_on_links, (local, todo), SEND_TIMEOUT)

    async def send_on_links(self, what, timeout):
        """Every link sends part of the round, taking the next message whenever it has room for
        one, so that a slower link takes fewer. Called through ask: a link's failure becomes
        the CudaError that says the context stays here."""
        local, todo = what
        if len(todo) < len(self.links):
            makers, done = await self.pieces(local, todo)
        else:
            makers, done = [self.whole_chunks(local, todo)] * len(self.links), ()
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        sending = [loop.run_in_executor(self.senders, self.send_on, link, make, stop, timeout)
                   for link, make in zip(self.links, makers)]
        try:
            results = await asyncio.gather(*sending, return_exceptions=True)
        finally:
            stop.set()         # cancelled: the senders stop at their next answer or poll
        # the failure that stopped the others, not theirs (CANCELLED)
        failures = sorted((r for r in results if isinstance(r, BaseException)), key=stopped_by_another)
        if failures:
            raise failures[0]
        self.sent.update(done)

    def whole_chunks(self, local, todo):
        """The messages of a round of whole chunks: a link's next batch, each of per_batch chunks
        or BATCH_BYTES at most, read as it goes; None once none is left."""
        keys, taking = iter(todo), threading.Lock()
        header = pb.PutChunksRequest(store=self.inbox).SerializeToString()
        # a round smaller than a batch a link is shared out among them all
        per_batch = -(-len(todo) // (len(self.links) * WINDOW))

        def take():
            with taking:
                return next(keys, None)

        def batch():
            keys, blobs, size = [], [], 0
            while size < BATCH_BYTES and len(keys) < per_batch:
                key = take()
                if key is None:
                    break
                keys.append(key)
                blobs.append(self.read_chunk(local, key))
                size += len(blobs[-1])
            return ([header, *blobs], keys, size) if keys else None
        return batch

    async def pieces(self, local, todo):
        """The messages of a round of fewer chunks than links (the frozen round's, often): each
        chunk cut into pieces, a piece a message, so that all the links carry it at once (a
        chunk's trip is mostly its encryption on one connection's thread). The target puts the
        chunks together (Inboxes.put_pieces). Returns a message maker for each link, which deals
        it its share of the pieces (pulled from one queue, the first links would take them all,
        WINDOW at a time), and the chunks' keys, sent once every piece was answered."""
        loop = asyncio.get_running_loop()
        blobs = await asyncio.gather(*(loop.run_in_executor(self.senders, self.read_chunk, local, k) for k in todo))
        per_chunk = -(-len(self.links) // len(todo))
        pieces = []
        for key, blob in zip(todo, blobs):
            size = max(PIECE_BYTES, -(-len(blob) // per_chunk))
            for offset in range(0, len(blob), size):
                piece = pb.ChunkPiece(key=key, offset=offset, total=len(blob))
                header = pb.PutChunksRequest(store=self.inbox, pieces=[piece]).SerializeToString()
                pieces.append(([header, memoryview(blob)[offset:offset + size]], (), min(size, len(blob) - offset)))
        shares = [iter(pieces[i::len(self.links)]) for i in range(len(self.links))]
        return [lambda share=share: next(share, None) for share in shares], todo

    def send_on(self, link, message, stop, timeout):
        """One link's part of a round, on its thread: the messages message() makes until it gives
        None, WINDOW of them in flight; the first failure sets `stop` for the other links."""
        carried = []           # each message's (keys, bytes), by its index

        def messages():
            while not stop.is_set():
                made = message()
                if made is None:
                    return
                carried.append(made[1:])
                yield made[0]
        try:
            for i, _ in link.calls(PUT_CHUNKS, messages(), timeout, WINDOW, stop):
                keys, size = carried[i]
                with self.tally:
                    self.sent.update(keys)
                    self.sent_bytes += size
        except BaseException:
            stop.set()
            raise

    def read_chunk(self, local, key):
        try:
            return local.get_chunk(key)
        except (OSError, ImageError) as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"handoff of context {self.ctx}: a round's "
                            f"chunk cannot be read here: {e}") from None


def stopped_by_another(e):
    """Whether a link's failure is its being stopped because another failed."""
    return isinstance(e, AdminCallError) and e.code() == grpc.StatusCode.CANCELLED


class Inboxes:
    """The target's side: stores in /dev/shm that handoffs from other hosts send rounds into,
    one a context (a later handoff of it replaces it). Named as the source's own rounds are
    (phos-handoff-<pid>-...), so that frontend.sweep_shm removes what a killed server left."""

    def __init__(self):
        self.paths = {}          # ctx -> path
        self.landed = {}         # path -> {key: raw length} of the chunks verified into it
        self.partial = {}        # path -> {key: Assembly} of the chunks arriving in pieces
        self.verifiers = concurrent.futures.ThreadPoolExecutor(VERIFIERS, thread_name_prefix="inbox")

    def open(self, ctx):
        self.drop(ctx)
        path = tempfile.mkdtemp(prefix=f"phos-handoff-{os.getpid()}-in{ctx}-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        DirStore(path, fsync=False)      # in memory: a lost one is a failed handoff, the context stays at the source
        self.paths[ctx], self.landed[path] = path, {}
        return path

    def store(self, path):
        """The store of an inbox OpenInbox gave; any other path is refused (the admin API writes
        only there)."""
        if path not in self.paths.values():
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{path!r} is not a handoff inbox of this server")
        return DirStore(path, fsync=False, create=False)

    async def put_chunks(self, path, blobs, pieces=()):
        """Verify and store a batch of chunks (views of the frames they came in) on the verifier
        threads, a share of the batch each; the event loop goes on receiving meanwhile. Returns
        how many the inbox lacked; a chunk that fails its check is refused by its key. With
        `pieces` (schema/admin.proto ChunkPiece, one a frame), the frames are pieces of chunks
        (put_pieces)."""
        if pieces:
            return await self.put_pieces(path, pieces, blobs)
        store = self.store(path)
        loop = asyncio.get_running_loop()
        shares = [blobs[i::VERIFIERS] for i in range(min(VERIFIERS, len(blobs)))]
        landed = self.landed.get(path)
        stored = await asyncio.gather(*(loop.run_in_executor(self.verifiers, put_share, store, share, landed)
                                        for share in shares), return_exceptions=True)
        for result in stored:
            if isinstance(result, ImageError):
                raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"a handoff's chunk was refused: {result}")
            if isinstance(result, BaseException):
                raise result
        return sum(stored)

    async def put_pieces(self, path, pieces, frames):
        """Put each piece in its chunk (a frame each); a chunk whole at last is verified and
        stored as a whole one is (put_received_chunk), and must bear the key its pieces named.
        Returns how many chunks the inbox took. What the pieces say is checked before a byte is
        copied: a piece out of its chunk's bounds, over another, or of a chunk no chunk can be
        is refused with the chunk's pieces so far, and so is a chunk that would take the inbox's
        pieces over PIECES_BYTES."""
        store = self.store(path)
        if len(pieces) != len(frames):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a handoff's {len(pieces)} pieces came in {len(frames)} "
                            "frames: one a piece")
        partial = self.partial.setdefault(path, {})
        loop = asyncio.get_running_loop()
        stored = 0
        for piece, frame in zip(pieces, frames):
            chunk = partial.get(piece.key)
            if chunk is None:
                check_piece_key(piece.key)
                if not 0 < piece.total <= MAX_CHUNK_BYTES + HEADER_SIZE:
                    raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"chunk {piece.key}: {piece.total} bytes in "
                                    "pieces: no chunk is that big")
                if sum(len(c.blob) for c in partial.values()) + piece.total > PIECES_BYTES:
                    raise CudaError(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"chunk {piece.key}: the inbox holds "
                                    f"{PIECES_BYTES >> 20} MiB of chunks in pieces at most")
                chunk = partial[piece.key] = Assembly(piece.key, piece.total)
            if not chunk.take(piece.offset, piece.total, len(frame)):     # on the loop: no two take one range
                partial.pop(piece.key, None)      # the sender is broken: its chunk fails whole
                raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"chunk {piece.key}: a piece of {len(frame)} bytes "
                                f"at {piece.offset} does not fit in the {len(chunk.blob)} bytes of the chunk's pieces so "
                                "far")
            whole = await loop.run_in_executor(self.verifiers, chunk.fill, piece.offset, frame)
            if whole:
                partial.pop(piece.key, None)
                try:
                    stored += await loop.run_in_executor(self.verifiers, put_whole, store, chunk, self.landed.get(path))
                except ImageError as e:
                    raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"a handoff's chunk was refused: {e}") from None
        return stored

    def put_manifest(self, path, name, raw):
        store = self.store(path)
        try:
            # dropped meanwhile (this runs on a thread): no record, every chunk is looked at
            put_received_manifest(store, name, raw, known=self.landed.get(path))
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"a handoff's manifest was refused: {e}") from None

    def is_inbox(self, path):
        return path in self.paths.values()

    def drop(self, ctx, wait=False):
        """Forget ctx's inbox and remove its files: on a thread of their own unless wait, as
        freeing gigabytes of /dev/shm takes ~0.25 s a GiB, which a handoff's answer (and its
        application) must not wait for."""
        path = self.paths.pop(ctx, None)
        self.landed.pop(path, None)
        self.partial.pop(path, None)
        if path and wait:
            shutil.rmtree(path, ignore_errors=True)
        elif path:
            threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                             name="inbox-remove", daemon=True).start()

    def drop_path(self, path):
        for ctx, p in list(self.paths.items()):
            if p == path:
                self.drop(ctx)

    def close(self):
        for ctx in list(self.paths):
            self.drop(ctx, wait=True)
        self.verifiers.shutdown(wait=False)


def put_share(store, blobs, landed):
    return sum(put_received_chunk(store, blob, landed) for blob in blobs)


def put_whole(store, chunk, landed):
    return put_received_chunk(store, chunk.blob, landed, key=chunk.key)


def check_piece_key(key):
    try:
        check_key(key)
    except ImageError:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a handoff's piece names chunk {key[:80]!r}: not a chunk "
                        "key") from None


class Assembly:
    """A chunk blob arriving in pieces (RemoteTarget.pieces), put together in the inbox. take()
    claims a piece's range on the event loop, in the order the pieces came; fill() copies it on
    a verifier thread and says whether the chunk is whole."""

    def __init__(self, key, total):
        self.key, self.blob = key, bytearray(total)
        self.ranges = []            # (start, end) of the pieces claimed
        self.filling = total        # bytes not yet copied
        self.lock = threading.Lock()

    def take(self, offset, total, size):
        end = offset + size
        if total != len(self.blob) or not size or end > total or any(s < end and offset < e for s, e in self.ranges):
            return False
        self.ranges.append((offset, end))
        return True

    def fill(self, offset, piece):
        piece = memoryview(piece).cast("B")
        self.blob[offset:offset + len(piece)] = piece
        with self.lock:
            self.filling -= len(piece)
            return self.filling == 0
