"""A handoff to a server that shares nothing with this one but the network (a tcp:// target).

The source (gpu_server/control/handoff.py) takes its rounds into its own host store where it has one
(--host-store: the device copies them straight into its slots), else into a directory in
/dev/shm, as for any target without a shared store. RemoteTarget, the target party it talks to, sends each
round to the target over the target's network admin API (gpu_server/control/admin_net.py; CURVE,
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
thread, here and at the target), each a thread here that reads its batches and keeps up to
WINDOW of them in flight (one, where the round has no more chunks than links); each chunk sent
from where it lies (a HostStore's slot: no copy), in frames of PIECE_BYTES, and verified where
it lands.
"""
import asyncio
import concurrent.futures
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import types

import grpc

from phos.base import settings
from phos.gpu_server.control.handoff_target import TargetServer
from phos.schema import admin_pb2 as pb
from phos.schema.admin_net import PUT_CHUNKS, AdminCallError, NetAdminConnection, admin_address
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot import DirStore, ImageError, open_store, read_image
from phos.snapshot.image import chunk_blob_parts, put_received_chunk, put_received_manifest, read_delta

log = logging.getLogger("phos.admin")
BATCH_BYTES = 16 << 20          # chunk bytes a PUT_CHUNKS carries, about, at most
WINDOW = 2                      # batches in flight on a connection: the next travels while the target stores one
# a chunk travels in frames of this many bytes: ZeroMQ encrypts and decrypts frame by frame, so
# the target decrypts a chunk's first pieces while its last are encrypted (a 2 MiB chunk lands
# ~1 ms sooner; smaller pieces cost more per frame than they overlap)
PIECE_BYTES = 512 << 10
SEND_TIMEOUT = 120              # seconds the target may take to store one batch
# threads that verify and store chunks on the target: fingerprinting and writing leave the
# interpreter's lock free for most of their time
VERIFIERS = min(8, max(4, os.cpu_count() or 1))


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
            try:
                keys = {key for _, _, key in read_delta(delta, name).changes}
            except ImageError as e:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"handoff round {name}: {e}") from None
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

    async def restore(self, store, name, warm=False, advance=False, full=False, delta=b""):
        """The target restores from its inbox, where send() put the round. On a connection of
        their own: a call holds its connection until answered, and the next round's manifest
        must not wait behind the target's load of this one."""
        if self.loads is None:
            self.loads = self.open()
        return await super().restore(self.inbox, name, warm, advance, full, delta)

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
        """Every link sends part of the round, taking the next keys whenever it has room for a
        batch, so that a slower link takes fewer. Called through ask: a link's failure becomes
        the CudaError that says the context stays here."""
        local, todo = what
        keys, taking, stop = iter(todo), threading.Lock(), threading.Event()
        # a round smaller than a batch a link (the frozen one, often) is shared out among them all,
        # a chunk a link at first: a link that took a second would encrypt it after its first
        per_batch = -(-len(todo) // (len(self.links) * WINDOW))
        window = min(WINDOW, -(-len(todo) // len(self.links)))

        def take():
            with taking:
                return next(keys, None)
        loop = asyncio.get_running_loop()
        sending = [loop.run_in_executor(self.senders, self.send_on, link, local, take, per_batch, window, stop, timeout)
                   for link in self.links]
        try:
            results = await asyncio.gather(*sending, return_exceptions=True)
        finally:
            stop.set()         # cancelled: the senders stop at their next answer or poll
        # the failure that stopped the others, not theirs (CANCELLED)
        failures = sorted((r for r in results if isinstance(r, BaseException)), key=stopped_by_another)
        if failures:
            raise failures[0]

    def send_on(self, link, local, take, per_batch, window, stop, timeout):
        """One link's part of a round, on its thread: batches of the keys take() gives until none
        is left, `window` of them in flight, each of per_batch chunks or BATCH_BYTES at most; the
        first failure sets `stop` for the other links."""
        carried = []           # each batch's (keys, bytes), by its index

        def batches():
            while not stop.is_set():
                keys, frames, pieces, size = [], [], [], 0
                while size < BATCH_BYTES and len(keys) < per_batch:
                    key = take()
                    if key is None:
                        break
                    keys.append(key)
                    parts = [memoryview(part)[i:i + PIECE_BYTES] for part in self.read_chunk(local, key)
                             for i in range(0, len(part), PIECE_BYTES)]
                    frames += parts
                    pieces.append(len(parts))
                    size += sum(map(len, parts))
                if not keys:
                    return
                carried.append((keys, size))
                yield [pb.PutChunksRequest(store=self.inbox, pieces=pieces).SerializeToString(), *frames]
        try:
            for i, _ in link.calls(PUT_CHUNKS, batches(), timeout, window, stop):
                keys, size = carried[i]
                with self.tally:
                    self.sent.update(keys)
                    self.sent_bytes += size
        except BaseException:
            stop.set()
            raise

    def read_chunk(self, local, key):
        """The chunk's blob as the buffers it lies in here (chunk_blob_parts)."""
        try:
            return chunk_blob_parts(local, key)
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

    async def put_chunks(self, path, frames, pieces=()):
        """Verify and store a batch of chunks (views of the frames they came in, `pieces` frames
        to each: PutChunksRequest) on the verifier threads, a share of the batch each; the event
        loop goes on receiving meanwhile. Returns how many the inbox lacked; a chunk that fails
        its check is refused by its key."""
        store = self.store(path)
        blobs = chunk_frames(frames, pieces)
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


def chunk_frames(frames, pieces):
    """A PutChunks's frames by chunk: `pieces` frames to each, in order (none: one each)."""
    if not pieces:
        return [[frame] for frame in frames]
    if min(pieces) < 1 or sum(pieces) != len(frames):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a batch of {len(frames)} frames cannot hold "
                        f"{len(pieces)} chunks in {sum(pieces)} pieces (none empty)")
    starts = itertools.accumulate(pieces, initial=0)
    return [frames[i:i + n] for i, n in zip(starts, pieces)]


def put_share(store, chunks, landed):
    """Verify and store chunks, each the frames it came in (joined: a chunk is checked whole),
    on a verifier thread."""
    return sum(put_received_chunk(store, joined(parts), landed) for parts in chunks)


_joins = threading.local()
KEPT_JOIN_BYTES = 32 << 20      # a verifier thread keeps a buffer this big at most (8 of them: 256 MiB)


def joined(parts):
    """A chunk's frames as one buffer, the verifier thread's own, until its next chunk: a fresh
    one (malloc's fresh pages) would take a page fault every 4 KiB, ~0.5 ms a 2 MiB chunk. A
    chunk bigger than KEPT_JOIN_BYTES (up to 256 MiB) is joined afresh: rare, and not worth
    the memory kept."""
    if len(parts) == 1:
        return parts[0]
    parts = [memoryview(part).cast("B") for part in parts]
    size = sum(map(len, parts))
    if size > KEPT_JOIN_BYTES:
        return b"".join(parts)
    if len(getattr(_joins, "buffer", b"")) < size:
        _joins.buffer = bytearray(size)
    view, at = memoryview(_joins.buffer)[:size], 0
    for part in parts:
        view[at:at + len(part)] = part
        at += len(part)
    return view
