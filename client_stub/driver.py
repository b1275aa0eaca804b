"""phos's drop-in for `cuda.bindings.driver`.

Same names, argument order and `(CUresult, value, ...)` returns as cuda-python, so
a program switches to phos by changing its import line:

    from phos.client_stub import driver as cuda    # was: from cuda.bindings import driver as cuda

PHOS_SERVER names the server (default ipc:///tmp/phos/phos.sock).
"""
import bisect
import contextlib
import ctypes
import os
import threading

from phos.base import settings
from phos.client_stub import agent
from phos.client_stub.connection import CONNECT_TIMEOUT, Connection, host_writer
from phos.schema import wire
from phos.schema.cuda_types import ERROR_STRINGS, CudaError, CUdevice_attribute, CUresult  # noqa: F401 (re-exported)

SUCCESS = CUresult.CUDA_SUCCESS


# -- handle types, shaped like cuda-python's: int() gives the value, getPtr() its address --
class _Handle:
    def __init__(self, init_value=0):
        self._box = ctypes.c_uint64(int(init_value))

    def __int__(self):
        return self._box.value

    __index__ = __int__

    def getPtr(self):
        return ctypes.addressof(self._box)

    def __eq__(self, other):
        return type(self) is type(other) and int(self) == int(other)

    def __hash__(self):
        return hash((type(self).__name__, int(self)))

    def __repr__(self):
        return f"<{type(self).__name__} {int(self):#x}>"


class CUdeviceptr(_Handle): pass
class CUdevice(_Handle): pass
class CUmodule(_Handle): pass
class CUfunction(_Handle): pass
class CUstream(_Handle): pass
class CUevent(_Handle): pass


class CUcontext(_Handle):
    """A context: its worker connection lives in the client, keyed by the context id."""


class CUuuid:
    def __init__(self, raw=b"\0" * 16):
        self.bytes = bytes(raw)

    def __repr__(self):
        return f"<CUuuid {self.bytes.hex()}>"


class _State(threading.local):
    stack = None


_lock = threading.RLock()
_front = None                 # Connection to the front end, made by cuInit
_contexts = {}                # ctx id -> Connection to its worker
_primary = {}                 # device -> [ctx id, refcount]
_device_of = {}               # ctx id -> its device
_peers = {}                   # ctx id -> the ctx ids it enabled peer access to
_params = {}                  # (ctx id, function id) -> [(offset, size)]
_known = {}                   # ctx id -> _Ranges: the device ranges its calls have named
_tls = _State()
last_error = ""               # the server's explanation of the last failure, for people


class AgentView:
    """This module's contexts as the checkpoint agent (agent.py) sees them: the agent gets this
    rather than the module (it need not import the driver, and a copy of the module loaded
    apart, as the load test loads one per user, hands over its own)."""
    lock, contexts = _lock, _contexts

    def close_front_end(self):
        global _front
        if _front is not None:
            _front.close()
            _front = None

    def reach_front_end(self):
        """Connect to the front end again (PHOS_SERVER may have changed); why not, or None."""
        global _front
        _front = None
        status, = cuInit(0)
        return last_error if status else None


class _Ranges:
    """The device ranges a context's client knows: the allocations and globals it was given, and
    those its worker named. A call naming a pointer outside them asks the worker first
    (memGetAddressRange), so a bad pointer fails its own call, as with CUDA, not the next
    synchronising one; a known one costs no round trip."""

    def __init__(self):
        self.bases, self.sizes, self.allocated = [], {}, set()

    def add(self, base, size, allocated=False):
        if base not in self.sizes:
            bisect.insort(self.bases, base)
        self.sizes[base] = size
        if allocated:
            self.allocated.add(base)

    def drop(self, base):
        if base in self.sizes:
            self.bases.remove(base)
            del self.sizes[base]
            self.allocated.discard(base)

    def forget_globals(self):
        for base in [b for b in self.bases if b not in self.allocated]:
            self.drop(base)

    def holding(self, ptr):
        i = bisect.bisect_right(self.bases, ptr) - 1
        return self.bases[i] if i >= 0 and ptr < self.bases[i] + self.sizes[self.bases[i]] else None


