"""The snapshot engine's interfaces: what it needs of a device (SnapshotOps, a backend's
`snap`) and of the context it checkpoints or restores (SnapshotSession, the worker's Session).

gpu_server/backends/emu.py and gpu_server/backends/cuda_snapshot.py implement SnapshotOps; gpu_server/worker/session.py's
Session implements SnapshotSession. tests/unit/test_interfaces.py checks that they declare every
member with the same parameters.

The batch sizes are here, not in the engine or a backend: the engine cuts its copies into
batches of them, and a backend sizes its copy buffers to hold one.
"""
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Optional, Protocol, Sequence, runtime_checkable

BATCH_BYTES = 128 << 20          # a checkpoint copies this much per device round trip ...
URGENT_BATCH_BYTES = 16 << 20    # ... and a call's copy-on-write this much
DIRECT_BATCH_BYTES = 512 << 20   # ... straight between the device and a pinned HostStore (a restore; a checkpoint from its device copy)

Chunk = tuple                    # (device address, length in bytes)


def ahead_memory(ahead: Future):
    """The memory a done map_ahead() Future holds, or None where it holds none (the device had
    too little free, or mapping failed)."""
    return ahead.result() if ahead.exception() is None else None


class WorkThreads(ThreadPoolExecutor):
    """A snapshot's threads, counting the work they hold. The worker's loop spins on the
    mailbox while a checkpoint or restore runs, keeping the interpreter's lock: it lets go of
    it, by sleeping, only while such threads have work (Worker.serve), as each sleep costs the
    application's next call the kernel's timer slack, tens of microseconds."""

    def __init__(self, n, name):
        super().__init__(n, thread_name_prefix=name)
        self.lock = threading.Lock()
        self.unfinished = 0

    def submit(self, fn, /, *args, **kwargs):
        with self.lock:
            self.unfinished += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self.finished(None)
            raise
        future.add_done_callback(self.finished)
        return future

    def finished(self, _future):
        with self.lock:
            self.unfinished -= 1

    @property
    def at_work(self):
        return self.unfinished > 0


