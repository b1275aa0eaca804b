"""The snapshot engine: consistent checkpoints taken while the application runs, and
restores that hand the context back before its contents are loaded (DESIGN 7, 8, 10).

It runs inside a context worker and sees its Session (gpu_server/worker/session.py) as a
SnapshotSession, through its methods alone; the device work goes through the backend's snapshot
operations (`backend.snap`, SnapshotOps). Both interfaces are in snapshot/ops.py.

Checkpoint: the cut is a point in the call stream (the worker's last executed call). The
engine records the context's objects, fingerprints every chunk at the cut, and saves the
chunks in the background: in steps that the worker's loop takes between calls, on its own
thread (`advance`). A second Python thread would take the interpreter from the loop that serves
the application at every step, and leave the application a fraction of its kernels per second.
A call that waits goes before the next step (for up to STEP_AT_LEAST), and a step
that found the device still copying is not taken again for LOOK_EVERY. A call that would write
a chunk not yet saved saves it first (soft copy-on-write, `before_write`). A saved chunk whose
fingerprint differs from the cut's was written behind our back (a kernel storing through a
pointer it loaded): the engine then pauses the context and takes the image again at a new
cut, copying only the chunks the store does not hold yet. Chunks are content-addressed, so an
unchanged chunk is never copied twice: that is what makes checkpoints incremental.

Restore: objects come back with their ids and addresses; contents load in a background
thread, and a call touching a chunk not yet loaded loads it first (`before_access`). Before
the restore says it succeeded, the manifest's signature and every chunk's presence and header
are checked; each chunk's contents are checked on the device as they load, and a damaged one
fails the context (`damaged`). Until its last chunk is in, the restore holds the store's
session (garbage collection removes nothing) and its image's reader lock (deleting the image
is refused, naming it): `hold`.

Both sign and check images with this server's image key (snapshot/image_key.py) unless given
another.
"""
import bisect
import collections
import contextlib
# The executor's module is imported lazily by concurrent.futures: here, not on a worker's first
# checkpoint, with the application held by the cut.
from concurrent.futures import ThreadPoolExecutor
import functools
import hashlib
import logging
import struct
import threading
import time
import types

import numpy as np

from phos.base import settings
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot.fingerprint import fingerprint
from phos.snapshot.image import (DEFAULT_CHUNK_SIZE, MAX_CHUNK_BYTES, ImageError, ImageWriter, check_chunks, chunk_count,
                                 chunk_payload, encode_delta, read_chunk, read_chunk_into, read_delta, read_image,
                                 read_latest_image)
from phos.snapshot.image_key import image_key
from phos.snapshot.ops import BATCH_BYTES, DIRECT_BATCH_BYTES, URGENT_BATCH_BYTES, WorkThreads
from phos.snapshot.relocations import Relocations
from phos.snapshot.store import keys_of

log = logging.getLogger("phos.snapshot")
ASK_AT_ONCE = 2048               # chunks a checkpoint's step asks the store about (a short step)
LOOK_EVERY = 500e-6              # seconds between a checkpoint's looks at a busy device (advance)
STEP_AT_LEAST = 1e-3             # ... and at most between its steps while calls keep coming
LEAST_RATE = 64 << 20            # bytes a second a paced checkpoint may ask for, at least
# a checkpoint reports its steps of this long from the cut (trace_ms); a benchmark may ask for
# its whole copy (PHOS_TRACE_SECONDS=1: a trace so long that its JSON holds the worker's thread
# at the end, a gap the application sees)
TRACE_SECONDS = settings.trace_seconds()
DEVICE_COPY = bool(settings.checkpoint_device_copy())   # a concurrent cut copies the context on the device (freeze)
# ... into memory mapped ahead of it (map_ahead) for the context's allocations and a sixteenth
# more, or AHEAD_SPARE more if that is more: for what it allocates until the cut, and its
# module globals (small, not counted)
AHEAD_ROOM, AHEAD_SPARE = 16, 64 << 20
IO_THREADS = 6                   # chunk files written or read at once
PENDING, BUSY, DONE = 0, 1, 2
FEW = 32                         # chunk lists up to this long are walked in Python, longer ones by NumPy


