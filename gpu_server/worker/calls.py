"""The context calls a worker serves: one row per call, like gVisor nvproxy's tables.

Each handler takes (session, args, payloads) and returns a dict of Result fields
(u64s, f64, text, data, payload, params) or None. Handlers check every handle and
pointer against the calling session's own objects before touching the backend.
"""
import time

import numpy as np

from phos.gpu_server.worker.module_cache import image_digest
from phos.schema.cuda_types import STICKY, CudaError, CUresult
from phos.schema.wire import (LAUNCH_CONFIG, STREAM_ALIASES, TENSOR_MAP_IM2COL, TENSOR_MAP_TILED, WireError, phos_capnp,
                              read_launch_batch)
from phos.snapshot import engine

STEP_AFTER = 0.0005    # seconds into a wait for the device before a running checkpoint takes its steps


def _payload(payloads, index, size):
    if not 1 <= index <= len(payloads):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"payload frame {index} is missing ({len(payloads)} sent)")
    frame = payloads[index - 1]
    if len(frame) != size:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"payload frame {index} has {len(frame)} bytes, call says {size}")
    return frame


def _stream(s, sid):
    return None if sid in STREAM_ALIASES else s.lookup("stream", sid)


def wait_device(s, wait, done):
    """Wait for the device. A running checkpoint copies in steps on this thread: once the wait
    is long (a long kernel), take them meanwhile, or the copy would stand still for it. Not in a
    short wait: a step can take a few hundred microseconds, and the application waits for the
    reply (the copy has two batches under way, milliseconds of work, so it loses nothing)."""
    cp = s.checkpoint
    if cp is None or not cp.running:
        return wait()
    t = time.perf_counter()
    while not done():
        if time.perf_counter() - t > STEP_AFTER:
            cp.advance()
    cp.step("application_waits", t)


def _before_blocking_copy(s, stream):
    """A copy on the default stream waits for the kernels before it: wait for them here first,
    where a running checkpoint keeps copying meanwhile."""
    if stream is None:
        wait_device(s, lambda: None, s.backend.idle)


def mem_alloc(s, a, p):
    if a.at and s.space.reservation_of(a.at, a.size) is None:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemMap: {a.at:#x}+{a.size} is not inside a reserved range")
    return {"u64s": [s.backend.alloc(a.size, at=a.at or None)]}


def mem_reserve(s, a, p):
    return {"u64s": [s.space.reserve(a.size, a.alignment, a.at)]}


def mem_unreserve(s, a, p):
    s.space.unreserve(a.ptr)


def mem_free(s, a, p):
    if s.snapshotting and s.space.find(a.ptr):
        s.touch(a.ptr, 0, whole=True)      # an image in progress still needs its contents
    s.backend.free(a.ptr)   # the address space refuses anything but an allocation's base


def mem_get_info(s, a, p):
    free, total = s.backend.mem_info()
    if s.space.ledger is not None:       # the tenant's quota (PHOS_TENANT_QUOTA) may leave it less
        free = min(free, s.space.ledger.free())
    return {"u64s": [free, total]}


def mem_get_address_range(s, a, p):
    hit = s.space.find(a.ptr)
    if hit is None:
        raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"{a.ptr:#x} is not inside an allocation of this context")
    return {"u64s": list(hit)}


def _check_copy(s, ptr, a, what):
    """Check the whole copy a chunk belongs to, so that a bad copy fails in every chunk."""
    if a.totalSize:
        if a.chunkOffset + a.size > a.totalSize or a.chunkOffset > ptr:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"chunk {a.chunkOffset}+{a.size} lies outside its {a.totalSize}-byte copy")
        s.space.check(ptr - a.chunkOffset, a.totalSize, what)
    s.space.check(ptr, a.size, what)


def _before_copy_in(s, dst, nbytes, data):
    """A copy is about to write nbytes of `data` at dst: a snapshot saves (checkpoint) or loads (restore)
    what it overwrites first, and a restore follows a pointer written into a module global."""
    if s.snapshotting:
        s.touch(dst, nbytes)
        hit = s.space.find(dst) if s.restoring is not None else None
        if hit is not None and hit[0] in s.space.external:   # a pointer set in a module global: followed
            s.restoring.followed.update(engine.kernel_pointers(s, bytes(data)[-(dst - hit[0]) % 8:]))


def memcpy_htod(s, a, p):
    data = s.staging(a.shmOffset, a.size) if a.viaShm else _payload(p, a.payload, a.size)
    _check_copy(s, a.dst, a, "destination")
    stream = _stream(s, a.stream)
    _before_copy_in(s, a.dst, a.size, data)
    _before_blocking_copy(s, stream)
    s.backend.htod(s.space.to_device(a.dst), data, stream)
    if a.viaShm and stream is not None:
        s.backend.stream_sync(stream)     # the client reuses the staging slot once we reply


