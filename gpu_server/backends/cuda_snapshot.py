"""The snapshot engine's device operations on a real GPU (CudaSnapshotOps): the cut's device
copy and fingerprint pass, and the copies of chunks between the device and the host."""
import collections
import ctypes
from concurrent.futures import Future
import itertools
import logging
import os
import threading
import time

import numpy as np
from cuda.bindings import driver as cu

from phos.gpu_server.backends.cuda_driver import (
    DEVICEMAP, PIN_PAUSE, LaunchConfig, check, cuEventQuery, cuEventRecord, cuLaunchKernelEx, cuMemCreate, cuMemMap,
    cuMemRelease, cuMemSetAccess, cuMemUnmap, cuMemcpyDtoDAsync, cuMemcpyDtoHAsync, cuMemcpyHtoDAsync, ok, ready)
from phos.gpu_server.backends.staging_layout import FrozenLayout, copy_runs, join_runs, pieces, stage_offsets
from phos.schema.cuda_types import CudaError, CUresult
from phos.snapshot.ops import BATCH_BYTES, URGENT_BATCH_BYTES, WorkThreads, ahead_memory

log = logging.getLogger("phos.cuda")
STORE_PIN_PIECE = 16 << 20   # a HostStore is pinned in pieces of whole slots about this big (see CudaSnapshotOps.pin)
# Batches of a read from freeze()'s copy into a store's slots under way at once (others: two, in
# buffers that take turns): the link idles once those are copied, and the worker's steps (a
# batch's bookkeeping) can come as far apart as a batch takes to copy. Not more: enqueueing a
# batch's copies can wait for room in the driver's queue, the application's calls held meanwhile.
FROZEN_IN_FLIGHT = 3
HASH_PART = 1 << 20      # a chunk bigger than this is hashed in parts of this size ...
SPLIT_BELOW = 1024       # ... when fewer chunks than this are hashed at once (a cut's thousands fill the GPU as they are)
FREEZE_HEADROOM = 2 << 30   # a checkpoint's device copy leaves this much free at least (or 5% of the device)
CUT_TABLE = 1 << 16      # chunks a cut hashes without growing its table (128 GiB in 2 MiB chunks): 1 MiB, pinned
FREEZE_PIECE = 4 << 20   # the cut's device copy gives each block of its kernel this much at most ...
FREEZE_TABLE = 1 << 15   # ... and copies this many pieces without growing its table (a large model's training context): 768 KiB, pinned


def _wait_event(event):
    """Wait for an event, polling: the worker's loop serving the application must not stall
    behind our copies. (cuda.bindings releases the GIL in every driver call, NVIDIA/cuda-python
    #1065, so cuEventSynchronize on a blocking-sync event would do as well: neither the
    application's throughput during a checkpoint nor the copy rate gains by it.)"""
    while not _event_done(event):
        time.sleep(0.00005)


def _event_done(event):
    return ready(cuEventQuery(int(event)), "cuEventQuery")


def _copies(one, dsts, srcs, sizes, stream, what):
    """Enqueue copies on stream: one(dst, src, size, stream) each (a cuMemcpy*Async)."""
    dsts, srcs, sizes = (np.ascontiguousarray(a, np.uint64) for a in (dsts, srcs, sizes))
    for dst, src, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        err = one(dst, src, n, stream)
        if err:      # which copy, and the ranges the driver knows its ends in
            ranges = [cu.cuMemGetAddressRange(p) for p in (src, src + n - 1, dst, dst + n - 1)]
            known = ", ".join(f"{int(b):#x}+{int(size)}" if not int(e) else "none" for e, b, size in ranges)
            ok((err,), f"{what}({dst:#x}, {src:#x}, {n}; driver's ranges of the ends: {known})")


_char = ctypes.c_char


def _addresses(views):
    """The addresses of host views (NumPy arrays), quicker than ndarray.ctypes."""
    try:
        return [ctypes.addressof(_char.from_buffer(v)) for v in views]
    except (TypeError, ValueError):     # read-only, or empty
        return [v.ctypes.data for v in views]