def _device_range(ptr, nbytes, what):
    """The base of the current context's range that holds [ptr, ptr + nbytes); CudaError
    (CUDA_ERROR_INVALID_VALUE) when none does."""
    ctx, conn = _current()
    known = _known[ctx]
    base = known.holding(ptr)
    if base is None:
        res = conn.call("memGetAddressRange", {"ptr": ptr})
        if res.status == CUresult.CUDA_ERROR_NOT_FOUND:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"{what} {ptr:#x} is outside this context's allocations")
        base, size = _check(res).u64s      # an earlier call's failure comes out here, as from any synchronising call
        known.add(base, size)
    if ptr + nbytes > base + known.sizes[base]:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"{what} {ptr:#x}+{nbytes} runs past the end of the {known.sizes[base]}-byte allocation at {base:#x}")
    return base


def _stack():
    if _tls.stack is None:
        _tls.stack = []
    return _tls.stack


@contextlib.contextmanager
def _current_for_a_while(ctx_id):
    """Make context ctx_id current for the calls inside, then the one before again."""
    _stack().append(ctx_id)
    try:
        yield
    finally:
        _stack().pop()


def _current():
    stack = _stack()
    if not stack:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, "no current context")
    return stack[-1], _contexts[stack[-1]]


def _check(result):
    if result.status != SUCCESS:
        raise CudaError(result.status, result.message)
    return result


def _front_call(name, args=None):
    if _front is None:
        raise CudaError(CUresult.CUDA_ERROR_NOT_INITIALIZED, "call cuInit first")
    with _lock:
        return _check(_front.call(name, args))


def _ctx_call(name, args=None, payload=None):
    with _lock:
        return _check(_current()[1].call(name, args, payload))


def _ctx_post(name, args=None, payload=None, on_bytes=None):
    with _lock:
        _current()[1].post(name, args, payload, on_bytes)


def _api(arity):
    """Turn CudaError into cuda-python's (status, None, ...) return of `arity` values."""
    def wrap(fn):
        def call(*a, **kw):
            global last_error
            try:
                out = fn(*a, **kw)
                return (SUCCESS,) if out is None else (SUCCESS, *out) if isinstance(out, tuple) else (SUCCESS, out)
            except CudaError as e:
                last_error = e.message
                if settings.verbose():
                    print(f"phos: {fn.__name__}: {e}", flush=True)
                status = e.status if isinstance(e.status, CUresult) else CUresult.CUDA_ERROR_UNKNOWN
                return (status, *([None] * arity))
        call.__name__ = call.__qualname__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call
    return wrap


def _stream_id(stream):
    return 0 if stream is None else int(stream)


def _reset_for_tests():
    """Forget every connection, as a fresh process would (tests start many servers)."""
    global _front
    with _lock:
        for conn in [_front, *_contexts.values()]:
            if conn is not None:
                conn.close()
        _front = None
        _contexts.clear()
        _primary.clear()
        _device_of.clear()
        _peers.clear()
        _params.clear()
        _tls.stack = []


# -- initialisation and device ----------------------------------------------------------
@_api(0)
def cuInit(Flags=0):
    global _front
    with _lock:
        if _front is not None:
            return
        conn = Connection(settings.server())
        try:
            res = conn.call("hello", {"version": wire.PROTOCOL_VERSION, "client": f"python pid {os.getpid()}"},
                            timeout=CONNECT_TIMEOUT)
        except CudaError:
            conn.close()
            raise
        if res.status != SUCCESS:
            conn.close()
            raise CudaError(res.status, res.message)
        _front = conn


@_api(1)
def cuDriverGetVersion():
    return _front_call("driverGetVersion").u64s[0] if _front else 13000


@_api(1)
def cuDeviceGetCount():
    return _front_call("deviceGetCount").u64s[0]


def _check_device(dev):
    if not 0 <= int(dev) < _front_call("deviceGetCount").u64s[0]:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {int(dev)} does not exist")


@_api(1)
def cuDeviceGet(ordinal):
    _check_device(ordinal)
    return CUdevice(ordinal)


@_api(1)
def cuDeviceGetName(length, dev):
    return _front_call("deviceGetName", {"device": int(dev)}).text.encode()[:max(length - 1, 0)]


@_api(1)
def cuDeviceGetUuid(dev):
    return CUuuid(_front_call("deviceGetUuid", {"device": int(dev)}).data)