@runtime_checkable
class SnapshotOps(Protocol):
    """A backend's device operations for snapshots (`backend.snap`). Chunks are (address,
    length) pairs of device memory, or an (n, 2) uint64 array of them; a fingerprint is the
    16-byte pfp1 digest of a chunk's contents (snapshot/fingerprint.py)."""

    def fingerprints(self, chunks, fence, frozen=None) -> Callable[..., Optional[list]]:
        """Start fingerprinting each chunk as the device holds it now (a checkpoint's cut);
        returns wait: wait() gives the fingerprints, in order, once they are done;
        wait(block=False) gives None until then. fence: later application work waits for
        the fingerprinting, so that none of it can change a chunk before it is read.
        frozen: freeze()'s copy of the cut, just made: the chunks are hashed there, and need
        no fence (freeze's covers them)."""

    def map_ahead(self, nbytes) -> Future:
        """Start mapping nbytes of memory of the backend's own for a coming freeze(), on a
        thread of its own: mapping takes milliseconds per GiB, which a cut that mapped it would
        hold the application for. Returns a concurrent.futures.Future whose result is that
        memory, for freeze()'s ahead, or None where the device has too little free for it or
        mapping failed (logged as freeze() logs it). Memory that no freeze() took goes back
        through release()."""

    def freeze(self, regions, step=None, ahead=None) -> Optional[object]:
        """Copy each region [(device address, length)] as the device holds it now (a
        checkpoint's cut, just before fingerprints()) into memory of the backend's own, where
        later application work cannot change it: that work waits for the copy alone (a
        fence), not for the hashing after it. Returns that copy, for read(), fingerprints()
        and release(); None where memory is short for it.
        step(name, since) -> now, if given, is told where the time went (Checkpoint.step).
        ahead: a done map_ahead() Future, which this call takes over: the copy goes into its
        memory where the regions fit there, else that memory is released and the copy's mapped
        now; where its result is None, there is no copy (None)."""

    def release(self, frozen) -> None:
        """Free a copy that freeze() made, once no read() from it is under way; or the memory
        of a map_ahead() Future that no freeze() took, once it is mapped."""

    def read(self, batches: Iterable, urgent=False, frozen=None) -> Iterator[Optional[tuple]]:
        """Copy batches of chunks to the host. Pulls (chunks, into, tag) from the iterable
        batches as its buffers free up, and yields (tag, [(bytes, fingerprint of what was
        copied)]) per batch, in order, or None while the device is still copying; a batch's
        bytes stay valid until the next item is asked for. into: a host view per chunk to
        copy it to (a HostStore's slots), or None for a buffer of its own. urgent: a call
        waits for it (a copy-on-write), beside the background copy. frozen: copy the chunks
        from that copy of freeze()'s instead of from the context; a fingerprint may then be
        None, for "as the cut's" (the cut hashed the very bytes that copy holds). Closing the
        generator waits for the copies under way."""

    def write(self, chunks: Sequence[Chunk], load, pool, urgent=False, sources=None) -> list:
        """Copy chunks to the device: chunk i's bytes from load(i, out), which fills out (a
        host buffer of its length; pool, an executor, runs the loads), or straight from
        sources[i] (host views this backend maps). Returns the fingerprints of what landed
        on the device, so that a restore verifies there. urgent: as for read."""

    def threads_at_work(self) -> bool:
        """Whether threads of its own (map_ahead's) have work, which needs the interpreter."""

    def maps(self, host) -> bool:
        """Whether read and write may copy straight to and from this host memory (a NumPy
        view): the device reaches it without a buffer in between."""

    def pin(self, memory, slot_bytes) -> bool:
        """Make a HostStore's shared memory (a NumPy view of slots of slot_bytes each) one that
        maps() accepts, for copies straight to and from it. False where it could not (copies
        then go through buffers: slower, still correct)."""

    def prepare(self) -> None:
        """Make now what the first checkpoint or restore would make (copy buffers, tables):
        a pre-started worker does it before an application uses it."""


@runtime_checkable
class SnapshotSession(Protocol):
    """What the engine needs of the context it checkpoints or restores (gpu_server/worker/session.py's
    Session). The engine reads and changes the context through these methods alone."""

    @property
    def backend(self):
        """The context's device (gpu_server/backends/backend.py Backend); its `snap` is SnapshotOps."""

    @property
    def space(self):
        """The context's AddressSpace (gpu_server/address_space.py): its allocations, and
        where the device placed what it moved."""

    def listing(self) -> list:
        """[(id, kind, object, facts)] of every object of the context, by id: kind "module",
        "function", "stream" or "event"; facts, what the session keeps about it for
        snapshots ({} if nothing; a module's: "image", its bytes, and "name")."""

    def note(self, hid, facts) -> None:
        """Keep more facts (a dict) about object hid (a module image's fingerprint,
        "image_fp"), as listing() gives them."""

    def load_module(self, image):
        """The backend's module of image (bytes), its host memory charged to the context's tenant
        first: CudaError CUDA_ERROR_OUT_OF_MEMORY past the tenant's PHOS_TENANT_HOST_QUOTA."""

    def place(self, hid, kind, obj, facts=None) -> None:
        """Put a recreated object under the id it had (a restore), with its facts (a dict)."""

    def lookup(self, kind, hid):
        """The object of that kind with that id; CudaError if there is none."""

    def reach_global(self, old, ptr, size, name) -> bool:
        """Make the address the client knows a module global by (old) reach where the device
        put it now (ptr). False when another range holds old."""

    def state(self) -> tuple:
        """(session, error) as an image keeps them: {"ctx", "token" (the digest of the
        session token), "next_id"}, and {"status", "message"} of the error that fails every
        later call (status 0: none)."""

    def adopt(self, session, error) -> None:
        """Take on an image's session and error (as state() gives them): a restore's context
        is the one the image was taken of, its next handle and sticky error included."""