def _pinned(nbytes):
    """A page-locked host buffer as a uint8 array (kept for the worker's life)."""
    ptr = int(ok(cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class CudaSnapshotOps:
    """The snapshot engine's device operations (SnapshotOps, snapshot/ops.py) on a real GPU.

    Copies run on two streams of our own that never block the application's: `bulk` for
    the background copy, `urgent` (highest priority) for copy-on-write saves. The cut
    makes both wait for the application's work so far, and fingerprints every chunk with
    the pfp1 kernel; with a fence, the application's streams then wait for that kernel,
    so no later write can run before it. A read copies a batch of chunks into a device
    buffer of ours, hashes it there and sends it to the host from there, on the same stream:
    the fingerprint of what was copied.
    """
    BUFFER = {"bulk": BATCH_BYTES, "urgent": URGENT_BATCH_BYTES}     # at least: the engine's batches; two of each

    def __init__(self, backend):
        self.backend = backend
        ok(cu.cuCtxSetCurrent(backend.ctx), "cuCtxSetCurrent")   # we may be made on a restore's loader thread
        self.modules = {}
        self.kernel = self._kernel("pfp1", "pfp1_lane_sums")
        self.copy_kernel = self._kernel("copy_pieces", "copy_pieces")
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        _, greatest = ok(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        self.streams = {"bulk": ok(cu.cuStreamCreateWithPriority(flags, 0), "cuStreamCreate"),
                        "urgent": ok(cu.cuStreamCreateWithPriority(flags, greatest), "cuStreamCreate")}
        self.handles = {k: int(s) for k, s in self.streams.items()}     # for the ctypes calls
        self.host = {k: [] for k in self.streams}      # pinned buffers, made on first use
        self.pinned = []         # (start, end) of host memory pinned for direct copies (pin)
        self.pieces = []         # the start of each of its pinned pieces
        self.device = {}         # stream key -> ([two device buffers], size), made on first use
        self.tables = {}         # purpose -> chunk table and sums, on the device and pinned on the host
        self.splits = {}         # chunk table bytes -> its hash_parts
        self.uploaded = {}       # purpose -> (device table, parts) it holds: a batch's layout repeats
        self.launches = {}       # (device table, n, stream) -> pfp1's prepared arguments
        self.events = []         # events done with, for reuse: creating one costs a driver call
        self.freeze_table = None   # freeze's copies: (device table, pinned host table, capacity in pieces)
        self.mapper = WorkThreads(1, "phos-map-ahead")   # map_ahead's mappings, and unmapping freeze's copies

    def _kernel(self, name, function):
        """A kernel of snapshot/kernels/NAME.ptx (checked in: servers need no compiler)."""
        from phos import snapshot
        with open(os.path.join(os.path.dirname(snapshot.__file__), "kernels", f"{name}.ptx"), "rb") as f:
            ptx = f.read()
        self.modules[name] = ok(cu.cuModuleLoadData(ptx + b"\0"), f"cuModuleLoadData({name})")
        return ok(cu.cuModuleGetFunction(self.modules[name], function.encode()), f"cuModuleGetFunction({function})")

    def _launch(self, kernel, blocks, stream, args):
        """Launch kernel on blocks of 256 threads with these u64 arguments (a u32 parameter
        reads the low half of its u64, little-endian)."""
        params = np.array(args, np.uint64)
        pointers = np.array([params.ctypes.data + 8 * i for i in range(len(args))], np.uint64)
        config = LaunchConfig((blocks, 1, 1), (256, 1, 1), 0, stream, None, 0)
        return params, pointers, config, ctypes.addressof(config), pointers.ctypes.data

    def _table(self, key, n):
        """(device table, device sums, host table, host sums) for n chunks; pinned, so async copies stay async."""
        t = self.tables.get(key)
        if t is None or t[4] < n:
            cap = max(n, 1024)
            t = (int(ok(cu.cuMemAlloc(16 * cap), "cuMemAlloc")), int(ok(cu.cuMemAlloc(16 * cap), "cuMemAlloc")),
                 _pinned(16 * cap).view(np.uint64), _pinned(16 * cap).view(np.uint64), cap)
            self.tables[key] = t          # the old buffers stay allocated: a pending hash may still use them
        return t

    def _hash(self, chunks, key, stream):
        """Enqueue pfp1 lane sums of chunks on stream; returns a function giving the fingerprints.
        A few chunks (a batch of copies) are hashed in parts, so that many blocks share the
        work: with one block per chunk, the hash would hold a batch's copies below the link's speed."""
        from phos.snapshot.fingerprint import finish_many, hash_parts
        rows = np.asarray(chunks, np.uint64).reshape(-1, 2)     # a cut's thousands come as an array already
        parts, firsts = rows, None
        if 0 < len(rows) < SPLIT_BELOW and int(rows[:, 1].max()) > HASH_PART:
            split = rows.tobytes()        # a checkpoint's batches repeat a few layouts: split once
            if split not in self.splits:
                if len(self.splits) > 64:
                    self.splits.clear()
                self.splits[split] = hash_parts(rows, HASH_PART)
            parts, firsts = self.splits[split]
        n = len(parts)
        table, sums, spec, out, _ = self._table(key, n)
        if n:
            held = self.uploaded.get(key)
            if firsts is None or held is None or held[0] != table or held[1] is not parts:
                spec[:2 * n] = parts.reshape(-1)
                check(cuMemcpyHtoDAsync(table, spec.ctypes.data, 16 * n, stream), "cuMemcpyHtoDAsync")
                self.uploaded[key] = (table, parts) if firsts is not None else None
            launch = self.launches.get((table, n, stream))
            if launch is None:       # pfp1(table, sums, n): its arguments and shape, kept alive with it
                if len(self.launches) > 64:
                    self.launches.clear()
                launch = self.launches[(table, n, stream)] = self._launch(self.kernel, n, stream, [table, sums, n])
            check(cuLaunchKernelEx(launch[3], int(self.kernel), launch[4], None), "launch of pfp1_lane_sums")
            check(cuMemcpyDtoHAsync(out.ctypes.data, sums, 16 * n, stream), "cuMemcpyDtoHAsync")

        def fingerprints():
            lane_sums = out[:2 * n].reshape(-1, 2)
            if firsts is not None:       # the parts' sums add up (mod 2**64) to their chunk's
                lane_sums = np.add.reduceat(lane_sums, firsts, axis=0)
            return finish_many(lane_sums, rows[:, 1])
        return self._once_done(stream, fingerprints)

    def _once_done(self, stream, result):
        """wait(block=True): result() once the stream's work so far is done (None before, when
        not blocking); the first answer is kept, as the event may be another batch's by then."""
        event = self.events.pop() if self.events else int(ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"))
        check(cuEventRecord(event, stream), "cuEventRecord")
        done = []

        def wait(block=True):
            if done:
                return done[0]
            if not _event_done(event):
                if not block:
                    return None
                _wait_event(event)
            self.events.append(event)
            done.append(result())
            return done[0]
        return wait

    def _app_streams(self):
        return [0, *self.backend.streams]

    def _after_application(self):
        """Our streams start after the application's work so far."""
        for app in self._app_streams():
            event = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            ok(cu.cuEventRecord(event, app), "cuEventRecord")
            for ours in self.streams.values():
                ok(cu.cuStreamWaitEvent(ours, event, 0), "cuStreamWaitEvent")
            cu.cuEventDestroy(event)

    def map_ahead(self, nbytes):
        """Map memory for the cut's copy (SnapshotOps.map_ahead) on a thread of ours: the driver
        calls release the interpreter, so the worker serves the application's calls meanwhile."""
        return self.mapper.submit(self._map_copy, nbytes)

    def freeze(self, regions, step=None, ahead=None):
        """A copy of the regions on the device (SnapshotOps.freeze), on the bulk stream, which
        the cut's fingerprint pass and its fence follow: the application's next kernels wait for
        a copy at device speed (milliseconds for a large model), and the checkpoint then reads
        what it needs from the copy, with no copy-on-write. None while the device has too little
        free.

        The application is held while this runs, so both halves are made cheap. The memory is
        mapped as the application's is (cuMemCreate, cuMemMap: far quicker than cuMemAllocAsync,
        perf/probe_freeze_alloc.py), and unmapping it later stalls no other work; mapped ahead
        of the cut (map_ahead), the cut only copies: mapping would be most of its time. The copy
        is one launch of a kernel that copies every region (snapshot/kernels/copy_pieces.cu):
        each driver copy costs microseconds to issue, and PyTorch's contexts hold thousands of
        regions."""
        t = time.perf_counter()
        layout = FrozenLayout(regions)
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        mapped = None if ahead is None else ahead.result()
        if mapped is not None and not 0 < layout.nbytes <= mapped[1]:     # the context grew past it since
            self._unmap(mapped)
            mapped = ahead = None             # mapped below, as without it
            t = step("cut_freeze_unmap_ahead", t) if step else t
        if not layout.nbytes or ahead is not None and mapped is None:      # none could be mapped ahead (logged)
            return None
        try:
            self._after_application()
            t = step("cut_freeze_layout", t) if step else t
            if mapped is None:
                mapped = self._map_copy(layout.nbytes)
                if mapped is None:
                    return None
                t = step("cut_freeze_alloc", t) if step else t
            base = mapped[0]
            table = pieces(*layout.runs(base), FREEZE_PIECE)
            self._copy_pieces(table, self.handles["bulk"])
            self._fence(self.streams["bulk"])       # the application's later work waits for the copy alone
        except BaseException:      # a driver call failed: the memory goes with the cut, once our stream is done
            if mapped is not None:
                cu.cuStreamSynchronize(self.streams["bulk"])
                self._unmap(mapped)
            raise
        if step:
            step(f"cut_freeze_{len(table)}_pieces_of_{len(layout.sizes)}_regions", t)
        return base, layout, mapped

    def _copy_pieces(self, table, stream):
        """Enqueue the copies of a pieces() table on stream, in one launch of copy_pieces. Its
        table is uploaded from pinned memory that the next freeze overwrites: release() (which
        comes first) waits for this stream."""
        n = len(table)
        device, host = self._freeze_table(n)
        host[:3 * n] = table.reshape(-1)
        check(cuMemcpyHtoDAsync(device, host.ctypes.data, 24 * n, stream), "cuMemcpyHtoDAsync")
        launch = self._launch(self.copy_kernel, n, stream, [device, n])
        check(cuLaunchKernelEx(launch[3], int(self.copy_kernel), launch[4], None), "launch of copy_pieces")

    def _freeze_table(self, n):
        """(device table, pinned host table) for n pieces: made ahead by prepare(); a bigger
        one is made when needed (pinning it holds the application a few milliseconds, once)."""
        if self.freeze_table is None or self.freeze_table[2] < n:
            cap = max(n, FREEZE_TABLE)
            self.freeze_table = (int(ok(cu.cuMemAlloc(24 * cap), "cuMemAlloc")), _pinned(24 * cap).view(np.uint64), cap)
        return self.freeze_table[:2]

    def _map_copy(self, nbytes):
        """_map's memory for a copy of nbytes, or None (logged) where the device has too little
        free for it or mapping failed: copy-on-write then. Current first: map_ahead's thread
        has no context until it sets one."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        free, total = (int(n) for n in ok(cu.cuMemGetInfo(), "cuMemGetInfo"))
        if free < nbytes + max(FREEZE_HEADROOM, total // 20):
            log.info("checkpoint: %d MiB free on the device, too little for a copy of %d MiB: copy-on-write instead",
                     free >> 20, nbytes >> 20)
            return None
        mapped = self._map(nbytes)
        if isinstance(mapped, str):
            log.info("checkpoint: no device copy of %d MiB (%s): copy-on-write instead", nbytes >> 20, mapped)
            return None
        return mapped

    def _map(self, nbytes):
        """(address, length, handle) of nbytes of fresh device memory mapped at an address of
        its own, or why not."""
        length = -(-nbytes // self.backend.space.align) * self.backend.space.align
        handle, base = ctypes.c_uint64(), 0
        try:
            check(cuMemCreate(ctypes.byref(handle), length, self.backend.prop_ptr, 0), "cuMemCreate")
            base = int(ok(cu.cuMemAddressReserve(length, 0, 0, 0), "cuMemAddressReserve"))
            check(cuMemMap(base, length, 0, handle.value, 0), "cuMemMap")
            check(cuMemSetAccess(base, length, self.backend.access_ptr, 1), "cuMemSetAccess")
            return base, length, handle.value
        except CudaError as e:
            self._unmap((base, length, handle.value))
            return e.message

    @staticmethod
    def _unmap(mapped):
        base, length, handle = mapped
        if base:
            cuMemUnmap(base, length)          # fails harmlessly where the mapping was not made
            cu.cuMemAddressFree(base, length)
        if handle:
            cuMemRelease(handle)

    def release(self, frozen):
        """Once the bulk stream's reads of the copy are done: unmapping does not wait for them.
        Memory mapped ahead that no freeze() took was never read: it goes once it is mapped."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        if isinstance(frozen, Future):
            mapped = ahead_memory(frozen)
        else:
            ok(cu.cuStreamSynchronize(self.streams["bulk"]), "cuStreamSynchronize")
            mapped = frozen[2]
        if mapped is not None:
            # on the mapping thread: unmapping a context's copy takes as long as mapping it, which
            # would hold the application's calls on this one
            self.mapper.submit(self._unmap_current, mapped)

    def _unmap_current(self, mapped):
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        self._unmap(mapped)

    def fingerprints(self, chunks, fence, frozen=None):
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        if frozen is not None:
            # The copy's bytes, after it on the same stream (freeze fenced it), and before the copy
            # to the host, which follows on it: with that copy on another stream, its queue of
            # batches held the pass's lane sums back to near its end, and left its batches
            # unchecked until then.
            rows = np.asarray(chunks, np.uint64).reshape(-1, 2)
            copied = np.column_stack([frozen[1].source(frozen[0], rows[:, 0]), rows[:, 1]])
            return self._hash(copied, "cut", self.handles["bulk"])
        self._after_application()
        wait = self._hash(chunks, "cut", self.handles["bulk"])
        if fence:                            # and the application's later work after the hash
            self._fence(self.streams["bulk"])
        return wait

    def _fence(self, stream):
        """The application's later work waits for what `stream` holds now."""
        event = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        ok(cu.cuEventRecord(event, stream), "cuEventRecord")
        for app in self._app_streams():
            ok(cu.cuStreamWaitEvent(app, event, 0), "cuStreamWaitEvent")
        cu.cuEventDestroy(event)

    def prepare(self):
        """Pin the copy buffers now (a pre-started worker, before any application uses it):
        pinning holds a driver lock that would stall the application for a quarter second."""
        for key in self.streams:
            self._buffers(key, self.BUFFER[key])
            for n in (0, 1):
                self._table(f"{key}{n}", 1024)
        self._table("cut", CUT_TABLE)       # a larger cut would pin a table of its own, the application held
        self._freeze_table(FREEZE_TABLE)

    def pin(self, memory, slot_bytes):
        """Pin a HostStore's shared memory (a NumPy view) for copies straight to and from it, in
        pieces of whole slots of slot_bytes, about STORE_PIN_PIECE each: one copy runs pinned
        only within one registration. A pre-started worker does it before any application uses
        it: pinning a fresh store's pages is slow (perf/probe_host_arena.py). Small pieces, a
        moment apart: pinning and unpinning hold a driver lock that all processes on the GPU
        share (see CudaBackend.close). Returns False (logged) if it could not, or if the backend
        began to close meanwhile.
        On a thread of its own (a worker that pins behind its client's calls), it is one of the
        threads close() waits for, as the staging areas' pinning is: appended before its first
        check of closing, so that close() either joins it or it sees closing and stops."""
        if threading.current_thread() is not threading.main_thread():
            self.backend.pinning.append(threading.current_thread())
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        piece = slot_bytes * max(1, STORE_PIN_PIECE // slot_bytes)
        start, done = memory.ctypes.data, []
        for off in range(0, memory.nbytes, piece):
            if self.backend.closing:
                break
            n = min(piece, memory.nbytes - off)
            err = cu.cuMemHostRegister(start + off, n, DEVICEMAP)[0]
            if int(err):
                log.warning("pinning %d MiB of host store memory failed (%s): copies go through buffers", n >> 20, err)
                break
            done.append(start + off)
            time.sleep(PIN_PAUSE)
        else:
            self.pinned.append((start, start + memory.nbytes))
            self.pieces = sorted(self.pieces + done)     # sorted: join_runs breaks copies at them
            return True
        for at in done:
            cu.cuMemHostUnregister(at)
        return False

    def threads_at_work(self):
        return self.mapper.at_work

    def maps(self, host):
        lo = host.ctypes.data
        return any(a <= lo and lo + host.nbytes <= b for a, b in self.pinned)

    def _buffer_size(self, key, at_least):
        """A stream's copy buffers: BUFFER[key] and a MiB (room for a batch's chunks at 16-byte
        boundaries, stage_offsets), or at_least rounded up to a MiB if bigger."""
        return max(self.BUFFER[key] + (1 << 20), -(-at_least // (1 << 20)) << 20)

    def _buffers(self, key, at_least):
        """The two pinned host buffers of a stream, grown to hold a chunk of at_least bytes.
        Made when first needed, not at the cut: pinning takes a while."""
        buffers = self.host[key]
        if not buffers or len(buffers[0]) < at_least:
            size = self._buffer_size(key, at_least)
            buffers[:] = [_pinned(size), _pinned(size)]      # the old ones stay allocated: rare, and safe
        return buffers

    def _batches(self, chunks, capacity):
        """Split chunks into runs that fit one host buffer: [(start, end)]."""
        out, start = [], 0
        while start < len(chunks):
            end, used = start, 0
            while end < len(chunks) and (end == start or used + chunks[end][1] <= capacity):
                if chunks[end][1] > capacity:
                    raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"chunk of {chunks[end][1]} bytes exceeds the {capacity}-byte copy buffer")
                used += chunks[end][1]
                end += 1
            out.append((start, end))
            start = end
        return out

    def _device_buffers(self, key, at_least):
        """Two device buffers of a stream: a batch is copied into one on the device, hashed
        there and sent on from there. Made when first needed (a checkpoint's first batch)."""
        buffers = self.device.get(key)
        if buffers is None or buffers[1] < at_least:
            size = self._buffer_size(key, at_least)
            buffers = self.device[key] = ([int(ok(cu.cuMemAlloc(size), "cuMemAlloc")) for _ in (0, 1)], size)
        return buffers

    def read(self, batches, urgent=False, frozen=None):
        """Copy batches of chunks to the host (snapshot/ops.py, SnapshotOps.read, has the contract).
        Each batch is copied on the device into a buffer of ours first, hashed there and sent to the host
        from there: the fingerprint is that of the bytes handed on even if the application
        writes a chunk meanwhile, and the hash reads device memory, not the host copy (which
        held the copies far below the link's speed). Two batches are under way at a time, in
        buffers that take turns: the next copies while the caller stores this one (from
        freeze()'s copy into a store's slots, FROZEN_IN_FLIGHT). Without
        into, a batch lands in one of two pinned host buffers; with it (views of pinned memory,
        one per chunk), the chunks land there."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        key = "urgent" if urgent else "bulk"
        stream, batches, under_way, n = self.handles[key], iter(batches), collections.deque(), 0
        first = next(batches, None)
        depth = FROZEN_IN_FLIGHT if frozen is not None and first is not None and first[1] is not None else 2
        batches = itertools.chain([first] if first is not None else [], batches)
        try:
            while True:
                while len(under_way) < depth and (batch := next(batches, None)) is not None:
                    yield None    # a batch's bookkeeping, its copies and storing the last: steps apart,
                    under_way.append(self._copy_out(key, stream, n % 2, *batch, frozen))     # a call may come between
                    n += 1
                    yield None
                if not under_way:
                    return
                views, tag, wait = under_way[0]
                while (fps := wait(block=False)) is None:
                    yield None
                under_way.popleft()
                yield tag, list(zip(views, fps))
        finally:          # stopped early: what is under way still lands where it was sent
            for _, _, wait in under_way:
                wait()

    def _copy_out(self, key, stream, turn, chunks, into, tag, frozen=None):
        """Enqueue one batch's copies into buffer `turn`: (views, tag, wait for fingerprints)."""
        if frozen is not None:
            return self._copy_frozen(key, stream, turn, chunks, into, tag, frozen)
        offsets, used = stage_offsets(chunks)
        stage, capacity = self._device_buffers(key, used)
        stage = stage[turn]
        find = self.backend.space.find
        runs = copy_runs(chunks, offsets, [find(addr) for addr, _ in chunks])   # neighbouring chunks of one region: one copy
        _copies(cuMemcpyDtoDAsync, [stage + off for _, off, _ in runs], [addr for addr, _, _ in runs], [n for _, _, n in runs],
                stream, "cuMemcpyDtoDAsync")
        spans = np.array([(stage + off, size) for (_, size), off in zip(chunks, offsets)], np.uint64).reshape(-1, 2)
        if into is None:
            host = self._buffers(key, capacity)[turn]
            check(cuMemcpyDtoHAsync(host.ctypes.data, stage, used, stream), "cuMemcpyDtoHAsync")
            views = [host[off:off + size] for (_, size), off in zip(chunks, offsets)]
        else:
            _copies(cuMemcpyDtoHAsync, _addresses(into), spans[:, 0], spans[:, 1], stream, "cuMemcpyDtoHAsync")
            views = into
        return views, tag, self._hash(spans, f"{key}{turn}", stream)

    def _copy_frozen(self, key, stream, turn, chunks, into, tag, frozen):
        """A batch from freeze()'s copy, which nothing writes: straight to the host, neither
        staged nor hashed, as the cut's pass hashed these very bytes (its fingerprints stand:
        None for each). The device's SMs stay the application's, and only the copy engines
        work: staging and hashing each batch beside a training step held the copy well below
        the link's speed."""
        sources = frozen[1].source(frozen[0], [addr for addr, _ in chunks])
        sizes = [size for _, size in chunks]
        if into is None:
            offsets, used = stage_offsets(chunks)
            host = self._buffers(key, used)[turn]
            into = [host[off:off + size] for off, size in zip(offsets, sizes)]
            destinations, breaks = host.ctypes.data + np.asarray(offsets, np.uint64), ()
        else:          # a store's slots: those side by side in one pinned piece take one copy
            destinations, breaks = _addresses(into), self.pieces
        _copies(cuMemcpyDtoHAsync, *join_runs(destinations, sources, sizes, breaks), stream, "cuMemcpyDtoHAsync")
        return into, tag, self._once_done(stream, lambda: [None] * len(chunks))

    def write(self, chunks, load, pool, urgent=False, sources=None):
        """Copy chunks to the device through a pinned buffer: pool threads read chunk i in
        place (load(i, out)), then the link copies them at full speed; or straight from
        sources[i], views of pinned memory. Returns the fingerprints of what landed.
        urgent: a call waits for these (own stream and buffer, beside the background loading)."""
        ok(cu.cuCtxSetCurrent(self.backend.ctx), "cuCtxSetCurrent")
        key = "urgent" if urgent else "bulk"
        stream = self.handles[key]
        if sources is not None:
            _copies(cuMemcpyHtoDAsync, [addr for addr, _ in chunks], _addresses(sources), [size for _, size in chunks], stream, "cuMemcpyHtoDAsync")
            return self._hash(chunks, f"{key}0", stream)()
        host = self._buffers(key, max(size for _, size in chunks))[0]
        fps = []
        for start, end in self._batches(chunks, len(host)):
            offsets = np.cumsum([0] + [size for _, size in chunks[start:end]])

            list(pool.map(lambda i: load(start + i, host[offsets[i]:offsets[i + 1]]), range(end - start)))
            _copies(cuMemcpyHtoDAsync, [addr for addr, _ in chunks[start:end]], host.ctypes.data + offsets[:-1], np.diff(offsets), stream,
                    "cuMemcpyHtoDAsync")
            fps += self._hash(chunks[start:end], f"{key}0", stream)()
        return fps