cuDeviceGetUuid_v2 = cuDeviceGetUuid


@_api(1)
def cuDeviceTotalMem(dev):
    return _front_call("deviceTotalMem", {"device": int(dev)}).u64s[0]


@_api(1)
def cuDeviceGetAttribute(attrib, dev):
    value = _front_call("deviceGetAttribute", {"attribute": int(attrib), "device": int(dev)}).u64s[0]
    return value - (1 << 64) if value >= 1 << 63 else value


@_api(2)
def cuDeviceComputeCapability(dev):
    return tuple(_front_call("deviceComputeCapability", {"device": int(dev)}).u64s)


P2P_ACCESS_SUPPORTED = 2      # CUdevice_P2PAttribute: whether peer access may be enabled


def _p2p_attribute(attrib, dev, peer):
    """The server's answer for two devices (distinct ones: a device is no peer of itself)."""
    return _front_call("deviceP2PAttribute", {"attribute": int(attrib), "device": int(dev), "peer": int(peer)}).u64s[0]


def _can_access(dev, peer):
    for d in (dev, peer):
        _check_device(d)
    return 0 if int(dev) == int(peer) else _p2p_attribute(P2P_ACCESS_SUPPORTED, dev, peer)


@_api(1)
def cuDeviceCanAccessPeer(dev, peerDev):
    return _can_access(dev, peerDev)


@_api(1)
def cuDeviceGetP2PAttribute(attrib, srcDevice, dstDevice):
    return _p2p_attribute(attrib, srcDevice, dstDevice)


# -- contexts ---------------------------------------------------------------------------
def _open_context(dev, flags):
    res = _front_call("ctxCreate", {"flags": int(flags), "device": int(dev)})
    ctx_id, endpoint, token = res.u64s[0], res.text, res.data
    conn = Connection(endpoint)
    try:
        _check(conn.attach({"ctx": ctx_id, "token": token}, lambda args: conn.call("attach", args)))
    except CudaError:
        conn.close()
        raise
    conn.find_again = _finder(conn, ctx_id, token)
    _contexts[ctx_id] = conn
    agent.start(AgentView())
    _known[ctx_id] = _Ranges()
    _device_of[ctx_id] = int(dev)
    return ctx_id


def _finder(conn, ctx_id, token):
    """How a context's connection finds its worker again after a restore (Connection.reattach):
    it asks its server (PHOS_SERVER, read then), then the standby (PHOS_STANDBY, else the one
    its worker named, as the native stub does); whichever knows the context is asked first
    next time. After a handoff, the old worker said where it went (Connection.moved_to): that
    is tried first, without asking. passed_over: attaching where the last answer pointed failed
    (the server that answered had handed the context off to one that died since), so that
    server is asked last."""
    order = []

    def find(passed_over=False):
        moved, conn.moved_to = conn.moved_to, None
        prefer, conn.prefer = conn.prefer, None
        if prefer:                     # a resumed process's server (Connection.resume)
            if prefer in order:
                order.remove(prefer)
            order.insert(0, prefer)
        if moved is not None and not passed_over:      # its old worker said where, as it retired
            conn.standby = moved[1] or conn.standby
            return moved[0], {"ctx": ctx_id, "token": token}
        servers = [settings.server(), settings.standby() or conn.standby]
        for server in order + servers:
            if server and server not in order:
                order.append(server)
        if passed_over:
            order.append(order.pop(0))
        why = "no server to ask"
        for server in list(order):
            front = Connection(server)
            try:
                res = front.call("reattach", {"ctx": ctx_id, "token": token}, timeout=min(CONNECT_TIMEOUT, 2.0))
            except CudaError as e:       # that server is gone too
                res, why = None, e.message
            finally:
                front.close()
            if res is not None and res.status == CUresult.CUDA_ERROR_NOT_PERMITTED:
                raise CudaError(res.status, res.message)      # our key was revoked: final, no use waiting
            if res is not None and res.status == 0:
                order.remove(server)
                order.insert(0, server)
                if res.data:            # handed off: the standby of the server it went to
                    conn.standby = bytes(res.data).decode()
                return res.text, {"ctx": ctx_id, "token": token}
            why = res.message if res is not None else why
        raise CudaError(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED, why)
    return find