def memcpy_dtoh(s, a, p):
    _check_copy(s, a.src, a, "source")
    if s.snapshotting:
        s.touch(a.src, a.size, write=False)
    out = s.staging(a.shmOffset, a.size) if a.viaShm else np.empty(a.size, np.uint8)
    stream = _stream(s, a.stream)
    _before_blocking_copy(s, stream)
    s.backend.dtoh(s.space.to_device(a.src), out, stream)
    return None if a.viaShm else {"payload": out}


def memcpy_pinned(s, a, p):
    """A copy between the device and the client's pinned range a.range, which we map: queued on
    the stream, and waited for when the client waits (schema/phos.capnp, "Pinned host memory")."""
    host = s.pinned(a.range, a.offset, a.size)
    stream = _stream(s, a.stream)
    if a.toDevice:
        s.space.check(a.device, a.size, "destination")
        _before_copy_in(s, a.device, a.size, host)
    else:
        s.space.check(a.device, a.size, "source")
        if s.snapshotting:
            s.touch(a.device, a.size, write=False)
    s.backend.copy_pinned(s.space.to_device(a.device), host, a.toDevice, stream)
    if a.wait:
        wait_device(s, lambda: s.backend.stream_sync(stream), lambda: s.backend.stream_query(stream))


def host_map(s, a, p):
    """The client's pinned host range: mapped if it is theirs and within our bound. u64s: [1] if
    mapped, else [0] with the reason in text (the client then copies as for any memory)."""
    why = s.map_host(a.id, a.path, bytes(a.cookie), a.size, a.address)
    return {"u64s": [int(why is None)], "text": why or ""}


def host_unmap(s, a, p):
    s.unmap_host(a.id)


def memcpy_dtod(s, a, p):
    s.space.check(a.src, a.size, "source")
    s.space.check(a.dst, a.size, "destination")
    if s.snapshotting:
        s.touch(a.src, a.size, write=False)
        s.touch(a.dst, a.size)
    s.backend.dtod(s.space.to_device(a.dst), s.space.to_device(a.src), a.size, _stream(s, a.stream))


def memset(s, a, p):
    if a.elemSize not in (1, 2, 4):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"memset element size {a.elemSize} is not 1, 2 or 4")
    if a.value >> (8 * a.elemSize):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"memset value {a.value:#x} does not fit {a.elemSize} bytes")
    s.space.check(a.dst, a.elemSize * a.count, "destination")
    if s.snapshotting:
        s.touch(a.dst, a.elemSize * a.count)
    s.backend.memset(s.space.to_device(a.dst), a.value, a.elemSize, a.count, _stream(s, a.stream))


def module_image(s, a, p):
    """The image a ModuleLoad names: its payload (kept by the server's cache when a digest comes
    with it), or the cached image with that digest."""
    digest = bytes(a.digest)
    if a.payload == 0 and digest:
        image = s.modules.get(digest) if s.modules else None
        if image is None:
            raise CudaError(CUresult.CUDA_ERROR_NOT_FOUND, f"module image {digest.hex()[:16]} is not kept by this server")
        return image
    if not 1 <= a.payload <= len(p):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"module image frame {a.payload} is missing")
    image = bytes(p[a.payload - 1])
    if digest:
        if image_digest(image) != digest:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, "the module image does not match its digest")
        if s.modules:
            s.modules.put(digest, image)
    return image


def module_load(s, a, p):
    image = module_image(s, a, p)
    module = s.load_module(image)
    mid = s.add("module", module, image=image, image_hashing=engine.hash_in_background(image))
    places = s.globals_noted.get(mid) or {}
    # asked of the backend only when needed: a replay's reload, or a recovery store to note them in
    globals_ = s.backend.module_globals(module) if places or s.recovery is not None else ()
    for name, ptr, size in globals_:
        if name in places:        # loaded again by a replay: where the client was told it is
            s.reach_global(places[name], ptr, size, name)
    if s.recovery is not None:
        s.recovery.note_globals(mid, {name: s.space.to_app(ptr) for name, ptr, _ in globals_})
    return {"u64s": [mid]}


def module_unload(s, a, p):
    module = s.lookup("module", a.id)
    if s.snapshotting:
        for _, ptr, _ in s.backend.module_globals(module):
            s.touch(s.space.to_app(ptr), 0, whole=True)     # as the image knows it
    s.unload_module(module)
    s.drop(a.id)
    for fid in [f for f, (kind, obj) in s.objects.items() if kind == "function" and obj.module_id == a.id]:
        s.drop(fid)


