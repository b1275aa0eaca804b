"""The context calls a worker serves: one row per call, like gVisor nvproxy's tables.

Each handler takes (session, args, payloads) and returns a dict of Result fields
(u64s, f64, text, data, payload, params) or None. Handlers check every handle and
pointer against the calling session's own objects before touching the backend.
"""
import numpy as np

from phos.schema.cuda_types import CudaError, CUresult
from phos.schema.wire import LAUNCH_CONFIG

STREAM_ALIASES = (0, 1, 2)   # default stream, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD


def _payload(payloads, index, size):
    if not 1 <= index <= len(payloads):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"payload frame {index} is missing ({len(payloads)} sent)")
    frame = payloads[index - 1]
    if len(frame) != size:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"payload frame {index} has {len(frame)} bytes, call says {size}")
    return frame


def _stream(s, sid):
    return None if sid in STREAM_ALIASES else s.handle("stream", sid)


def mem_alloc(s, a, p):
    return {"u64s": [s.backend.alloc(a.size)]}


def mem_free(s, a, p):
    s.backend.free(a.ptr)   # the address space refuses anything but an allocation's base


def mem_get_info(s, a, p):
    return {"u64s": list(s.backend.mem_info())}


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


def memcpy_htod(s, a, p):
    data = s.staging(a.shmOffset, a.size) if a.viaShm else _payload(p, a.payload, a.size)
    _check_copy(s, a.dst, a, "destination")
    stream = _stream(s, a.stream)
    s.backend.htod(a.dst, data, stream)
    if a.viaShm and stream is not None:
        s.backend.stream_sync(stream)     # the client reuses the staging slot once we reply


def memcpy_dtoh(s, a, p):
    _check_copy(s, a.src, a, "source")
    out = s.staging(a.shmOffset, a.size) if a.viaShm else np.empty(a.size, np.uint8)
    s.backend.dtoh(a.src, out, _stream(s, a.stream))
    return None if a.viaShm else {"payload": out}


def memcpy_dtod(s, a, p):
    s.space.check(a.src, a.size, "source")
    s.space.check(a.dst, a.size, "destination")
    s.backend.dtod(a.dst, a.src, a.size, _stream(s, a.stream))


def memset(s, a, p):
    if a.elemSize not in (1, 2, 4):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"memset element size {a.elemSize} is not 1, 2 or 4")
    if a.value >> (8 * a.elemSize):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"memset value {a.value:#x} does not fit {a.elemSize} bytes")
    s.space.check(a.dst, a.elemSize * a.count, "destination")
    s.backend.memset(a.dst, a.value, a.elemSize, a.count, _stream(s, a.stream))


def module_load(s, a, p):
    if not 1 <= a.payload <= len(p):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"module image frame {a.payload} is missing")
    module = s.backend.load_module(p[a.payload - 1])
    return {"u64s": [s.add("module", module, image=bytes(p[a.payload - 1]))]}


def module_unload(s, a, p):
    module = s.handle("module", a.id)
    s.backend.unload_module(module)
    s.drop(a.id)
    for fid in [f for f, (kind, obj) in s.objects.items() if kind == "function" and obj.module_id == a.id]:
        s.drop(fid)


def module_get_function(s, a, p):
    fn = s.backend.get_function(s.handle("module", a.module), a.name)
    fn.module_id, fn.size = a.module, fn.param_bytes
    fid = s.add("function", fn)
    return {"u64s": [fid], "params": fn.params}


def module_get_global(s, a, p):
    return {"u64s": list(s.backend.get_global(s.handle("module", a.module), a.name))}


def launch(s, a, p):
    fn = s.handle("function", a.function)
    config = a.config
    if len(config) != LAUNCH_CONFIG.size:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: config holds {len(config)} bytes, not {LAUNCH_CONFIG.size}")
    gx, gy, gz, bx, by, bz, shared, _, stream = LAUNCH_CONFIG.unpack(config)
    if not (gx and gy and gz and bx and by and bz):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: grid {(gx, gy, gz)} and block {(bx, by, bz)} must be non-zero")
    if bx * by * bz > 1024:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: {bx * by * bz} threads per block exceeds 1024")
    params = a.params
    if len(params) != fn.size:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"launch of {fn.name}: {len(params)} parameter bytes, kernel takes {fn.size}")
    s.backend.launch(fn, (gx, gy, gz), (bx, by, bz), shared, _stream(s, stream), params)


def stream_create(s, a, p):
    return {"u64s": [s.add("stream", s.backend.stream_create(a.flags, a.priority))]}


def stream_destroy(s, a, p):
    s.backend.stream_destroy(s.handle("stream", a.id))
    s.drop(a.id)


def stream_synchronize(s, a, p):
    s.backend.stream_sync(_stream(s, a.id))


def stream_query(s, a, p):
    if not s.backend.stream_query(_stream(s, a.id)):
        raise CudaError(CUresult.CUDA_ERROR_NOT_READY, "stream has pending work")


def stream_wait_event(s, a, p):
    s.backend.stream_wait_event(_stream(s, a.stream), s.handle("event", a.event))


def event_create(s, a, p):
    return {"u64s": [s.add("event", s.backend.event_create(a.flags))]}


def event_record(s, a, p):
    s.backend.event_record(s.handle("event", a.event), _stream(s, a.stream))


def event_synchronize(s, a, p):
    s.backend.event_sync(s.handle("event", a.id))


def event_query(s, a, p):
    if not s.backend.event_query(s.handle("event", a.id)):
        raise CudaError(CUresult.CUDA_ERROR_NOT_READY, "event has not completed")


def event_elapsed_time(s, a, p):
    return {"f64": s.backend.event_elapsed(s.handle("event", a.start), s.handle("event", a.end))}


def event_destroy(s, a, p):
    s.backend.event_destroy(s.handle("event", a.id))
    s.drop(a.id)


def ctx_synchronize(s, a, p):
    s.backend.synchronize()


def ctx_destroy(s, a, p):
    s.backend.synchronize()
    s.closing = True


# call name -> handler. A call missing here is refused with its name.
WORKER_CALLS = {
    "ctxDestroy": ctx_destroy,
    "ctxSynchronize": ctx_synchronize,
    "memAlloc": mem_alloc,
    "memFree": mem_free,
    "memGetInfo": mem_get_info,
    "memGetAddressRange": mem_get_address_range,
    "memcpyHtoD": memcpy_htod,
    "memcpyDtoH": memcpy_dtoh,
    "memcpyDtoD": memcpy_dtod,
    "memset": memset,
    "moduleLoad": module_load,
    "moduleUnload": module_unload,
    "moduleGetFunction": module_get_function,
    "moduleGetGlobal": module_get_global,
    "launch": launch,
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
}