def _close_context(ctx_id):
    conn = _contexts.pop(ctx_id)
    _known.pop(ctx_id, None)
    _device_of.pop(ctx_id, None)
    _peers.pop(ctx_id, None)
    for peers in _peers.values():
        peers.discard(ctx_id)
    try:
        _check(conn.call("ctxDestroy"))
    finally:
        conn.close()
        for key in [k for k in _params if k[0] == ctx_id]:
            del _params[key]
        for stack_ctx in list(_stack()):
            if stack_ctx == ctx_id:
                _stack().remove(ctx_id)


@_api(1)
def cuCtxCreate(ctxCreateParams, flags, dev):
    """cuda-python 13 form: (params or None, flags, device)."""
    with _lock:
        ctx_id = _open_context(dev, flags)
    _stack().append(ctx_id)
    return CUcontext(ctx_id)


@_api(0)
def cuCtxDestroy(ctx):
    with _lock:
        if int(ctx) not in _contexts:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{int(ctx)} is not a live context")
        _close_context(int(ctx))


@_api(0)
def cuCtxSynchronize():
    _ctx_call("ctxSynchronize")


@_api(0)
def cuCtxSetCurrent(ctx):
    stack = _stack()
    if ctx is None or int(ctx) == 0:
        if stack:
            stack.pop()
        return
    if int(ctx) not in _contexts:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{int(ctx)} is not a live context")
    if stack:
        stack[-1] = int(ctx)
    else:
        stack.append(int(ctx))


@_api(1)
def cuCtxGetCurrent():
    stack = _stack()
    return CUcontext(stack[-1] if stack else 0)


@_api(0)
def cuCtxPushCurrent(ctx):
    if int(ctx) not in _contexts:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{int(ctx)} is not a live context")
    _stack().append(int(ctx))


@_api(1)
def cuCtxPopCurrent():
    stack = _stack()
    if not stack:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, "no current context")
    return CUcontext(stack.pop())


@_api(1)
def cuCtxGetDevice():
    return CUdevice(_device_of[_current()[0]])


def _peer_context(peerContext):
    """The current context and peerContext, a live context other than it."""
    ctx, peer = _current()[0], int(peerContext)
    if peer not in _contexts or peer == ctx:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{peer} is not a live context other than the current one")
    return ctx, peer


@_api(0)
def cuCtxEnablePeerAccess(peerContext, Flags):
    """Bookkeeping, with CUDA's errors: copies between contexts work without it (cuMemcpyPeer),
    and a kernel cannot reach another context's memory (each is a worker of its own)."""
    with _lock:
        ctx, peer = _peer_context(peerContext)
        if Flags:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuCtxEnablePeerAccess: Flags must be 0, not {Flags}")
        if not _can_access(_device_of[ctx], _device_of[peer]):
            raise CudaError(CUresult.CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
                            f"device {_device_of[ctx]} cannot access device {_device_of[peer]}'s memory")
        if peer in _peers.setdefault(ctx, set()):
            raise CudaError(CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
                            f"peer access to context {peer} is enabled already")
        _peers[ctx].add(peer)


@_api(0)
def cuCtxDisablePeerAccess(peerContext):
    with _lock:
        ctx, peer = _peer_context(peerContext)
        if peer not in _peers.get(ctx, ()):
            raise CudaError(CUresult.CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, f"peer access to context {peer} is not enabled")
        _peers[ctx].remove(peer)


@_api(1)
def cuDevicePrimaryCtxRetain(dev):
    with _lock:
        entry = _primary.get(int(dev))
        if entry is None:
            entry = _primary[int(dev)] = [_open_context(dev, 0), 0]
        entry[1] += 1
        return CUcontext(entry[0])


@_api(0)
def cuDevicePrimaryCtxRelease(dev):
    with _lock:
        entry = _primary.get(int(dev))
        if entry is None:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"device {int(dev)} has no retained primary context")
        entry[1] -= 1
        if entry[1] == 0:
            del _primary[int(dev)]
            _close_context(entry[0])