def module_get_function(s, a, p):
    fn = s.backend.get_function(s.lookup("module", a.module), a.name)
    fn.module_id, fn.size = a.module, fn.param_bytes
    fid = s.add("function", fn)
    # the attributes follow the id as 64-bit two's complement (a carveout of -1 is "no preference")
    return {"u64s": [fid, *(a & (1 << 64) - 1 for a in fn.attributes)], "params": fn.params}


def module_get_global(s, a, p):
    ptr, size = s.backend.get_global(s.lookup("module", a.module), a.name)
    return {"u64s": [s.space.to_app(ptr), size]}


def run_launch(s, function_id, config, params):
    """Check one launch and hand it to the backend: the single path of launch and launchBatch.

    config: Launch.config's 40 bytes, or LAUNCH_CONFIG's nine values already unpacked."""
    fn = s.lookup("function", function_id)
    if not isinstance(config, tuple):
        if len(config) != LAUNCH_CONFIG.size:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: config holds {len(config)} bytes, not {LAUNCH_CONFIG.size}")
        config = LAUNCH_CONFIG.unpack(config)
    gx, gy, gz, bx, by, bz, shared, options, stream = config
    if not (gx and gy and gz and bx and by and bz):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: grid {(gx, gy, gz)} and block {(bx, by, bz)} must be non-zero")
    if bx * by * bz > 1024:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: {bx * by * bz} threads per block exceeds 1024")
    if len(params) != fn.size:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: {len(params)} parameter bytes, kernel takes {fn.size}")
    if s.snapshotting:
        s.touch_kernel(fn, params)
    if s.space.moved:        # a restored context whose module globals the device placed elsewhere
        params = s.space.translate_words(params)
    s.backend.launch(fn, (gx, gy, gz), (bx, by, bz), shared, _stream(s, stream), params, options)


def launch_one(s, a, p):
    """A launch call: one kernel, not in a batch."""
    run_launch(s, a.function, a.config, a.params)


def launch_batch(s, blob, p):
    """Run the records as that many `launch` calls (phos.capnp, "Launch batches").

    A failed launch does not stop the later ones: the first failure is raised at the end,
    and Session.execute defers it to the next synchronizing call. A sticky one stops the rest.
    The backend's compiled launch path, where it has one, takes the batches it can."""
    if s.backend.launcher is not None and s.backend.launcher.run(s, blob):
        return
    try:
        records = read_launch_batch(blob)
    except WireError as e:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"malformed launch batch: {e}") from None
    first = None
    for i, (function_id, config, params) in enumerate(records):
        try:
            run_launch(s, function_id, config, params)
        except CudaError as e:
            if e.status in STICKY:
                raise
            if first is None:
                first = CudaError(e.status, f"record {i + 1} of {len(records)}: {e.message}")
    if first is not None:
        raise first


def stream_create(s, a, p):
    return {"u64s": [s.add("stream", s.backend.stream_create(a.flags, a.priority), flags=a.flags, priority=a.priority)]}


def stream_destroy(s, a, p):
    s.backend.stream_destroy(s.lookup("stream", a.id))
    s.drop(a.id)


def stream_synchronize(s, a, p):
    stream = _stream(s, a.id)
    wait_device(s, lambda: s.backend.stream_sync(stream), lambda: s.backend.stream_query(stream))


def stream_query(s, a, p):
    if not s.backend.stream_query(_stream(s, a.id)):
        raise CudaError(CUresult.CUDA_ERROR_NOT_READY, "stream has pending work")


def stream_wait_event(s, a, p):
    s.backend.stream_wait_event(_stream(s, a.stream), s.lookup("event", a.event))


def event_create(s, a, p):
    return {"u64s": [s.add("event", s.backend.event_create(a.flags), flags=a.flags)]}


def event_record(s, a, p):
    s.backend.event_record(s.lookup("event", a.event), _stream(s, a.stream))


def event_synchronize(s, a, p):
    event = s.lookup("event", a.id)
    wait_device(s, lambda: s.backend.event_sync(event), lambda: s.backend.event_query(event))


def event_query(s, a, p):
    if not s.backend.event_query(s.lookup("event", a.id)):
        raise CudaError(CUresult.CUDA_ERROR_NOT_READY, "event has not completed")


def event_elapsed_time(s, a, p):
    return {"f64": s.backend.event_elapsed(s.lookup("event", a.start), s.lookup("event", a.end))}


def event_destroy(s, a, p):
    s.backend.event_destroy(s.lookup("event", a.id))
    s.drop(a.id)