class Chunks:
    """The chunks of a set of regions [(address, size, chunk_size)], found by address.

    moved: {address: device address} of regions the device has elsewhere (AddressSpace.moved):
    regions go by the application's addresses, table, addr and spans by the device's."""

    def __init__(self, regions, moved=None):
        self.regions = sorted(regions)
        self.moved = moved or {}
        self.bases = [r[0] for r in self.regions]
        # Built by NumPy as a whole, not a region at a time: a context of PyTorch's holds
        # thousands of regions, and the cut (the application held) waits for this
        rows = np.array([(self.moved.get(b, b), n, cs) for b, n, cs in self.regions], np.uint64).reshape(-1, 3)
        starts, nbytes, cs = rows[:, 0], rows[:, 1], rows[:, 2]
        counts = (nbytes + cs - np.uint64(1)) // np.maximum(cs, np.uint64(1))
        first = np.concatenate([np.zeros(1, np.uint64), np.cumsum(counts, dtype=np.uint64)[:-1]])
        self.first = first.tolist()  # index of each region's first chunk
        region = np.repeat(np.arange(len(rows)), counts.astype(np.int64))       # each chunk's region
        within = np.arange(len(region), dtype=np.uint64) - first[region]       # its place in its region
        addrs = starts[region] + within * cs[region]
        self.sizes = np.minimum(cs[region], starts[region] + nbytes[region] - addrs)
        self.table = np.stack([addrs, self.sizes], axis=1)      # (n, 2): every chunk, for the cut's fingerprints
        self.state = np.zeros(len(self.table), np.int8)

    # As Python lists, for the steps' few chunks at a time; made once asked for, after the cut
    # has set the fingerprint pass going (a large context's take long enough for the fence to wait)
    @functools.cached_property
    def addr(self):
        return self.table[:, 0].tolist()

    @functools.cached_property
    def size(self):
        return self.sizes.tolist()

    def __len__(self):
        return len(self.table)

    def spans(self, idx):
        return [(self.addr[c], self.size[c]) for c in idx]

    def device_regions(self):
        """[(device address, size)] of the regions that hold bytes."""
        return [(self.moved.get(base, base), size) for base, size, _ in self.regions if size]

    def region(self, r):
        return range(self.first[r], self.first[r] + chunk_count(self.regions[r][1], self.regions[r][2]))

    def covering(self, ptr, nbytes):
        """Chunk indices that [ptr, ptr+nbytes) touches."""
        r = bisect.bisect_right(self.bases, ptr) - 1
        if r < 0 or nbytes <= 0:
            return range(0)
        base, size, cs = self.regions[r]
        if ptr >= base + size:
            return range(0)
        end = min(ptr + nbytes, base + size)
        return range(self.first[r] + (ptr - base) // cs, self.first[r] + (end - 1 - base) // cs + 1)

    def batches(self, idx, limit=BATCH_BYTES):
        """idx in runs of at most limit bytes (one chunk at least): a device round trip each."""
        run, size = [], 0
        for c in idx:
            if run and size + self.size[c] > limit:
                yield run
                run, size = [], 0
            run.append(c)
            size += self.size[c]
        if run:
            yield run

    def region_at(self, ptr):
        """The index of the region holding ptr, or None."""
        r = bisect.bisect_right(self.bases, ptr) - 1
        return None if r < 0 or ptr >= self.regions[r][0] + self.regions[r][1] else r


def indices(idx):
    """Chunk indices (a range or a list) as an array, to index the chunk tables in one step."""
    if isinstance(idx, range):
        return np.arange(idx.start, idx.stop, idx.step, dtype=np.int64)
    return np.asarray(idx, dtype=np.int64)


def differing(a, b):
    """Indices where two equally long lists of chunk keys (32 hex characters) differ, as an array:
    NumPy compares a handoff's thousands in one step, where Python compared them one by one."""
    if len(a) != len(b) or None in a or None in b:
        return indices([i for i, (x, y) in enumerate(zip(a, b)) if x != y])
    x, y = "".join(a).encode(), "".join(b).encode()
    if len(x) != 32 * len(a) or len(y) != 32 * len(b):
        return indices([i for i, (p, q) in enumerate(zip(a, b)) if p != q])
    return np.flatnonzero((np.frombuffer(x, np.uint8).reshape(-1, 32) != np.frombuffer(y, np.uint8).reshape(-1, 32)).any(axis=1))


def kernel_pointers(session, params):
    """Values among a launch's parameters that point into this context's memory: the
    pointer arguments, and pointer-looking words inside by-value structs."""
    space = session.space
    lo, hi = space.base, space.base + space.size
    n = len(params) // 8
    if n <= 64:                  # a few arguments, every launch of a checkpoint: Python is quicker
        return [w for w in struct.unpack_from(f"<{n}Q", params) if lo <= w < hi]
    words = np.frombuffer(params, np.uint64, n)
    return [int(w) for w in words[(words >= lo) & (words < hi)]]


_image_hasher = None


def hash_in_background(image):
    """A future of a module image's fingerprint, hashed on a thread of its own: a module is
    loaded as the application starts, long before a checkpoint names its image, and hashing
    the tens of MB of PyTorch's libraries beside a checkpoint slowed its first steps."""
    global _image_hasher
    if _image_hasher is None:
        _image_hasher = ThreadPoolExecutor(1, thread_name_prefix="phos-image-hash")
    return _image_hasher.submit(fingerprint, image)


def image_kind(data):
    head = bytes(data[:4])
    return {b"\x7fELF": "cubin", b"\x50\xed\x55\xba": "fatbin", b"\xb1\x43\x62\x46": "fatbin"}.get(head, "ptx")


def describe(session, chunk_size):
    """The manifest fields of a session's objects, its regions [(address, size, chunk_size)],
    and the facts the session keeps about each module ({id: facts})."""
    backend = session.backend
    modules, functions, streams, events, globals_ = [], [], [], [], []
    global_ptrs, images = set(), {}
    for hid, kind, obj, meta in session.listing():
        if kind == "module":
            images[hid] = meta
            modules.append({"id": hid, "name": meta.get("name", f"module{hid}"), "kind": image_kind(meta["image"]),
                            "image": None, "size": len(meta["image"])})
            for name, ptr, size in backend.module_globals(obj):
                g = {"module": hid, "name": name, "address": session.space.to_app(ptr), "size": size}
                if g["address"] != ptr:      # pointers to it, inside globals, hold this (Restore.look_into_globals)
                    g["device"] = ptr
                globals_.append(g)
                global_ptrs.add(ptr)
        elif kind == "function":
            functions.append({"id": hid, "module": obj.module_id, "name": obj.name, "params": [list(p) for p in obj.params]})
            if obj.set_attributes:
                functions[-1]["attributes"] = [[a, v] for a, v in sorted(obj.set_attributes.items())]
        elif kind == "stream":
            streams.append({"id": hid, "flags": meta.get("flags", 0), "priority": meta.get("priority", 0)})
        elif kind == "event":
            events.append({"id": hid, "flags": meta.get("flags", 0)})
    allocations = [{"address": a, "size": n} for a, n in session.space.allocations() if a not in global_ptrs]
    for e in allocations + globals_:
        e["chunk_size"] = chunk_size
    info = backend.device_info()
    sess, error = session.state()
    fields = {
        "backend": backend.name,
        "device": {"name": info.name, "uuid": info.uuid.hex(), "cc": list(info.compute_capability), "total_mem": info.total_mem},
        "address_space": {"base": session.space.base, "size": session.space.size},
        "modules": modules, "functions": functions, "globals": globals_, "streams": streams, "events": events,
        "allocations": allocations,
        "error": error, "session": sess,
    }
    regions = [(e["address"], e["size"], chunk_size) for e in allocations + globals_ if e["size"]]
    return fields, regions, images


class ChunkJob:
    """What a checkpoint and a restore share: chunks that the background work (a checkpoint's
    steps, a restore's loader thread) and the calls of the worker's loop both work through,
    each chunk claimed by one of them."""

    def __init__(self):
        self.cv = threading.Condition()
        self.failure = None          # an exception from the background work
        self.bytes_total = self.bytes_done = 0
        self.phase_ms = {}           # steps and their times, for the reports of a handoff and a restore
        self.settled = set()         # regions whose chunks are all done (not_done)
        self.trace, self.trace_from, self.trace_until = [], 0.0, 0.0    # the steps of a window (trace_steps)

    def step(self, name, since):
        """Add the time since `since` to step `name`; returns now."""
        now = time.perf_counter()
        self.phase_ms[name] = self.phase_ms.get(name, 0.0) + (now - since) * 1e3
        if since < self.trace_until:
            self.trace.append([round((since - self.trace_from) * 1e3, 3), name, round((now - since) * 1e3, 3)])
        return now

    def trace_steps(self, since, seconds):
        """Keep each step of the next seconds, as [start, name, ms] (ms after since): where a
        checkpoint's pause went, the application being held behind the cut's fingerprint pass."""
        self.trace, self.trace_from, self.trace_until = [], since, since + seconds

    # A call touches a chunk or a few (a Python loop is cheapest); a round or a whole region
    # thousands (array steps are): FEW tells them apart.
    def claim(self, idx):
        """Mark the pending chunks of idx busy; returns them."""
        state = self.chunks.state
        with self.cv:
            if len(idx) > FEW:
                ix = indices(idx)
                mine = ix[state[ix] == PENDING].tolist()
            else:
                mine = [c for c in idx if state[c] == PENDING]
            state[mine] = BUSY
            return mine

    def mark_done(self, idx):
        with self.cv:
            if len(idx) > FEW:
                ix = indices(idx)
                self.chunks.state[ix] = DONE
                self.bytes_done += int(self.chunks.sizes[ix].sum())
            else:
                self.chunks.state[list(idx)] = DONE
                self.bytes_done += sum(self.chunks.size[c] for c in idx)
            self.cv.notify_all()

    def done(self, idx):
        state = self.chunks.state
        return (state[indices(idx)] == DONE).all() if len(idx) > FEW else all(state[c] == DONE for c in idx)

    def not_done(self, ptr, nbytes, whole):
        """The chunks a call touches ([ptr, ptr+nbytes), or with whole the region holding ptr: a
        kernel may write anywhere in it), or None when all are done: the commonest case once a
        call touched them. A region found done is remembered (`settled`), as every launch
        during a checkpoint asks about its kernel's allocations."""
        if not whole:
            idx = self.chunks.covering(ptr, nbytes)
            return None if not len(idx) or self.done(idx) else idx
        r = self.chunks.region_at(ptr)
        if r is None or r in self.settled:
            return None
        idx = self.chunks.region(r)
        if self.done(idx):
            self.settled.add(r)
            return None
        return idx

    def wait_done(self, idx):
        """Wait until the other side has finished the chunks of idx it claimed."""
        with self.cv:
            while self.failure is None and not self.done(idx):
                self.cv.wait(0.1)

    def fail(self, e):
        """The background work ends in an exception: keep it for the worker's loop to report."""
        with self.cv:
            self.failure = self.failure or e
            self.cv.notify_all()


class Checkpoint(ChunkJob):
    """One checkpoint of one session into one store; see the module docstring."""

    def __init__(self, session, store, name, parent=None, paused=False, compress=False,
                 chunk_size=DEFAULT_CHUNK_SIZE, key=None, precopy=False, known=(), prior=None, rate=0):
        """precopy: a handoff's pre-copy round. There is no cut: each chunk is stored as it was
        when copied, nothing waits for the copy (no fence, no copy-on-write), and the image is
        consistent only in its objects. Only a warm handoff target restores it; the frozen
        last round then fixes every chunk that differs from the cut.
        known: the parent's chunk keys, when the caller holds them (ImageWriter).
        prior: the parent's (regions, chunk keys in Chunks order), when the caller holds them: a
        paused checkpoint of the same regions then asks the store only about the chunks whose
        fingerprints changed (a handoff's last round, where most are the parent's).
        key: the image key to sign its manifest with (default: this server's).
        rate: bytes a second the background copy keeps to, at most (0: as fast as it goes): the
        checkpoint takes longer, and leaves more of the worker's thread and of the host to the
        application (perf/RESULTS.md, bench_snapshot: the application's throughput at full rate
        and at a rate)."""
        if rate and (paused or precopy):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "only a concurrent checkpoint keeps to a rate: a paused "
                            "one copies while the application waits")
        if rate and rate < LEAST_RATE:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"a checkpoint's rate of {rate} bytes a second is under "
                            f"the least of {LEAST_RATE >> 20} MiB a second (it would hold the context's copy for long)")
        if chunk_size <= 0 or chunk_size % 8 or chunk_size > MAX_CHUNK_BYTES:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"chunk size {chunk_size} must be a multiple of 8 up to {MAX_CHUNK_BYTES}")
        if chunk_size > getattr(store, "capacity", chunk_size):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"chunk size {chunk_size} is over the {store.capacity}-byte "
                            f"slots of the host store {store.path}")
        self.session, self.store, self.name = session, store, name
        self.prior = prior
        self.prior_keys = None       # the parent's keys, once the cut found the parent's regions (cut)
        self.concurrent = not paused
        self.precopy = precopy and not paused
        self.level = 1 if compress else None
        self.chunk_size = chunk_size
        try:
            self.writer = ImageWriter(store, name, parent=parent, key=image_key() if key is None else key,
                                      level=self.level, known=known)
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, str(e)) from None
        super().__init__()
        # a HostStore this process pinned: the device copies chunks straight into its slots
        self.direct = self.level is None and hasattr(store, "reserve") and session.backend.snap.maps(store.memory)
        self.mismatched = 0          # saved chunks that differed from the cut
        self.pause_s = 0.0           # time the application was held: the cut, and a fallback pause
        self.io = WorkThreads(IO_THREADS, "phos-ckpt-io")
        self.work = None             # the background copy (run), while it runs
        self.frozen = None           # the cut's copy of the context on the device (snap.freeze), saved from
        self.ahead = None            # memory for that copy, being mapped before the cut (map_ahead), until the cut takes it
        self.ahead_at = 0.0          # when its mapping began
        self.spare = []              # store slots reserved for the copy, not yet filled (take_slots)
        self.kept = []               # batches copied before the cut's fingerprints were in (keep)
        self.look_at = 0.0           # advance's next step, not before (perf_counter)
        self.stepped_at = 0.0        # when it took the last
        self.started = time.perf_counter()
        self.rate = rate
        self.fed = 0                 # bytes the background copy handed the device to copy (saving)

    # -- the cut -----------------------------------------------------------------------
    @property
    def freezes(self):
        """Whether the cut copies the context on the device (freeze): saved from a copy the
        application cannot write, no call waits for a copy-on-write."""
        return DEVICE_COPY and self.concurrent and not self.precopy

    def map_ahead(self):
        """Start mapping the memory the cut's device copy will fill (SnapshotOps.map_ahead),
        while the application runs: the cut holds the application, and mapping there would be
        most of it. The worker takes the cut once it is `mapped`;
        a context that outgrew that memory by then is mapped for at the cut, as without it."""
        if self.freezes:
            nbytes = sum(n for _, n in self.session.space.allocations())
            self.ahead_at = time.perf_counter()
            self.ahead = self.session.backend.snap.map_ahead(nbytes + max(nbytes // AHEAD_ROOM, AHEAD_SPARE))

    @property
    def before_cut(self):
        """Asked for, and its cut waits for the memory it maps ahead: it does not run yet."""
        return self.ahead is not None

    @property
    def mapped(self):
        """Whether the memory mapped ahead for the cut is ready, or could not be had: cut now."""
        return self.ahead is None or self.ahead.done()

    def release_ahead(self):
        """Give back the memory mapped ahead that no cut took (a checkpoint that ends before its cut)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.session.backend.snap.release(ahead)

    def cut(self, cut_seq, paused):
        """Take the cut now, between two calls. paused: copy everything before returning."""
        self.cut_at = t0 = time.perf_counter()
        self.trace_steps(t0, TRACE_SECONDS)
        if self.ahead is not None:      # the application ran meanwhile; traced as a step before the cut
            self.step("freeze_map_ahead", self.ahead_at)
        s = self.session
        self.cut_seq = cut_seq
        self.fields, regions, images = describe(s, self.chunk_size)
        self.chunks, self.settled = Chunks(regions, s.space.moved), set()
        # the pass first: the application's next kernel waits for it (the fence), not for the rest
        f = self.fields    # the step's name says how much it described (a benchmark's report shows it)
        t = self.step(f"cut_describe_{len(f['modules'])}_modules_{len(f['functions'])}_functions_{len(regions)}_regions", t0)
        self.release_frozen()        # a re-cut's
        self.copied_on_device = False
        if self.freezes:
            ahead, self.ahead = self.ahead, None       # freeze() takes it over
            self.frozen = s.backend.snap.freeze(self.chunks.device_regions(), self.step, ahead)
            self.copied_on_device = self.frozen is not None
            t = self.step("cut_freeze", t)
        # from the device copy, if any: the application's next kernel then waits for that copy alone
        self.fp_wait = s.backend.snap.fingerprints(self.chunks.table, fence=self.concurrent and not self.precopy,
                                                   frozen=self.frozen)
        t = self.step("cut_pass_launch", t)
        self.fps = None
        if self.prior is not None and self.prior[0] == self.chunks.regions:
            self.prior_keys = self.prior[1]
        # A module's image is the same bytes every checkpoint: hashed once, after the cut (the
        # libraries PyTorch loads hold tens of MB of them: hashed in the cut, even on the I/O
        # threads, they would lengthen the pause)
        self.module_images = [(e, images[e["id"]]) for e in self.fields["modules"]]
        self.storing_images = None
        if paused:
            self.add_module_images()
        self.keys = [None] * len(self.chunks)
        self.asked = [False] * len(self.chunks)    # whether the store was asked if it holds the chunk
        self.bytes_total, self.bytes_done, self.fed = int(self.chunks.sizes.sum()), 0, 0
        self.mismatch = False
        if paused:
            t = self.step("describe", t0)
            self.fps = self.fp_wait()
            t = self.step("fingerprint", t)
            mine = self.claim(range(len(self.chunks)))
            self.ask_store(mine)              # one question for them all: a handoff's last round holds most
            lacking = [c for c in mine if self.keys[c] is None]
            held = np.zeros(len(self.chunks), bool)
            held[mine] = True
            held[lacking] = False
            self.mark_done(np.flatnonzero(held))
            self.save(lacking)
            self.step("copy", t)
        else:
            self.work = self.run()
            self.step("cut_after_pass", t)
            self.step("cut", t0)
        self.pause_s += time.perf_counter() - t0

    def store_module_images(self):
        """Store each module's image (a chunk) on the I/O threads, beside the copy: PyTorch's
        libraries hold tens of MB of them, which would hold up a checkpoint's end."""
        if self.storing_images is None:
            self.storing_images = [self.io.submit(self.store_module_image, facts) for _, facts in self.module_images]

    def store_module_image(self, facts):
        """(fingerprint, key) of a module's image, stored; hashed where neither an earlier
        checkpoint nor its load (hash_in_background) did."""
        fp = facts.get("image_fp")
        if fp is None:
            fp = facts["image_hashing"].result() if facts.get("image_hashing") else fingerprint(facts["image"])
        return fp, self.writer.add_chunk(facts["image"], fp)

    def add_module_images(self):
        """Name each module's image in the image."""
        self.store_module_images()
        for (e, facts), storing in zip(self.module_images, self.storing_images):
            fp, e["image"] = storing.result()
            if not facts.get("image_fp"):
                self.session.note(e["id"], {"image_fp": fp})
        self.module_images = []

    # -- copying -----------------------------------------------------------------------
    def saving(self, batches, claim=False, urgent=False, paced=False):
        """Save batches of chunks, claimed already or, with claim, as they are reached: skip
        those the store holds, copy and validate the rest. A generator: it yields while the
        device copies, and the caller takes its next step when it likes (drain, advance).
        paced: the background copy, which keeps to the checkpoint's rate (held_back)."""
        reserved = []                 # each batch's slots, until published or given back

        def feed():                   # read() pulls the next batch when a buffer frees up
            for idx in batches:
                t = time.perf_counter()
                mine = self.claim(idx) if claim else list(idx)
                need = self.not_held(mine)
                if not need:
                    self.mark_done(mine)
                    continue
                spans = self.chunks.spans(need)
                self.fed += sum(n for _, n in spans)
                slots = self.take_slots(len(need)) if self.direct else None
                reserved.append(slots)
                into = [self.store.payload(slot, n) for slot, (_, n) in zip(slots, spans)] if slots else None
                self.step("feed", t)         # the thread's own time in each part of a batch's steps
                yield spans, into, (mine, need, slots)
        copies = self.session.backend.snap.read(feed(), urgent, self.frozen)
        try:
            t = time.perf_counter()
            for got in copies:
                if self.copies_before_fingerprints:
                    self.fingerprints_in()
                if got is None:
                    yield
                    continue
                t = self.step("copy_device", t) if not self.concurrent else t     # a paused round reports its steps
                if self.concurrent:
                    yield             # a call may come between its fingerprints and storing it
                yield from self.keep(*got)
                t = self.step("copy_store", t) if not self.concurrent else t
                while paced and self.held_back():
                    yield             # the next batch is pulled once the rate allows it
        finally:
            copies.close()            # waits for copies under way: their slots must not be reused first
            for slots in reserved:    # the copy failed: nobody will publish them
                self.release_unpublished(slots)

    def held_back(self):
        """Whether the copy is ahead of the checkpoint's rate, counted from its cut."""
        return self.rate and self.fed > self.rate * (time.perf_counter() - self.cut_at)

    def not_held(self, idx):
        """The chunks of idx the store does not hold already; the others get their keys. Before
        the cut's fingerprints are in (a call's copy-on-write right after the cut), all of them:
        the store takes a chunk it holds already as a copy of it."""
        if self.fps is None:
            return list(idx)
        self.ask_store(idx)
        return [c for c in idx if self.keys[c] is None]

    def ask_store(self, idx):
        """Ask the store once whether it holds each chunk of idx (at the cut's fingerprint)."""
        fps = self.fps
        if len(idx) == len(fps) and not any(self.asked) and self.prior_keys is not None:
            # A paused round of the parent's regions: a chunk whose fingerprint is the parent's
            # there is the parent's chunk, which the store holds. NumPy finds the others.
            keys = list(self.prior_keys)
            was = np.frombuffer(bytes.fromhex("".join(keys)), np.uint64).reshape(-1, 2)
            changed = np.flatnonzero((np.frombuffer(b"".join(fps), np.uint64).reshape(-1, 2) != was).any(axis=1)).tolist()
            new = [fps[c].hex() for c in changed]
            for c, k, held in zip(changed, new, self.writer.reuse_chunks(new)):
                keys[c] = k if held else self.keys[c]
            self.writer.reuse_known(len(keys) - len(changed))
            self.keys, self.asked = keys, [True] * len(fps)
            return
        if len(idx) == len(fps) and not any(self.asked):      # a paused round's first: all at once
            keys = keys_of(b"".join(fps))
            self.keys = [k if held else had for k, held, had in zip(keys, self.writer.reuse_chunks(keys), self.keys)]
            self.asked = [True] * len(fps)
            return
        ask = [c for c in idx if not self.asked[c]]
        if ask:
            keys = keys_of(b"".join(fps[c] for c in ask))
            for c, k, held in zip(ask, keys, self.writer.reuse_chunks(keys)):
                self.asked[c] = True
                if held:
                    self.keys[c] = k

    def take_slots(self, n):
        """n reserved slots of the store: those run() reserved for the whole copy, or new ones."""
        if len(self.spare) < n:
            self.spare += self.store.reserve(n - len(self.spare))
        slots, self.spare = self.spare[:n], self.spare[n:]
        return slots

    def release_spare(self):
        spare, self.spare = self.spare, []
        for (_, _, slots), _ in self.kept:     # never checked: the copy ended before its fingerprints
            spare += slots
        self.kept = []
        if spare:
            self.store.release(spare)

    def release_unpublished(self, slots):
        """Give back a batch's slots that hold no published chunk (None marks a published one)."""
        if slots and any(slot is not None for slot in slots):
            self.store.release([slot for slot in slots if slot is not None])
            slots[:] = [None] * len(slots)

    def keep(self, batch, copied):
        """Store a copied batch: publish its slots, or write its chunks (I/O threads; yields
        until they are written). A chunk that differs from the cut was written behind our back.
        Before the cut's fingerprints are in, a batch copied into store slots (a call's
        copy-on-write right after the cut, or the background copy's first batches from the
        cut's device copy) is kept aside, to be checked once they are: the call goes on
        meanwhile, its kernel queued behind the fingerprint pass (check_kept)."""
        t = time.perf_counter()
        mine, need, slots = batch
        if self.fps is None and slots and not self.precopy:
            self.kept.append(((mine, need, list(slots)), copied))
            slots[:] = [None] * len(slots)          # ours now: saving() must not give them back
            self.mark_done(mine)
            self.step("keep", t)
            return
        direct, writes = [], []
        cut = self.fps if self.fps is not None or self.precopy else self.cut_fingerprints()
        if self.frozen is not None:      # read from the cut's own copy: None is the cut's fingerprint
            copied = [(data, cut[c] if fp is None else fp) for c, (data, fp) in zip(need, copied)]
        for j, (c, (data, fp)) in enumerate(zip(need, copied)):
            if self.precopy or fp == cut[c]:      # pre-copy: what was copied is what counts
                if slots:
                    direct.append(j)
                else:
                    writes.append((c, self.io.submit(self.writer.add_chunk, data, fp)))
            else:
                self.mismatched += 1
                self.mismatch = True
        if direct:
            keys = self.writer.add_slots([slots[j] for j in direct], [copied[j][0] for j in direct],
                                         [copied[j][1] for j in direct])
            for j, k in zip(direct, keys):
                self.keys[need[j]], slots[j] = k, None
        self.release_unpublished(slots)      # mismatched: not published
        self.step("keep", t)
        while not all(write.done() for _, write in writes):     # the buffer is reused after us
            yield
        for c, write in writes:
            self.keys[c] = write.result()
        self.mark_done(mine)

    def check_kept(self):
        """Check and publish the batches keep() set aside before the cut's fingerprints."""
        kept, self.kept = self.kept, []
        for batch, copied in kept:
            self.drain(self.keep(batch, copied))

    def batches(self, idx, urgent=False):
        """Batches of idx to copy at once. From the cut's copy on the device straight into the
        store's pinned slots, no buffer bounds a batch: bigger ones take fewer of the worker's
        steps, which a busy application leaves far apart (snapshot.ops, read)."""
        limit = URGENT_BATCH_BYTES if urgent else DIRECT_BATCH_BYTES if self.frozen is not None and self.direct else BATCH_BYTES
        return self.chunks.batches(idx, max(limit, self.chunk_size))

    @property
    def copies_before_fingerprints(self):
        """Whether the background copy starts before the cut's fingerprints are in: from the
        cut's own copy on the device into the store's slots, where nothing can change the bytes,
        its first batches follow the fingerprint pass on the device and wait in `kept` to be
        checked (keep). Waiting for them first, a training context's copy would begin only after
        the fingerprints, a training step's call and the store's questions, a good part into the
        checkpoint. Not with a parent of the same layout: the
        store holds most chunks then, and the fingerprints say which before anything is copied."""
        return self.frozen is not None and self.direct and self.prior_keys is None

    def take_fingerprints(self):
        """Whether the cut's fingerprints are in: taken from the device once it is done."""
        if self.fps is None:
            fps = self.fp_wait(block=False)
            if fps is None:
                return False
            self.fps = fps
            self.step("cut_fingerprints_ready", time.perf_counter())
        return True

    def fingerprints_in(self):
        """take_fingerprints, and the batches copied before them checked and published then."""
        if self.fps is None and self.take_fingerprints():
            self.check_kept()
            self.store_module_images()     # on the I/O threads, now that the copy is under way
        return self.fps is not None

    def save(self, idx, urgent=False):
        """Save claimed chunks now (a paused checkpoint, a call's copy-on-write)."""
        self.drain(self.saving(self.batches(idx, urgent), urgent=urgent))

    def drain(self, steps):
        """Take every step of a generator that yields while the device works, waiting meanwhile.
        Asleep while the I/O threads have work, to give them the interpreter; else spinning: even
        sleep(0) lasts the kernel's timer slack, tens of microseconds, and a handoff's frozen round or a
        call's copy-on-write waits in series for a few batches."""
        for _ in steps:
            if self.threads_at_work():
                time.sleep(0)

    def run(self):
        """The background copy: every chunk nobody saved first, a step at a time (advance)."""
        n = len(self.chunks)
        if self.copies_before_fingerprints:
            yield from self.saving(self.batches(range(n)), claim=True, paced=True)
            while not self.fingerprints_in():        # every batch was copied before they came
                yield
            return
        self.store_module_images()
        while not self.take_fingerprints():
            yield
        # a call's copy-on-write may be waiting for them; and a call waiting on the device, whose
        # kernel ran right behind the pass, answers before the copies kept aside are checked
        yield
        self.check_kept()
        for start in range(0, n, ASK_AT_ONCE):     # the store's questions in a few steps, not one a batch
            self.ask_store(range(start, min(start + ASK_AT_ONCE, n)))
            yield
        if self.direct:                            # and its slots under one lock
            self.spare += self.store.reserve(max(0, self.keys.count(None) - len(self.spare)))
        yield from self.saving(self.batches(range(n)), claim=True, paced=True)

    def advance(self, busy=None):
        """Take the background copy's next step: the worker's loop calls it between calls.
        After a mere look at the device, the next waits LOOK_EVERY: the device has two batches
        to copy, milliseconds of work, and each look delays the call that arrives meanwhile.
        busy: whether a call is waiting (a function, asked only when a step is due: the loop
        spins through here); it goes first unless the copy has waited STEP_AT_LEAST."""
        t = time.perf_counter()
        if self.work is None or t < self.look_at or busy is not None and t - self.stepped_at < STEP_AT_LEAST and busy():
            return
        self.stepped_at = t
        try:
            next(self.work)
            if time.perf_counter() - t > 50e-6:      # a step that did work, not just a look at the device
                self.step("steps_over_50us", t)
            else:        # counted, not traced: one each LOOK_EVERY
                self.phase_ms["looks"] = self.phase_ms.get("looks", 0.0) + (time.perf_counter() - t) * 1e3
                self.look_at = t + LOOK_EVERY
        except StopIteration:
            self.work = None
        except Exception as e:          # reported by finish()
            log.exception("checkpoint %s failed", self.name)
            self.work = None
            self.fail(e)

    @property
    def running(self):
        return self.work is not None

    def threads_at_work(self):
        """Whether its threads have work: they need the interpreter's lock (Worker.serve)."""
        return self.io.at_work or self.session.backend.snap.threads_at_work()

    def wait_done(self, idx):
        """Wait until the background copy has saved the chunks of idx it claimed: it runs on
        this thread, so take its steps meanwhile."""
        while self.failure is None and self.running and not self.done(idx):
            self.advance()

    def cut_fingerprints(self):
        """The cut's fingerprints: the background's steps are taken until they are in."""
        while self.fps is None and self.running:
            self.advance()
        if self.fps is None:
            raise self.failure or CudaError(CUresult.CUDA_ERROR_UNKNOWN, f"checkpoint {self.name!r} ended before its cut's fingerprints")
        return self.fps

    @property
    def watches_writes(self):
        """Whether a call must say what it writes (before_write) before it runs."""
        return self.running and not self.precopy and self.frozen is None

    def release_frozen(self):
        frozen, self.frozen = self.frozen, None
        if frozen is not None:
            self.session.backend.snap.release(frozen)

    def before_write(self, ptr, nbytes, whole=False):
        """Save the chunks a call is about to write, if the background has not yet (saved
        from the cut's device copy, they need not be)."""
        if not self.watches_writes:
            return
        idx = self.not_done(ptr, nbytes, whole)
        if idx is None:
            return
        # copied now, beside the cut's fingerprint pass; checked against it once it is done (keep)
        mine = self.claim(idx) if self.failure is None else []
        if mine:
            self.save(mine, urgent=True)
        self.wait_done(idx)   # the background may be copying some of them right now

    # -- the end -----------------------------------------------------------------------
    def finish(self, seq_now, before_commit=None):
        """Commit the image once copying ended (on the worker's thread). Returns stats.
        before_commit: called with the image as a delta of its parent (delta()) before the
        commit, which a handoff's target need not wait for."""
        while self.running:
            self.advance()
        try:
            return self.commit_image(seq_now, before_commit)
        finally:
            self.release_frozen()      # the device copy: last, its bytes are on the host by then

    def commit_image(self, seq_now, before_commit):
        """finish() once copying ended: the image checked, described and committed."""
        t = time.perf_counter()
        self.release_spare()
        self.release_ahead()         # a cut that failed before freeze() took it
        t = self.step("finish_release", t)
        if self.failure is not None:
            self.io.shutdown()        # a module image being stored is stored before the abort takes it back
            self.writer.abort()
            raise self.failure if isinstance(self.failure, CudaError) else \
                CudaError(CUresult.CUDA_ERROR_UNKNOWN, f"checkpoint {self.name!r} failed: {self.failure}")
        fell_back = self.mismatch
        if fell_back:     # validation failed: pause and take the image again at a new cut
            t0 = time.perf_counter()
            self.session.backend.synchronize()
            self.pause_s += time.perf_counter() - t0
            self.cut(seq_now, paused=True)
            if self.mismatch:
                self.writer.abort()
                raise CudaError(CUresult.CUDA_ERROR_UNKNOWN, f"checkpoint {self.name!r}: memory changed while the context was paused")
        self.add_module_images()
        fields = dict(self.fields)
        for e in fields["allocations"] + fields["globals"]:     # the chunks go by address, as Chunks sorts them
            span = self.chunks.covering(e["address"], e["size"])
            e["chunks"] = self.keys[span.start:span.stop]
        self.step("finish_fields", t)
        elapsed = time.perf_counter() - self.started
        fields["cut_seq"] = self.cut_seq
        fields["metadata"] = {"mode": "precopy" if self.precopy else "concurrent" if self.concurrent else "paused",
                              "device_copy": self.copied_on_device,
                              "paused": fell_back or not self.concurrent, "pause_ms": round(self.pause_s * 1e3, 3),
                              "recopied_chunks": self.mismatched, "seconds": round(elapsed, 6)}
        self.io.shutdown()
        if before_commit is not None:
            before_commit(self.delta(fields))
        t0 = time.perf_counter()
        try:
            man = self.writer.commit(fields)
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_UNKNOWN, str(e)) from None
        self.step("commit", t0)
        st = self.writer.stats()
        return {"name": self.name, "bytes": self.bytes_total, "copied_bytes": st["raw_bytes"],
                "stored_bytes": st["stored_bytes"], "new_chunks": st["new_chunks"], "reused_chunks": st["reused_chunks"],
                "seconds": round(elapsed, 6), **fields["metadata"], "cut_seq": self.cut_seq, "manifest_bytes": len(man.raw),
                "phase_ms": {k: round(v, 3) for k, v in self.phase_ms.items()}, "trace_ms": self.trace,
                "trace_from": self.trace_from}

    def chunk_keys(self):
        """Every chunk key of the committed image: its contents and its modules."""
        return frozenset(self.keys) | {e["image"] for e in self.fields["modules"]}

    def delta(self, fields):
        """image_delta of the image these fields will commit: with the parent's layout and keys
        (prior), only the chunks that differ from them (a handoff's last round: a few)."""
        changes = None
        if self.prior_keys is not None:
            ch = self.chunks
            changes = []
            for c in differing(self.prior_keys, self.keys).tolist():
                r = bisect.bisect_right(ch.first, c) - 1
                changes.append([ch.regions[r][0], c - ch.first[r], self.keys[c]])
        return image_delta(types.SimpleNamespace(**{**fields, "name": self.name, "parent": self.writer.parent}), changes)

    def abort(self, why="checkpoint aborted"):
        self.fail(CudaError(CUresult.CUDA_ERROR_UNKNOWN, why))
        if self.work is not None:
            self.work.close()         # gives back the slots of its batches under way
            self.work = None
        self.release_spare()
        self.release_frozen()
        self.release_ahead()
        self.io.shutdown()
        self.writer.abort()


def region_entries(m):
    """A manifest's globals (module by module) and allocations with contents: the order in
    which Restore.recreate lays out their chunks, and advance() pairs two images' entries."""
    out = [g for e in m.modules for g in m.globals if g["module"] == e["id"]]
    return [e for e in out + list(m.allocations) if e["size"]]


def same_objects(m):
    """What must not change for Restore.advance: every object with its id, place and shape."""
    pick = lambda entries, *keys: [tuple(str(e.get(k)) for k in keys) for e in entries]    # noqa: E731
    sess = getattr(m, "session", {})
    return (m.backend, sess.get("ctx"), sess.get("token"), str(sess.get("limits", [])), str(sess.get("reserved", [])),
            pick(m.modules, "id", "image"), pick(m.functions, "id", "module", "name"),
            pick(m.streams, "id", "flags", "priority"), pick(m.events, "id", "flags"),
            pick(region_entries(m), "address", "size", "chunk_size", "module", "name"))


def image_delta(m, changes=None):
    """An image (a Manifest, or its fields) as a handoff's warm target needs it to move on from
    the parent image it holds (Restore.advance), without reading a manifest: what the objects
    are (a digest), the session's next id, the error state, the cut, and the chunks whose keys
    differ from the parent's, as [region address, chunk index in it, key]. changes: those, when
    the caller knows them; else every chunk is listed. Returns its ImageDelta message's bytes
    (image.encode_delta)."""
    if changes is None:
        changes = [[e["address"], j, k] for e in list(m.allocations) + list(m.globals) for j, k in enumerate(e["chunks"])]
    return encode_delta(m.name, m.parent, m.cut_seq, objects_digest(m), m.session["next_id"], m.error, changes)


def objects_digest(m):
    """A digest of same_objects(m): a delta names the objects of its image by it."""
    return hashlib.blake2b(repr(same_objects(m)).encode(), digest_size=16).hexdigest()


class Restore(ChunkJob):
    """Bring an image back into a fresh session: objects now, contents now or on demand."""

    def __init__(self, session, store, name, key=None):
        """name: the image, or None for the store's latest (found here: the manifest is then
        read and checked once). key: the image key its manifest must be signed with (default:
        this server's)."""
        super().__init__()
        self.session, self.store = session, store
        self.held = None             # what keeps the image's chunks in the store while they load (hold)
        t0 = time.perf_counter()
        try:
            self.key = image_key() if key is None else key
            self.manifest = read_image(store, name, key=self.key) if name else read_latest_image(store, key=self.key)
            if self.manifest is not None:
                self.hold(self.manifest.name)
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, str(e)) from None
        if self.manifest is None:
            raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"no readable image in {getattr(store, 'path', store)}")
        self.name = self.manifest.name
        self.thread = None           # the background loader
        self.first_touch = None      # bytes loaded when a call first touched memory (on demand)
        self.relocations = Relocations(())   # where the module globals that moved went (recreate)
        self.global_chunks = set()   # chunks of module globals: the ones look_into_globals() reads
        self.followed = set()        # addresses in allocations that module globals hold (touch_kernel)
        self.stopping = False        # advance() holds the background loader
        self.loader_held = False     # the loader waits for start_loader()
        self.io = WorkThreads(IO_THREADS, "phos-restore-io")
        # a HostStore this process pinned: chunks go to the device straight from its slots
        self.direct = hasattr(store, "source") and session.backend.snap.maps(store.memory)
        self.started = self.step("manifest", t0)

    def refuse(self, why):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, f"image {self.name!r}: {why}")

    def hold(self, name, committed=True):
        """Keep the chunks of image `name` in the store until they are all loaded
        (release_store): the store's session, so that garbage collection removes none of them,
        and, for a committed image, its reader lock, so that deleting it is refused with an error
        that names it (a delta's image may not be committed yet: its writer's session, then its
        manifest, keep its chunks). Replaces what held an earlier image."""
        held = contextlib.ExitStack()
        try:
            held.enter_context(self.store.session())
            if committed:
                held.enter_context(self.store.reading(name))
        except BaseException:
            held.close()
            raise
        self.release_store()
        self.held = held

    def release_store(self):
        with self.cv:       # the loader and a call may both load the last chunk
            held, self.held = self.held, None
        if held is not None:
            held.close()

    def release_when_loaded(self):
        if self.bytes_done >= self.bytes_total:
            self.release_store()

    def fail(self, e):
        """A chunk failed to load: the context cannot go on, and what is not loaded never will be."""
        super().fail(e)
        self.release_store()

    def error(self):
        """The failure as the CudaError that the context's calls get from now on."""
        if isinstance(self.failure, CudaError):
            return self.failure
        return CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"restore of image {self.name!r} failed: {self.failure}")

    def damaged(self, c, why):
        """The error of chunk c, found damaged as it loaded. The restore said it succeeded (its
        header was sound), so the context fails: every later call gets this error."""
        r = bisect.bisect_right(self.chunks.first, c) - 1
        base = self.chunks.regions[r][0]
        return CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE,
                         f"image {self.name!r} is damaged: its chunk {c - self.chunks.first[r]} of the memory at {base:#x} "
                         f"({self.keys[c]}) {why}; the context restored from it cannot go on")

    def recreate(self):
        """Recreate modules, functions, streams, events and allocations with their ids and addresses."""
        m, s = self.manifest, self.session
        backend, t = s.backend, time.perf_counter()
        if m.backend != backend.name:
            self.refuse(f"taken on the {m.backend} backend, this server runs {backend.name}")
        # (the manifest's fields read as they are: to_dict() decodes a copy, slow for a large image)
        if getattr(m, "address_space", {}).get("base", s.space.base) != s.space.base:
            self.refuse(f"address space base {m.address_space['base']:#x} differs from this server's {s.space.base:#x}")
        info = backend.device_info()
        if list(info.compute_capability) != m.device["cc"]:
            self.refuse(f"taken on a compute capability {m.device['cc']} device, this one is {list(info.compute_capability)}")
        sess = getattr(m, "session", None)
        if not isinstance(sess, dict) or not {"ctx", "token", "next_id"} <= set(sess):
            self.refuse("it names no session (ctx, token, next_id)")
        t = self.step("device", t)
        placed = {}              # (module id, global name) -> where the device put it, when the old address is taken
        moved = []               # (old start, old end, new start) of the module globals the device put elsewhere
        globals_of = collections.defaultdict(list)
        for g in m.globals:
            globals_of[g["module"]].append(g)
        for e in m.modules:
            try:
                image = read_chunk(self.store, e["image"], expected_len=e["size"])
            except ImageError as err:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, str(err)) from None
            module = s.load_module(image)     # charged to its tenant, as its first load was
            s.place(e["id"], "module", module, {"image": image, "name": e["name"], "kind": e["kind"], "image_fp": bytes.fromhex(e["image"])})
            for g in globals_of[e["id"]]:
                ptr, size = backend.get_global(module, g["name"])
                if size != g["size"]:
                    self.refuse(f"global {g['name']} holds {size} bytes, the image {g['size']}")
                for old in {g["address"], g["device"] or ptr} - {ptr}:
                    moved.append((old, old + size, ptr))
                if not s.reach_global(g["address"], ptr, size, g["name"]):
                    placed[g["module"], g["name"]] = ptr
        self.relocations = Relocations(moved)
        for f in m.functions:
            fn = backend.get_function(s.lookup("module", f["module"]), f["name"])
            if [list(p) for p in fn.params] != f["params"]:
                self.refuse(f"kernel {f['name']} has parameters {fn.params}, the image {f['params']}")
            fn.module_id, fn.size = f["module"], fn.param_bytes
            for attribute, value in f.get("attributes", []):
                backend.set_function_attribute(fn, attribute, value)
                fn.set_attributes[attribute] = value
            s.place(f["id"], "function", fn)
        for e in m.streams:
            s.place(e["id"], "stream", backend.stream_create(e["flags"], e["priority"]), {"flags": e["flags"], "priority": e["priority"]})
        for e in m.events:
            s.place(e["id"], "event", backend.event_create(e["flags"]), {"flags": e["flags"]})
        t = self.step("modules", t)
        for e in m.allocations:
            backend.alloc(e["size"], at=e["address"])
        t = self.step("allocations", t)
        s.adopt(m.session, m.error)
        regions = [(placed.get((e.get("module"), e.get("name")), e["address"]), e) for e in region_entries(m)]
        self.bases = [ptr for ptr, _ in regions]      # advance() pairs a later image's entries with them
        self.chunks, self.settled = Chunks([(ptr, e["size"], e["chunk_size"]) for ptr, e in regions], s.space.moved), set()
        by_base = {ptr: e["chunks"] for ptr, e in regions}
        self.keys = [k for base, _, _ in self.chunks.regions for k in by_base[base]]
        self.bytes_total, self.bytes_done = int(self.chunks.sizes.sum()), 0
        self.global_chunks = {c for ptr, e in regions if "module" in e for c in self.chunks.covering(ptr, e["size"])}
        return m.cut_seq

    def advance(self, name, full=False, delta=None):
        """Move this restore (its context not yet in use) on to a later image of the same
        context, as a handoff's last round: only the chunks whose contents changed load again.
        delta: that image as Checkpoint.delta gave it, an ImageDelta message's bytes (its manifest
        is not read, and may not be committed yet). Returns the later image's cut, or None when the images differ in more
        than contents (objects created or destroyed): then it must be restored afresh."""
        t = time.perf_counter()
        self.phase_ms = {}
        m = None
        if delta is not None:
            delta = self.check_delta(name, delta)
            if delta.objects != objects_digest(self.manifest):
                return None
            # each region by the address the images give it: its chunks here
            place = {e["address"]: self.chunks.covering(ptr, e["size"]) for ptr, e in zip(self.bases, region_entries(self.manifest))}
            keys, touched = list(self.keys), set()
            for address, j, key in delta.changes:
                span = place.get(address, range(0))
                if not 0 <= j < len(span):
                    self.refuse(f"the delta of image {name!r} names chunk {j} of a region at {address:#x}, "
                                f"which {f'has {len(span)} chunks' if span else 'is not one of its regions'}")
                keys[span[j]] = key
                touched.add(span[j])
            changed = indices(sorted(c for c in touched if keys[c] != self.keys[c]))
            session, error, cut_seq = dict(self.manifest.session, next_id=delta.next_id), delta.error, delta.cut_seq
        else:
            try:     # the chunks of the image it advances from were checked when it was read
                m = read_image(self.store, name, key=self.key, check_chunks=False)
            except ImageError as e:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_IMAGE, str(e)) from None
            if same_objects(self.manifest) != same_objects(m):
                return None
            by_base = {ptr: e["chunks"] for ptr, e in zip(self.bases, region_entries(m))}
            keys = [k for base, _, _ in self.chunks.regions for k in by_base[base]]
            session, error, cut_seq = m.session, m.error, m.cut_seq
            changed = differing(self.keys, keys)
        # only the changed chunks load again: the store must hold them, whole, from now until they are in
        try:
            self.hold(name, committed=m is not None)
            bad = check_chunks(self.store, [keys[c] for c in changed], self.chunks.sizes[changed])
        except ImageError as e:
            self.refuse(str(e))
        if bad:
            self.refuse(f"chunk {keys[changed[bad[0]]]} {bad[1]}")
        self.stopping = True          # the loader stops between batches; what it holds, it finishes
        if self.thread is not None:
            self.thread.join()
        self.stopping, self.thread = False, None
        with self.cv:
            self.keys = keys
            loaded = changed[self.chunks.state[changed] == DONE]
            self.chunks.state[loaded] = PENDING
            self.settled.clear()
            self.bytes_done -= int(self.chunks.sizes[loaded].sum())
        if m is not None:          # by a delta, the objects are those of the manifest we hold
            self.manifest = m
        self.name = name
        self.session.adopt(session, error)
        t = self.step("manifest", t)
        if self.failure is None:
            self.start(full)
            self.step("load", t)
        return cut_seq

    def check_delta(self, name, blob):
        """The Delta of an ImageDelta message (image.read_delta); refuses a malformed one, or one
        that moves on from another image than ours."""
        try:
            d = read_delta(blob, name)
        except ImageError as e:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, str(e)) from None
        if d.parent != self.name:
            raise CudaError(CUresult.CUDA_ERROR_ILLEGAL_STATE, f"delta of image {name!r}: it moves on from image "
                            f"{d.parent!r}, this restore holds {self.name!r}")
        return d

    def chunk_keys(self):
        """Every chunk key of the image this restore is at: its contents and its modules."""
        return frozenset(self.keys) | {e["image"] for e in self.manifest.modules}

    def read(self, c, out):
        """Chunk c's stored contents into out (a host buffer of its length)."""
        try:     # every header field is checked here; the contents' fingerprint on the device
            read_chunk_into(self.store, self.keys[c], out, check=False)
        except ImageError as e:
            raise self.damaged(c, f"cannot be loaded: {e}") from None

    def sources(self, idx):
        """Where the store keeps chunks idx, header checked, for the device to copy from; None
        when it has no such place for them all (they are read into a copy buffer instead)."""
        if not self.direct:
            return None
        out = []
        for c in idx:
            try:
                out.append(chunk_payload(self.store, self.keys[c], int(self.chunks.sizes[c])))
            except ImageError as e:
                raise self.damaged(c, f"cannot be loaded: {e}") from None
        return None if any(p is None for p in out) else out

    def load(self, idx, urgent=False):
        """Load claimed chunks, verifying each."""
        fps = self.session.backend.snap.write(self.chunks.spans(idx), lambda i, out: self.read(idx[i], out), self.io, urgent,
                                              self.sources(idx))
        for c, fp in zip(idx, fps):
            if fp.hex() != self.keys[c]:
                raise self.damaged(c, f"is corrupt: its contents fingerprint to {fp.hex()}")
        globals_here = [c for c in idx if c in self.global_chunks] if self.global_chunks else ()
        if globals_here:
            self.look_into_globals(globals_here)
        self.mark_done(idx)
        self.release_when_loaded()

    def look_into_globals(self, idx):
        """Read module globals as they load (small, and before a kernel of theirs runs):
        - point the pointers they hold to a moved global at where it is now. The driver does
          this for a module's initialisers at load; the image's contents hold the old places;
        - note the allocations they point into (followed): a kernel may follow such a pointer
          without being passed it, and must not read the allocation before it is loaded.
        Pointers kept in allocations are not searched for: a kernel that follows one may read
        memory not loaded yet, and a pointer there to a moved global stays stale."""
        backend = self.session.backend
        for addr, n in self.chunks.spans(idx):
            buf = np.empty(n, np.uint8)
            backend.dtoh(addr, buf, None)
            words = buf[:n // 8 * 8].view(np.uint64)
            if self.relocations.apply(words):
                backend.htod(addr, buf, None)
            self.followed.update(kernel_pointers(self.session, words.tobytes()))

    def load_all(self):
        with self.cv:      # after an advance, the few that changed: batches of those alone
            pending = np.flatnonzero(self.chunks.state == PENDING).tolist()
        # straight from pinned memory the link is fast enough that the round trips would show:
        # fewer, bigger ones then
        for batch in self.chunks.batches(pending, DIRECT_BATCH_BYTES if self.direct else BATCH_BYTES):
            if self.failure is not None or self.stopping:
                return
            mine = self.claim(batch)
            if mine:
                self.load(mine)

    def start(self, full, deferred=False):
        """full: load everything now. Else a background thread loads it, from now on or, with
        deferred, once start_loader() is called: the worker serves its client's re-attach
        and first calls before the loader competes with them for the interpreter."""
        if full:
            try:
                self.load_all()
            except BaseException as e:
                self.fail(e)
                raise
        elif deferred:
            self.loader_held = True
        else:
            self.start_loader()
        self.release_when_loaded()       # nothing (more) to load

    def start_loader(self):
        self.loader_held = False
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="phos-restore", daemon=True)
            self.thread.start()

    @property
    def running(self):
        return self.loader_held or self.thread is not None and self.thread.is_alive()

    def threads_at_work(self):
        """Whether its threads have work: the loader's, the I/O threads' (Worker.serve)."""
        return self.thread is not None and self.thread.is_alive() or self.io.at_work \
            or self.session.backend.snap.threads_at_work()

    def run(self):
        try:
            self.load_all()
        except CudaError as e:
            log.warning("restore of %s failed: %s", self.name, e.message)
            self.fail(e)
        except BaseException as e:
            log.exception("restore of %s failed", self.name)
            self.fail(e)

    def before_access(self, ptr, nbytes, whole=False):
        """Load the chunks a call touches now, ahead of the background queue."""
        if self.failure is not None:
            raise self.error()
        if self.first_touch is None:
            self.first_touch = self.bytes_done
        idx = self.not_done(ptr, nbytes, whole)
        if idx is None:
            return
        mine = self.claim(idx)
        if mine:
            try:
                self.load(mine, urgent=True)
            except BaseException as e:      # the context fails, and whoever waits for these chunks stops
                self.fail(e)
                raise self.error() from None
        self.wait_done(idx)
        if self.failure is not None:        # the loader failed on some of them
            raise self.error()

    def wait(self):
        """Block until every chunk is loaded (a synchronous full restore, or shutdown)."""
        if self.loader_held:
            self.start_loader()
        if self.thread is not None:
            self.thread.join()
        if self.failure is not None:
            raise self.error()