# -- memory -----------------------------------------------------------------------------
@_api(1)
def cuMemAlloc(bytesize):
    with _lock:
        ptr = _ctx_call("memAlloc", {"size": int(bytesize)}).u64s[0]
        _known[_current()[0]].add(ptr, int(bytesize), allocated=True)
        return CUdeviceptr(ptr)


@_api(0)
def cuMemFree(dptr):
    ptr = int(dptr)
    if ptr == 0:
        return              # as the driver: nothing to free
    with _lock:
        known = _known[_current()[0]]
        if ptr not in known.allocated and _device_range(ptr, 0, "cuMemFree:") != ptr:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemFree: {ptr:#x} is not the start of an allocation")
        known.drop(ptr)
        _ctx_post("memFree", {"ptr": ptr})


@_api(2)
def cuMemGetInfo():
    return tuple(_ctx_call("memGetInfo").u64s)


@_api(2)
def cuMemGetAddressRange(dptr):
    base, size = _ctx_call("memGetAddressRange", {"ptr": int(dptr)}).u64s
    return CUdeviceptr(base), size


def _htod(dst, src, n, stream):
    with _lock:
        if int(n) > 0:
            _device_range(int(dst), int(n), "destination")
        _current()[1].copy_to_device(int(dst), src, int(n), stream)


def _dtoh(dst, src, n, stream, wait):
    with _lock:
        if int(n) > 0:
            _device_range(int(src), int(n), "source")
        conn = _current()[1]
        if wait:
            failure = conn.copy_from_device(dst, int(src), int(n), stream)
            if failure is not None:
                _check(failure)
        else:
            conn.post("memcpyDtoH", {"src": int(src), "size": int(n), "stream": stream}, on_bytes=host_writer(dst, int(n)))


@_api(0)
def cuMemcpyHtoD(dstDevice, srcHost, ByteCount):
    _htod(dstDevice, srcHost, ByteCount, 0)


@_api(0)
def cuMemcpyHtoDAsync(dstDevice, srcHost, ByteCount, hStream):
    _htod(dstDevice, srcHost, ByteCount, _stream_id(hStream))


@_api(0)
def cuMemcpyDtoH(dstHost, srcDevice, ByteCount):
    _dtoh(dstHost, srcDevice, ByteCount, 0, wait=True)


@_api(0)
def cuMemcpyDtoHAsync(dstHost, srcDevice, ByteCount, hStream):
    """The bytes land in dstHost by the next synchronizing call, as with CUDA."""
    _dtoh(dstHost, srcDevice, ByteCount, _stream_id(hStream), wait=False)


def _dtod(dst, src, n, stream):
    with _lock:
        if int(n) > 0:
            _device_range(int(dst), int(n), "destination")
            _device_range(int(src), int(n), "source")
        _ctx_post("memcpyDtoD", {"dst": int(dst), "src": int(src), "size": int(n), "stream": stream})


@_api(0)
def cuMemcpyDtoD(dstDevice, srcDevice, ByteCount):
    _dtod(dstDevice, srcDevice, ByteCount, 0)


@_api(0)
def cuMemcpyDtoDAsync(dstDevice, srcDevice, ByteCount, hStream):
    _dtod(dstDevice, srcDevice, ByteCount, _stream_id(hStream))


def _peer_copy(dst, dst_ctx, src, src_ctx, n, stream):
    """A copy between two contexts. Each is a worker of its own, maybe on another device, so the
    bytes come here from the source and go on to the destination. `stream` is the current
    context's: when it is the source, the copy waits for the stream's work before it; when the
    destination, it is queued on it, after that work."""
    with _lock:
        dst_ctx, src_ctx, cur = int(dst_ctx), int(src_ctx), _current()[0]
        for ctx in (dst_ctx, src_ctx):
            if ctx not in _contexts:
                raise CudaError(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{ctx} is not a live context")
        if stream and cur not in (src_ctx, dst_ctx):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_HANDLE, "the stream of a peer copy must be the current "
                            "context's, and that the source's or the destination's")
        if src_ctx == dst_ctx:
            with _current_for_a_while(src_ctx):
                return _dtod(dst, src, n, stream if cur == src_ctx else 0)
        if int(n) == 0:
            return
        data = bytearray(int(n))
        with _current_for_a_while(src_ctx):
            _dtoh(data, src, n, stream if cur == src_ctx else 0, wait=True)
        with _current_for_a_while(dst_ctx):
            _htod(dst, data, n, stream if cur == dst_ctx else 0)


@_api(0)
def cuMemcpyPeer(dstDevice, dstContext, srcDevice, srcContext, ByteCount):
    _peer_copy(dstDevice, dstContext, srcDevice, srcContext, ByteCount, 0)


@_api(0)
def cuMemcpyPeerAsync(dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream):
    _peer_copy(dstDevice, dstContext, srcDevice, srcContext, ByteCount, _stream_id(hStream))


def _memset(dst, value, elem, n, stream):
    with _lock:
        if int(n) > 0:
            _device_range(int(dst), int(n) * elem, "memset")
        _ctx_post("memset", {"dst": int(dst), "value": int(value), "elemSize": elem, "count": int(n), "stream": stream})


@_api(0)
def cuMemsetD8(dstDevice, uc, N):
    _memset(dstDevice, uc, 1, N, 0)


@_api(0)
def cuMemsetD16(dstDevice, us, N):
    _memset(dstDevice, us, 2, N, 0)


@_api(0)
def cuMemsetD32(dstDevice, ui, N):
    _memset(dstDevice, ui, 4, N, 0)


@_api(0)
def cuMemsetD8Async(dstDevice, uc, N, hStream):
    _memset(dstDevice, uc, 1, N, _stream_id(hStream))


@_api(0)
def cuMemsetD16Async(dstDevice, us, N, hStream):
    _memset(dstDevice, us, 2, N, _stream_id(hStream))


@_api(0)
def cuMemsetD32Async(dstDevice, ui, N, hStream):
    _memset(dstDevice, ui, 4, N, _stream_id(hStream))


# -- modules and launches ---------------------------------------------------------------
def _load(image):
    if isinstance(image, int):
        data = ctypes.string_at(image)      # a NUL-terminated PTX image in host memory
    else:
        data = bytes(memoryview(image).cast("B"))
    return CUmodule(_ctx_call("moduleLoad", {}, data).u64s[0])


@_api(1)
def cuModuleLoadData(image):
    return _load(image)


@_api(1)
def cuModuleLoadDataEx(image, numOptions=0, options=None, optionValues=None):
    return _load(image)


@_api(1)
def cuModuleLoad(fname):
    path = fname.decode() if isinstance(fname, bytes) else fname
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CudaError(CUresult.CUDA_ERROR_FILE_NOT_FOUND, f"{path}: {e.strerror}")
    return _load(data)


@_api(0)
def cuModuleUnload(hmod):
    with _lock:
        _known[_current()[0]].forget_globals()      # that module's among them: the worker names the others again
        _ctx_post("moduleUnload", {"id": int(hmod)})


@_api(1)
def cuModuleGetFunction(hmod, name):
    name = name.decode() if isinstance(name, bytes) else name
    res = _ctx_call("moduleGetFunction", {"module": int(hmod), "name": name})
    _params[(_current()[0], res.u64s[0])] = res.params
    return CUfunction(res.u64s[0])


@_api(2)
def cuModuleGetGlobal(hmod, name):
    name = name.decode() if isinstance(name, bytes) else name
    with _lock:
        ptr, size = _ctx_call("moduleGetGlobal", {"module": int(hmod), "name": name}).u64s
        _known[_current()[0]].add(ptr, size)
        return CUdeviceptr(ptr), size


def _layout(func):
    layout = _params.get((_current()[0], int(func)))
    if layout is None:
        raise CudaError(CUresult.CUDA_ERROR_INVALID_HANDLE, f"{int(func):#x} is not a function of the current context")
    return layout


@_api(2)
def cuFuncGetParamInfo(func, paramIndex):
    layout = _layout(func)
    if not 0 <= paramIndex < len(layout):
        raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"parameter {paramIndex} does not exist ({len(layout)} parameters)")
    return layout[paramIndex]