def ctx_synchronize(s, a, p):
    wait_device(s, s.backend.synchronize, s.backend.idle)


def ctx_destroy(s, a, p):
    s.backend.synchronize()
    s.closing = True


def log_full(s, a, p):
    """The client's recovery log is full: take an image as soon as none is running."""
    if s.recovery is None:
        return {"u64s": [0]}       # no images: the Reply's ackSeq is what the client may drop
    s.recovery.wanted = True
    return {"u64s": [s.recovery.durable]}


def tensor_map_encode(s, a, p):
    layout = TENSOR_MAP_IM2COL if a.im2col else TENSOR_MAP_TILED
    if len(a.args) != layout.size:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"tensorMapEncode: {len(a.args)} bytes of arguments, not {layout.size}")
    values = layout.unpack(a.args)
    rank = values[1]
    if not 1 <= rank <= 5:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"tensorMapEncode: rank {rank} is not 1 to 5")
    return {"data": s.backend.tensor_map_encode(bool(a.im2col), values)}


# CUfunction_attribute values an application may set: dynamic shared memory, the carveout,
# the required cluster size and the two cluster policies.
SETTABLE_ATTRIBUTES = {8, 9, 11, 12, 13, 14, 15}


def func_set_attribute(s, a, p):
    fn = s.lookup("function", a.function)
    if a.attribute not in SETTABLE_ATTRIBUTES or a.value < -1:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{fn.name}: attribute {a.attribute} cannot be set to {a.value}")
    s.backend.set_function_attribute(fn, a.attribute, a.value)
    fn.set_attributes[a.attribute] = a.value       # a restore sets them again (engine)


def ctx_limit(s, a, p):
    if a.set:
        s.backend.set_limit(a.limit, a.value)
        s.limits[a.limit] = a.value        # a restore sets them again (Session.adopt)
    return {"u64s": [s.backend.get_limit(a.limit)]}


# FuncOccupancy.Query (phos.capnp), by number
_QUERY_NUMBERS = phos_capnp.FuncOccupancy.Query.schema.enumerants
OCCUPANCY_QUERIES = tuple(sorted(_QUERY_NUMBERS, key=_QUERY_NUMBERS.get))


def func_occupancy(s, a, p):
    fn = s.lookup("function", a.function)
    query = getattr(a.query, "raw", a.query)     # by number: a value past the enum is refused here
    if not isinstance(query, int):
        query = OCCUPANCY_QUERIES.index(query) if query in OCCUPANCY_QUERIES else -1
    if not 0 <= query < len(OCCUPANCY_QUERIES):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"funcOccupancy: no query {query}")
    return {"u64s": list(s.backend.occupancy(fn, OCCUPANCY_QUERIES[query], a.a, a.b, a.flags, a.grid))}


# Calls about the client's connection, not the context (phos.capnp, "Pinned host memory"): sent
# alone with seq 0, they never answer with an earlier call's deferred failure.
CONNECTION_CALLS = frozenset({"hostMap", "hostUnmap"})

# call name -> handler. A call missing here is refused with its name.
WORKER_CALLS = {
    "ctxDestroy": ctx_destroy,
    "ctxSynchronize": ctx_synchronize,
    "memAlloc": mem_alloc,
    "memReserve": mem_reserve,
    "memUnreserve": mem_unreserve,
    "memFree": mem_free,
    "memGetInfo": mem_get_info,
    "memGetAddressRange": mem_get_address_range,
    "memcpyHtoD": memcpy_htod,
    "memcpyDtoH": memcpy_dtoh,
    "memcpyDtoD": memcpy_dtod,
    "memcpyPinned": memcpy_pinned,
    "hostMap": host_map,
    "hostUnmap": host_unmap,
    "memset": memset,
    "moduleLoad": module_load,
    "moduleUnload": module_unload,
    "moduleGetFunction": module_get_function,
    "moduleGetGlobal": module_get_global,
    "launch": launch_one,
    "launchBatch": launch_batch,
    "streamCreate": stream_create,
    "streamDestroy": stream_destroy,
    "streamSynchronize": stream_synchronize,
    "streamQuery": stream_query,
    "streamWaitEvent": stream_wait_event,
    "eventCreate": event_create,
    "eventRecord": event_record,
    "eventSynchronize": event_synchronize,
    "eventQuery": event_query,
    "eventElapsedTime": event_elapsed_time,
    "eventDestroy": event_destroy,
    "logFull": log_full,
    "tensorMapEncode": tensor_map_encode,
    "funcOccupancy": func_occupancy,
    "funcSetAttribute": func_set_attribute,
    "ctxLimit": ctx_limit,
}