def pack_params(layout, kernelParams):
    """Pack cuda-python's kernelParams forms into one buffer laid out as the kernel wants."""
    if kernelParams is None or (isinstance(kernelParams, int) and kernelParams == 0):
        if layout:
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"the kernel takes {len(layout)} parameters, none given")
        return b""
    buf = bytearray(max((o + s for o, s in layout), default=0))
    if isinstance(kernelParams, tuple) and len(kernelParams) == 2 and isinstance(kernelParams[0], (tuple, list)):
        values, types = kernelParams
        if len(values) != len(layout) or len(types) != len(layout):
            raise CudaError(CUresult.CUDA_ERROR_INVALID_VALUE, f"the kernel takes {len(layout)} parameters, {len(values)} given")
        for (off, sz), v, t in zip(layout, values, types):
            if t is None:
                addr = v.getPtr() if hasattr(v, "getPtr") else ctypes.addressof(v)
                raw = ctypes.string_at(addr, sz)
            else:
                obj = t(int(v)) if isinstance(v, _Handle) else v if isinstance(v, t) else t(v)
                raw = ctypes.string_at(ctypes.addressof(obj), min(ctypes.sizeof(obj), sz))
            buf[off:off + len(raw)] = raw
        return bytes(buf)
    # an int address of, or a buffer holding, a void*[] with one pointer per parameter
    if isinstance(kernelParams, int):
        ptrs = (ctypes.c_void_p * len(layout)).from_address(kernelParams)
    else:
        ptrs = (ctypes.c_void_p * len(layout)).from_buffer_copy(memoryview(kernelParams).cast("B"))
    for (off, sz), p in zip(layout, ptrs):
        buf[off:off + sz] = ctypes.string_at(p, sz)
    return bytes(buf)


@_api(0)
def cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                   kernelParams, extra):
    if extra not in (None, 0):
        raise CudaError(CUresult.CUDA_ERROR_NOT_SUPPORTED, "cuLaunchKernel: pass parameters in kernelParams, not extra")
    params = pack_params(_layout(f), kernelParams)
    config = (gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, int(sharedMemBytes), 0, _stream_id(hStream))
    with _lock:
        _current()[1].post_launch(int(f), config, params)


# -- streams and events -----------------------------------------------------------------
@_api(1)
def cuStreamCreate(Flags):
    return CUstream(_ctx_call("streamCreate", {"flags": int(Flags)}).u64s[0])


@_api(1)
def cuStreamCreateWithPriority(flags, priority):
    return CUstream(_ctx_call("streamCreate", {"flags": int(flags), "priority": int(priority)}).u64s[0])


@_api(0)
def cuStreamDestroy(hStream):
    _ctx_post("streamDestroy", {"id": int(hStream)})


@_api(0)
def cuStreamSynchronize(hStream):
    _ctx_call("streamSynchronize", {"id": _stream_id(hStream)})


@_api(0)
def cuStreamQuery(hStream):
    _ctx_call("streamQuery", {"id": _stream_id(hStream)})


@_api(0)
def cuStreamWaitEvent(hStream, hEvent, Flags=0):
    _ctx_post("streamWaitEvent", {"stream": _stream_id(hStream), "event": int(hEvent), "flags": int(Flags)})


@_api(1)
def cuEventCreate(Flags):
    return CUevent(_ctx_call("eventCreate", {"flags": int(Flags)}).u64s[0])


@_api(0)
def cuEventRecord(hEvent, hStream):
    _ctx_post("eventRecord", {"event": int(hEvent), "stream": _stream_id(hStream)})


@_api(0)
def cuEventSynchronize(hEvent):
    _ctx_call("eventSynchronize", {"id": int(hEvent)})


@_api(0)
def cuEventQuery(hEvent):
    _ctx_call("eventQuery", {"id": int(hEvent)})


@_api(1)
def cuEventElapsedTime(hStart, hEnd):
    return _ctx_call("eventElapsedTime", {"start": int(hStart), "end": int(hEnd)}).f64


@_api(0)
def cuEventDestroy(hEvent):
    _ctx_post("eventDestroy", {"id": int(hEvent)})


# -- errors -----------------------------------------------------------------------------
def cuGetErrorString(error):
    text = ERROR_STRINGS.get(int(error))
    return (SUCCESS, text.encode()) if text else (CUresult.CUDA_ERROR_INVALID_VALUE, None)


def cuGetErrorName(error):
    try:
        return SUCCESS, CUresult(int(error)).name.encode()
    except ValueError:
        return CUresult.CUDA_ERROR_INVALID_VALUE, None
